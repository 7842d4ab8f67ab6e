"""Split-K entmax attention for decoding: a few queries per sequence against a long, possibly paged, KV cache.

One program owns one key range (a *split*) of one (batch entry, kv head, row tile); its rows are the
``Nq x (Hq / Hk)`` queries that read that kv head (GQA packing: every q head of a group shares one read of
the cache). For alpha > 1 a decode step is two launches of one kernel, every split working on its own key blocks,
and in each launch the last program of a row tile to finish (a ticket per tile, ``_decode_state._last_arrival``)
doing what needs every split's results:

1. **score pass** (``PHASE 0``): the scores ``z = (alpha - 1) s`` of the split's keys are computed once
   from the cache and stored (``Z``, float32, ``Nq x Hq / Hk`` rows per kv head: a fraction of the key
   cache's own size), together with the split's row max, valid-key count, NaN flag and ``f``, ``g``, ``c``
   at ``GRID_K`` grid points ``ref + i / (GRID_K - 1)`` below the split's own running max (the forward's
   ring, kernels/attn/entmax_attn_fwd.py; ``ref`` the split's reference score, ``_threshold_tiles.anchor``).
   Blocks whose scores all lie below the lowest point are dead. The last program merges the splits' grid sums into
   the global sums (exact: the splits' references are a whole number of ring turns apart, so their grids are one
   grid and each slot of a split is that slot of the global ring; a point above a split's own max simply has
   nothing from that split), solves for a certified bracket and an estimate (kernels/attn/_threshold.py) and,
   while a row of the tile is not pinned down (at most ``max_passes - 2`` times), runs a **candidate pass** over
   every split's live blocks: ``CAND_P`` points of the bracket, from the stored scores (not the cache), dropping
   blocks below the certified lower bound (``_decode_state._cand_passes``). It stores the final threshold state of
   the tile.
2. **value pass** (``PHASE 2``): with that threshold, for every live block of the split the weights; the block's
   value rows are read only when some weight is positive. Partial ``sum_j p_j v_j``, ``sum_j p_j`` and support
   sizes per split; the last program combines them: ``out = sum_s acc_s / sum_s l_s`` and the statistics
   (``_decode_state._combine_rows``).

alpha == 1 is flash-decoding: one launch, one pass per split (online softmax, exponents ``(s - m) log2(e)`` in the
scores' own scale), the last program combining the splits rescaled by their maxima. Every pass after the score pass
takes the stored scores relative to the row's reference score (docs/kernels.md, "Shift invariance"). The number of
launches is fixed on the host (no synchronization) while the candidate passes adapt. Each split writes only its
own slots; the last program of a launch reads them all (the ticket orders its reads after every split's stores) and
sets the ticket back to zero.

The attention variants are the forward's (``kernels/_masking.py``: ``MASK``, ``SCORE``) with the decode alignment
(query ``i`` at key position ``i + cache_seqlens[b] - Nq``); the splits share only the key blocks the tile's rows may
see (``_masking.key_range``), and a key block a block-sparse mask (``SCORE.blocks``) hides from every row of a program
is never read (``_decode_state._tile_live``). A sink is one virtual score per row held by split 0
(``_masking.sink_tile``): it enters that split's max and grid sums, its candidate sums and its value-pass weight sum,
so every merge sees it exactly once; softmax rows add it in the combine. Values may have their own head dim
(``HEAD_DIM_V``). Derivation, measurements and the offline sm_90 builds: docs/decode.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _args
from .._common import LOG2E
from .._masking import key_block_range, score_mod, sink_tile
from .._spec import kernel_spec
from . import _decode_launch as _launch
from ._decode_state import (
    N_PART,
    _cache_strides,
    _cache_tile,
    _cand_passes,
    _combine_rows,
    _grid_state,
    _hint_sums,
    _last_arrival,
    _load_state,
    _packed_rows,
    _read_count,
    _row_mods,
    _store_partials,
    _store_points,
    _store_state,
    _tile_list,
    _tile_live,
)
from ._threshold import weights
from ._threshold_tiles import grid_counts, grid_start, grid_sums, grid_tile


class EntmaxDecodeResult(NamedTuple):
    """What :func:`entmax_decode_fwd` returns.

    out:         ``(B, Hq, Nq, Dv)`` in ``q.dtype``.
    tau:         float32 ``(B, Hq, Nq)``: the threshold in the z-scale (logsumexp of the scores at alpha == 1),
                 ``+inf`` for rows with no valid key, NaN for rows with a NaN or ``+inf`` score.
    nnz:         int32 ``(B, Hq, Nq)``: support size (valid keys at alpha == 1; 0 for NaN rows).
    n_valid:     int32 ``(B, Hq, Nq)``: keys the row may attend to.
    n_passes:    int32 ``(n_chains, B, Hk, n_row_tiles)``: passes that ran per row tile (score and value pass
                 included; 1 for softmax), one entry per alpha class launched (0 where it had no row of its class
                 in the tile).
    blocks_read: int32 ``(n_chains, B, Hk, n_row_tiles, n_splits, max_passes + 1)``: key blocks read per split
                 and pass. Column 0: cache key blocks of the score pass (softmax: its only pass); 1 .. max_passes
                 - 2: score blocks of each candidate pass (from the stored scores; the tile's last program reads
                 every split's, counted in split 0's row); max_passes - 1: score blocks of the value pass (each
                 split's share of the tile's live blocks); max_passes: cache value blocks (those with a positive
                 weight).
    n_splits, block_n: the key-range splits and the key block size used.
    """

    out: torch.Tensor
    tau: torch.Tensor
    nnz: torch.Tensor
    n_valid: torch.Tensor
    n_passes: torch.Tensor
    blocks_read: torch.Tensor
    n_splits: int
    block_n: int


@triton.jit
def _scores(q, keys, pages, rows, cols, z_scale, bias_scale, mods, MASK, SCORE, BIAS_KIND: tl.constexpr, CACHE):
    """Scores of one key block as the forward's (``_masking.score_mod``): ``z_scale * q.k`` soft-capped in that
    scale, ``+ bias_scale * (bias - slope * |d|)``, ``-inf`` where not visible or the row is inactive.
    [BLOCK_M, BLOCK_N]

    ``z_scale``, ``bias_scale`` are per row ``[BLOCK_M]``; ``mods`` from ``_decode_state._row_mods`` (the mask read
    per packed row at ``(b, h, i)``); ``keys``, ``pages`` as ``_decode_state._cache_tile``; ``rows``: ``(i, active,
    seqlen_q, seqlen_k, kt_lo, kt_hi)``, the packed rows' queries, which of them are active, the lengths and the
    split's key blocks.
    """
    i, active, seqlen_q, seqlen_k, _, _ = rows
    k = _cache_tile(keys, pages, cols, CACHE[0], CACHE[1], q.shape[1], True, CACHE[5])
    z = score_mod(tl.dot(q, k, input_precision=CACHE[6]) * z_scale[:, None], i, cols, seqlen_q, seqlen_k, mods,
                  bias_scale[:, None], MASK, SCORE, BIAS_KIND)
    return tl.where(active[:, None], z, float("-inf"))


@triton.jit
def _sink_scores(sink, am1, own, BLOCK_N: tl.constexpr):
    """The sink (``sink``: the logit per row, ``_decode_state._row_mods``) as a virtual score tile
    (``_masking.sink_tile``: ``(alpha - 1) * sink`` in column 0) for the rows ``own`` (split 0's: one score per row,
    counted once), ``-inf`` elsewhere and where the sink is NaN or ``+inf``; and those rows' flag.
    ``[BLOCK_M, BLOCK_N]``, ``[BLOCK_M]``"""
    z_sink = am1 * sink
    sink_bad = (z_sink != z_sink) | (z_sink == float("inf"))
    return sink_tile(tl.where(own & (sink_bad == 0), z_sink, float("-inf"))[:, None], am1.shape[0], BLOCK_N), sink_bad


@triton.jit
def _grid_pass(q, keys, pages, rows, mods, out, ent, zs, MASK, SCORE, POW: tl.constexpr, GRID_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BIAS_KIND: tl.constexpr, CACHE):
    """The score pass over the split's key blocks ``[kt_lo, kt_hi)`` of ``rows`` (after the sink tile ``zs`` with
    sinks): stores the scores and lists the live blocks (``out``: ``(Z, z_rows, list_base)``); each block goes
    through the ring update it shares with the forward (``_threshold_tiles.grid_tile``). ``ent``: ``(z_scale, am1, beta,
    bm1, shift, T)`` per row, ``T`` the hint points ``[BLOCK_M, HINT_P]`` (``[BLOCK_M, 1]``: no hint); with a hint
    every block (dead ones too: a hint may lie below the grid) also adds its point sums there
    (``_decode_state._hint_sums``).

    Returns ``(m, j_top, ref, n_valid, bad, F, G, C, n_live, n_read, (FH, GH, CH))``: the split's row max, its grid
    index relative to its reference score ``ref``, the reference, valid keys, NaN/+inf flag and the ``[BLOCK_M,
    GRID_K]`` sums at the ring's points (POW 0: scaled by the split max's term; counts from
    ``_threshold_tiles.grid_counts``), the number of live blocks written to ``list_base`` and of blocks read from the
    cache (those a block mask hides from every row are not: ``_decode_state._tile_live``), and the sums at the hint
    points (scaled by the split max's term at POW 0).
    """
    Z, z_rows, list_base = out
    z_scale, am1, beta, bm1, shift, T = ent
    HINT_P: tl.constexpr = T.shape[1]
    active = rows[1]
    w_grid, slot, m, j_top, ref, n_valid, bad, F, G, L = grid_start(q.shape[0], GRID_K, 0)
    n_live = tl.zeros([], tl.int32)
    n_read = _read_count(rows, SCORE)
    FH = tl.zeros([q.shape[0], HINT_P], tl.float32)
    GH = tl.zeros([q.shape[0], HINT_P], tl.float32)
    CH = tl.zeros([q.shape[0], HINT_P], tl.float32)
    LH = tl.full([q.shape[0], HINT_P], -99.65784284662087, tl.float32)
    if SCORE.has_sinks:
        m, j_top, ref, F, G, L, _ = grid_tile(zs, m, j_top, ref, F, G, L, slot, w_grid, shift, beta[:, None],
                                              bm1[:, None], POW, GRID_K, 0)
        if HINT_P > 1:
            LH, FH, GH, CH = _hint_sums(zs, m, T, LH, FH, GH, CH, beta, bm1, POW, HINT_P)
    for kt in range(rows[4], rows[5]):
        # a key block the block mask hides from every row is never loaded nor listed (its scores are not stored)
        tile_open = True
        if SCORE.blocks:
            tile_open = _tile_live(mods, rows, kt, BLOCK_N)
            n_read += tile_open.to(tl.int32)
        if tile_open:
            cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            z = _scores(q, keys, pages, rows, cols, z_scale, am1, mods, MASK, SCORE, BIAS_KIND, CACHE)
            tl.store(Z + z_rows[:, None] + cols[None, :], z, mask=active[:, None])
            bad = bad | tl.max(((z != z) | (z == float("inf"))).to(tl.int32), 1)
            n_valid += tl.sum((z != float("-inf")).to(tl.int32), 1)
            m, j_top, ref, F, G, L, live = grid_tile(z, m, j_top, ref, F, G, L, slot, w_grid, shift, beta[:, None],
                                                     bm1[:, None], POW, GRID_K, 0)
            tl.store(list_base + n_live, kt, mask=live != 0)
            n_live += live
            if HINT_P > 1:
                LH, FH, GH, CH = _hint_sums(z, m, T, LH, FH, GH, CH, beta, bm1, POW, HINT_P)
    F, G = grid_sums(F, G, 0)
    return m, j_top, ref, n_valid, bad, F, G, grid_counts(G, POW), n_live, n_read, (FH, GH, CH)


@triton.jit
def _softmax_split(q, keys, values, pages, rows, mods, scale, MASK, SCORE, BLOCK_N: tl.constexpr,
                   BIAS_KIND: tl.constexpr, CACHE):
    """alpha == 1 on the split's key blocks ``[kt_lo, kt_hi)`` of ``rows``: online softmax (exponents ``(s - m)
    log2(e)``, the max in the scores' scale, as the fused forward's ``softmax_rows``). Returns ``(m, l,
    acc, n_valid, n_read)`` (the sink joins in the combine; ``n_read``: key blocks read, those a block mask hides
    from every row are not)."""
    BLOCK_M: tl.constexpr = q.shape[0]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, CACHE[4]], tl.float32)
    ones = tl.zeros([BLOCK_M], tl.float32) + 1.0
    n_read = _read_count(rows, SCORE)
    for kt in range(rows[4], rows[5]):
        cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        tile_open = True
        if SCORE.blocks:
            tile_open = _tile_live(mods, rows, kt, BLOCK_N)
            n_read += tile_open.to(tl.int32)
        if tile_open:
            s = _scores(q, keys, pages, rows, cols, ones * scale, ones, mods, MASK, SCORE, BIAS_KIND, CACHE)
            n_valid += tl.sum((s != float("-inf")).to(tl.int32), 1)
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            corr = tl.exp2((m - m_safe) * LOG2E)
            p = tl.exp2((s - m_safe[:, None]) * LOG2E)
            v = _cache_tile(values, pages, cols, CACHE[0], CACHE[3], CACHE[4], False, CACHE[5])
            l_sum = l_sum * corr + tl.sum(p, 1)
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=CACHE[6])
            m = m_new
    return m, l_sum, acc, n_valid, n_read


@triton.jit
def _entmax_decode_split_kernel(
    Q, K, V, ALPHA, BLOCK_TABLE, CACHE_SEQLENS, Z, LIST, LIVE_N, GRID_ROW, GRID_PTS, STATE, PART_ROW, PART_ACC,
    OUT, TAU, NNZ, N_VALID, COUNT, BLOCKS_READ, N_PASSES, TAU_HINT, HINT_PTS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_hintb, stride_hinth, stride_hintm, hint_step,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tb, stride_tn, page_size,
    n_heads, n_kv_heads, kv_group, seqlen_q, n_rows, n_row_tiles, n_splits, blocks_per_split, n_span,
    max_seqlen_k, scale, tol, n_slots, MASK, SCORE, MODS, CACHE,
    ALPHA_CLASS: tl.constexpr, FILTER: tl.constexpr, PHASE: tl.constexpr, POW: tl.constexpr, GRID_K: tl.constexpr,
    CAND_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_HINT: tl.constexpr, HINT_P: tl.constexpr,
):
    """One program per (split, kv head x row tile, batch entry); ``PHASE`` 0 the score pass (and, in the tile's last
    program, the merge and the candidate passes), 2 the value pass (and the combine), as the module docstring says.
    ``ALPHA_CLASS`` 0 (softmax) runs its single pass (and the combine) whatever ``PHASE``; ``POW``, ``GRID_K``,
    ``CAND_P``: the class's threshold arithmetic and points (``_args.CLASS_POW``, ``_threshold.DECODE_POINTS``).
    ``CACHE``: ``(IS_PAGED, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, UPCAST, DOT_PRECISION)`` (:func:`_cache_spec`),
    passed on unread to the helpers that read the cache; ``MODS`` the score modifications (``_args.mods_args``);
    ``OUT`` contiguous;
    ``COUNT`` one ticket counter per row tile, zero at rest. With ``HAS_HINT``, ``TAU_HINT`` holds a threshold per row
    (``(B, Hq, Nq)`` at the ``stride_hint*`` strides, absolute, in the z-scale: a previous step's ``tau``); the score
    pass evaluates ``f``, ``g``, ``c`` at ``HINT_P`` points ``hint_step`` apart around it, the hint itself one of them
    (``HINT_PTS``, per split), and
    the merge adds them to the bracket like any other point (certified on whichever side they fall; a non-finite hint
    gives no point).

    The splits share the key blocks the tile's rows may see (``_masking.key_block_range``: a sliding window's blocks
    only, at most ``n_span``); the scores are stored relative to the first of them.
    """
    split = tl.program_id(0)
    h_kv = tl.program_id(1) // n_row_tiles
    rt = tl.program_id(1) % n_row_tiles
    b = tl.program_id(2)
    r, i, h, active, alpha = _packed_rows(ALPHA, rt, h_kv, kv_group, seqlen_q, n_rows, ALPHA_CLASS, FILTER, BLOCK_M)
    if tl.max(active.to(tl.int32)) == 0:
        return
    seqlen_k = tl.minimum(tl.maximum(tl.load(CACHE_SEQLENS + b), 0), max_seqlen_k)
    kt_start, kt_end = key_block_range(tl.min(tl.where(active, i, seqlen_q), 0), tl.max(tl.where(active, i, -1), 0),
                                       seqlen_q, seqlen_k, MASK, BLOCK_N)
    kt_lo = kt_start + split * blocks_per_split
    kt_hi = tl.maximum(tl.minimum(kt_lo + blocks_per_split, kt_end), kt_lo)
    tile = (b * n_kv_heads + h_kv) * n_row_tiles + rt
    rows_pad = n_row_tiles * BLOCK_M
    split_rows = (((b * n_kv_heads + h_kv) * rows_pad + r) * n_splits).to(tl.int64)  # [BLOCK_M]
    state_rows = ((b * n_kv_heads + h_kv) * rows_pad + r).to(tl.int64)
    z_rows = ((b * n_kv_heads + h_kv) * n_rows + r).to(tl.int64) * (n_span * BLOCK_N) - kt_start * BLOCK_N
    list_tile = LIST + tile.to(tl.int64) * n_span
    list_base = list_tile + split * blocks_per_split
    live_n = LIVE_N + tile.to(tl.int64) * n_splits + split
    reads = BLOCKS_READ + (tile.to(tl.int64) * n_splits + split) * n_slots
    offs_d = tl.arange(0, CACHE[2])
    q_rows = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + i.to(tl.int64) * stride_qm
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=active[:, None] & (offs_d[None, :] < CACHE[1]),
                other=0.0)
    if CACHE[5]:
        q = q.to(tl.float32)
    stat_offs = (b.to(tl.int64) * n_heads + h) * seqlen_q + i
    # the program's rows, score modifications and cache (tuples the helpers take)
    rows = (i, active, seqlen_q, seqlen_k, kt_lo, kt_hi)
    mods = _row_mods(MODS, b, h, SCORE)
    pages = (BLOCK_TABLE, stride_tb, stride_tn, page_size, b, h_kv, seqlen_k)
    keys = (K, stride_kb, stride_kh, stride_kn, stride_kd)
    values = (V, stride_vb, stride_vh, stride_vn, stride_vd)
    outs = (OUT, TAU, NNZ, N_VALID)

    if ALPHA_CLASS == 0:
        m, l_sum, acc, n_valid, n_read = _softmax_split(q, keys, values, pages, rows, mods, scale, MASK, SCORE,
                                                        BLOCK_N, BIAS_KIND, CACHE)
        if not SCORE.blocks:
            n_read = kt_hi - kt_lo
        _store_partials(PART_ROW, PART_ACC, split_rows + split, active, m, l_sum, n_valid, acc, CACHE[3], CACHE[4])
        tl.store(PART_ROW + (split_rows + split) * N_PART + 3, n_valid.to(tl.float32), mask=active)
        tl.store(reads, n_read)
        tl.store(reads + n_slots - 1, n_read)
        if split == 0:
            tl.store(N_PASSES + tile, 1)
        if _last_arrival(COUNT + tile, n_splits):
            _combine_rows(outs, PART_ROW, PART_ACC, split_rows, n_splits, stat_offs, active, alpha,
                          mods.sink + tl.zeros([BLOCK_M], tl.float32), CACHE[3], CACHE[4])
        return

    # unchecked device alpha outside [1, 2] (or NaN) reaches the general class: those rows are NaN
    a_ok = (alpha >= 1.0) & (alpha <= 2.0)
    am1 = tl.where(a_ok, alpha, 1.5) - 1.0
    beta = 1.0 / am1
    bm1 = beta - 1.0
    if POW == 0:
        shift = 1.0
    else:
        shift = 0.0
    zs, sink_bad = _sink_scores(mods.sink, am1, active & (split == 0), BLOCK_N)

    if PHASE == 0:
        if HAS_HINT:
            t_h = tl.load(TAU_HINT + b.to(tl.int64) * stride_hintb + h.to(tl.int64) * stride_hinth
                          + i.to(tl.int64) * stride_hintm, mask=active, other=float("nan"))
            # the points, absolute (tau + shift); far above every score (no sums, no point) for a hint that is NaN,
            # infinite or beyond +-1e15 (whose squared distances to the scores could overflow float32 sums)
            offs = (tl.arange(0, HINT_P) - HINT_P // 2).to(tl.float32) * hint_step  # the hint itself among them
            T = tl.where((tl.abs(t_h) < 1e15)[:, None], t_h[:, None] + offs[None, :] + shift, 3e38)
        else:
            T = tl.zeros([BLOCK_M, 1], tl.float32)
        m, j_top, ref, n_valid, bad, F, G, C, n_live, n_read, hint_pts = _grid_pass(
            q, keys, pages, rows, mods, (Z, z_rows, list_base), (scale * am1, am1, beta, bm1, shift, T), zs, MASK,
            SCORE, POW, GRID_K, BLOCK_N, BIAS_KIND, CACHE)
        if not SCORE.blocks:
            n_read = kt_hi - kt_lo
        row = GRID_ROW + (split_rows + split) * N_PART
        tl.store(row, m, mask=active)
        tl.store(row + 1, j_top, mask=active)
        tl.store(row + 2, n_valid.to(tl.float32), mask=active)
        tl.store(row + 3, tl.where(a_ok & (sink_bad == 0), bad, 1).to(tl.float32), mask=active)
        tl.store(row + 4, ref, mask=active)
        tl.store(PART_ROW + (split_rows + split) * N_PART + 3, n_valid.to(tl.float32), mask=active)
        _store_points(GRID_PTS, split_rows + split, active, F, G, C, GRID_K)
        if HAS_HINT:
            _store_points(HINT_PTS, split_rows + split, active, hint_pts[0], hint_pts[1], hint_pts[2], HINT_P)
        tl.store(live_n, n_live)
        tl.store(reads, n_read)
        if _last_arrival(COUNT + tile, n_splits):
            # the merged state (m, the thresholds and the points relative to the rows' reference score ref), then
            # the candidate passes over every split's live blocks; the sink counted once
            g_m, g_br, g_est, g_lo, g_hi, g_exact, g_usable, g_bad, g_passes, g_ref = _grid_state(
                GRID_ROW, GRID_PTS, split_rows, n_splits, active, am1, beta, bm1, shift, POW, GRID_K, BLOCK_M,
                (HINT_PTS, T))
            live_tile = LIVE_N + tile.to(tl.int64) * n_splits
            c_m, c_br, c_est, c_lo, c_hi, c_exact, c_usable, c_passes, c_ref = _cand_passes(
                (Z, z_rows, list_tile, live_tile, BLOCKS_READ + tile.to(tl.int64) * n_splits * n_slots),
                _tile_list(list_tile, live_tile, n_splits, blocks_per_split), n_slots,
                (g_m, g_br, g_est, g_lo, g_hi, g_exact, g_usable, g_passes, g_ref), (am1, beta, bm1, shift),
                _sink_scores(mods.sink, am1, active, BLOCK_N)[0], tol, SCORE, POW, CAND_P, BLOCK_N)
            _store_state(STATE, state_rows, active, c_m, c_br, c_est, c_lo, c_hi, c_exact, c_usable, g_bad, c_passes,
                         c_ref)
        return

    m, br, est, lo, hi, exact, usable, bad, passes, ref = _load_state(STATE, state_rows, active)
    # this split's share of the tile's live blocks (the list the score pass's last program left)
    n_all = tl.load(LIVE_N + tile.to(tl.int64) * n_splits)
    share = list_tile + split * n_all // n_splits
    n_in = (split + 1) * n_all // n_splits - split * n_all // n_splits
    col_blk = tl.arange(0, BLOCK_N)
    ok_row = usable != 0.0
    # value pass at the estimate; a threshold at the max would leave no weight: keep it one rounding step below
    tau_lim = m - tl.maximum(tl.abs(m) * 2.4e-7, 1e-15) + shift
    t_use = tl.where(ok_row, tl.minimum(est, tau_lim), 0.0)
    tau_row = t_use - shift
    t_use = tau_row + shift
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    if SCORE.has_sinks:
        l_sum = tl.sum(tl.where(ok_row[:, None], weights(zs - ref[:, None], t_use, POW, beta[:, None]), 0.0), 1)
    nnz = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, CACHE[4]], tl.float32)
    # weights of the live blocks; those holding a positive weight are listed again (in place: the list only
    # shrinks) and only their value rows are read, by a second loop without branches (its loads pipeline)
    v_reads = tl.zeros([], tl.int32)
    for idx in range(0, n_in):
        kt = tl.load(share + idx)
        z = tl.load(Z + z_rows[:, None] + (kt * BLOCK_N + col_blk)[None, :], mask=ok_row[:, None],
                    other=float("-inf")) - ref[:, None]
        p = weights(z, t_use, POW, beta[:, None])
        l_sum += tl.sum(p, 1)
        nnz += tl.sum((p > 0.0).to(tl.int32), 1)
        pos = (tl.max(p) > 0.0).to(tl.int32)
        tl.store(share + v_reads, kt, mask=pos != 0)
        v_reads += pos
    # one thread stores each list entry, every thread reads them: the last store before the next loop's first loads
    tl.debug_barrier()
    for idx in range(0, v_reads):
        cols = tl.load(share + idx) * BLOCK_N + col_blk
        z = tl.load(Z + z_rows[:, None] + cols[None, :], mask=ok_row[:, None], other=float("-inf")) - ref[:, None]
        p = weights(z, t_use, POW, beta[:, None])
        v = _cache_tile(values, pages, cols, CACHE[0], CACHE[3], CACHE[4], False, CACHE[5])
        acc += tl.dot(p.to(v.dtype), v, input_precision=CACHE[6])
    is_bad = bad != 0.0
    _store_partials(PART_ROW, PART_ACC, split_rows + split, active, tl.zeros([BLOCK_M], tl.float32),
                    tl.where(is_bad, float("nan"), l_sum), tl.where(is_bad, 0, nnz), acc, CACHE[3], CACHE[4])
    tl.store(reads + n_slots - 2, n_in)
    tl.store(reads + n_slots - 1, v_reads)
    if split == 0:
        tau = tl.where(is_bad, float("nan"), tl.where(ok_row, ref + tau_row, float("inf")))
        tl.store(TAU + stat_offs, tau, mask=active)
        tl.store(N_PASSES + tile, passes.to(tl.int32) + 1)
    if _last_arrival(COUNT + tile, n_splits):
        _combine_rows(outs, PART_ROW, PART_ACC, split_rows, n_splits, stat_offs, active, alpha,
                      mods.sink + tl.zeros([BLOCK_M], tl.float32), CACHE[3], CACHE[4])


def _hint_args(tau_hint, rows: tuple, ws: dict) -> dict:
    """The threshold hint's kernel arguments: the tensor broadcast to ``rows`` (a view: stride 0 on broadcast dims)
    and its strides; without a hint, a scratch tensor that is never read."""
    if tau_hint is None:
        return dict(TAU_HINT=ws["STATE"], HINT_PTS=ws["STATE"], stride_hintb=0, stride_hinth=0, stride_hintm=0)
    hint = tau_hint.expand(rows)
    return dict(TAU_HINT=hint, HINT_PTS=ws["HINT_PTS"], **_args.stride_args("stride_hint", hint, "bhm"))


def entmax_decode_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    alpha,
    scale: float,
    *,
    block_table: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    window_size: tuple | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    tol: float | None = None,
    max_passes: int | None = None,
    alpha_class: str | None = None,
    block_n: int | None = None,
    block_mask: tuple | None = None,
    tau_hint: torch.Tensor | None = None,
    hint_step: float | None = None,
    counters: bool = True,
    stats: bool = True,
    reuse_scratch: bool = True,
) -> EntmaxDecodeResult:
    """Split-K entmax attention of a few queries per sequence over a KV cache (a chain of kernel launches, no
    host synchronization).

    Arguments are validated by the caller (``sparse_attn.decode.entmax_decode``); here only cheap asserts.

    Args:
        q: ``(B, Hq, Nq, D)``, fp16/bf16/fp32, any strides; ``16 <= D <= 256``.
        k_cache, v_cache: contiguous layout ``(B, Hk, Nk, D)`` and ``(B, Hk, Nk, Dv)`` (any strides: a
            ``(B, Nk, Hk, D)`` cache ``.transpose(1, 2)``), or with ``block_table`` page pools
            ``(num_pages, page_size, Hk, D or Dv)`` (flash-attn / vLLM layout, any strides). ``Hq % Hk == 0``; q head
            ``h`` reads kv head ``h // (Hq // Hk)``; ``16 <= Dv <= 256``.
        cache_seqlens: int32 ``(B,)``, valid keys per sequence (the keys of the current queries included);
            values are clamped to ``[0, max_seqlen_k]``.
        alpha: float32 ``(Hq,)`` (each in [1, 2], mixed per head), or a Python float.
        scale: float multiplying ``q . k``.
        block_table: int32 ``(B, max_pages_per_seq)``: page ``j // page_size`` of sequence ``b`` is
            ``block_table[b, j // page_size]``. Default None (contiguous cache).
        bias: None, an additive float mask or a boolean keep mask, broadcastable to ``(B, Hq, Nq, Nk_cap)``
            (``Nk_cap``: the cache's key capacity), indexed by key position. Default None.
        is_causal: query ``i`` of a sequence with ``L`` keys sees key ``j`` iff ``j <= i + L - Nq`` (the
            queries are the last ``Nq`` keys). Default False.
        window_size: ``(left, right)``: query ``i`` sees key ``j`` iff ``-left <= j - (i + L - Nq) <= right``
            (``-1``: unbounded side), as :func:`sparse_attn.kernels.attn.entmax_attn_fwd.entmax_attn_fwd` with the
            decode alignment; the splits cover the window's key blocks only. Default None.
        alibi_slopes, softcap, sinks: as ``entmax_attn_fwd`` (ALiBi distance ``|i + L - Nq - j|``; slopes ``(Hq,)``
            or ``(B, Hq)``). Default None.
        max_seqlen_k: bound on ``cache_seqlens`` (default the capacity); the splits cover this many keys.
        num_splits: key-range splits per (batch entry, kv head); default ``_decode_launch.default_num_splits``.
        tol: change of a row's total weight across its certified bracket at which its threshold counts as found
            (default by dtype).
        max_passes: passes per step, score and value pass included (``>= 2``; default by dtype).
        alpha_class: as :func:`sparse_attn.kernels.attn.entmax_attn_fwd.entmax_attn_fwd` (default from the values for a
            Python float or a CPU tensor, else ``"mixed"``).
        block_n: keys per block (a power of two >= 16); default by head dim.
        block_mask: ``(mask, (block_q, block_k)[, bits])`` (``_args.block_args``): ``mask`` ``(B or 1, Hq or 1,
            >= ceil(Nq / block_q), >= ceil(max_seqlen_k / block_k))``; query ``i`` (its index among the ``Nq``, as
            the fused forward's rows) sees key ``j`` only if block ``(i // block_q, j // block_k)`` keeps it. Key
            blocks it hides from every row of a program are not read. Default None.
        tau_hint: float32, broadcastable to ``(B, Hq, Nq)`` (any strides): a threshold per row, absolute, in the
            z-scale of ``tau`` (a previous step's ``tau``). The score pass evaluates the row's total weight at
            ``HINT_POINTS`` points ``hint_step`` apart around it, which tighten the certified bracket where they
            fall on either side of the root; non-finite entries and softmax rows are ignored. The result is the
            same up to ``tol``; fewer candidate passes run when the hint is close (docs/decode.md). Default None.
        hint_step: spacing of the hint's points in the z-scale (default ``_decode_launch.HINT_STEP`` by alpha class).

        counters: return ``n_passes`` and ``blocks_read`` (False: None, and the kernels write them to scratch).
        stats: return ``tau``, ``nnz`` and ``n_valid`` (False: None, likewise).
        reuse_scratch: take the scratch memory from the per-stream buffers that steps reuse (False: allocate it, as
            the custom op does: under ``torch.compile``'s CUDA graphs an allocation belongs to the graph's pool).

    Everything but the tensors is planned once per configuration and the scratch memory is reused from step to step
    (``kernels/attn/_decode_launch.py``); the returned tensors are allocated afresh on every call.

    Returns:
        :class:`EntmaxDecodeResult`.
    """
    spec = kernel_spec(q, k_cache, v_cache, alpha, scale, bias=bias, is_causal=is_causal, max_seqlen_k=max_seqlen_k,
                       alpha_class=alpha_class, window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap,
                       sinks=sinks, block_mask=block_mask, cache_seqlens=cache_seqlens, block_table=block_table,
                       num_splits=num_splits)
    return launch_decode(spec, tol=tol, max_passes=max_passes, block_n=block_n, tau_hint=tau_hint,
                         hint_step=hint_step, counters=counters, stats=stats, reuse_scratch=reuse_scratch)


@_args.launches_on(lambda spec, *args, **kwargs: spec.q)
def launch_decode(spec, *, tol: float | None = None, max_passes: int | None = None, block_n: int | None = None,
                  tau_hint: torch.Tensor | None = None, hint_step: float | None = None, counters: bool = True,
                  stats: bool = True, reuse_scratch: bool = True) -> EntmaxDecodeResult:
    """:func:`entmax_decode_fwd` of an ``AttnSpec`` whose ``k`` / ``v`` are the KV cache (``kernels/_spec.py``: the
    decode op's spec, or ``kernel_spec`` of the launcher's keywords), with the options of :func:`entmax_decode_fwd`."""
    q, k_cache, v_cache, cache_seqlens, alpha, bias = spec.q, spec.k, spec.v, spec.cache_seqlens, spec.alpha, spec.mask
    block_table, num_splits, max_seqlen_k = spec.block_table, spec.num_splits, spec.max_seqlen_k
    batch, n_heads, seqlen_q, head_dim = q.shape
    head_dim_v = v_cache.shape[3]
    paged = block_table is not None
    n_kv_heads = k_cache.shape[2] if paged else k_cache.shape[1]
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[2]
    assert 16 <= head_dim <= 256 and 16 <= head_dim_v <= 256 and n_heads % max(n_kv_heads, 1) == 0
    kv_group = n_heads // max(n_kv_heads, 1)
    n_rows = kv_group * seqlen_q
    alpha_class = _args.resolve_alpha_class(alpha, spec.alpha_class)
    classes = _args.classes_present(alpha, alpha_class)
    block_mask = _args.spec_block_mask(spec)
    window, blocks = None if spec.window_size is None else tuple(spec.window_size), _args.blocks_mode(block_mask, None)
    plan = _launch.static_plan(q.dtype, paged, head_dim, head_dim_v, n_rows, bool(spec.is_causal), window, spec.softcap,
                               spec.alibi_slopes is not None, spec.sinks is not None, blocks, classes, tol, max_passes,
                               block_n, tau_hint is not None)
    dev = q.device
    sz = _launch.sizes(plan, batch, n_kv_heads, n_rows, seqlen_q, capacity, max_seqlen_k, num_splits, dev)
    if block_mask is not None:
        grid_blocks, (block_q, block_k), _ = _args.block_parts(block_mask)
        assert grid_blocks.dim() == 4 and grid_blocks.shape[0] in (1, batch) and grid_blocks.shape[1] in (1, n_heads)
        assert grid_blocks.shape[2] >= -(-seqlen_q // block_q), f"block_mask: got {tuple(grid_blocks.shape)}"
        assert grid_blocks.shape[3] >= -(-sz.max_seqlen_k // block_k), f"block_mask: got {tuple(grid_blocks.shape)}"

    rows = (batch, n_heads, seqlen_q)
    out = torch.empty((*rows, head_dim_v), dtype=q.dtype, device=dev)
    tiles = (batch, n_kv_heads, sz.n_row_tiles)
    ws = _launch.workspace(_launch.scratch_layout(plan, sz, rows, n_kv_heads, head_dim_v, counters, stats), dev,
                           reuse_scratch)
    if stats:
        tau = torch.empty(rows, dtype=torch.float32, device=dev)
        nnz = torch.empty(rows, dtype=torch.int32, device=dev)
        n_valid = torch.empty(rows, dtype=torch.int32, device=dev)
    else:
        tau, nnz, n_valid = ws["TAU"], ws["NNZ"], ws["N_VALID"]
    if counters:
        n_passes = torch.zeros((len(classes), *tiles), dtype=torch.int32, device=dev)
        blocks_read = torch.zeros((len(classes), *tiles, sz.n_splits, plan.max_passes + 1), dtype=torch.int32,
                                  device=dev)
    else:
        n_passes, blocks_read = ws["N_PASSES"], ws["BLOCKS_READ"]
    result = EntmaxDecodeResult(out, tau if stats else None, nnz if stats else None, n_valid if stats else None,
                                n_passes if counters else None, blocks_read if counters else None, sz.n_splits,
                                plan.block_n)
    if out.numel() == 0:
        return result

    alpha_t = _args.alpha_arg(alpha, n_heads, dev)
    mods = _args.mods_args(bias, (batch, n_heads, seqlen_q, capacity), spec.alibi_slopes, spec.sinks, q, block_mask)
    args = dict(
        plan.consts, Q=q, K=k_cache, V=v_cache, ALPHA=alpha_t, BLOCK_TABLE=block_table if paged else cache_seqlens,
        CACHE_SEQLENS=cache_seqlens, **mods, Z=ws["Z"], LIST=ws["LIST"], LIVE_N=ws["LIVE_N"],
        GRID_ROW=ws["GRID_ROW"], STATE=ws["STATE"], PART_ROW=ws["PART_ROW"], PART_ACC=ws["PART_ACC"], OUT=out,
        TAU=tau, NNZ=nnz, N_VALID=n_valid,
        COUNT=_launch.tickets(batch * n_kv_heads * sz.n_row_tiles, dev, reuse_scratch),
        **_args.stride_args("stride_q", q, "bhmd"), **_hint_args(tau_hint, rows, ws),
        **_cache_strides("stride_k", k_cache, paged),
        **_cache_strides("stride_v", v_cache, paged),
        stride_tb=block_table.stride(0) if paged else 0, stride_tn=block_table.stride(1) if paged else 0,
        page_size=k_cache.shape[1] if paged else 1, n_heads=n_heads, n_kv_heads=n_kv_heads, kv_group=kv_group,
        seqlen_q=seqlen_q, n_rows=n_rows, n_row_tiles=sz.n_row_tiles, n_splits=sz.n_splits,
        blocks_per_split=sz.blocks_per_split, n_span=sz.n_span, max_seqlen_k=sz.max_seqlen_k, scale=float(spec.scale))
    grid = (sz.n_splits, n_kv_heads * sz.n_row_tiles, batch)
    per_split = ws["PART_ROW"].shape[:4]
    try:
        for launch, (cls, pow_, grid_k, cand_p, phases) in enumerate(plan.chains):
            # the grid sums of this class's chain, contiguous at its own point count
            grid_pts = _launch.carve(ws["GRID_PTS"], (*per_split, 3, grid_k))
            for phase in phases:
                _entmax_decode_split_kernel[grid](
                    **args, GRID_PTS=grid_pts, BLOCKS_READ=blocks_read[launch], N_PASSES=n_passes[launch],
                    hint_step=float(_launch.HINT_STEP[pow_] if hint_step is None else hint_step),
                    ALPHA_CLASS=cls, POW=pow_, GRID_K=grid_k, CAND_P=cand_p, PHASE=phase, **plan.options)
    except BaseException:
        _launch.reset_tickets(dev)  # a launch that did not finish leaves tickets taken
        raise
    return result
