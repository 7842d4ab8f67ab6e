"""The inputs of one entmax attention call, validated once, and the per-row statistics it returns.

:func:`prepare_attention` checks every argument of :func:`sparse_attn.entmax_attention` (and of
the reference, the modules and the Hugging Face integration, which all go through it) and
normalizes them into one frozen spec, :class:`~sparse_attn.kernels._spec.AttnSpec` (also named
:data:`AttentionInputs`); the fused path
(:mod:`sparse_attn.attn._attn_autograd`) and the reference (:mod:`sparse_attn.reference`) consume it.

The attention variants real models use (a sliding ``window_size``, ``alibi_slopes``, per-head
``sinks``, ``softcap``, a value head dim ``Dv`` different from the query/key head dim) are carried
here too. Which of them the fused kernels implement is decided in one place,
:func:`unfused_variants`; a call that needs a missing one on the fused path raises (never a silent
fallback to the dense reference).

Value checks that read tensors back to the host (a tensor ``alpha`` in ``[1, 2]``, a float mask
free of NaN/``+inf`` on the fused path, ``cu_seqlens`` offsets, ``max_seqlen`` bounds) run for
CPU tensors and, for device tensors, only with :func:`sparse_attn.set_checks` on, so that a CUDA
call does not synchronize. Unchecked out-of-range alphas give NaN outputs for their head.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import NamedTuple

import torch
from torch import Tensor

from sparse_attn._validation import check_bool, check_number, values_checkable
from sparse_attn.attn._kv_cache import check_kv_cache
from sparse_attn.attn.masks import check_block_mask, check_mask
from sparse_attn.attn.routes import refused, used_variants
from sparse_attn.kernels._args import computed_alpha, interpreting
from sparse_attn.kernels._spec import DIFFERENTIABLE, AttnSpec, resolve_spec_alpha_class

__all__ = [
    "AttnSpec",
    "AttentionInputs",
    "AttentionStats",
    "prepare_attention",
    "resolve_backend",
    "unfused_variants",
    "check_head_alpha",
    "check_alpha_not_mask",
    "check_variants",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
]

BACKENDS = ("auto", "triton", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
"""Head dims the fused kernels take (``backend="auto"`` runs the reference outside this range)."""


class AttentionStats(NamedTuple):
    """Per-row statistics of an attention call, each of shape ``(B, Hq, Nq)``.

    nnz:     int32, number of keys with a nonzero weight (support size); at alpha == 1 every
             valid key (softmax's support, whatever the floating-point underflow).
    tau:     float32 (float64 on the reference for float64 inputs or ``compute_dtype``), the
             threshold: for alpha > 1 the entmax threshold in the z = (alpha - 1) * score
             scale, so that ``p = [z - tau]_+^(1 / (alpha - 1))``; for alpha == 1 the row's
             logsumexp. ``+inf`` for rows with no valid key.
    n_valid: int32, number of keys the query may attend to (not masked).

    On the reference, a row whose scores hold NaN or ``+inf`` (a NaN output row) has
    ``tau = NaN`` and ``nnz = 0``. With ``sinks``, ``tau`` is the threshold (logsumexp) of the row
    including its sink (``+inf`` for a row with no valid key, as without sinks), while ``nnz`` and ``n_valid``
    count real keys only.
    """

    nnz: Tensor
    tau: Tensor
    n_valid: Tensor


AttentionInputs = AttnSpec
"""The spec under its earlier name (the same class): see :class:`sparse_attn.kernels._spec.AttnSpec`."""


def _check_qkv(q, k, v, enable_gqa: bool, varlen: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree in (batch, kv_heads, seq_k), got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    h_q, h_k = q.shape[1], k.shape[1]
    if (h_k == 0 and h_q != 0) or (h_k != 0 and h_q % h_k != 0):
        raise ValueError(f"the number of q heads ({h_q}) must be a multiple of the number of k/v heads ({h_k})")
    if h_q != h_k and not enable_gqa:
        raise ValueError(
            f"q has {h_q} heads and k/v have {h_k}: pass enable_gqa=True for grouped-query or multi-query attention"
        )
    if varlen and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the packed tensors must have batch size 1, got q of shape {tuple(q.shape)}")


def unfused_variants(q: Tensor, v: Tensor, window_size=None, alibi_slopes=None, sinks=None,
                     softcap=None, v_name: str = "v") -> list[str]:
    """The arguments of a call that the fused Triton kernels do not implement yet, as error-message phrases.

    What :data:`sparse_attn.attn.routes.SUPPORTED` refuses on the ``"fused"`` route, checked before the rest of the
    arguments (the full set is checked again at dispatch, :meth:`AttnSpec.used`), and the kernels' value
    head dims. Arguments as
    :func:`prepare_attention` (``window_size`` etc. already normalized: None when unused); ``v_name`` names ``v``
    in the phrases.
    """
    missing = refused("fused", used_variants(q, None, v, window_size=window_size, alibi_slopes=alibi_slopes,
                                             sinks=sinks, softcap=softcap))
    if not MIN_HEAD_DIM <= v.shape[-1] <= MAX_HEAD_DIM:
        missing.append(f"{v_name} of head_dim {v.shape[-1]} (the kernels take value head dims in [{MIN_HEAD_DIM}, "
                       f"{MAX_HEAD_DIM}])")
    return missing


def _on_kernel_device(q: Tensor) -> bool:
    """Whether ``backend="auto"`` runs the fused kernels for tensors on ``q``'s device (CUDA)."""
    return q.is_cuda


def resolve_backend(backend: str, q: Tensor, v: Tensor | None = None, unfused: list[str] | tuple = ()) -> str:
    """``"triton"`` or ``"reference"`` for these inputs; raises if the fused path cannot run them.

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        q, v: the queries and values (dtype, device, head dims).
        unfused: what :func:`unfused_variants` found. With ``backend="triton"``, or ``"auto"`` where
            it picks the fused kernels (CUDA, fp16/bf16/fp32, head dim 16-256), a nonempty list
            raises ``ValueError`` naming the arguments: never a silent fallback to the dense reference.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    d = q.shape[-1]
    if backend == "auto":
        fits = q.dtype in KERNEL_DTYPES and MIN_HEAD_DIM <= d <= MAX_HEAD_DIM
        backend = "triton" if _on_kernel_device(q) and fits else "reference"
        how = f"backend='auto' on {q.device} picks the fused Triton kernels"
    elif backend == "triton":
        if not q.is_cuda and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import, for testing), "
                f"got tensors on {q.device}; use backend='auto' or 'reference'"
            )
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the triton backend takes float16, bfloat16 or float32 inputs, got {q.dtype}")
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"the triton backend takes head_dim in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
        how = "backend='triton'"
    if backend == "triton" and unfused:
        raise ValueError(
            f"{'; '.join(unfused)}: not supported by the fused Triton kernels yet ({how}); pass backend='reference' "
            f"(the materialized reference, O(N^2) memory; for a Hugging Face model set config.entmax_backend = "
            f"'reference')"
        )
    return backend


def check_head_alpha(name: str, alpha, n_heads: int) -> None:
    """Check the type and shape of a per-head alpha: a Python number, or a floating tensor of
    shape ``()``, ``(1,)`` or ``(n_heads,)``. Values are not read."""
    if isinstance(alpha, Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating-point tensor, got a tensor of dtype {alpha.dtype}")
        n = alpha.numel()  # compared one by one: `in` misjudges sizes that torch.compile(dynamic=True) made symbolic
        if alpha.dim() > 1 or (n != 1 and n != n_heads):
            raise ValueError(
                f"{name} must be a float or a tensor of shape () or ({n_heads},) (one per head), "
                f"got shape {tuple(alpha.shape)}"
            )
    elif isinstance(alpha, bool) or not isinstance(alpha, Real):
        hint = (f"; for one alpha per head pass a tensor of shape ({n_heads},), e.g. torch.tensor({list(alpha)!r})"
                if isinstance(alpha, (list, tuple)) else "")
        raise TypeError(f"{name} must be a float or a tensor, got {type(alpha).__name__}{hint}")


def check_alpha_not_mask(alpha, q) -> None:
    """The attention calls' 4th positional argument is ``alpha`` where ``scaled_dot_product_attention`` takes
    ``attn_mask``: a boolean tensor, or a tensor of two or more dims with a last dim above 1, there is most likely a
    mask passed by position. Raise the alpha error with that said (``TypeError`` for a boolean tensor, ``ValueError``
    otherwise); anything else is left to :func:`check_head_alpha`."""
    if not isinstance(alpha, Tensor):
        return
    if alpha.dtype == torch.bool:
        err, what = TypeError, f"a float or a floating-point tensor, got a tensor of dtype {alpha.dtype}"
    elif alpha.dim() >= 2 and alpha.shape[-1] > 1:
        heads = f"({q.shape[1]},)" if isinstance(q, Tensor) and q.dim() == 4 else "(heads,)"
        err, what = ValueError, f"a float or a tensor of shape () or {heads} (one per head), got shape " \
                                f"{tuple(alpha.shape)}"
    else:
        return
    raise err(f"alpha must be {what}. alpha is the 4th positional argument, where scaled_dot_product_attention "
              f"takes attn_mask: pass a mask as attn_mask=...")


def alpha_tensor(alpha: Tensor, q: Tensor) -> Tensor:
    """A checked tensor alpha as the spec holds it: ``(Hq,)`` on ``q``'s device, float32 (float64 for float64 ``q``),
    a differentiable view or cast of the caller's tensor."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return alpha.to(device=q.device, dtype=dtype).reshape(-1).expand(q.shape[1])


def head_cast(t: Tensor | None, q: Tensor) -> Tensor | None:
    """A checked per-head tensor (``alibi_slopes``, ``sinks``) as the spec holds it: float32, float64 for float64
    ``q`` (a differentiable cast)."""
    return None if t is None else t.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _normalize_alpha(alpha, q: Tensor, in_range: bool, compute_dtype: torch.dtype | None = None):
    """alpha as ``(tensor (Hq,), python value or None, values known in range)``; a Python alpha as the computation
    holds it (``compute_dtype``: default float64 for float64 ``q``, float32 otherwise)."""
    n_heads = q.shape[1]
    check_head_alpha("alpha", alpha, n_heads)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if isinstance(alpha, Tensor):
        if alpha.device != q.device and alpha.device.type != "cpu":
            raise ValueError(f"alpha must be on the device of q ({q.device}) or on the CPU, got {alpha.device}")
        checked = in_range
        if not checked and values_checkable(alpha):
            vals = alpha.detach()
            if not bool(((vals >= 1) & (vals <= 2)).all()):  # NaN fails both comparisons
                raise ValueError(f"alpha must be finite and in [1, 2], got {vals.flatten().tolist()}")
            checked = True
        return alpha_tensor(alpha, q), None, checked
    if not torch.compiler.is_compiling():
        alpha = check_number("alpha", alpha, 1.0, 2.0)
    # the value the computation holds (1 + 1e-9 is 1.0 in float32: the softmax class, as a tensor alpha would be)
    alpha = computed_alpha(alpha, dtype if compute_dtype is None else compute_dtype)
    return torch.full((n_heads,), alpha, dtype=dtype, device=q.device), alpha, True


def _check_cu_seqlens(cu_q, cu_k, q: Tensor, k: Tensor, max_seqlen_q, max_seqlen_k):
    """Validate packed-sequence offsets; return them as int32 with the longest sequence lengths."""
    lengths = []
    for name, cu, total, given in (("cu_seqlens_q", cu_q, q.shape[2], max_seqlen_q),
                                   ("cu_seqlens_k", cu_k, k.shape[2], max_seqlen_k)):
        if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            got = f"{cu.dtype} tensor of shape {tuple(cu.shape)}" if isinstance(cu, Tensor) else type(cu).__name__
            raise TypeError(f"{name} must be a 1-d int32 or int64 tensor, got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold at least two offsets (nseq + 1), got {cu.numel()}")
        longest = None
        if values_checkable(cu):
            vals = cu.tolist()
            if vals[0] != 0 or vals[-1] != total or any(b < a for a, b in zip(vals, vals[1:])):
                raise ValueError(
                    f"{name} must start at 0, be non-decreasing and end at the packed length {total}, got {vals}"
                )
            longest = max(b - a for a, b in zip(vals, vals[1:]))
        lengths.append(_max_seqlen(name.replace("cu_seqlens", "max_seqlen"), given, cu, longest))
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    return cu_q.to(torch.int32), cu_k.to(torch.int32), lengths[0], lengths[1]


def _max_seqlen(name: str, given, cu: Tensor, longest: int | None) -> int:
    """The given bound (checked against ``longest`` when known), else the longest sequence (one host read)."""
    if given is None and longest is None and cu.device.type == "meta":
        raise ValueError(f"{name} must be given with meta cu_seqlens (their values cannot be read), got None")
    if given is None:
        return longest if longest is not None else int((cu[1:] - cu[:-1]).max())
    if isinstance(given, bool) or not isinstance(given, Integral):
        raise TypeError(f"{name} must be None or an int, got {type(given).__name__}")
    if given < 0 or (longest is not None and given < longest):
        bound = f"the longest sequence ({longest})" if longest is not None else "0"
        raise ValueError(f"{name} must be at least {bound}, got {given}")
    return int(given)


_UNBOUNDED_WINDOW = 2**62
"""Window sides at least this wide are unbounded (no tensor has that many rows)."""


def _check_window_size(window_size) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)`` ints >= -1, or None for no window (also for ``(-1, -1)``). A side of
    :data:`_UNBOUNDED_WINDOW` or more reaches past any sequence: it becomes ``-1`` (the mask arithmetic is int64)."""
    if window_size is None:
        return None
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, Integral) and not isinstance(w, bool) for w in window_size)
    if not ok:
        raise TypeError(f"window_size must be None or a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size must hold ints >= -1 (-1 = unbounded on that side), got {window_size!r}")
    left, right = (-1 if w >= _UNBOUNDED_WINDOW else w for w in (left, right))
    return None if left == right == -1 else (left, right)


def _head_vector(name: str, t, q: Tensor, shapes: tuple, expected: str) -> Tensor | None:
    """A per-head floating tensor on ``q``'s device with one of ``shapes``, cast to float32 (float64 for
    float64 ``q``; a differentiable cast)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be None or a floating-point tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    return head_cast(t, q)


_SMALLEST_CAP = 2.0**-64
"""Soft caps below this act as it: every finite score is capped to within ``2**-64`` of 0 either way, below the
resolution of the rows' thresholds in float32 and float64 (uniform weights), while the kernels' ``1 / cap`` (times
alpha - 1) stays finite in float32 (smaller caps gave NaN at zero scores)."""


def _check_softcap(softcap) -> float | None:
    """``softcap`` as a positive float (at least :data:`_SMALLEST_CAP`), or None when off (None or 0, flash-attn's
    default)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, Real):
        raise TypeError(f"softcap must be None or a Python number, got {type(softcap).__name__}")
    value = float(softcap)
    if not (0.0 <= value < float("inf")):
        raise ValueError(f"softcap must be None, 0 (off) or a finite positive number, got {softcap!r}")
    return max(value, _SMALLEST_CAP) if value > 0 else None


def check_variants(q: Tensor, n_rows: int, window_size, alibi_slopes, sinks, softcap, rows_name: str = "batch"):
    """Check the attention variants of a call with ``q`` ``(B, Hq, Nq, D)`` and ``n_rows`` batch entries (or packed
    sequences, ``rows_name``), as :func:`sparse_attn.entmax_attention` documents them; return them normalized:
    ``(window_size, alibi_slopes, sinks, softcap)``, each None when unused (slopes and sinks float32 on ``q``'s
    device, float64 for float64 ``q``). Raises ``TypeError`` / ``ValueError`` naming the argument."""
    window_size = _check_window_size(window_size)
    n_heads = q.shape[1]
    alibi_slopes = _head_vector("alibi_slopes", alibi_slopes, q, ((n_heads,), (n_rows, n_heads)),
                                f"({n_heads},) or ({rows_name}, heads) = ({n_rows}, {n_heads})")
    sinks = _head_vector("sinks", sinks, q, ((n_heads,),), f"({n_heads},) (one sink logit per q head)")
    return window_size, alibi_slopes, sinks, _check_softcap(softcap)


def prepare_attention(
    q: Tensor, k: Tensor, v: Tensor, alpha: float | Tensor = 1.5, *,
    attn_mask: Tensor | None = None, is_causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
    enable_gqa: bool = False, cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, backend: str = "auto",
    window_size: tuple[int, int] | None = None, alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
    softcap: float | None = None, alpha_in_range: bool = False, need_stats: bool = False, kv_cache: bool = False,
    cache_seqlens: Tensor | int | None = None, block_table: Tensor | None = None, num_splits: int | None = None,
    block_mask=None, compute_dtype: torch.dtype | None = None, deterministic: bool = True,
) -> AttnSpec:
    """Validate the arguments of :func:`sparse_attn.entmax_attention` and normalize them into the one spec of the call
    (see :class:`~sparse_attn.kernels._spec.AttnSpec`, also named :data:`AttentionInputs`).

    Arguments as :func:`sparse_attn.entmax_attention` (``need_stats`` is its ``return_stats``), plus a promise callers
    may make: ``alpha_in_range`` (a tensor alpha's values are in [1, 2], e.g. a module's alpha, valid by
    construction: they are not read), and the reference's ``compute_dtype`` (a Python alpha is held as that dtype
    holds it: ``kernels._args.computed_alpha``). Float masks are not checked for NaN / +inf: such entries make
    their rows NaN on every backend (the non-finite policy). Problems with no query, key, head or batch entry
    run on the reference (their output is empty or zero).

    ``kv_cache=True`` is a decoding step (:func:`sparse_attn.entmax_decode`): ``k`` / ``v`` are its KV cache
    (contiguous, or a page pool with ``block_table``), ``cache_seqlens``, ``max_seqlen_k`` and ``num_splits`` as that
    function documents them (checked by :func:`sparse_attn.attn._kv_cache.check_kv_cache`); grouped-query heads need no
    flag.

    Returns:
        :class:`~sparse_attn.kernels._spec.AttnSpec`. Raises ``TypeError`` / ``ValueError`` naming the argument.
    """
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    check_bool("need_stats", need_stats)
    check_bool("deterministic", deterministic)
    if kv_cache:
        cache_seqlens, max_seqlen_k = check_kv_cache(q, k, v, cache_seqlens, block_table, max_seqlen_k, num_splits)
        varlen, kv_names = False, ("k_cache", "v_cache")
    else:
        for name, given in (("cache_seqlens", cache_seqlens), ("block_table", block_table),
                            ("num_splits", num_splits)):
            if given is not None:
                raise ValueError(f"{name} is only used with a KV cache (sparse_attn.entmax_decode), got {given!r}")
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        varlen, kv_names = cu_seqlens_q is not None, ("k", "v")
        _check_qkv(q, k, v, enable_gqa, varlen)
    packed = varlen and isinstance(cu_seqlens_q, Tensor) and cu_seqlens_q.dim() == 1
    n_rows = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    window_size, alibi_slopes, sinks, softcap = check_variants(q, n_rows, window_size, alibi_slopes, sinks, softcap,
                                                               "nseq" if varlen else "batch")
    backend = resolve_backend(backend, q, v, unfused_variants(q, v, window_size, alibi_slopes, sinks, softcap,
                                                              kv_names[1]))
    if not kv_cache and (0 in q.shape[:3] or k.shape[2] == 0):
        backend = "reference"
    alpha_t, alpha_value, alpha_checked = _normalize_alpha(alpha, q, alpha_in_range, compute_dtype)
    seqlen_k = (block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[2])
    check_mask("attn_mask", attn_mask, q.device, (q.shape[0], q.shape[1], q.shape[2], seqlen_k))
    if varlen:
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = _check_cu_seqlens(
            cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    else:
        for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", None if kv_cache else max_seqlen_k)):
            if given is not None:
                raise ValueError(
                    f"{name} is only used with cu_seqlens_q/cu_seqlens_k (packed sequences), got {given!r}"
                )
        max_seqlen_q, max_seqlen_k = q.shape[2], max_seqlen_k if kv_cache else k.shape[2]
    block_mask = check_block_mask("block_mask", block_mask, q.device, n_rows, q.shape[1], max_seqlen_q, max_seqlen_k,
                                  "nseq" if varlen else "batch")
    if varlen and (max_seqlen_q > q.shape[2] or max_seqlen_k > k.shape[2]):
        # no sequence is longer than the packed length: a larger bound (a model's context length, passed for every
        # batch) would only size the kernels' grids past it (2**40 ran for minutes); a block mask built for that bound
        # keeps the blocks the packed length reaches
        max_seqlen_q, max_seqlen_k = min(max_seqlen_q, q.shape[2]), min(max_seqlen_k, k.shape[2])
        if block_mask is not None:
            (bq, bk), grid = block_mask.block_size, block_mask.mask
            block_mask = block_mask._replace(mask=grid[:, :, :-(-max_seqlen_q // bq), :-(-max_seqlen_k // bk)])
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)):
        raise TypeError(f"scale must be None or a Python number, got {type(scale).__name__}")
    if scale is not None and not abs(float(scale)) < float("inf"):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0
    dropout_p = check_number("dropout_p", dropout_p, 0.0, 1.0, high_open=True)
    fields = dict(q=q, k=k, v=v, alpha=alpha_t, mask=attn_mask, sinks=sinks, alibi_slopes=alibi_slopes)
    need_grad = torch.is_grad_enabled() and any(isinstance(fields[name], Tensor) and fields[name].requires_grad
                                                for name in DIFFERENTIABLE)
    return AttnSpec(
        q=q, k=k, v=v, alpha=alpha_t, alpha_value=alpha_value, alpha_checked=alpha_checked, mask=attn_mask,
        is_causal=is_causal, scale=float(scale), dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend,
        window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap,
        alpha_class=resolve_spec_alpha_class(alpha_t, alpha_value, alpha_checked), need_stats=need_stats,
        need_grad=need_grad, cache_seqlens=cache_seqlens, block_table=block_table, num_splits=num_splits,
        block_mask=None if block_mask is None else block_mask.mask,
        block_size=None if block_mask is None else block_mask.block_size,
        block_bits=None if block_mask is None else block_mask.bits, deterministic=deterministic,
    )
