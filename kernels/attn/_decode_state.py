"""The decode kernels' rows, cache addressing and per-row state across splits and launches
(``kernels/attn/entmax_decode.py``): the packed (GQA) rows of a program, cache rows through a block table (and the
launcher's ``CACHE`` argument and cache strides), which key blocks a block mask leaves live, merging
per-split point sums into certified brackets (a ``_threshold.Bracket`` per row), the state stored between launches,
and the combine of the splits' partial value sums (docs/decode.md). The threshold arithmetic, the stopping rule and
the candidate points are those of ``kernels/attn/_threshold.py``.
"""

import torch
import triton
import triton.language as tl

from .. import _args
from .._common import LN2, LOG2E, alpha_class_id
from .._masking import BlockGrid, ProgramMods, block_visible, program_mods
from ._threshold import Bracket, log_ref, merge_points, open_bracket, phi, pick_bracket, solve, weight_done
from ._threshold_tiles import anchor, cand_points, cand_sums, ring_index

# per-row merged threshold state carried from launch to launch (columns of STATE)
N_STATE = tl.constexpr(20)
# per-split, per-row results: of the score pass (GRID_ROW: max, grid index, valid keys, NaN flag, reference score)
# and of the value (or softmax) pass (PART_ROW: max for softmax, sum of weights, support size, valid keys)
N_PART = tl.constexpr(5)


@triton.jit
def _packed_rows(ALPHA, rt, h_kv, kv_group, seqlen_q, n_rows, ALPHA_CLASS: tl.constexpr, FILTER: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Rows of row tile ``rt``: packed index ``r = g * Nq + i`` (q head ``h = h_kv * group + g``, query ``i``).

    Returns ``(r, i, h, active, alpha)``, each ``[BLOCK_M]``: ``active`` marks rows that exist and, with
    ``FILTER``, whose head is of this launch's alpha class; ``alpha`` is 1.5 outside. Padding rows past the group
    get its last head, so that per-head loads (mask, ALiBi slope, sink) stay in bounds.
    """
    r = rt * BLOCK_M + tl.arange(0, BLOCK_M)
    g = r // seqlen_q
    i = r - g * seqlen_q
    h = h_kv * kv_group + tl.minimum(g, kv_group - 1)
    active = r < n_rows
    alpha = tl.load(ALPHA + h, mask=active, other=1.5)
    if FILTER:
        active = active & (alpha_class_id(alpha) == ALPHA_CLASS)
    return r, i, h, active, tl.where(active, alpha, 1.5)


@triton.jit
def _row_mods(MODS, b, h, SCORE):
    """The ``mods`` of ``_masking.score_mod`` for packed rows of q heads ``h [BLOCK_M]`` of batch entry ``b``
    (``_masking.program_mods`` per row, masks indexed by query and key position): the mask's base pointers and the
    ALiBi slopes as ``[BLOCK_M, 1]`` columns of a score tile, the sink logits per row ``[BLOCK_M]`` (a scalar
    ``-inf`` without sinks), the block mask with its base per row as a ``[BLOCK_M, 1]`` column (the block grid of
    batch entry ``b`` and head ``h``, its rows the query index ``i`` as the fused forward's:
    ``_masking.block_visible``). ``MODS`` is the kernel argument of ``_args.mods_args``."""
    mods = program_mods(MODS, b, b, h, b * 0, b * 0, SCORE)
    blocks = mods.blocks
    return ProgramMods(mods.bias_base[:, None], mods.stride_bias_m, mods.stride_bias_n,
                       (mods.slope + tl.zeros([h.shape[0]], tl.float32))[:, None], mods.sink,
                       BlockGrid(blocks.base[:, None], blocks.stride_m, blocks.stride_n, blocks.block_q, blocks.block_k,
                                 blocks.bits, blocks.n_words))


@triton.jit
def _tile_live(mods, rows, kt, BLOCK_N: tl.constexpr):
    """Whether the block mask keeps, for some active packed row of ``rows`` (``(i, active, seqlen_q, seqlen_k, ...)``),
    a key of key block ``kt``: the OR over the rows' own (head, query block) of their grids, so a grid with a head dim
    is exact too (``_masking.block_tile_live`` takes one head). A block for which it is False holds no visible key of
    the tile and is never loaded. One ``[BLOCK_M, BLOCK_N]`` uint8 load (``_masking.block_visible``) of a few
    distinct bytes. ``mods`` from :func:`_row_mods`; read only with a block mask (``SCORE.blocks``)."""
    cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows[1][:, None] & (cols < rows[3])[None, :]
    return tl.max((block_visible(rows[0], cols, mods.blocks, ok) & ok).to(tl.int32)) != 0


@triton.jit
def _read_count(rows, SCORE):
    """The count of key blocks a split reads, before its loop over ``[kt_lo, kt_hi)`` (``rows[4:6]``): zero; with a
    block mask the loop adds the blocks :func:`_tile_live` leaves, without one the kernel stores ``kt_hi - kt_lo``
    after the loop (so that nothing stays live across it)."""
    return rows[4] * 0


@triton.jit
def _cache_rows(pages, cols, col_ok, IS_PAGED: tl.constexpr):
    """``(outer, inner)`` int64 ``[BLOCK_N]`` indices of the keys ``cols`` of the program's batch entry in the cache:
    ``(b, col)`` for a contiguous cache, ``(page, slot)`` through the block table for a paged one. ``pages``:
    ``(BLOCK_TABLE, stride_tb, stride_tn, page_size, b, h_kv, seqlen_k)`` (:func:`_cache_tile`)."""
    BLOCK_TABLE, stride_tb, stride_tn, page_size, b, _, _ = pages
    if IS_PAGED:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_tb + (cols // page_size).to(tl.int64) * stride_tn,
                       mask=col_ok, other=0)
        return page.to(tl.int64), (cols % page_size).to(tl.int64)
    return cols.to(tl.int64) * 0 + b.to(tl.int64), cols.to(tl.int64)


@triton.jit
def _cache_tile(cache, pages, cols, IS_PAGED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr):
    """Cache rows of the keys ``cols`` (those ``< seqlen_k``; 0 elsewhere): ``[BLOCK_N, BLOCK_D]``, or
    ``[BLOCK_D, BLOCK_N]`` if ``TRANSPOSED``. ``cache``: ``(PTR, stride_b, stride_h, stride_n, stride_d)`` of the key
    or value cache; ``pages``: ``(BLOCK_TABLE, stride_tb, stride_tn, page_size, b, h_kv, seqlen_k)``, where the keys
    of the program's batch entry ``b`` and kv head ``h_kv`` are."""
    PTR, stride_b, stride_h, stride_n, stride_d = cache
    h_kv = pages[5]
    col_ok = cols < pages[6]
    outer, inner = _cache_rows(pages, cols, col_ok, IS_PAGED)
    offs_d = tl.arange(0, BLOCK_D)
    row = outer * stride_b + inner * stride_n + h_kv.to(tl.int64) * stride_h
    if TRANSPOSED:
        x = tl.load(PTR + row[None, :] + offs_d.to(tl.int64)[:, None] * stride_d,
                    mask=col_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    else:
        x = tl.load(PTR + row[:, None] + offs_d.to(tl.int64)[None, :] * stride_d,
                    mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


def _cache_spec(paged: bool, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> tuple:
    """The ``CACHE`` kernel argument, how the split kernel reads the cache and multiplies by it (compile-time):
    ``(IS_PAGED, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, UPCAST, DOT_PRECISION)`` (``_args.attention_args``
    names them)."""
    return tuple(tl.constexpr(x) for x in (
        paged, head_dim, _args.head_dim_block(head_dim), head_dim_v, _args.head_dim_block(head_dim_v),
        _args.interpreting(), _args.dot_precision(dtype)))


def _cache_strides(prefix: str, cache: torch.Tensor, paged: bool) -> dict:
    """``stride_<x>b/h/n/d`` of a cache: ``(B, Hk, Nk, D)``, or a page pool ``(pages, page_size, Hk, D)`` whose
    ``b`` stride steps pages and ``n`` stride slots within a page."""
    if paged:
        st = cache.stride()
        return {prefix + "b": st[0], prefix + "n": st[1], prefix + "h": st[2], prefix + "d": st[3]}
    return _args.stride_args(prefix, cache, "bhnd")


@triton.jit
def _store_points(PTS, split_rows, active, F, G, C, N: tl.constexpr):
    """Store one split's ``[BLOCK_M, N]`` point sums (``f``, ``g``, ``c`` of each row, ``3 N`` floats per row)."""
    pts = PTS + split_rows[:, None] * (3 * N) + tl.arange(0, N)[None, :]
    tl.store(pts, F, mask=active[:, None])
    tl.store(pts + N, G, mask=active[:, None])
    tl.store(pts + 2 * N, C, mask=active[:, None])


@triton.jit
def _grid_state(GRID_ROW, GRID_PTS, split_rows, n_splits, active, am1, beta, bm1, shift, POW: tl.constexpr,
                GRID_K: tl.constexpr, BLOCK_M: tl.constexpr, hint):
    """Merge the splits' score-pass results into the global row state and solve the first bracket.

    Split ``s`` holds its sums at the points ``ref_s + i w`` (``i`` in ``(J_s - GRID_K, J_s]``) below its own max;
    the global ring is relative to ``ref = anchor(max)``, and ``ref_s - ref`` is a multiple of ``GRID_K`` (both
    ``_threshold_tiles.anchor``), a whole number of ring turns: the split's point ``i`` is the global point
    ``i + off_s``,
    ``off_s = (ref_s - ref) (GRID_K - 1)``, held by the same slot. So split ``s`` holds the sums at the global points
    ``(J - GRID_K, J]`` that are not above its own top index, and nothing at the others (each of its keys lies below
    its max). Returns the state tuple of :func:`_store_state` (``m`` relative to ``ref``).

    ``hint``: ``(HINT_PTS, T)``; with ``HINT_P > 1`` hint points ``T`` (``[BLOCK_M, HINT_P]``; ``[BLOCK_M, 1]``: no
    hint), the splits' sums at them (``HINT_PTS``; absolute points, the same in every split, so their sums add; POW 0
    rescaled from each split's max to the row's) are merged too, at ``T - ref`` (:func:`_merge_hint`).
    """
    w_grid = 1.0 / (GRID_K - 1)
    slot = tl.arange(0, GRID_K).to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.float32)
    for s in range(0, n_splits):
        row = GRID_ROW + (split_rows + s) * N_PART
        m = tl.maximum(m, tl.load(row, mask=active, other=float("-inf"), cache_modifier=".cg"))
        n_valid += tl.load(row + 2, mask=active, other=0.0, cache_modifier=".cg")
        bad = tl.maximum(bad, tl.load(row + 3, mask=active, other=0.0, cache_modifier=".cg"))
    valid = n_valid > 0.0
    usable = valid & (bad == 0.0) & active
    ref = tl.where(usable, anchor(m, GRID_K), 0.0)
    # the global top index: the largest of the splits' in the global frame (the same arithmetic as each split's);
    # fp32 indexes the grid only below 2**22 steps, on every split that has a key
    j_top = tl.full([BLOCK_M], -1e30, tl.float32)
    j_far = tl.zeros([BLOCK_M], tl.float32)
    for s in range(0, n_splits):
        row = GRID_ROW + (split_rows + s) * N_PART
        has = tl.load(row, mask=usable, other=float("-inf"), cache_modifier=".cg") > float("-inf")
        j_s = tl.load(row + 1, mask=has, other=0.0, cache_modifier=".cg")
        ref_s = tl.load(row + 4, mask=has, other=0.0, cache_modifier=".cg")
        j_top = tl.maximum(j_top, tl.where(has, j_s + (ref_s - ref) * (GRID_K - 1), -1e30))
        j_far = tl.maximum(j_far, tl.abs(j_s))
    m_abs = m
    m = tl.where(usable, m - ref, 0.0)
    j_top = tl.where(usable, j_top, 0.0)
    i_glob = ring_index(j_top[:, None], slot[None, :], GRID_K)
    t_glob = i_glob * w_grid + shift
    l_glob = log_ref(m[:, None], t_glob)
    F = tl.zeros([BLOCK_M, GRID_K], tl.float32)
    G = tl.zeros([BLOCK_M, GRID_K], tl.float32)
    C = tl.zeros([BLOCK_M, GRID_K], tl.float32)
    for s in range(0, n_splits):
        row = GRID_ROW + (split_rows + s) * N_PART
        m_s = tl.load(row, mask=usable, other=float("-inf"), cache_modifier=".cg")
        off_s = (tl.load(row + 4, mask=usable, other=0.0, cache_modifier=".cg") - ref) * (GRID_K - 1)
        j_s = tl.load(row + 1, mask=usable, other=-1e30, cache_modifier=".cg") + off_s
        same = ((ring_index(j_s[:, None], slot[None, :], GRID_K) == i_glob) & usable[:, None]
                & (m_s > float("-inf"))[:, None])
        F, G, C = _add_split_points(GRID_PTS, split_rows + s, same, (F, G, C), log_ref((m_s - ref)[:, None], t_glob)
                                    - l_glob, beta, bm1, POW, GRID_K)
    # beyond 2**22 grid steps fp32 cannot index the grid: those rows start from [m - 1, m], phi(m - 1) unknown
    grid_ok = (tl.abs(j_top) < 4194304.0) & (j_far < 4194304.0)
    br = open_bracket(m, grid_ok, shift)
    ph, dph = phi(F, G, POW, am1[:, None], l_glob)
    # the lowest point is <= m - 1, where f >= 1 in exact arithmetic
    lowest = i_glob == (j_top - (GRID_K - 1))[:, None]
    br = merge_points(br, tl.where(grid_ok[:, None], t_glob, float("nan")), tl.where(lowest, tl.maximum(ph, 0.0), ph),
                      dph, tl.where(lowest, tl.maximum(F, 1.0), F), G, C, GRID_K)
    if hint[1].shape[1] > 1:
        br = _merge_hint(br, GRID_ROW, hint, split_rows, n_splits, usable, m_abs, ref, am1, beta, bm1, POW)
    est, lo, hi, exact = solve(br, POW)
    return (m, Bracket(*br[:10], br.top.to(tl.float32)), est, lo, hi, exact.to(tl.float32), usable.to(tl.float32),
            tl.where(active, bad, 0.0), tl.full([], 1.0, tl.float32), ref)


@triton.jit
def _add_split_points(PTS, rows, has, sums, d_l, beta, bm1, POW: tl.constexpr, N: tl.constexpr):
    """Add one split's ``[BLOCK_M, N]`` point sums (as :func:`_store_points` stored them at ``rows``), where ``has``, to
    ``sums = (F, G, C)``; POW 0 rescales them from the split max's term to the row max's (``d_l`` the difference of
    the two ``log_ref``). Returns the sums."""
    F, G, C = sums
    pts = PTS + rows[:, None] * (3 * N) + tl.arange(0, N)[None, :]
    f_s = tl.load(pts, mask=has, other=0.0, cache_modifier=".cg")
    g_s = tl.load(pts + N, mask=has, other=0.0, cache_modifier=".cg")
    if POW == 0:
        F += tl.where(has, f_s * tl.exp2(beta[:, None] * d_l), 0.0)
        G += tl.where(has, g_s * tl.exp2(bm1[:, None] * d_l), 0.0)
    else:
        F += f_s
        G += g_s
        C += tl.load(pts + 2 * N, mask=has, other=0.0, cache_modifier=".cg")
    return F, G, C


@triton.jit
def _merge_hint(br, GRID_ROW, hint, split_rows, n_splits, usable, m_abs, ref, am1, beta, bm1, POW: tl.constexpr):
    """The bracket ``br`` tightened with the splits' sums ``HINT_PTS`` at the hint points ``T`` (absolute, ``[BLOCK_M,
    HINT_P]``; ``hint = (HINT_PTS, T)``):
    the sums add over the splits (POW 0: each rescaled from its split max's term to the row max ``m_abs``'s), and each
    point moves an end of the bracket only where its ``phi`` certifies it (``merge_points``); a non-finite hint's
    points lie far above the row max and move nothing."""
    HINT_PTS, T = hint
    HINT_P: tl.constexpr = T.shape[1]
    FH = tl.zeros([T.shape[0], HINT_P], tl.float32)
    GH = tl.zeros([T.shape[0], HINT_P], tl.float32)
    CH = tl.zeros([T.shape[0], HINT_P], tl.float32)
    l_row = log_ref(m_abs[:, None], T)
    for s in range(0, n_splits):
        m_s = tl.load(GRID_ROW + (split_rows + s) * N_PART, mask=usable, other=float("-inf"), cache_modifier=".cg")
        has = usable[:, None] & (m_s > float("-inf"))[:, None]
        FH, GH, CH = _add_split_points(HINT_PTS, split_rows + s, has, (FH, GH, CH), log_ref(m_s[:, None], T) - l_row,
                                       beta, bm1, POW, HINT_P)
    ph, dph = phi(FH, GH, POW, am1[:, None], l_row)
    t_rel = tl.where((T < 1e38) & usable[:, None], T - ref[:, None], float("nan"))
    return merge_points(br, t_rel, ph, dph, FH, GH, CH, HINT_P)


@triton.jit
def _hint_sums(z, m, T, LH, FH, GH, CH, beta, bm1, POW: tl.constexpr, HINT_P: tl.constexpr):
    """Add the point sums of the score tile ``z [BLOCK_M, BLOCK_N]`` (absolute scores) at the decode kernels' hint
    points ``T [BLOCK_M, HINT_P]`` (absolute, ``tau + shift``) to ``FH``, ``GH``, ``CH`` and return ``(LH, FH, GH,
    CH)``. ``m`` is the running max after the tile; POW 0's sums are scaled by the max key's term, ``LH =
    log_ref(m, T)``, and rescaled here when the max rises (as the grid's ring)."""
    if POW == 0:
        l_new = log_ref(m[:, None], T)
        FH = FH * tl.exp2(beta[:, None] * (LH - l_new))
        GH = GH * tl.exp2(bm1[:, None] * (LH - l_new))
        LH = l_new
    zero = tl.zeros([z.shape[0]], tl.float32)
    _, _, _, FH, GH, CH = cand_sums(z, (zero, zero, T, LH, tl.arange(0, HINT_P).to(tl.float32)),
                                    (zero, zero, zero, FH, GH, CH), POW, HINT_P, bm1[:, None])
    return LH, FH, GH, CH


@triton.jit
def _store_state(STATE, state_rows, active, m, br, est, lo, hi, exact, usable, bad, passes, ref):
    """Store the row state: the row max ``m``, the bracket ``br`` (its ``top`` a 0/1 float), the estimate, the
    certified bounds (all relative to the reference score ``ref``), the flags (``N_STATE`` columns of ``STATE``; flags
    as 0/1 floats, ``passes`` run so far) and ``ref``."""
    base = STATE + state_rows * N_STATE
    tl.store(base, m, mask=active)
    for f in tl.static_range(11):
        tl.store(base + (f + 1), br[f], mask=active)
    tl.store(base + 12, est, mask=active)
    tl.store(base + 13, lo, mask=active)
    tl.store(base + 14, hi, mask=active)
    tl.store(base + 15, exact, mask=active)
    tl.store(base + 16, usable, mask=active)
    tl.store(base + 17, bad, mask=active)
    tl.store(base + 18, passes, mask=active)
    tl.store(base + 19, ref, mask=active)


@triton.jit
def _load_state(STATE, state_rows, active):
    """The state :func:`_store_state` stored, as it takes it (inactive rows: unusable, done)."""
    base = STATE + state_rows * N_STATE
    return (tl.load(base, mask=active, other=0.0),
            Bracket(tl.load(base + 1, mask=active, other=0.0), tl.load(base + 2, mask=active, other=0.0),
                    tl.load(base + 3, mask=active, other=-1.0), tl.load(base + 4, mask=active, other=1.0),
                    tl.load(base + 5, mask=active, other=0.0), tl.load(base + 6, mask=active, other=0.0),
                    tl.load(base + 7, mask=active, other=0.0), tl.load(base + 8, mask=active, other=-1.0),
                    tl.load(base + 9, mask=active, other=-1.0), tl.load(base + 10, mask=active, other=0.0),
                    tl.load(base + 11, mask=active, other=1.0)),
            tl.load(base + 12, mask=active, other=0.0), tl.load(base + 13, mask=active, other=0.0),
            tl.load(base + 14, mask=active, other=0.0), tl.load(base + 15, mask=active, other=1.0),
            tl.load(base + 16, mask=active, other=0.0), tl.load(base + 17, mask=active, other=0.0),
            tl.max(tl.load(base + 18, mask=active, other=0.0), 0), tl.load(base + 19, mask=active, other=0.0))


@triton.jit
def _merge_cands(sums, pts, state, am1, tol, POW: tl.constexpr, CAND_P: tl.constexpr):
    """Merge a candidate pass's sums ``(FP, GP, CP)`` at its points ``(t_p, l_p)`` into the bracket of ``state``
    (``(br, est, lo, hi, exact, usable)``) and solve again (rows already done are left as they are). Returns the
    updated ``(br, est, lo, hi, exact)``."""
    FP, GP, CP = sums
    t_p, l_p = pts
    br, est, lo, hi, exact, usable = state
    act = weight_done(exact, lo, hi, br.da, 1.0 / am1, usable, tol) == 0
    ph, dph = phi(FP, GP, POW, am1[:, None], l_p)
    # rows that are done take no point (NaN compares false), so their bracket stays well formed
    new = merge_points(Bracket(*br[:10], br.top != 0.0), tl.where(act[:, None], t_p, float("nan")), ph, dph, FP, GP,
                       CP, CAND_P)
    n_est, n_lo, n_hi, n_exact = solve(new, POW)
    n_lo = tl.maximum(lo, n_lo)
    n_hi = tl.minimum(hi, n_hi)
    n_lo = tl.minimum(n_lo, n_hi)
    n_est = tl.minimum(tl.maximum(n_est, n_lo), n_hi)
    br = pick_bracket(act, Bracket(*new[:10], new.top.to(tl.float32)), br)
    return (br, tl.where(act, n_est, est), tl.where(act, n_lo, lo), tl.where(act, n_hi, hi),
            tl.where(act, n_exact.to(tl.float32), exact))


@triton.jit
def _tile_list(LIST, LIVE_N, n_splits, blocks_per_split):
    """Gather the live lists of a row tile's splits (split ``s``'s ``LIVE_N[s]`` entries at ``LIST + s *
    blocks_per_split``) into one list at ``LIST``, in place (a write never overtakes a read), its length in
    ``LIVE_N[0]``; returns the length."""
    n_all = tl.zeros([], tl.int32)
    for s in range(0, n_splits):
        n_s = tl.load(LIVE_N + s, cache_modifier=".cg")
        for idx in range(0, n_s):
            tl.store(LIST + n_all + idx, tl.load(LIST + s * blocks_per_split + idx, cache_modifier=".cg"))
        n_all += n_s
    tl.store(LIVE_N, n_all)
    return n_all


@triton.jit
def _cand_passes(store, n_in, n_slots, state, ent, zs, tol, SCORE, POW: tl.constexpr, CAND_P: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The candidate passes of one row tile, run by the last program of its score pass over the tile's ``n_in`` live
    blocks (their stored scores; the list of :func:`_tile_list`): while a row is not pinned down and the budget
    lasts (``n_slots - 3`` passes), ``f``, ``g``, ``c`` at ``CAND_P`` points of the bracket, the list rewritten in
    place without the blocks below the certified lower bound, and the sums merged into the bracket
    (:func:`_merge_cands`).

    ``store``: ``(Z, z_rows, LIST, LIVE_N, READS)``, the tile's stored scores (rows ``z_rows``), its list, its length
    (in ``LIVE_N[0]``) and block counters (candidate pass ``p`` in ``READS[1 + p]``); ``state``: ``(m, br, est, lo,
    hi, exact, usable, passes, ref)`` as :func:`_grid_state` gives it; ``ent``: ``(am1, beta, bm1, shift)``; ``zs``
    the sink tile. Returns ``state`` after the passes."""
    Z, z_rows, LIST, LIVE_N, READS = store
    m, br, est, lo, hi, exact, usable, passes, ref = state
    am1, beta, bm1, shift = ent
    ok_row = usable != 0.0
    col_blk = tl.arange(0, BLOCK_N)
    cand = tl.arange(0, CAND_P).to(tl.float32)
    zero = tl.zeros([m.shape[0]], tl.float32)
    n_pass = 0
    go = tl.max((weight_done(exact, lo, hi, br.da, beta, usable, tol) == 0).to(tl.int32), 0)
    while (go != 0) & (n_pass < n_slots - 3):
        t_p, l_p = cand_points(m, lo, hi, CAND_P)
        FP = tl.zeros([m.shape[0], CAND_P], tl.float32)
        GP = tl.zeros([m.shape[0], CAND_P], tl.float32)
        CP = tl.zeros([m.shape[0], CAND_P], tl.float32)
        lo_kill = lo - shift
        n_out = tl.zeros([], tl.int32)
        for idx in range(0, n_in):
            kt = tl.load(LIST + idx)
            z = tl.load(Z + z_rows[:, None] + (kt * BLOCK_N + col_blk)[None, :], mask=ok_row[:, None],
                        other=float("-inf"), cache_modifier=".cg") - ref[:, None]
            live = tl.max((z > lo_kill[:, None]).to(tl.int32))
            tl.store(LIST + n_out, kt, mask=live != 0)
            n_out += live
            _, _, _, FP, GP, CP = cand_sums(z, (zero, zero, t_p, l_p, cand), (zero, zero, zero, FP, GP, CP),
                                            POW, CAND_P, bm1[:, None])
        if SCORE.has_sinks:
            _, _, _, FP, GP, CP = cand_sums(zs - ref[:, None], (zero, zero, t_p, l_p, cand),
                                            (zero, zero, zero, FP, GP, CP), POW, CAND_P, bm1[:, None])
        br, est, lo, hi, exact = _merge_cands((FP, GP, CP), (t_p, l_p), (br, est, lo, hi, exact, usable), am1, tol,
                                              POW, CAND_P)
        tl.store(READS + 1 + n_pass, n_in)
        n_in = n_out
        passes += 1.0
        n_pass += 1
        go = tl.max((weight_done(exact, lo, hi, br.da, beta, usable, tol) == 0).to(tl.int32), 0)
    tl.store(LIVE_N, n_in)
    return m, br, est, lo, hi, exact, usable, passes, ref


@triton.jit
def _last_arrival(COUNT, n_splits):
    """Whether this program is the last of its row tile's ``n_splits`` programs to finish the launch (a ticket taken
    with an atomic add on the tile's counter, ``COUNT``), so that it may read what all of them stored: the barrier
    orders every thread's stores before the ticket (released at GPU scope), the ticket's acquire orders the reads
    after it. The last program sets the counter back to 0 for the next launch (counters are zero at rest)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNT, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_splits - 1
    tl.store(COUNT, 0, mask=last)
    return last


@triton.jit
def _store_partials(PART_ROW, PART_ACC, split_rows, active, m, l_sum, nnz, acc, HEAD_DIM_V: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    """One split's value-pass results: max (softmax; 0 for entmax), sum of weights, support size, ``acc``."""
    offs_d = tl.arange(0, BLOCK_DV)
    tl.store(PART_ROW + split_rows * N_PART, m, mask=active)
    tl.store(PART_ROW + split_rows * N_PART + 1, l_sum, mask=active)
    tl.store(PART_ROW + split_rows * N_PART + 2, nnz.to(tl.float32), mask=active)
    tl.store(PART_ACC + split_rows[:, None] * HEAD_DIM_V + offs_d[None, :], acc,
             mask=active[:, None] & (offs_d[None, :] < HEAD_DIM_V))


@triton.jit
def _combine_rows(OUTS, PART_ROW, PART_ACC, split_rows, n_splits, stat_offs, active, alpha, sink,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The combine of a row tile's ``active`` rows, run by the last program of their value (or softmax) pass:
    ``out = sum_s w_s acc_s / sum_s w_s l_s`` with ``w_s = e^(m_s - max m)`` (1 for entmax rows, whose split maxima are
    0), and the row statistics. ``OUTS``: ``(OUT, TAU, NNZ, N_VALID)``, ``OUT`` contiguous ``(B, Hq, Nq, Dv)``, the
    statistics at ``stat_offs``; the sink logit ``sink`` of a softmax row joins here (its max and denominator; entmax
    rows have it in their threshold and split 0's sum; their ``tau`` is stored by the value pass)."""
    OUT, TAU, NNZ, N_VALID = OUTS
    offs_d = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM_V
    sink_bad = (alpha == 1.0) & ((sink != sink) | (sink == float("inf")))
    s_sink = tl.where((alpha == 1.0) & (sink_bad == 0), sink, float("-inf"))
    m = s_sink
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(PART_ROW + (split_rows + s) * N_PART, mask=active, other=float("-inf"),
                                  cache_modifier=".cg"))
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    l_sum = tl.exp2((s_sink - m_safe) * LOG2E)
    nnz = tl.zeros([m.shape[0]], tl.float32)
    n_valid = tl.zeros([m.shape[0]], tl.float32)
    acc = tl.zeros([m.shape[0], BLOCK_DV], tl.float32)
    for s in range(0, n_splits):
        row = PART_ROW + (split_rows + s) * N_PART
        w = tl.exp2((tl.load(row, mask=active, other=float("-inf"), cache_modifier=".cg") - m_safe) * LOG2E)
        l_sum += w * tl.load(row + 1, mask=active, other=0.0, cache_modifier=".cg")
        nnz += tl.load(row + 2, mask=active, other=0.0, cache_modifier=".cg")
        n_valid += tl.load(row + 3, mask=active, other=0.0, cache_modifier=".cg")
        part = tl.load(PART_ACC + (split_rows + s)[:, None] * HEAD_DIM_V + offs_d[None, :],
                       mask=active[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        acc += w[:, None] * part
    is_bad = (l_sum != l_sum) | sink_bad
    ok = l_sum > 0.0
    out = tl.where(ok[:, None], acc / tl.where(ok, l_sum, 1.0)[:, None], 0.0)
    out = tl.where(is_bad[:, None], float("nan"), out)
    tl.store(OUT + stat_offs[:, None] * HEAD_DIM_V + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=active[:, None] & d_ok[None, :])
    tl.store(NNZ + stat_offs, tl.where(is_bad, 0.0, nnz).to(tl.int32), mask=active)
    tl.store(N_VALID + stat_offs, n_valid.to(tl.int32), mask=active)
    tau_soft = tl.where(n_valid > 0.0, m_safe + tl.log2(tl.where(ok, l_sum, 1.0)) * LN2, float("inf"))
    tl.store(TAU + stat_offs, tl.where(is_bad, float("nan"), tau_soft), mask=active & (alpha == 1.0))
