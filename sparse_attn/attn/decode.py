"""Entmax attention for decoding: a few new queries per sequence against a (paged) KV cache.

``entmax_decode(q, k_cache, v_cache, cache_seqlens, alpha)`` is shaped like flash-attn's
``flash_attn_with_kvcache`` (without the in-kernel cache append: the cache already holds the keys of the current
queries) and returns, when asked, the same per-row statistics as ``entmax_attention(..., return_stats=True)``, so a
generation loop can report head densities per generated token at no extra cost. CUDA tensors run the split-K
kernels of ``kernels/attn/entmax_decode.py``; other tensors gather the cache and run the float64-capable reference.
Design and measurements: docs/decode.md.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from sparse_attn._validation import check_bool, values_checkable
from sparse_attn.attn._kv_cache import MAX_DECODE_QUERIES
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec, alpha_tensor, head_cast, prepare_attention
from sparse_attn.attn.reference import entmax_attention_reference
from sparse_attn.attn.routes import refusal_message, refused
from sparse_attn.kernels._common import alpha_class_of

__all__ = ["entmax_decode", "MAX_DECODE_QUERIES", "decode_attention", "decode_fits", "decode_unsupported"]

@torch.library.custom_op("sparse_attn::entmax_decode", mutates_args=())
def _decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, alpha: Tensor, alpha_value: float | None,
    scale: float, block_table: Tensor | None, bias: Tensor | None, is_causal: bool, max_seqlen_k: int | None,
    num_splits: int | None, window_size: list[int] | None, alibi_slopes: Tensor | None, softcap: float | None,
    sinks: Tensor | None, block_mask: Tensor | None = None, block_size: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode kernels as a custom op (forward only): ``(out, tau, nnz, n_valid)``; ``alpha`` float32 ``(Hq,)``,
    ``alpha_value`` the Python number it holds when it was given as one (one compile-time alpha class);
    ``block_mask``, ``block_size``: the spec's block grid and its ``(bq, bk)`` (both None without one)."""
    res = _launch(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                  max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask, block_size, True,
                  False)
    return res.out, res.tau, res.nnz, res.n_valid


def _launch(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
            max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask, block_size, stats, reuse):
    """The launcher on the op's arguments, for the op (``stats`` and not ``reuse``: every output fresh, the scratch
    allocated, which under ``torch.compile``'s CUDA graphs belongs to the graph's pool) or for an eager call that
    needs no op (:func:`_run_decode_op`: the scratch reused, the statistics computed into it unless ``stats``)."""
    from sparse_attn.kernels.attn import entmax_decode as kernels

    return kernels.entmax_decode_fwd(
        q, k_cache, v_cache, cache_seqlens, alpha, scale, block_table=block_table, bias=bias, is_causal=is_causal,
        window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, max_seqlen_k=max_seqlen_k,
        num_splits=num_splits, block_mask=None if block_mask is None else (block_mask, tuple(block_size)),
        alpha_class=None if alpha_value is None else alpha_class_of([alpha_value]), counters=False,
        stats=stats, reuse_scratch=reuse)


@_decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                 max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask=None, block_size=None):
    rows = q.shape[:3]
    return (q.new_empty((*rows, v_cache.shape[-1])), q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.int32), q.new_empty(rows, dtype=torch.int32))


def _gathered(cache: Tensor, block_table: Tensor | None) -> Tensor:
    """The cache as ``(B, Hk, capacity, D)`` (pages gathered through the block table)."""
    if block_table is None:
        return cache
    pages = cache[block_table.long().clamp(0, cache.shape[0] - 1)]  # (B, max_pages, page_size, Hk, D)
    b, n_pages, page_size, heads, d = pages.shape
    return pages.reshape(b, n_pages * page_size, heads, d).transpose(1, 2)


def _reference_decode(spec: AttnSpec):
    """The reference backend: each sequence's first ``cache_seqlens[b]`` keys (slots past them may hold anything)
    through ``entmax_attention_reference``, so that the causal mask, the window and ALiBi take the decode
    alignment (query ``i`` at key position ``i + cache_seqlens[b] - Nq``)."""
    q, return_stats = spec.q, spec.need_stats
    alpha = spec.alpha if spec.alpha_value is None else spec.alpha_value
    k, v = _gathered(spec.k, spec.block_table), _gathered(spec.v, spec.block_table)
    if q.shape[0] == 0:
        return entmax_attention_reference(q, k, v, alpha, enable_gqa=True, return_stats=return_stats)
    mask = None if spec.mask is None else spec.mask.expand(*q.shape[:3], k.shape[2])
    outs, stats = [], []
    for b, length in enumerate(spec.cache_seqlens.tolist()):
        slopes = spec.alibi_slopes
        slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]
        out, st = entmax_attention_reference(
            q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length], alpha, scale=spec.scale,
            is_causal=spec.is_causal, attn_mask=None if mask is None else mask[b:b + 1, ..., :length],
            enable_gqa=True, return_stats=True, window_size=spec.window_size, alibi_slopes=slopes, sinks=spec.sinks,
            softcap=spec.softcap)
        outs.append(out)
        stats.append(st)
    out = torch.cat(outs)
    if not return_stats:
        return out
    return out, AttentionStats(*(torch.cat([getattr(st, f) for st in stats]) for f in AttentionStats._fields))


def entmax_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor | int | None = None,
    alpha: float | Tensor = 1.5,
    *,
    block_table: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    window_size: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
):
    """Entmax attention of ``Nq <= 16`` new queries per sequence over a KV cache (one decoding step).

    ``out_i = sum_j p_ij v_j`` with ``p_i = alpha-entmax(s_i)``, ``s_ij = scale * q_i . k_j (+ mask)`` over the
    first ``cache_seqlens[b]`` keys of sequence ``b`` (the keys of the current queries included: append them to
    the cache first). The key range is split across GPU programs (split-K); the threshold of each row is
    found from all splits' partial statistics, and only key blocks that can hold a positive weight are read
    again (docs/decode.md). The attention variants of :func:`sparse_attn.entmax_attention` (a sliding window,
    ALiBi, sinks, a soft cap, a value head dim ``Dv != D``) run on the kernels too; query ``i`` stands at key
    position ``i + cache_seqlens[b] - Nq`` for the window and ALiBi distances, and with a window the splits
    read only the window's key blocks.

    Args:
        q: ``(B, Hq, Nq, D)`` queries, any strides (a ``(B, Nq, Hq, D)`` tensor ``.transpose(1, 2)``).
            float16, bfloat16, float32 (float64 on the reference backend). ``Nq <= 16`` on the triton backend.
        k_cache, v_cache: the cache, same dtype and device as ``q``, either contiguous ``(B, Hk, Nk, D)``
            (any strides: a flash-attn ``(B, Nk, Hk, D)`` cache ``.transpose(1, 2)``), or with ``block_table`` a
            page pool ``(num_pages, page_size, Hk, D)`` (flash-attn / vLLM layout, any page size).
            ``Hq % Hk == 0`` (grouped-query and multi-query attention need no flag); ``v_cache`` may have another
            head dim ``Dv`` (16 to 256 on the triton backend).
        cache_seqlens: valid keys per sequence: int32 ``(B,)`` tensor on ``q``'s device, an int for every
            sequence, or None (the whole capacity). 0 gives zero outputs. Values outside ``[0, capacity]`` raise
            ``ValueError`` when checked (CPU tensors, or with :func:`sparse_attn.set_checks`); unchecked, they
            are clamped on the triton backend.
        alpha: float in [1, 2], or a tensor of shape ``(Hq,)`` or ``()`` (one alpha per q head, mixed freely).
            Default 1.5. A CUDA tensor's values are not read (no sync): a head outside [1, 2] gives NaN outputs.
        block_table: int32 ``(B, max_pages_per_seq)``: key ``j`` of sequence ``b`` lies in page
            ``block_table[b, j // page_size]``, slot ``j % page_size``. Default None (contiguous cache).
        attn_mask: boolean keep mask (True = may attend) or additive float mask, broadcastable to
            ``(B, Hq, Nq, capacity)`` and indexed by key position (``capacity``: ``Nk``, or
            ``max_pages_per_seq * page_size``); e.g. a left-padding mask. NaN or ``+inf`` entries give NaN rows
            (the non-finite policy), ``-inf`` entries exclude their keys.
        is_causal: the queries are the last ``Nq`` keys of their sequence: query ``i`` sees key ``j`` iff
            ``j <= i + cache_seqlens[b] - Nq``. Default False (every query sees the whole cache).
        scale: score scale, default ``1 / sqrt(D)``.
        max_seqlen_k: an upper bound on ``cache_seqlens`` (default: the capacity, or the longest entry where the
            values are read for checks: a CPU tensor); the key range the splits cover, so a tight bound saves idle
            programs.
        num_splits: key-range splits per (batch entry, kv head); default: enough programs to fill the GPU.
        return_stats: also return :class:`sparse_attn.AttentionStats` (per-row support size ``nnz``, threshold
            ``tau`` and valid keys ``n_valid``, each ``(B, Hq, Nq)``), as ``entmax_attention`` does.
        backend: ``"auto"`` (triton for CUDA fp16/bf16/fp32 tensors with ``16 <= D <= 256``, the reference
            otherwise), ``"triton"`` or ``"reference"``.
        window_size: ``(left, right)`` sliding window (``-1``: unbounded side): query ``i`` sees key ``j`` iff
            ``-left <= j - (i + cache_seqlens[b] - Nq) <= right``; intersected with ``is_causal`` and the mask.
            Default None.
        alibi_slopes: float ``(Hq,)`` or ``(B, Hq)``: adds ``-slope * |i + cache_seqlens[b] - Nq - j|`` to the
            (soft-capped) scores. Slopes that require grad raise on the triton backend. Default None.
        sinks: float ``(Hq,)`` sink logits: one more virtual key per row, of that score (not scaled, capped or
            masked) and zero value, in the normalization (``tau`` includes it; ``nnz`` and ``n_valid`` count real
            keys). A NaN or ``+inf`` sink makes its head's rows NaN, ``-inf`` is no sink. Default None.
        softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` before masks and ALiBi. Default None (off).

    Returns:
        ``out`` ``(B, Hq, Nq, Dv)`` in the input dtype, or ``(out, stats)``. Rows with no key give zeros; a row
        whose scores hold NaN or ``+inf`` is NaN (``tau`` NaN, ``nnz`` 0).
    """
    check_bool("is_causal", is_causal)
    check_bool("return_stats", return_stats)
    spec, why = _gate(q, k_cache, v_cache, cache_seqlens, alpha, dict(
        attn_mask=attn_mask, is_causal=is_causal, scale=scale, max_seqlen_k=max_seqlen_k, backend=backend,
        window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap, need_stats=return_stats,
        block_table=block_table, num_splits=num_splits))
    if spec.backend == "reference":
        return _reference_decode(spec)
    if why:
        raise ValueError(refusal_message("decode", why, "use sparse_attn.entmax_attention to train, or call "
                                         "entmax_decode under torch.no_grad()"))
    return _run_decode_op(spec, spec.cache_seqlens, spec.need_stats)


# the argument gate of entmax_decode, cached by what its checks read (_gate)
_GATE: OrderedDict = OrderedDict()
_GATE_SIZE = 64
# the spec fields that hold the call's own tensors: swapped in on every call, never kept by the cache
_CALL_TENSORS = ("q", "k", "v", "mask", "block_table", "alibi_slopes", "sinks")


def _capturing(q) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``q``'s device."""
    return isinstance(q, Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()


def _meta(x):
    """What the checks read of one argument: a tensor's type, shape, dtype, device and ``requires_grad``; any other
    value itself, with its type (``True`` and ``1`` differ)."""
    if isinstance(x, Tensor):
        return (type(x), x.shape, x.dtype, x.device, x.requires_grad)
    return (type(x), x)


def _gate(q, k_cache, v_cache, cache_seqlens, alpha, kw: dict):
    """``prepare_attention`` of a decoding step, and what keeps it off the decode kernels (phrases; None on the
    reference backend).

    A second call whose arguments have the same metadata (:func:`_meta`: types, shapes, dtypes, devices,
    ``requires_grad``, the other arguments' values, grad mode) skips the checks, which read nothing else: the spec of
    the first call is kept without its tensors and this call's tensors are swapped in (converted as
    ``prepare_attention`` converts them). Never while the values of a tensor are read for checks (CPU tensors,
    :func:`sparse_attn.set_checks`; those checks run on every call), while ``torch.compile`` traces, or while a CUDA
    graph is being captured: an integer ``cache_seqlens`` or a Python ``alpha`` become device tensors the kept spec
    holds, which a capture would leave unwritten, and a graph must not read a kept tensor the cache may drop."""
    cacheable = not (torch.compiler.is_compiling() or _capturing(q)
                     or values_checkable(q, cache_seqlens, kw["block_table"], alpha))
    if cacheable:
        try:
            key = (torch.is_grad_enabled(), _meta(q), _meta(k_cache), _meta(v_cache), _meta(cache_seqlens),
                   _meta(alpha), *(_meta(x) for x in kw.values()))
            hit = _GATE.get(key)
        except TypeError:  # an unhashable argument (the checks will name it, or it is a list): not cached
            cacheable, hit = False, None
        if hit is not None:
            template, why = hit
            fields = dict(q=q, k=k_cache, v=v_cache, mask=kw["attn_mask"], block_table=kw["block_table"],
                          alibi_slopes=head_cast(kw["alibi_slopes"], q), sinks=head_cast(kw["sinks"], q))
            if isinstance(alpha, Tensor):
                fields["alpha"] = alpha_tensor(alpha, q)
            if isinstance(cache_seqlens, Tensor):
                fields["cache_seqlens"] = cache_seqlens.to(torch.int32)
            return template.swapped(**fields), why
    spec = prepare_attention(q, k_cache, v_cache, alpha, kv_cache=True, cache_seqlens=cache_seqlens, **kw)
    why = refused("decode", spec.used()) if spec.backend == "triton" else None
    if cacheable:
        dropped = dict.fromkeys(_CALL_TENSORS)
        if isinstance(alpha, Tensor):
            dropped["alpha"] = None
        if isinstance(cache_seqlens, Tensor):
            dropped["cache_seqlens"] = None
        _GATE[key] = (spec.swapped(**dropped), why)
        if len(_GATE) > _GATE_SIZE:
            _GATE.popitem(last=False)
    return spec, why


def _window_arg(window_size) -> list[int] | None:
    """``window_size`` as the custom op takes it (a list of ints, or None)."""
    return None if window_size is None else [int(w) for w in window_size]


def decode_unsupported(inputs: AttnSpec) -> list[str]:
    """What keeps a fused-path call off the decode kernels, as phrases (empty: they can run it).

    The variants the ``"decode"`` route does not list in :data:`sparse_attn.routes.SUPPORTED`: the decode kernels
    implement masks (boolean or float), bottom-right causal masking, GQA/MQA, per-head alpha and every attention
    variant the fused path takes (sliding window, ALiBi, sinks, soft cap, ``Dv != D``, a block mask), forward only.
    What the fused path refuses (:func:`sparse_attn.attn_inputs.unfused_variants`: slopes that require grad, value
    head dims outside [16, 256]) never reaches here.
    """
    return refused("decode", inputs.used())


def decode_fits(inputs: AttnSpec) -> bool:
    """Whether the fused path runs ``inputs`` on the split-K decode kernels instead of the general forward.

    A decoding step: ``1 <= Nq <= MAX_DECODE_QUERIES`` queries per sequence against more keys than queries (a KV
    cache; ``Nk > Nq``), on the triton backend, with nothing from :func:`decode_unsupported`.
    """
    n_q, n_k = inputs.q.shape[2], inputs.k.shape[2]
    return (inputs.backend == "triton" and 1 <= n_q <= MAX_DECODE_QUERIES and n_k > n_q
            and not decode_unsupported(inputs))


def decode_attention(inputs: AttnSpec, return_stats: bool | None = None):
    """Run prepared inputs for which :func:`decode_fits` holds on the decode kernels: ``k``, ``v`` are a contiguous
    cache of ``Nk`` keys for every sequence. Returns ``out`` ``(B, Hq, Nq, Dv)`` or ``(out, AttentionStats)``
    (``return_stats`` None: the spec's ``need_stats``)."""
    return _run_decode_op(inputs, _whole_cache(inputs.q.shape[0], inputs.q.device),
                          inputs.need_stats if return_stats is None else return_stats)


_WHOLE: dict = {}


def _whole_cache(batch: int, device: torch.device) -> Tensor:
    """Lengths that say "every key of the cache": int32 ``(B,)`` of int32's largest value, which the kernels clamp to
    ``max_seqlen_k`` (the cache's ``Nk``). One tensor per (batch size, device), made outside CUDA graph captures
    and compiled traces (within them: a new one, part of the graph)."""
    if torch.compiler.is_compiling():
        return torch.full((batch,), 2**31 - 1, dtype=torch.int32, device=device)
    lengths = _WHOLE.get((batch, device))
    if lengths is None:
        lengths = torch.full((batch,), 2**31 - 1, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WHOLE[(batch, device)] = lengths
    return lengths


def _direct(*tensors) -> bool:
    """Whether an eager call may run the launcher without the custom op: plain tensors (or parameters) off the meta
    device, nothing tracing (``torch.compile``, ``torch.jit.trace``) and no dispatch mode (fake tensors, counters,
    ...) that must see the op. The op adds only its dispatch: the launcher and its results are the same."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or (type(t) in (Tensor, torch.nn.Parameter) and t.device.type != "meta") for t in tensors)


def _run_decode_op(spec: AttnSpec, seqlens: Tensor, return_stats: bool):
    """The decode kernels on a spec whose ``k`` / ``v`` are a KV cache holding ``seqlens`` keys per sequence: ``out``
    or ``(out, AttentionStats)``; through the custom op, or straight to the launcher where :func:`_direct` allows."""
    args = (spec.q, spec.k, spec.v, seqlens, spec.alpha.detach().float().contiguous(), spec.alpha_value, spec.scale,
            spec.block_table, spec.mask, spec.is_causal, spec.max_seqlen_k, spec.num_splits,
            _window_arg(spec.window_size), spec.alibi_slopes, spec.softcap, spec.sinks, spec.block_mask,
            None if spec.block_size is None else [int(n) for n in spec.block_size])
    if _direct(spec.q, spec.k, spec.v, seqlens, spec.mask, spec.block_table, spec.alibi_slopes, spec.sinks,
               spec.block_mask):
        res = _launch(*args, return_stats, True)
        out, tau, nnz, n_valid = res.out, res.tau, res.nnz, res.n_valid
    else:
        out, tau, nnz, n_valid = _decode_op(*args)
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out
