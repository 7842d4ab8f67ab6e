"""Entmax attention for decoding: a few new queries per sequence against a (paged) KV cache.

``entmax_decode(q, k_cache, v_cache, cache_seqlens, alpha)`` is shaped like flash-attn's
``flash_attn_with_kvcache`` (without the in-kernel cache append: the cache already holds the keys of the current
queries) and returns, when asked, the same per-row statistics as ``entmax_attention(..., return_stats=True)``, so a
generation loop can report head densities per generated token at no extra cost. CUDA tensors run the split-K
kernels of ``kernels/entmax_decode.py``; other tensors gather the cache and run the float64-capable reference.
Design and measurements: docs/decode.md.
"""

from __future__ import annotations

from numbers import Integral, Real

import torch
from torch import Tensor

from sparse_attn._validation import check_bool, check_number, values_checkable
from sparse_attn.attn_inputs import (
    AttentionInputs,
    AttentionStats,
    check_head_alpha,
    check_variants,
    resolve_backend,
    unfused_variants,
)
from sparse_attn.masks import check_mask
from sparse_attn.reference import entmax_attention_reference
from sparse_attn.routes import refusal_message, refused, used_variants

__all__ = ["entmax_decode", "MAX_DECODE_QUERIES", "decode_attention", "decode_fits", "decode_unsupported"]

MAX_DECODE_QUERIES = 16
"""Queries per sequence the decode kernels take (longer query chunks: :func:`sparse_attn.entmax_attention`)."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.custom_op("sparse_attn::entmax_decode", mutates_args=())
def _decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, alpha: Tensor, alpha_value: float | None,
    scale: float, block_table: Tensor | None, bias: Tensor | None, is_causal: bool, max_seqlen_k: int | None,
    num_splits: int | None, window_size: list[int] | None, alibi_slopes: Tensor | None, softcap: float | None,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode kernels as a custom op (forward only): ``(out, tau, nnz, n_valid)``; ``alpha`` float32 ``(Hq,)``,
    ``alpha_value`` the Python number it holds when it was given as one (one compile-time alpha class)."""
    from sparse_attn.kernels import entmax_decode as kernels

    res = kernels.entmax_decode_fwd(
        q, k_cache, v_cache, cache_seqlens, alpha if alpha_value is None else alpha_value, scale,
        block_table=block_table, bias=bias, is_causal=is_causal, window_size=window_size, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, max_seqlen_k=max_seqlen_k, num_splits=num_splits)
    return res.out, res.tau, res.nnz, res.n_valid


@_decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                 max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks):
    rows = q.shape[:3]
    return (q.new_empty((*rows, v_cache.shape[-1])), q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.int32), q.new_empty(rows, dtype=torch.int32))


def _check_cache(q: Tensor, k_cache, v_cache, block_table) -> tuple[int, int]:
    """Check the cache tensors against ``q``; return ``(n_kv_heads, capacity)`` (keys a sequence may hold)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(batch, heads, seq, head_dim)" if name == "q" or block_table is None else \
                "(num_pages, page_size, kv_heads, head_dim) with block_table"
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree in all but the head dim, got shapes {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"q and k_cache must have the same head_dim, got {q.shape[3]} and {k_cache.shape[3]}")
    if block_table is None:
        if k_cache.shape[0] != q.shape[0]:
            raise ValueError(f"q and k_cache must have the same batch size, got {q.shape[0]} and {k_cache.shape[0]} "
                             f"(a paged cache needs block_table)")
        n_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    else:
        if not isinstance(block_table, Tensor):
            raise TypeError(f"block_table must be None or a torch.Tensor, got {type(block_table).__name__}")
        if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2:
            raise TypeError(f"block_table must be a 2-d int32 tensor (batch, max_pages_per_seq), got a "
                            f"{block_table.dtype} tensor of shape {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")
        if block_table.shape[0] != q.shape[0]:
            raise ValueError(f"block_table must have one row per batch entry ({q.shape[0]}), "
                             f"got {block_table.shape[0]}")
        if k_cache.shape[1] < 1:
            raise ValueError(f"k_cache must have pages of at least one slot, got page size {k_cache.shape[1]}")
        n_kv_heads, capacity = k_cache.shape[2], block_table.shape[1] * k_cache.shape[1]
    h_q = q.shape[1]
    if (n_kv_heads == 0 and h_q != 0) or (n_kv_heads != 0 and h_q % n_kv_heads != 0):
        if block_table is None:
            # The usual cause: a flash-attn (B, N, Hk, D) cache given as it is. A layout cannot be inferred from the
            # shape (N == Hk, or N dividing Hq, is possible), so it is named rather than guessed.
            raise ValueError(
                f"the number of q heads ({h_q}) must be a multiple of the number of kv heads ({n_kv_heads}): a "
                f"contiguous k_cache must have shape (B, Hk, N, D) (kv heads on dim 1), got k_cache of shape "
                f"{tuple(k_cache.shape)} for q of shape {tuple(q.shape)} (B, Hq, Nq, D); a flash-attn (B, N, Hk, D) "
                f"cache must be transposed first: k_cache.transpose(1, 2), v_cache.transpose(1, 2) (views, no copy; "
                f"likewise a (B, Nq, Hq, D) q)")
        raise ValueError(f"the number of q heads ({h_q}) must be a multiple of the number of kv heads ({n_kv_heads}): "
                         f"a paged k_cache must have shape (num_pages, page_size, Hk, D), got "
                         f"{tuple(k_cache.shape)} for q of shape {tuple(q.shape)} (B, Hq, Nq, D)")
    return n_kv_heads, capacity


def _seqlens(cache_seqlens, q: Tensor, capacity: int, block_table, num_pages: int, page_size: int) -> Tensor:
    """``cache_seqlens`` as int32 ``(B,)`` on ``q``'s device, values checked when that is free (or asked for)."""
    batch = q.shape[0]
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    if isinstance(cache_seqlens, Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), got {cache_seqlens}")
        return torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        got = f"a {cache_seqlens.dtype} tensor" if isinstance(cache_seqlens, Tensor) else type(cache_seqlens).__name__
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor of shape ({batch},), got {got}")
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per batch entry), "
                         f"got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got {cache_seqlens.device}")
    if values_checkable(cache_seqlens):
        vals = cache_seqlens.tolist()
        if any(not 0 <= s <= capacity for s in vals):
            raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (the cache's capacity), got {vals}")
        if block_table is not None and values_checkable(block_table):
            for b, s in enumerate(vals):
                used = block_table[b, : -(-s // page_size)]
                if used.numel() and not bool(((used >= 0) & (used < num_pages)).all()):
                    raise ValueError(f"block_table[{b}] must index pages in [0, {num_pages}) for the "
                                     f"{s} keys of sequence {b}, got {used.tolist()}")
    return cache_seqlens.to(torch.int32)


def _max_seqlen(max_seqlen_k, seqlens: Tensor, capacity: int) -> int | None:
    """The checked bound on ``cache_seqlens`` (None: the capacity)."""
    if max_seqlen_k is None:
        return int(seqlens.max()) if seqlens.device.type == "cpu" and seqlens.numel() else None
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, Integral):
        raise TypeError(f"max_seqlen_k must be None or an int, got {type(max_seqlen_k).__name__}")
    longest = int(seqlens.max()) if values_checkable(seqlens) and seqlens.numel() else 0
    if not longest <= max_seqlen_k <= capacity:
        raise ValueError(f"max_seqlen_k must lie in [{longest}, {capacity}] (the longest cache_seqlens entry, "
                         f"the cache's capacity), got {max_seqlen_k}")
    return int(max_seqlen_k)


def _alpha(alpha, n_heads: int, device) -> tuple[Tensor, float | None]:
    """``alpha`` for the kernels: a float32 ``(Hq,)`` tensor (values checked when readable) and the Python number
    it holds when given as one."""
    check_head_alpha("alpha", alpha, n_heads)
    if not isinstance(alpha, Tensor):
        value = check_number("alpha", alpha, 1.0, 2.0)
        return torch.full((n_heads,), value, dtype=torch.float32, device=device), value
    if alpha.device != device and alpha.device.type != "cpu":
        raise ValueError(f"alpha must be on the device of q ({device}) or on the CPU, got {alpha.device}")
    if values_checkable(alpha):
        vals = alpha.detach()
        if not bool(((vals >= 1) & (vals <= 2)).all()):
            raise ValueError(f"alpha must be finite and in [1, 2], got {vals.flatten().tolist()}")
    return alpha.detach().to(torch.float32).reshape(-1).expand(n_heads).contiguous(), None


def _gathered(cache: Tensor, block_table: Tensor | None) -> Tensor:
    """The cache as ``(B, Hk, capacity, D)`` (pages gathered through the block table)."""
    if block_table is None:
        return cache
    pages = cache[block_table.long().clamp(0, cache.shape[0] - 1)]  # (B, max_pages, page_size, Hk, D)
    b, n_pages, page_size, heads, d = pages.shape
    return pages.reshape(b, n_pages * page_size, heads, d).transpose(1, 2)


def _reference_decode(q, k_cache, v_cache, seqlens: Tensor, block_table, alpha, attn_mask, is_causal: bool,
                      scale: float, return_stats: bool, window_size, alibi_slopes, sinks, softcap):
    """The reference backend: each sequence's first ``cache_seqlens[b]`` keys (slots past them may hold anything)
    through ``entmax_attention_reference``, so that the causal mask, the window and ALiBi take the decode
    alignment (query ``i`` at key position ``i + cache_seqlens[b] - Nq``)."""
    k, v = _gathered(k_cache, block_table), _gathered(v_cache, block_table)
    if q.shape[0] == 0:
        return entmax_attention_reference(q, k, v, alpha, enable_gqa=True, return_stats=return_stats)
    mask = None if attn_mask is None else attn_mask.expand(*q.shape[:3], k.shape[2])
    outs, stats = [], []
    for b, length in enumerate(seqlens.tolist()):
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        out, st = entmax_attention_reference(
            q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length], alpha, scale=scale, is_causal=is_causal,
            attn_mask=None if mask is None else mask[b:b + 1, ..., :length], enable_gqa=True, return_stats=True,
            window_size=window_size, alibi_slopes=slopes, sinks=sinks, softcap=softcap)
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
        max_seqlen_k: an upper bound on ``cache_seqlens`` (default: the capacity, or the longest entry of a CPU
            tensor); the key range the splits cover, so a tight bound saves idle programs.
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
    _, capacity = _check_cache(q, k_cache, v_cache, block_table)
    paged = block_table is not None
    seqlens = _seqlens(cache_seqlens, q, capacity, block_table, k_cache.shape[0], k_cache.shape[1] if paged else 1)
    bound = _max_seqlen(max_seqlen_k, seqlens, capacity)
    window_size, alibi_slopes, sinks, softcap = check_variants(q, q.shape[0], window_size, alibi_slopes, sinks,
                                                               softcap)
    backend = resolve_backend(backend, q, v_cache,
                              unfused_variants(q, v_cache, window_size, alibi_slopes, sinks, softcap, "v_cache"))
    if backend == "triton" and q.shape[2] > MAX_DECODE_QUERIES:
        raise ValueError(f"q: the decode kernels take at most {MAX_DECODE_QUERIES} queries per sequence, got "
                         f"{q.shape[2]}; use sparse_attn.entmax_attention for longer query chunks")
    alpha_t, alpha_value = _alpha(alpha, q.shape[1], q.device)
    check_mask("attn_mask", attn_mask, q.device, (q.shape[0], q.shape[1], q.shape[2], capacity))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)):
        raise TypeError(f"scale must be None or a Python number, got {type(scale).__name__}")
    if scale is not None and not abs(float(scale)) < float("inf"):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, Integral)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    if backend == "triton":
        used = used_variants(q, None, v_cache, alpha=alpha, mask=attn_mask, is_causal=is_causal,
                             window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap)
        why = refused("decode", used)
        if why:
            raise ValueError(refusal_message("decode", why, "use sparse_attn.entmax_attention to train, or call "
                                             "entmax_decode under torch.no_grad()"))
    if backend == "reference":
        return _reference_decode(q, k_cache, v_cache, seqlens, block_table, alpha, attn_mask, is_causal, scale,
                                 return_stats, window_size, alibi_slopes, sinks, softcap)

    out, tau, nnz, n_valid = _decode_op(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, alpha=alpha_t, alpha_value=alpha_value,
        scale=scale, block_table=block_table, bias=attn_mask, is_causal=is_causal, max_seqlen_k=bound,
        num_splits=num_splits, window_size=_window_arg(window_size), alibi_slopes=alibi_slopes, softcap=softcap,
        sinks=sinks)
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out


def _window_arg(window_size) -> list[int] | None:
    """``window_size`` as the custom op takes it (a list of ints, or None)."""
    return None if window_size is None else [int(w) for w in window_size]


def decode_unsupported(inputs: AttentionInputs) -> list[str]:
    """What keeps a fused-path call off the decode kernels, as phrases (empty: they can run it).

    The variants the ``"decode"`` route does not list in :data:`sparse_attn.routes.SUPPORTED`: the decode kernels
    implement masks (boolean or float), bottom-right causal masking, GQA/MQA, per-head alpha and every attention
    variant the fused path takes (sliding window, ALiBi, sinks, soft cap, ``Dv != D``), forward only. What the fused
    path refuses (:func:`sparse_attn.attn_inputs.unfused_variants`: slopes that require grad, value head dims outside
    [16, 256]) never reaches here.
    """
    return refused("decode", inputs.used())


def decode_fits(inputs: AttentionInputs) -> bool:
    """Whether the fused path runs ``inputs`` on the split-K decode kernels instead of the general forward.

    A decoding step: ``1 <= Nq <= MAX_DECODE_QUERIES`` queries per sequence against more keys than queries (a KV
    cache; ``Nk > Nq``), on the triton backend, with nothing from :func:`decode_unsupported`.
    """
    n_q, n_k = inputs.q.shape[2], inputs.k.shape[2]
    return (inputs.backend == "triton" and 1 <= n_q <= MAX_DECODE_QUERIES and n_k > n_q
            and not decode_unsupported(inputs))


def decode_attention(inputs: AttentionInputs, return_stats: bool = False):
    """Run prepared inputs for which :func:`decode_fits` holds on the decode kernels: ``k``, ``v`` are a contiguous
    cache of ``Nk`` keys for every sequence. Returns ``out`` ``(B, Hq, Nq, Dv)`` or ``(out, AttentionStats)``."""
    q, k = inputs.q, inputs.k
    seqlens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    out, tau, nnz, n_valid = _decode_op(
        q=q, k_cache=k, v_cache=inputs.v, cache_seqlens=seqlens, alpha=inputs.alpha.detach().float().contiguous(),
        alpha_value=inputs.alpha_value, scale=inputs.scale, block_table=None, bias=inputs.mask,
        is_causal=inputs.is_causal, max_seqlen_k=k.shape[2], num_splits=None,
        window_size=_window_arg(inputs.window_size), alibi_slopes=inputs.alibi_slopes, softcap=inputs.softcap,
        sinks=inputs.sinks)
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out
