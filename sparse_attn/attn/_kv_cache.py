"""The KV cache of a decoding step, checked for :func:`sparse_attn.attn.attn_inputs.prepare_attention`.

:func:`sparse_attn.entmax_decode` takes its keys and values as a cache (contiguous ``(B, Hk, N, D)`` or a paged pool
``(num_pages, page_size, Hk, D)`` with a ``block_table``) with per-sequence lengths; :func:`check_kv_cache` checks
those arguments (the rest of the call goes through the same gate as every attention call).
"""

from __future__ import annotations

from numbers import Integral

import torch
from torch import Tensor

from sparse_attn._validation import values_checkable

__all__ = ["MAX_DECODE_QUERIES", "check_kv_cache"]

MAX_DECODE_QUERIES = 16
"""Queries per sequence the decode kernels take at once (more: :func:`sparse_attn.entmax_decode` runs them on the fused
kernels, or on the decode kernels this many at a time)."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_kv_cache(q: Tensor, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k, num_splits):
    """Check a decoding step's cache arguments (as :func:`sparse_attn.entmax_decode` documents them); return
    ``(cache_seqlens as int32 (B,), max_seqlen_k)``, ``max_seqlen_k`` the checked bound or the capacity."""
    _, capacity = _check_cache(q, k_cache, v_cache, block_table)
    paged = block_table is not None
    seqlens = _seqlens(cache_seqlens, q, capacity, block_table, k_cache.shape[0], k_cache.shape[1] if paged else 1)
    bound = _max_seqlen(max_seqlen_k, seqlens, capacity)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, Integral)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return seqlens, capacity if bound is None else bound


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
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens must be in [0, {capacity}] (the cache's capacity), got {cache_seqlens}")
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    else:
        if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
            got = f"a {cache_seqlens.dtype} tensor" if isinstance(cache_seqlens, Tensor) else \
                type(cache_seqlens).__name__
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
        seqlens = cache_seqlens.to(torch.int32)
    if block_table is not None and values_checkable(seqlens, block_table):
        # the pages a sequence's keys lie in, whatever form its length was given in (an int or None too)
        for b, s in enumerate(seqlens.tolist()):
            used = block_table[b, : -(-s // page_size)]
            if used.numel() and not bool(((used >= 0) & (used < num_pages)).all()):
                raise ValueError(f"block_table[{b}] must index pages in [0, {num_pages}) for the "
                                 f"{s} keys of sequence {b}, got {used.tolist()}")
    return seqlens


def _max_seqlen(max_seqlen_k, seqlens: Tensor, capacity: int) -> int | None:
    """The checked bound on ``cache_seqlens`` (None: the capacity)."""
    if max_seqlen_k is None:
        # from the values only where they are read anyway (the bound must not depend on values otherwise: a decoding
        # step's checks are cached by metadata, sparse_attn.decode._gate)
        return int(seqlens.max()) if values_checkable(seqlens) and seqlens.numel() else None
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, Integral):
        raise TypeError(f"max_seqlen_k must be None or an int, got {type(max_seqlen_k).__name__}")
    longest = int(seqlens.max()) if values_checkable(seqlens) and seqlens.numel() else 0
    if not longest <= max_seqlen_k <= capacity:
        raise ValueError(f"max_seqlen_k must lie in [{longest}, {capacity}] (the longest cache_seqlens entry, "
                         f"the cache's capacity), got {max_seqlen_k}")
    return int(max_seqlen_k)
