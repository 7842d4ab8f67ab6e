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

from sparse_attn._validation import check_bool, check_tensor, values_checkable
from sparse_attn.attn._decode_op import _run_decode_op, decode_attention, decode_fits, decode_unsupported
from sparse_attn.attn._kv_cache import MAX_DECODE_QUERIES
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec, alpha_tensor, head_cast, prepare_attention
from sparse_attn.attn.masks import BlockSparseMask
from sparse_attn.attn.reference import entmax_attention_reference
from sparse_attn.attn.routes import refusal_message, refused

__all__ = ["entmax_decode", "MAX_DECODE_QUERIES", "decode_attention", "decode_fits", "decode_unsupported"]


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
        blocks = None
        if spec.block_mask is not None:  # this sequence's grid, cut to its own keys
            grid, (bq, bk) = spec.block_mask, spec.block_size
            grid = grid[b:b + 1] if grid.shape[0] > 1 else grid
            blocks = BlockSparseMask(grid[..., :-(-length // bk)], (bq, bk), spec.block_bits)
        out, st = entmax_attention_reference(
            q[b:b + 1], k[b:b + 1, :, :length], v[b:b + 1, :, :length], alpha, scale=spec.scale,
            is_causal=spec.is_causal, attn_mask=None if mask is None else mask[b:b + 1, ..., :length],
            enable_gqa=True, return_stats=True, window_size=spec.window_size, alibi_slopes=slopes, sinks=spec.sinks,
            softcap=spec.softcap, block_mask=blocks)
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
    block_mask=None,
    tau_hint: Tensor | None = None,
):
    """Entmax attention of ``Nq`` new queries per sequence over a KV cache (a decoding step, or a chunk of a prompt).

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
        block_mask: a :class:`sparse_attn.BlockSparseMask` ``(mask, (bq, bk))``, ``mask`` boolean ``(B or 1, Hq or 1,
            ceil(Nq / bq), ceil(max_seqlen_k / bk))`` (``max_seqlen_k``: as given, else the capacity), or torch's
            ``flex_attention.BlockMask`` (as :func:`sparse_attn.entmax_attention` takes it): query ``i`` sees key
            ``j`` only if block ``(i // bq, j // bk)`` keeps it (a ``BlockMask``'s partial blocks: where its
            ``mask_mod`` is True); key blocks hidden from every query of a program are not read. Default None.
        tau_hint: the previous decoding step's thresholds, ``stats.tau`` of a call with ``return_stats=True`` on the
            same layer (float32, broadcastable to ``(B, Hq, Nq)``, on ``q``'s device; in the same coordinates as
            that ``tau``: the z-scale ``(alpha - 1) * score``, soft cap, ALiBi and sinks included). The kernels
            evaluate each row's total weight at a few points around its hint in the pass that reads the keys, and
            use them only where they bracket the row's threshold (certified as every other bracket point, on
            either side of it): the result is the same as without the hint up to the kernels' threshold tolerance,
            and when the hint is close the passes that refine the threshold are skipped (docs/decode.md). A stale
            or wrong hint costs nothing but those points; NaN and infinite entries (rows with no key), entries
            beyond +-1e15 and softmax rows are ignored. The reference backend ignores it (its threshold is exact).
            Not taken with more than 16 queries per sequence. Default None.

    More than 16 queries per sequence (a chunk of a prompt over the cache: causal within the chunk, bottom-right
    against the cache) take the fused kernels on the triton backend: the sequences' keys are gathered from the cache
    into packed variable-length keys and values (no host synchronization on CUDA: space for the full capacity of
    every sequence is taken) and run like ``entmax_attention(..., cu_seqlens_q=..., cu_seqlens_k=...)``. A mask that
    varies by query instead runs through the decode kernels 16 queries at a time, which needs ``is_causal`` or, when
    not causal, neither ``window_size`` nor ``alibi_slopes``, and no ``block_mask`` (refused by name otherwise).

    Returns:
        ``out`` ``(B, Hq, Nq, Dv)`` in the input dtype, or ``(out, stats)``. Rows with no key give zeros; a row
        whose scores hold NaN or ``+inf`` is NaN (``tau`` NaN, ``nnz`` 0).
    """
    check_bool("is_causal", is_causal)
    check_bool("return_stats", return_stats)
    spec, why = _gate(q, k_cache, v_cache, cache_seqlens, alpha, dict(
        attn_mask=attn_mask, is_causal=is_causal, scale=scale, max_seqlen_k=max_seqlen_k, backend=backend,
        window_size=window_size, alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap, need_stats=return_stats,
        block_table=block_table, num_splits=num_splits, block_mask=block_mask))
    if tau_hint is not None:
        _check_tau_hint(tau_hint, spec.q)
    if spec.backend == "reference":
        return _reference_decode(spec)
    if why:
        raise ValueError(refusal_message("decode", why, "use sparse_attn.entmax_attention to train, or call "
                                         "entmax_decode under torch.no_grad()"))
    if spec.q.shape[2] > MAX_DECODE_QUERIES:
        if tau_hint is not None:
            raise ValueError(f"tau_hint is taken with at most {MAX_DECODE_QUERIES} queries per sequence (a decoding "
                             f"step), got {spec.q.shape[2]} queries")
        return _prefill(spec)
    return _run_decode_op(spec, spec.cache_seqlens, spec.need_stats, None if tau_hint is None else tau_hint.detach())


def _check_tau_hint(tau_hint, q: Tensor) -> None:
    """``tau_hint`` of :func:`entmax_decode`: a float32 tensor on ``q``'s device, broadcastable to ``(B, Hq, Nq)``
    (metadata only: its values are never read on the host)."""
    check_tensor("tau_hint", tau_hint)
    if tau_hint.dtype != torch.float32:
        raise TypeError(f"tau_hint must be a float32 tensor (the tau of a previous step's stats), got dtype "
                        f"{tau_hint.dtype}")
    if tau_hint.device != q.device:  # a 0-d CPU tensor too: the kernels read it
        raise ValueError(f"tau_hint must be on the device of q ({q.device}), got {tau_hint.device}")
    rows = tuple(q.shape[:3])
    if tau_hint.dim() > 3 or any(n not in (1, r) for n, r in zip(tau_hint.shape[::-1], rows[::-1], strict=False)):
        raise ValueError(f"tau_hint must be broadcastable to (batch, q heads, queries) = {rows}, got shape "
                         f"{tuple(tau_hint.shape)}")


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
    ``prepare_attention`` converts them). Never with a block mask (it is converted), while the values of a tensor are
    read for checks (CPU tensors, :func:`sparse_attn.set_checks`; those checks run on every call), while
    ``torch.compile`` traces, or while a CUDA graph is being captured: an integer ``cache_seqlens`` or a Python
    ``alpha`` become device tensors the kept spec holds, which a capture would leave unwritten, and a graph must not
    read a kept tensor the cache may drop."""
    cacheable = not (torch.compiler.is_compiling() or _capturing(q) or kw["block_mask"] is not None
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


def _prefill(spec: AttnSpec):
    """More than ``MAX_DECODE_QUERIES`` queries per sequence on the triton backend: packed through the fused
    kernels, or 16 queries at a time through the decode kernels with a mask that varies by query (docstring of
    :func:`entmax_decode`)."""
    if spec.mask is not None and spec.mask.dim() >= 2 and spec.mask.shape[-2] > 1:
        return _prefill_chunks(spec)
    return _prefill_packed(spec)


def _prefill_chunks(spec: AttnSpec):
    """The decode kernels on 16 queries at a time. Causal: chunk ``[c0, c1)`` is a decoding step of its own over the
    first ``cache_seqlens - (Nq - c1)`` keys (the chunk's queries are their last ones: the alignment, the window and
    ALiBi come out exact, and causality hides the later keys anyway); not causal, the alignment matters to nothing
    left, and every chunk sees every key."""
    why = []
    if not spec.is_causal and (spec.window_size is not None or spec.alibi_slopes is not None):
        why.append("window_size or alibi_slopes without is_causal")
    if spec.block_mask is not None:
        why.append("a block_mask")
    if why:
        raise ValueError(f"attn_mask: a mask that varies by query with more than {MAX_DECODE_QUERIES} queries takes "
                         f"the decode kernels {MAX_DECODE_QUERIES} queries at a time, which cannot align "
                         f"{' and '.join(why)}; pass a mask per key (shape (B, Hq or 1, 1, capacity)), or at most "
                         f"{MAX_DECODE_QUERIES} queries per call")
    n_q = spec.q.shape[2]
    outs, stats = [], []
    for c0 in range(0, n_q, MAX_DECODE_QUERIES):
        c1 = min(c0 + MAX_DECODE_QUERIES, n_q)
        lengths = (spec.cache_seqlens - (n_q - c1)).clamp_min(0) if spec.is_causal else spec.cache_seqlens
        res = _run_decode_op(spec.swapped(q=spec.q[:, :, c0:c1], mask=spec.mask[..., c0:c1, :]), lengths, True)
        outs.append(res[0])
        stats.append(res[1])
    out = torch.cat(outs, dim=2)
    if not spec.need_stats:
        return out
    return out, AttentionStats(*(torch.cat([getattr(st, f) for st in stats], dim=2) for f in AttentionStats._fields))


def _prefill_packed(spec: AttnSpec):
    """The fused kernels on packed variable-length sequences: sequence ``b``'s ``cache_seqlens[b]`` keys and values
    gathered from the cache (through the block table) one after another, its ``Nq`` queries likewise; each sequence's
    causal mask, window and ALiBi are bottom-right aligned, as a decoding step's. A mask (per key) is gathered with
    the keys. Where values are read for checks the packed length is exact; otherwise (CUDA) space is taken for
    ``B * max_seqlen_k`` keys, so that nothing is read back."""
    q, lengths = spec.q, spec.cache_seqlens.clamp(0, spec.max_seqlen_k)
    batch, n_heads, n_q, _ = q.shape
    dev = q.device
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), torch.cumsum(lengths, 0, dtype=torch.int32)])
    total = int(cu_k[-1]) if values_checkable(lengths) else batch * spec.max_seqlen_k
    slot = torch.arange(total, device=dev)
    seq = torch.searchsorted(cu_k[1:], slot, right=True).clamp_max(max(batch - 1, 0))
    pos = (slot - cu_k[seq]).clamp(0, max(spec.seqlen_k - 1, 0))  # key position in its sequence (past the end: unread)
    k, v = (_rows(t, spec.block_table, seq, pos).transpose(0, 1)[None] for t in (spec.k, spec.v))
    mask = spec.mask
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mask = mask.expand(*mask.shape[:3], spec.seqlen_k)[seq if mask.shape[0] > 1 else 0 * seq, :, 0, pos]
        mask = mask.transpose(0, 1)[None, :, None, :]  # (1, Hq or 1, 1, total)
    packed = prepare_attention(
        q.transpose(0, 1).reshape(n_heads, batch * n_q, q.shape[3])[None], k, v,
        spec.alpha if spec.alpha_value is None else spec.alpha_value, attn_mask=mask, is_causal=spec.is_causal,
        scale=spec.scale, enable_gqa=True,
        cu_seqlens_q=torch.arange(0, (batch + 1) * n_q, n_q, dtype=torch.int32, device=dev), cu_seqlens_k=cu_k,
        max_seqlen_q=n_q, max_seqlen_k=spec.max_seqlen_k, backend="triton", window_size=spec.window_size,
        alibi_slopes=spec.alibi_slopes, sinks=spec.sinks, softcap=spec.softcap, alpha_in_range=spec.alpha_checked,
        need_stats=spec.need_stats,
        block_mask=None if spec.block_mask is None else BlockSparseMask(spec.block_mask, spec.block_size,
                                                                        spec.block_bits))
    from sparse_attn.attn._attn_autograd import fused_entmax_attention

    res = fused_entmax_attention(packed, spec.need_stats) if packed.backend == "triton" else entmax_attention_reference(
        packed.q, packed.k, packed.v, packed.alpha, scale=spec.scale, enable_gqa=True, cu_seqlens_q=packed.cu_seqlens_q,
        cu_seqlens_k=cu_k, max_seqlen_q=n_q, max_seqlen_k=spec.max_seqlen_k, return_stats=spec.need_stats)

    def unpack(t):  # (1, Hq, B * Nq, ...) -> (B, Hq, Nq, ...)
        return t[0].unflatten(1, (batch, n_q)).transpose(0, 1)

    if not spec.need_stats:
        return unpack(res)
    return unpack(res[0]), AttentionStats(*(unpack(t) for t in res[1]))


def _rows(cache: Tensor, block_table: Tensor | None, seq: Tensor, pos: Tensor) -> Tensor:
    """Key (or value) rows ``(n, Hk, D)`` of sequences ``seq`` at positions ``pos`` (each ``(n,)``) of a contiguous
    ``(B, Hk, Nk, D)`` cache or a page pool with its block table."""
    if block_table is None:
        return cache[seq, :, pos]
    page_size = cache.shape[1]
    page = block_table[seq, pos // page_size].long().clamp(0, cache.shape[0] - 1)
    return cache[page, pos % page_size]


