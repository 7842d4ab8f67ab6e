"""The fused backward's tile-level work (``kernels/attn/entmax_attn_bwd.py`` launches the kernels): row factors, the
weights ``p``, ``U = p^(2 - alpha)`` and ``log p`` of a recomputed score tile by alpha class, the alpha-gradient
terms, one tile's ``dP`` and ``dS``, the loads of a key tile / query rows, and the liveness bits a loop walks.
Derivations in docs/backward.md.
"""

import triton
import triton.language as tl

from .._common import (
    LN2,
    LOG2E,
    alpha_class_id,
    dropout_keep,
    expm1mx_series,
    load_rows,
    log2_1p,
    slice_base,
    two_sum,
)
from .._masking import bit_rank, score_mod, soft_cap, tile_indices


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
    ``beta log r - log L`` (no second logarithm). ``log p`` is dead code unless d alpha is asked for.
    ``ALPHA_CLASS`` (``_common.ALPHA_CLASSES``) picks the path at compile time.
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
        logp = tl.where(p > 0.0, tl.log2(tl.where(p > 0.0, p, 1.0)) * LN2, 0.0)
    elif ALPHA_CLASS == 2:
        r = tl.maximum((s * 0.5 - tau[:, None]) - tau_lo[:, None], 0.0)
        u = r * cu[:, None]
        p = u * r * cp[:, None]
        logp = tl.where(p > 0.0, tl.log2(tl.where(p > 0.0, p, 1.0)) * LN2, 0.0)
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
def _tile(qrow, k, v, idx, alpha, scale, mods, drop, MASK, SCORE, ALPHA_CLASS: tl.constexpr, BIAS_KIND: tl.constexpr,
          HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Recompute one tile: weights ``p``, ``U``, ``log p``, ``dP``, the dropped weights ``pd``, ``dS = U (dP - delta)``
    (the gradient of the final scores, that of the mask) and ``dS_qk``, that of ``scale * q.k`` (``dS`` times the
    soft cap's derivative ``1 - tanh^2``), all ``[BLOCK_M, BLOCK_N]``.

    ``qrow``: the query rows ``(q, do, tau, cu, cp, log_l, delta)`` (``_query_rows``); ``k``, ``v``: the key tile;
    ``idx``: ``(rows, cols, rows_global, cols_global, seqlen_q, seqlen_k)`` (sequence-local and packed indices,
    sequence lengths); ``mods``: ``_masking.program_mods``; ``drop``: ``(seed, bh, total_k, dropout_p)``."""
    q, do, tau, cu, cp, log_l, delta = qrow
    rows, cols, rows_global, cols_global, seqlen_q, seqlen_k = idx
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s_m = score_mod(s, rows, cols, seqlen_q, seqlen_k, mods, 1.0, MASK, SCORE, BIAS_KIND)
    p, u, logp = _weights(s_m, tau, cu, cp, log_l, alpha, ALPHA_CLASS)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        seed, bh, total_k, dropout_p = drop
        keep = dropout_keep(seed, bh, rows_global, cols_global, total_k, dropout_p)
        fac = tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        dp = dp * fac
        pd = p * fac
    else:
        pd = p
    ds = u * (dp - delta[:, None])
    ds_qk = ds
    if SCORE[0]:
        t = soft_cap(s, SCORE[1], SCORE) / SCORE[1]  # the capped scores score_mod computed (one build: CSE)
        ds_qk = ds * (1.0 - t * t)
    return p, u, logp, dp, pd, ds, ds_qk


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
def _row_tile_bits(live_row, wd, kt_lo, kt_hi, HAS_LIVE: tl.constexpr):
    """Bits ``[32]``, their prefix counts and number set, of the key tiles ``32 wd + lane`` in ``[kt_lo, kt_hi)``
    that the liveness words at ``live_row`` mark live (all of them without a bitmap)."""
    kt = wd * 32 + tl.arange(0, 32)
    bits = ((kt >= kt_lo) & (kt < kt_hi)).to(tl.int32)
    if HAS_LIVE:
        bits = bits & (tl.load(live_row + wd) >> tl.arange(0, 32))
    rank, n_set = bit_rank(bits)
    return bits, rank, n_set


@triton.jit
def _column_tile_bits(live_col, c, kt, qt_lo, qt_hi, stride_live_m, HAS_LIVE: tl.constexpr, BLOCK_M: tl.constexpr,
                      LIVE_BLOCK_M: tl.constexpr):
    """Bits ``[32]``, prefix counts and number set of the query tiles ``32 c + lane`` (of ``BLOCK_M`` rows) in
    ``[qt_lo, qt_hi)`` for which key tile ``kt`` is live; ``live_col`` points at word ``kt // 32`` of query tile 0.
    The bitmap's rows are the forward's ``LIVE_BLOCK_M``-row tiles, which the backward's tiles divide."""
    qt = c * 32 + tl.arange(0, 32)
    ok = (qt >= qt_lo) & (qt < qt_hi)
    bits = ok.to(tl.int32)
    if HAS_LIVE:
        words = tl.load(live_col + (qt * BLOCK_M // LIVE_BLOCK_M).to(tl.int64) * stride_live_m, mask=ok, other=0)
        bits = bits & (words >> (kt % 32))
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
    ``kv = (k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd)``: the sequence's K / V slices of the kv head;
    ``dims``: ``_head_dims``."""
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd = kv
    offs_d, d_ok, offs_dv, dv_ok = dims
    cols, cols_global, col_ok = tile_indices(kt, k_start, seqlen_k, BLOCK_N)
    k = load_rows(k_base, cols, offs_d, stride_kn, stride_kd, col_ok, d_ok, UPCAST)
    v = load_rows(v_base, cols, offs_dv, stride_vn, stride_vd, col_ok, dv_ok, UPCAST)
    return cols, cols_global, col_ok, k, v


@triton.jit
def _query_rows(qdo, STATS, bh, total_q, rows, rows_global, row_ok, dims, alpha, UPCAST: tl.constexpr):
    """Rows ``rows`` of one (batch, q head) after the dQ kernel: ``qrow = (q, do, tau, cu, cp, log_l, delta)`` (the
    ``qrow`` of ``_tile``): ``q [BLOCK_M, BLOCK_D]``, ``do [BLOCK_M, BLOCK_DV]``, the per-row ``tau`` (``_row_tau``),
    weight factors ``cu``, ``cp``, ``log lsum`` (``_row_factors``) and ``delta``. ``qdo = (q_base, do_base,
    stride_qm, stride_qd, stride_dom, stride_dod)``: the sequence's Q / dO slices of the head; ``STATS = (TAU, LSUM,
    DELTA)`` with ``TAU = (TAU, TAU_LO)``."""
    q_base, do_base, stride_qm, stride_qd, stride_dom, stride_dod = qdo
    offs_d, d_ok, offs_dv, dv_ok = dims
    q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, d_ok, UPCAST)
    do = load_rows(do_base, rows, offs_dv, stride_dom, stride_dod, row_ok, dv_ok, UPCAST)
    stat_offs = bh.to(tl.int64) * total_q + rows_global.to(tl.int64)
    tau = _row_tau(STATS[0], stat_offs, row_ok)
    lsum = tl.load(STATS[1] + stat_offs, mask=row_ok, other=0.0)
    delta = tl.load(STATS[2] + stat_offs, mask=row_ok, other=0.0)
    cu, cp, log_l = _row_factors(alpha, lsum)
    return q, do, tau, cu, cp, log_l, delta
