"""Entmax attention for decoding: a few new queries per sequence against a (paged) KV cache.

``entmax_decode(q, k_cache, v_cache, cache_seqlens, alpha)`` is shaped like flash-attn's
``flash_attn_with_kvcache`` (without the in-kernel cache append: the cache already holds the keys of the current
queries) and returns, when asked, the same per-row statistics as ``entmax_attention(..., return_stats=True)``, so a
generation loop can report head densities per generated token at no extra cost. CUDA tensors run the split-K
kernels of ``kernels/attn/entmax_decode.py``; other tensors gather the cache and run the float64-capable reference.
Design and measurements: docs/decode.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_attn._validation import check_bool
from sparse_attn.attn._kv_cache import MAX_DECODE_QUERIES
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec, prepare_attention
from sparse_attn.attn.reference import entmax_attention_reference
from sparse_attn.attn.routes import refusal_message, refused

__all__ = ["entmax_decode", "MAX_DECODE_QUERIES", "decode_attention", "decode_fits", "decode_unsupported"]

@torch.library.custom_op("sparse_attn::entmax_decode", mutates_args=())
def _decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, alpha: Tensor, alpha_value: float | None,
    scale: float, block_table: Tensor | None, bias: Tensor | None, is_causal: bool, max_seqlen_k: int | None,
    num_splits: int | None, window_size: list[int] | None, alibi_slopes: Tensor | None, softcap: float | None,
    sinks: Tensor | None, block_mask: Tensor | None = None, block_size: list[int] | None = None,
    block_bits: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode kernels as a custom op (forward only): ``(out, tau, nnz, n_valid)``; ``alpha`` float32 ``(Hq,)``,
    ``alpha_value`` the Python number it holds when it was given as one (one compile-time alpha class);
    ``block_mask``, ``block_size``, ``block_bits``: the spec's block grid, its ``(bq, bk)`` and its partial blocks'
    bits (None without them)."""
    from sparse_attn.kernels.attn import entmax_decode as kernels

    res = kernels.entmax_decode_fwd(
        q, k_cache, v_cache, cache_seqlens, alpha if alpha_value is None else alpha_value, scale,
        block_table=block_table, bias=bias, is_causal=is_causal, window_size=window_size, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, max_seqlen_k=max_seqlen_k, num_splits=num_splits,
        block_mask=None if block_mask is None else (block_mask, tuple(block_size), block_bits))
    return res.out, res.tau, res.nnz, res.n_valid


@_decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                 max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask=None, block_size=None,
                 block_bits=None):
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
    spec = prepare_attention(
        q, k_cache, v_cache, alpha, attn_mask=attn_mask, is_causal=is_causal, scale=scale, max_seqlen_k=max_seqlen_k,
        backend=backend, window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap,
        need_stats=return_stats, kv_cache=True, cache_seqlens=cache_seqlens, block_table=block_table,
        num_splits=num_splits)
    if spec.backend == "reference":
        return _reference_decode(spec)
    why = refused("decode", spec.used())
    if why:
        raise ValueError(refusal_message("decode", why, "use sparse_attn.entmax_attention to train, or call "
                                         "entmax_decode under torch.no_grad()"))
    return _run_decode_op(spec, spec.cache_seqlens, spec.need_stats)


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
    q, k = inputs.q, inputs.k
    seqlens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)
    return _run_decode_op(inputs, seqlens, inputs.need_stats if return_stats is None else return_stats)


def _run_decode_op(spec: AttnSpec, seqlens: Tensor, return_stats: bool):
    """The decode op on a spec whose ``k`` / ``v`` are a KV cache holding ``seqlens`` keys per sequence: ``out`` or
    ``(out, AttentionStats)``."""
    out, tau, nnz, n_valid = _decode_op(
        q=spec.q, k_cache=spec.k, v_cache=spec.v, cache_seqlens=seqlens,
        alpha=spec.alpha.detach().float().contiguous(), alpha_value=spec.alpha_value, scale=spec.scale,
        block_table=spec.block_table, bias=spec.mask, is_causal=spec.is_causal, max_seqlen_k=spec.max_seqlen_k,
        num_splits=spec.num_splits, window_size=_window_arg(spec.window_size), alibi_slopes=spec.alibi_slopes,
        softcap=spec.softcap, sinks=spec.sinks, block_mask=spec.block_mask,
        block_size=None if spec.block_size is None else [int(n) for n in spec.block_size], block_bits=spec.block_bits)
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out
