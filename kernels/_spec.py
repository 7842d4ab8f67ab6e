"""The attention problem as one frozen value: :class:`AttnSpec`.

:func:`sparse_attn.attn.attn_inputs.prepare_attention` (the one argument gate: :func:`sparse_attn.entmax_attention`, the
reference, the modules, the Hugging Face function, :func:`sparse_attn.entmax_decode` and context parallelism) builds
it once; the routers read :meth:`AttnSpec.used`, the reference and the decode route read its fields, and the custom
ops (fused and decode) carry it across the ``torch.library`` boundary field by field (:func:`flatten_spec` /
:func:`unflatten_spec`). Each field declares in one place, :data:`DECLS`, its schema type at that boundary, whether it
may receive a gradient and the variants it states. Change a spec with :func:`dataclasses.replace`, never in place.

This module imports torch and the kernels package only (the import direction is ``sparse_attn`` -> ``kernels``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._args import alpha_class_of

__all__ = ["AttnSpec", "DECLS", "DIFFERENTIABLE", "FIELDS", "FieldDecl", "VARIANT_FIELDS", "flatten_spec",
           "kernel_spec", "op_schema", "unflatten_spec", "used_variants", "resolve_spec_alpha_class"]


@dataclasses.dataclass(frozen=True, eq=False)
class AttnSpec:
    """One attention call after :func:`~sparse_attn.attn.attn_inputs.prepare_attention`.
    Layout ``(batch, heads, seq, dim)``.

    q:             ``(B, Hq, Nq, D)`` (varlen: ``(1, Hq, total_q, D)``), float16/bfloat16/float32/float64.
    k, v:          ``(B, Hk, Nk, D)`` and ``(B, Hk, Nk, Dv)``, ``Hq % Hk == 0``, dtype and device of ``q``; with a
                   ``block_table`` a page pool ``(num_pages, page_size, Hk, D)`` / ``(..., Dv)`` (decode).
    alpha:         ``(Hq,)`` on ``q``'s device, float32 (float64 when ``q`` is float64); differentiable
                   when the caller's alpha requires grad (a view of it, cast).
    alpha_value:   the Python number when alpha was given as one, else None (exact fast paths).
    alpha_checked: True when alpha's values are known to lie in [1, 2] (a Python number, a checked
                   tensor, or a caller that guarantees it); otherwise an out-of-range or NaN
                   head gives NaN outputs.
    mask:          None, a boolean keep mask (True = attend) or a float additive bias, at its own
                   shape (at most 4-d, broadcastable to ``(B, Hq, Nq, Nk)``, never expanded).
    is_causal:     bottom-right aligned causal masking (per sequence with varlen).
    scale:         score scale (``1 / sqrt(D)`` unless given; 1 when ``D == 0``).
    dropout_p:     drop probability of the weights, in [0, 1).
    cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` packed-sequence offsets, or None.
    max_seqlen_q, max_seqlen_k: longest query / key sequence (``Nq`` / ``Nk`` without varlen; with a KV cache
                   ``max_seqlen_k`` bounds ``cache_seqlens``, the capacity when not given).
    backend:       ``"triton"`` or ``"reference"`` (resolved from ``"auto"``).
    window_size:   ``(left, right)`` sliding window (flash-attn semantics, bottom-right aligned, per
                   sequence with varlen; ``-1`` = unbounded on that side), or None for no window.
                   Intersected with ``is_causal`` and the mask.
    alibi_slopes:  None or ``(Hq,)`` / ``(B, Hq)`` (varlen: ``(nseq, Hq)``) float32 (float64 for float64
                   ``q``): the bias ``-slope * |i + Nk - Nq - j|`` is added to the (soft-capped) scores.
    sinks:         None or ``(Hq,)`` float32 (float64 for float64 ``q``), differentiable: one sink logit per
                   head, an extra key with a zero value in every row's normalization (not masked, not
                   soft-capped, not scaled). Weights over the real keys then sum to ``1 - p_sink``.
    softcap:       None or a positive float: finite scaled scores ``s`` become ``softcap * tanh(s / softcap)``
                   before masks and biases are added (non-finite scores are left as they are).
    alpha_class:   the kernels' compile-time alpha class (``softmax``, ``sparsemax``, ``entmax15``, ``general`` or
                   ``mixed``), resolved without a device sync (:func:`resolve_spec_alpha_class`).
    need_stats:    the caller asked for :class:`~sparse_attn.attn.attn_inputs.AttentionStats` (``return_stats``).
    need_grad:     grad mode was on and a :data:`DIFFERENTIABLE` field requires grad when the spec was built.
    cache_seqlens: decode only (:func:`sparse_attn.entmax_decode`): int32 ``(B,)`` valid keys per sequence of the
                   KV cache ``k`` / ``v``; None otherwise.
    block_table:   decode only: int32 ``(B, max_pages)`` pages of a paged cache, or None (contiguous cache).
    block_mask:    None or a boolean block grid ``(B or nseq or 1, Hq or 1, ceil(Nq / bq), ceil(Nk / bk))``
                   (validated; torch's ``BlockMask`` converted, :func:`sparse_attn.attn.masks.check_block_mask`):
                   key ``j`` is hidden from row ``i`` when block ``(i // bq, j // bk)`` is False (sequence-local
                   with varlen).
    block_size:    ``(bq, bk)`` of ``block_mask`` (None without one).
    block_bits:    None, or with partial blocks int32 ``(n_partial, bq, ceil(bk / 32))``: ``block_mask`` is then an
                   int32 grid of block states (0 hidden, 1 full, ``2 + i`` partial block ``i``) and bit ``c % 32`` of
                   ``block_bits[i, r, c // 32]`` keeps row ``r``, key ``c`` of partial block ``i``
                   (:class:`sparse_attn.attn.masks.BlockSparseMask`; a torch ``BlockMask``'s ``mask_mod``,
                   evaluated once).
    num_splits:    decode only: key-range splits per (batch entry, kv head), or None (the launcher's choice).
    deterministic: True (default): every gradient bitwise reproducible. False lets the fused backward add dQ with
                   atomics (fewer tensor-core products, results reproducible to float32 rounding only); the other
                   routes are deterministic either way.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    alpha: Tensor
    alpha_value: float | None
    alpha_checked: bool
    mask: Tensor | None
    is_causal: bool
    scale: float
    dropout_p: float
    cu_seqlens_q: Tensor | None
    cu_seqlens_k: Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str
    window_size: tuple[int, int] | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    softcap: float | None = None
    alpha_class: str = "mixed"
    need_stats: bool = False
    need_grad: bool = False
    cache_seqlens: Tensor | None = None
    block_table: Tensor | None = None
    num_splits: int | None = None
    block_mask: Tensor | None = None
    block_size: tuple[int, int] | None = None
    block_bits: Tensor | None = None
    deterministic: bool = True

    def used(self) -> frozenset:
        """The variants this call uses (names of :data:`sparse_attn.attn.routes.VARIANTS`); the routers refuse what a
        route does not list in :data:`sparse_attn.attn.routes.SUPPORTED`."""
        return used_variants(self.q, self.k, self.v, alpha=self.alpha, n_kv_heads=self.n_kv_heads,
                             need_grad=self.need_grad, **{name: getattr(self, name) for name in VARIANT_FIELDS})

    def swapped(self, **fields) -> AttnSpec:
        """A copy with ``fields`` replaced, without running ``__init__`` again: only for tensors that stand where
        tensors of the same type, shape, dtype, device and ``requires_grad`` stood (what the checks read), as the
        cached gate of :func:`sparse_attn.entmax_decode` swaps in each step's tensors. Inside a ``torch.compile``
        trace, a spec built by the constructor (Dynamo cannot trace writes into ``__dict__``; the traced graph runs
        none of this)."""
        if torch.compiler.is_compiling():
            return AttnSpec(**{name: fields.get(name, getattr(self, name)) for name in FIELDS})
        spec = object.__new__(AttnSpec)
        spec.__dict__.update(self.__dict__)
        spec.__dict__.update(fields)
        return spec

    @property
    def is_varlen(self) -> bool:
        """Packed sequences (``cu_seqlens``)."""
        return self.cu_seqlens_q is not None

    @property
    def is_paged(self) -> bool:
        """A paged KV cache (``k`` / ``v`` are page pools read through ``block_table``)."""
        return self.block_table is not None

    @property
    def batch(self) -> int:
        """``B`` (1 with packed sequences)."""
        return self.q.shape[0]

    @property
    def n_seqs(self) -> int:
        """Sequences: ``B``, or the number of packed sequences."""
        return self.batch if self.cu_seqlens_q is None else self.cu_seqlens_q.shape[0] - 1

    @property
    def n_heads(self) -> int:
        """``Hq``."""
        return self.q.shape[1]

    @property
    def n_kv_heads(self) -> int:
        """``Hk``."""
        return self.k.shape[2] if self.is_paged else self.k.shape[1]

    @property
    def kv_group(self) -> int:
        """Query heads per kv head, ``Hq // Hk`` (1 without GQA; 0 when there is no kv head)."""
        return self.n_heads // self.n_kv_heads if self.n_kv_heads else 0

    @property
    def seqlen_q(self) -> int:
        """``Nq`` (the packed length with varlen)."""
        return self.q.shape[2]

    @property
    def seqlen_k(self) -> int:
        """``Nk`` (the packed length with varlen, the capacity of a KV cache)."""
        if self.is_paged:
            return self.block_table.shape[1] * self.k.shape[1]
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        """``D``, the query/key head dim."""
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        """``Dv``, the value head dim."""
        return self.v.shape[-1]

    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, Nq, Nk)``."""
        return (self.batch, self.n_heads, self.seqlen_q, self.seqlen_k)


FIELDS = tuple(f.name for f in dataclasses.fields(AttnSpec))
"""The spec's field names in order (computed once: ``torch.compile`` does not trace ``dataclasses.fields``)."""


class FieldDecl(NamedTuple):
    """What a field of :class:`AttnSpec` declares: its ``torch.library`` schema type at the custom ops' boundary
    (``int[]`` fields are tuples in the spec, lists in the ops), whether it may receive a gradient, the variants
    (names of :data:`sparse_attn.attn.routes.VARIANTS`) whose use it states (none: a field of the problem itself,
    ``sparse_attn.attn.routes.PROBLEM_FIELDS``), and ``uses``, the rule naming which of them a value uses (default:
    the first variant whenever the field is given: not None, not False, not 0; :func:`used_variants` reads it)."""

    op_type: str
    grad: bool = False
    variants: tuple = ()
    uses: Callable | None = None

    def used_by(self, value) -> tuple:
        """The variants of :attr:`variants` that ``value`` (the field's normalized value) uses."""
        if self.uses is not None:
            return self.uses(value)
        given = value is not None and value is not False and not (isinstance(value, (int, float)) and value == 0)
        return self.variants[:1] if given else ()


def _mask_uses(mask) -> tuple:
    if mask is None:
        return ()
    kind = "bool_mask" if mask.dtype == torch.bool else "float_mask"
    return (kind, "mask_grad") if _wants_grad(mask) else (kind,)


def _alibi_uses(slopes) -> tuple:
    if slopes is None:
        return ()
    return ("alibi", "alibi_grad") if _wants_grad(slopes) else ("alibi",)


DECLS = {
    "q": FieldDecl("Tensor", grad=True), "k": FieldDecl("Tensor", grad=True), "v": FieldDecl("Tensor", grad=True),
    "alpha": FieldDecl("Tensor", grad=True), "alpha_value": FieldDecl("float?"), "alpha_checked": FieldDecl("bool"),
    "mask": FieldDecl("Tensor?", grad=True, variants=("bool_mask", "float_mask", "mask_grad"), uses=_mask_uses),
    "is_causal": FieldDecl("bool", variants=("causal",)), "scale": FieldDecl("float"),
    "dropout_p": FieldDecl("float", variants=("dropout",)),
    "cu_seqlens_q": FieldDecl("Tensor?", variants=("varlen",)),
    "cu_seqlens_k": FieldDecl("Tensor?"),  # travels with cu_seqlens_q
    "max_seqlen_q": FieldDecl("int"), "max_seqlen_k": FieldDecl("int"), "backend": FieldDecl("str"),
    "window_size": FieldDecl("int[]?", variants=("window",)),
    "alibi_slopes": FieldDecl("Tensor?", grad=True, variants=("alibi", "alibi_grad"), uses=_alibi_uses),
    "sinks": FieldDecl("Tensor?", grad=True, variants=("sinks",)),
    "softcap": FieldDecl("float?", variants=("softcap",)),
    "alpha_class": FieldDecl("str"), "need_stats": FieldDecl("bool"),
    "need_grad": FieldDecl("bool"),  # read by the "grad" variant
    "cache_seqlens": FieldDecl("Tensor?"), "block_table": FieldDecl("Tensor?"), "num_splits": FieldDecl("int?"),
    "block_mask": FieldDecl("Tensor?", variants=("block_mask",)),
    "block_size": FieldDecl("int[]?"), "block_bits": FieldDecl("Tensor?"),  # travel with block_mask
    "deterministic": FieldDecl("bool"),
}
"""Each field's :class:`FieldDecl`, in field order: a field without one fails at import, so a new field cannot be
forgotten at the op boundary, in the gradients or in the routes."""
if tuple(DECLS) != FIELDS:
    raise RuntimeError(f"kernels/_spec.py: DECLS must declare the fields of AttnSpec in order: {FIELDS}")

DIFFERENTIABLE = tuple(name for name, decl in DECLS.items() if decl.grad)
VARIANT_FIELDS = tuple(name for name, decl in DECLS.items() if decl.variants)
"""The fields of :class:`AttnSpec` that state variants (:func:`used_variants` reads each by its declaration)."""
"""The fields of :class:`AttnSpec` that may receive a gradient (each only when it requires one): what
:attr:`AttnSpec.need_grad` looks at, and what the fused op's backward returns gradients for by name."""


def kernel_spec(q: Tensor, k: Tensor, v: Tensor, alpha, scale: float, *, bias=None, is_causal: bool = False,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p: float = 0.0,
                alpha_class: str | None = None, window_size=None, alibi_slopes=None, softcap=None, sinks=None,
                block_mask=None, cache_seqlens=None, block_table=None, num_splits=None) -> AttnSpec:
    """The :class:`AttnSpec` of a direct call to the launchers (``entmax_attn_fwd``, ``entmax_attn_bwd``,
    ``entmax_decode_fwd``, whose keywords these are; they are not validated here): ``bias`` is the spec's ``mask``,
    ``block_mask`` the launchers' ``(grid, (bq, bk)[, bits])``; ``max_seqlen_*`` may stay None (the launch plan
    measures them) and ``alpha_class`` None (resolved from the values where that needs no device sync). The launchers
    build every kernel argument from the spec, as the custom ops' spec reaches them."""
    grid, size, bits = (None, None, None) if block_mask is None else (*block_mask, None)[:3]
    return AttnSpec(q=q, k=k, v=v, alpha=alpha, alpha_value=None, alpha_checked=False, mask=bias, is_causal=is_causal,
                    scale=scale, dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend="triton", window_size=window_size,
                    alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap, alpha_class=alpha_class,
                    block_mask=grid, block_size=size, block_bits=bits, cache_seqlens=cache_seqlens,
                    block_table=block_table, num_splits=num_splits)


def op_schema(extra: dict) -> str:
    """The arguments of a custom op that takes a spec (:func:`flatten_spec`) and then ``extra`` (name -> schema type):
    ``"Tensor q, Tensor k, ..."``."""
    return ", ".join([f"{decl.op_type} {name}" for name, decl in DECLS.items()]
                     + [f"{op_type} {name}" for name, op_type in extra.items()])


def flatten_spec(spec: AttnSpec, *extra) -> tuple:
    """A spec as a custom op's positional arguments (:data:`FIELDS` order, ``int[]`` fields as lists), then
    ``extra``; :func:`unflatten_spec` is the inverse."""
    return (*(_to_op(getattr(spec, name), decl.op_type) for name, decl in DECLS.items()), *extra)


def unflatten_spec(args) -> tuple[AttnSpec, tuple]:
    """The spec back from a custom op's positional arguments (:func:`flatten_spec`), and the arguments after it."""
    named = {name: _from_op(a, decl.op_type) for (name, decl), a in zip(DECLS.items(), args)}
    return AttnSpec(**named), tuple(args[len(FIELDS):])


def _to_op(value, op_type: str):
    return list(value) if value is not None and op_type.startswith("int[]") else value


def _from_op(value, op_type: str):
    return tuple(value) if value is not None and op_type.startswith("int[]") else value


def resolve_spec_alpha_class(alpha: Tensor, alpha_value: float | None, alpha_checked: bool) -> str:
    """The compile-time alpha class of a call: exact for a Python alpha, from the values of a checked CPU tensor (no
    device sync, not while compiling), otherwise ``"mixed"`` (the run-time branch per head, which also turns
    unchecked out-of-range heads into NaN outputs)."""
    if alpha_value is not None:
        return alpha_class_of([alpha_value])
    if alpha_checked and alpha.device.type == "cpu" and not torch.compiler.is_compiling():
        return alpha_class_of(alpha.detach().tolist())
    return "mixed"


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def used_variants(q: Tensor, k: Tensor | None, v: Tensor, *, alpha=None, n_kv_heads: int | None = None,
                  need_grad: bool | None = None, **fields) -> frozenset:
    """The names (keys of :data:`sparse_attn.attn.routes.VARIANTS`) of the variants a call uses, from normalized
    arguments: ``fields`` the spec's fields that state variants (:data:`VARIANT_FIELDS`), by name, None / False / 0
    when unused as :func:`sparse_attn.attn.attn_inputs.prepare_attention` leaves them (one not given is unused);
    ``k`` None: not known yet, no ``gqa``; ``n_kv_heads``: ``Hk`` when ``k`` is not ``(B, Hk, Nk, D)``;
    ``need_grad``: the spec's decision, None: from grad mode and the tensors now."""
    unknown = sorted(set(fields) - set(VARIANT_FIELDS))
    if unknown:
        raise TypeError(f"used_variants: {unknown} state no variant; expected fields among {VARIANT_FIELDS}")
    # the variants a field states, by its declaration (DECLS); the shapes and autograd state the rest
    used = {variant for name, value in fields.items() for variant in DECLS[name].used_by(value)}
    if k is not None and (k.shape[1] if n_kv_heads is None else n_kv_heads) != q.shape[1]:
        used.add("gqa")
    if v.shape[-1] != q.shape[-1]:
        used.add("dv")
    if _wants_grad(q, k, v, alpha, *(fields.get(name) for name in DIFFERENTIABLE)) if need_grad is None else need_grad:
        used.add("grad")
    return frozenset(used)
