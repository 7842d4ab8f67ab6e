"""The fused backward's tile-level work (``kernels/attn/entmax_attn_bwd.py`` launches the kernels): row factors, the
weights ``p``, ``U = p^(2 - alpha)`` and ``log p`` of a recomputed score tile by alpha class (``_weights``, the one
place they are recomputed from the saved threshold), the alpha-gradient terms and row formula, a tile's two
recomputed products in either orientation, its ``dP`` and ``dS``, the loads of a key tile / query rows, and the
liveness bits a loop walks. Derivations in docs/backward.md.
"""

import triton
import triton.language as tl

from .._common import (
    LN2,
    LOG2E,
    alpha_class_id,
    dropout_keep,
    expm1mx_series,
    fast_log2,
    load_rows,
    load_tile,
    log2_1p,
    slice_base,
    two_sum,
)
from .._masking import bit_rank, score_mod, score_mod_grad, tile_indices


@triton.jit
def _row_factors(alpha, lsum):
    """Per row ``[BLOCK_M]``: ``cu = lsum^(alpha-2)``, ``cp = lsum^(1-alpha)`` (0 where ``lsum == 0``), ``log lsum``."""
    valid = lsum > 0.0
    lg = tl.log2(tl.where(valid, lsum, 1.0))
    cu = tl.where(valid, tl.exp2((alpha - 2.0) * lg), 0.0)
    cp = tl.where(valid, tl.exp2((1.0 - alpha) * lg), 0.0)
    return cu, cp, lg * LN2


@triton.jit
def _row_tau(TAU, stat_offs, row_ok):
    """The forward's threshold of the rows at ``stat_offs`` as two floats ``(tau, tau_lo)`` (``[BLOCK_M]`` each;
    ``TAU = (TAU, TAU_LO)``): ``+inf`` and 0 outside ``row_ok``."""
    return (tl.load(TAU[0] + stat_offs, mask=row_ok, other=float("inf")),
            tl.load(TAU[1] + stat_offs, mask=row_ok, other=0.0))


@triton.jit
def _weights(s, tau, cu, cp, log_l, alpha, ALPHA_CLASS: tl.constexpr):
    """Weights ``p``, ``U = p^(2-alpha)`` and ``log p`` (0 where ``p == 0``) of a score tile ``s [BLOCK_M, BLOCK_N]``
    (masked = -inf), each ``[BLOCK_M, BLOCK_N]``.

    ``tau = (tau, tau_lo)`` (``_row_tau``): the threshold is their exact sum, and every score is taken relative to
    it as ``((alpha-1) s - tau) - tau_lo``: the first difference is exact near the threshold (one FMA), so that the
    weights do not depend on the magnitude of the scores (a constant added to a row), as in the forward.

    For alpha > 1, ``r = [(alpha-1) s - tau]_+``, ``U = r^(beta-1) cu`` and ``p = U r cp``
    (``beta = 1/(alpha-1)``), which is ``r^beta / L`` when ``cu = L^(alpha-2)``, ``cp = L^(1-alpha)``.
    For a general alpha, ``log r = log1p(w)`` with ``w = (alpha-1) s - (tau + 1)``: near alpha = 1
    ``r`` is within O(alpha-1) of 1, and rounding ``r`` itself would cost ``beta`` ulps in ``p``; ``log p`` is then
    ``beta log r - log L`` (no second logarithm); at alpha 1.5 and 2 it is ``fast_log2(p)`` (``lg2.approx``: an
    absolute error of at most ``2**-22`` in ``log2 p``, ``p`` times that in ``p log p``). ``log p`` is dead code unless
    d alpha is asked for.
    ``ALPHA_CLASS`` (``_args.ALPHA_CLASSES``) picks the path at compile time.
    """
    tau, tau_lo = tau
    if ALPHA_CLASS == 0:
        t = (s - tau[:, None]) - tau_lo[:, None]
        p = tl.exp2(t * LOG2E)
        u = p
        logp = tl.where(p > 0.0, t, 0.0)
    elif ALPHA_CLASS == 1:
        r = tl.maximum((s - tau[:, None]) - tau_lo[:, None], 0.0)
        u = tl.where(r > 0.0, cu[:, None], 0.0)
        p = r * cp[:, None]
        logp = tl.where(p > 0.0, fast_log2(tl.where(p > 0.0, p, 1.0)) * LN2, 0.0)
    elif ALPHA_CLASS == 2:
        r = tl.maximum((s * 0.5 - tau[:, None]) - tau_lo[:, None], 0.0)
        u = r * cu[:, None]
        p = u * r * cp[:, None]
        logp = tl.where(p > 0.0, fast_log2(tl.where(p > 0.0, p, 1.0)) * LN2, 0.0)
    else:
        beta = 1.0 / (alpha - 1.0)
        # relative to theta = tau + 1 as two floats (the forward's threshold on this path): near alpha = 1 the
        # scores and theta are small and w = z - theta is exact where z - tau would round at 1
        # (a row without keys, tau = +inf, gets a NaN residual and w: outside the support below)
        theta, theta_lo = two_sum(tau, 1.0)
        w = (s * (alpha - 1.0) - theta[:, None]) - (theta_lo + tau_lo)[:, None]
        sup = w > -1.0
        w = tl.where(sup, w, 0.0)
        lr = log2_1p(w)
        u = tl.where(sup, tl.exp2((beta - 1.0) * lr), 0.0)
        u = u * cu[:, None]
        p = u * (1.0 + w) * cp[:, None]
        logp = tl.where(p > 0.0, (beta * lr) * LN2 - log_l[:, None], 0.0)
    return p, u, logp


@triton.jit
def _dalpha_terms(p, u, logp, alpha, inv_eps2):
    """Elementwise ``p log p`` and ``pg = p (e^x - 1 - x) / (alpha-1)^2`` with ``x = -(alpha-1) log p``.

    ``pg`` uses the Taylor series of ``(e^x - 1 - x) / x^2`` for ``x < 1`` (exact at alpha = 1,
    where it is ``p log^2 p / 2``) and ``(U - p (1 + x)) / (alpha-1)^2`` otherwise
    (``inv_eps2 = 1 / max((alpha-1)^2, 1e-30)``, one scalar per head).
    """
    x = -(alpha - 1.0) * logp
    pg_series = p * logp * logp * expm1mx_series(x)
    pg_direct = (u - p * (1.0 + x)) * inv_eps2
    pg = tl.where(x < 1.0, pg_series, pg_direct)
    return p * logp, pg


@triton.jit
def _dalpha_rows(s_u, s_pd, s_pl, s_g, s_gd, s_pld, alpha):
    """d alpha of each row ``[BLOCK_M]`` from its six row sums over keys (docs/backward.md, "Gradient w.r.t.
    alpha"): ``S = sum U``, ``A = sum p dP``, ``sum p log p``, ``G = sum p g``, ``Pg = sum p g dP``,
    ``Pl = sum p log p dP``; 0 for a row without weights. Written with the row sums: no 1/(alpha-1) blow-up."""
    has_u = s_u > 0.0
    s_u = tl.where(has_u, s_u, 1.0)
    dalpha = (s_g * s_pd - s_gd) / s_u + (alpha - 1.0) * (s_pl * s_gd - s_g * s_pld) / s_u
    return tl.where(has_u, dalpha, 0.0)


@triton.jit
def _products_by_rows(q, do, k, v, scale, DOT_PRECISION: tl.constexpr):
    """The two recomputed products of a tile with the query rows as the MMA's M (the dQ and d bias kernels, which
    own their rows): ``s = scale q k^T`` and ``dP = dO v^T``, each ``[BLOCK_M, BLOCK_N]``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    return s, dp


@triton.jit
def _products_by_keys(q, do, k, v, scale, DOT_PRECISION: tl.constexpr):
    """The same two products with the keys as the MMA's M (the dK/dV kernel, which owns its keys: ``k v`` stay in
    shared memory as the A operand, and a tile of 64 or 128 keys fills Hopper's warpgroup MMA whatever the query
    step): ``s^T = k q^T``, ``dP^T = v dO^T`` computed, returned as their transposes ``[BLOCK_M, BLOCK_N]`` (register
    views: the elementwise work is written once, by rows)."""
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    return tl.trans(s_t) * scale, tl.trans(dp_t)


@triton.jit
def _tile(qrow, s, dp, idx, inside, alpha, mods, drop, MASK, SCORE, ALPHA_CLASS: tl.constexpr,
          BIAS_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """One recomputed tile from its products ``s = scale q.k`` and ``dp = dO.v`` (``_products_by_rows`` /
    ``_products_by_keys``): weights ``p``, ``U``, ``log p``, ``dP`` (dropout replayed), the dropped weights ``pd``,
    ``dS = U (dP - delta)`` (the gradient of the final scores, that of the mask) and ``dS_qk``, that of
    ``scale * q.k`` (``dS`` times the soft cap's derivative ``1 - tanh^2``), all ``[BLOCK_M, BLOCK_N]``.

    ``qrow``: the query rows ``(q, do, tau, cu, cp, log_l, delta)`` (``_query_rows``); ``idx``: ``(rows, cols,
    rows_global, cols_global, seqlen_q, seqlen_k)`` (sequence-local and packed indices, sequence lengths);
    ``inside``: ``_masking.tile_inside`` of the tile (every pair in the sequences and visible), which skips the
    per-score mask when no other score modification needs one; ``mods``: ``_masking.program_mods``; ``drop``:
    ``(seed, bh, total_k, dropout_p)``."""
    _, _, tau, cu, cp, log_l, delta = qrow
    rows, cols, rows_global, cols_global, seqlen_q, seqlen_k = idx
    s_m = score_mod(s, rows, cols, seqlen_q, seqlen_k, mods, 1.0, MASK, SCORE, BIAS_KIND, None, inside)
    p, u, logp = _weights(s_m, tau, cu, cp, log_l, alpha, ALPHA_CLASS)
    if HAS_DROPOUT:
        seed, bh, total_k, dropout_p = drop
        keep = dropout_keep(seed, bh, rows_global, cols_global, total_k, dropout_p)
        fac = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        dp = dp * fac
        pd = p * fac
    else:
        pd = p
    ds = u * (dp - delta[:, None])
    return p, u, logp, dp, pd, ds, score_mod_grad(ds, s, mods, SCORE)


@triton.jit
def _in_launch(alpha, ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr):
    """True when this launch computes the head with this alpha: always, or with ``HEAD_FILTER`` (one launch per
    alpha class) when the head is of class ``ALPHA_CLASS``."""
    cls = alpha_class_id(alpha)
    if HEAD_FILTER:
        mine = cls == ALPHA_CLASS
    else:
        mine = cls >= 0
    return mine


@triton.jit
def _live_base(LIVE, seq, h, stride_live_b, stride_live_h):
    """Liveness words of one (sequence, q head): query tile ``qt_fwd``'s words start at ``qt_fwd * stride_live_m``."""
    return LIVE + seq.to(tl.int64) * stride_live_b + h.to(tl.int64) * stride_live_h


@triton.jit
def _live_bits(live_base, qt, kt, ok, seqlen_q, stride_live_m, HAS_LIVE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, LIVE_BLOCK_M: tl.constexpr, LIVE_BLOCK_N: tl.constexpr):
    """Bits ``[32]`` (int32 0 / 1), their exclusive prefix counts and the number set, of 32 tile pairs of a loop:
    query tile ``qt`` (``BLOCK_M`` rows) and key tile ``kt`` (``BLOCK_N`` keys), one of them a ``[32]`` vector,
    the other a scalar; a pair is set where ``ok`` and, with a bitmap, where it meets a forward tile
    (``LIVE_BLOCK_M x LIVE_BLOCK_N``) marked live at ``live_base`` (``_live_base``).

    The tile sizes are powers of two, so a backward tile lies in one forward tile or is a union of whole ones: the
    bits of every forward tile it meets are OR-ed (``BLOCK_N > LIVE_BLOCK_N``: adjacent bits of one word;
    ``BLOCK_M > LIVE_BLOCK_M``: the words of adjacent bitmap rows, those that start in the sequence)."""
    bits = ok.to(tl.int32)
    if HAS_LIVE:
        SUB_M: tl.constexpr = (BLOCK_M + LIVE_BLOCK_M - 1) // LIVE_BLOCK_M
        SUB_N: tl.constexpr = (BLOCK_N + LIVE_BLOCK_N - 1) // LIVE_BLOCK_N
        tl.static_assert(SUB_N < 32, "a backward key tile spans at most 31 forward key tiles")
        row = qt * BLOCK_M // LIVE_BLOCK_M
        col = kt * BLOCK_N // LIVE_BLOCK_N
        found = bits * 0
        for r in tl.static_range(SUB_M):
            row_in = (row + r) * LIVE_BLOCK_M + col * 0 < seqlen_q  # [32] (the interpreter masks with vectors only)
            word = tl.load(live_base + (row + r).to(tl.int64) * stride_live_m + col // 32, mask=ok & row_in, other=0)
            found = found | ((word >> (col % 32)) & ((1 << SUB_N) - 1))
        bits = bits & (found != 0).to(tl.int32)
    rank, n_set = bit_rank(bits)
    return bits, rank, n_set


@triton.jit
def _head_dims(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``dims = (offs_d, d_ok, offs_dv, dv_ok)``: the head-dim offsets and in-range flags of q / k (``[BLOCK_D]``) and
    of dO / v (``[BLOCK_DV]``)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    return offs_d, d_ok, offs_dv, dv_ok


@triton.jit
def _tile_rows(X, Y, b, h, start, seqlen, tile, strides_x, strides_y, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """The tile a program owns: rows ``tile * BLOCK ...`` of the (batch ``b``, head ``h``) slices, starting at
    ``start``, of ``X`` (head dim ``HEAD_DIM``: q or k) and ``Y`` (``HEAD_DIM_V``: dO or v), with strides
    ``strides_x``, ``strides_y`` (each ``(batch, head, row, dim)``).

    Returns ``idx, idx_global, ok`` (``[BLOCK]``, ``_masking.tile_indices``), the head dims ``dims`` (``_head_dims``)
    and the rows ``x [BLOCK, BLOCK_D]``, ``y [BLOCK, BLOCK_DV]`` (0 outside; float32 with ``UPCAST``)."""
    idx, idx_global, ok = tile_indices(tile, start, seqlen, BLOCK)
    dims = _head_dims(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV)
    offs_d, d_ok, offs_dv, dv_ok = dims
    x = load_rows(slice_base(X, b, h, start, strides_x[0], strides_x[1], strides_x[2]), idx, offs_d, strides_x[2],
                  strides_x[3], ok, d_ok, UPCAST)
    y = load_rows(slice_base(Y, b, h, start, strides_y[0], strides_y[1], strides_y[2]), idx, offs_dv, strides_y[2],
                  strides_y[3], ok, dv_ok, UPCAST)
    return idx, idx_global, ok, dims, x, y


@triton.jit
def _key_tile(kt, kv, k_start, seqlen_k, dims, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile ``kt`` of a query tile: ``cols, cols_global, col_ok`` (``[BLOCK_N]``, ``_masking.tile_indices``) and
    its rows ``k [BLOCK_N, BLOCK_D]``, ``v [BLOCK_N, BLOCK_DV]`` (0 outside; float32 with ``UPCAST``).
    ``kv = (k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd)``: the sequence's K / V slices of the kv head
    (``_common.rows_source``); ``dims``: ``_head_dims``."""
    k_src, v_src, stride_kn, stride_kd, stride_vn, stride_vd = kv
    offs_d, d_ok, offs_dv, dv_ok = dims
    cols, cols_global, col_ok = tile_indices(kt, k_start, seqlen_k, BLOCK_N)
    k = load_tile(k_src, kt * BLOCK_N, cols, offs_d, stride_kn, stride_kd, col_ok, d_ok, UPCAST)
    v = load_tile(v_src, kt * BLOCK_N, cols, offs_dv, stride_vn, stride_vd, col_ok, dv_ok, UPCAST)
    return cols, cols_global, col_ok, k, v


@triton.jit
def _query_rows(qdo, STATS, bh, total_q, row0, rows, rows_global, row_ok, dims, UPCAST: tl.constexpr):
    """Rows ``rows`` (``row0 ..``) of one (batch, q head) after the dQ kernel: ``qrow = (q, do, tau, cu, cp, log_l,
    delta)`` (the ``qrow`` of ``_tile``): ``q [BLOCK_M, BLOCK_D]``, ``do [BLOCK_M, BLOCK_DV]``, the per-row ``tau``
    (``_row_tau``), weight factors ``cu``, ``cp``, ``log lsum`` (``_row_factors``, stored by the dQ kernel: a row's
    three floats at ``ROW_FACTORS + 3 row``) and ``delta``. ``qdo = (q_src, do_src, stride_qm, stride_qd, stride_dom,
    stride_dod)``: the sequence's Q / dO slices of the head (``_common.rows_source``); ``STATS = (TAU, ROW_FACTORS,
    DELTA)`` with ``TAU = (TAU, TAU_LO)``."""
    q_src, do_src, stride_qm, stride_qd, stride_dom, stride_dod = qdo
    offs_d, d_ok, offs_dv, dv_ok = dims
    q = load_tile(q_src, row0, rows, offs_d, stride_qm, stride_qd, row_ok, d_ok, UPCAST)
    do = load_tile(do_src, row0, rows, offs_dv, stride_dom, stride_dod, row_ok, dv_ok, UPCAST)
    stat_offs = bh.to(tl.int64) * total_q + rows_global.to(tl.int64)
    tau = _row_tau(STATS[0], stat_offs, row_ok)
    factors = STATS[1] + stat_offs * 3
    cu = tl.load(factors, mask=row_ok, other=0.0)
    cp = tl.load(factors + 1, mask=row_ok, other=0.0)
    log_l = tl.load(factors + 2, mask=row_ok, other=0.0)
    delta = tl.load(STATS[2] + stat_offs, mask=row_ok, other=0.0)
    return q, do, tau, cu, cp, log_l, delta
