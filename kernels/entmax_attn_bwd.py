"""Fused backward of alpha-entmax attention: dQ, dK, dV, d alpha per head and d bias.

Layout ``(batch, heads, seq, head_dim)``. The weights are recomputed tile by tile from the
forward's per-row statistics (``tau`` in the z-scale, ``lsum``); see ``docs/design.md`` for the
conventions and ``docs/backward.md`` for the derivation. With ``U = p^(2-alpha)`` on the support:

    dP = dO V^T (times the replayed dropout factor)   delta_i = sum_j U_ij dP_ij / sum_j U_ij
    dS = U (dP - delta)    dQ = scale dS K    dK = scale dS^T Q    dV = P^T dO    d bias = dS

Two kernels, no atomics, so every gradient is bitwise reproducible:

* ``_entmax_attn_bwd_dq_kernel``, one program per (query tile, q head, batch): sweep 1 over the
  live key tiles accumulates the row sums (``delta`` and the d alpha terms; skipped for
  alpha = 1 heads without d alpha, where ``delta = dO . O``), sweep 2 accumulates dQ and writes dS.
* ``_entmax_attn_bwd_dkdv_kernel``, one program per (key tile, kv head, batch): loops over the q
  heads of its group and their live query tiles, so dK/dV of GQA are summed in a fixed order.
* ``_entmax_attn_bwd_dbias_kernel`` (only for a mask broadcast over batch/heads but not over
  queries or keys): one program per mask block sums dS over the broadcast (batch, head) pairs.

Alpha is read per head at run time: alpha = 1 uses ``exp2``, alpha = 1.5 and alpha = 2 use
no transcendental function per score, other values one ``log2`` and one ``exp2``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LN2, LOG2E, MAX_GRID_YZ, dropout_keep, expm1mx_series, interpreting, log2_1p, seq_bounds

_DEFAULT_BLOCK = 64


@triton.jit
def _row_factors(alpha, lsum):
    """``cu = lsum^(alpha-2)`` and ``cp = lsum^(1-alpha)`` per row ``[BLOCK_M]``; 0 where ``lsum == 0``."""
    valid = lsum > 0.0
    lg = tl.log2(tl.where(valid, lsum, 1.0))
    cu = tl.where(valid, tl.exp2((alpha - 2.0) * lg), 0.0)
    cp = tl.where(valid, tl.exp2((1.0 - alpha) * lg), 0.0)
    return cu, cp


@triton.jit
def _weights(s, tau, cu, cp, alpha):
    """Weights ``p`` and ``U = p^(2-alpha)`` of a score tile ``s [BLOCK_M, BLOCK_N]`` (masked = -inf).

    For alpha > 1, ``r = [(alpha-1) s - tau]_+``, ``U = r^(beta-1) cu`` and ``p = U r cp``
    (``beta = 1/(alpha-1)``), which is ``r^beta / L`` when ``cu = L^(alpha-2)``, ``cp = L^(1-alpha)``.
    For a general alpha, ``log r = log1p(w)`` with ``w = (alpha-1) s - (tau + 1)``: near alpha = 1
    ``r`` is within O(alpha-1) of 1, and rounding ``r`` itself would cost ``beta`` ulps in ``p``.
    """
    if alpha == 1.0:
        p = tl.exp2((s - tau[:, None]) * LOG2E)
        u = p
    elif alpha == 2.0:
        r = tl.maximum(s - tau[:, None], 0.0)
        u = tl.where(r > 0.0, cu[:, None], 0.0)
        p = r * cp[:, None]
    elif alpha == 1.5:
        r = tl.maximum(s * 0.5 - tau[:, None], 0.0)
        u = r * cu[:, None]
        p = u * r * cp[:, None]
    else:
        w = s * (alpha - 1.0) - (tau[:, None] + 1.0)
        sup = w > -1.0
        w = tl.where(sup, w, 0.0)
        u = tl.where(sup, tl.exp2((1.0 / (alpha - 1.0) - 1.0) * log2_1p(w)), 0.0)
        u = u * cu[:, None]
        p = u * (1.0 + w) * cp[:, None]
    return p, u


@triton.jit
def _dalpha_terms(p, u, alpha):
    """Elementwise ``p log p`` and ``pg = p (e^x - 1 - x) / (alpha-1)^2`` with ``x = -(alpha-1) log p``.

    ``pg`` uses the Taylor series of ``(e^x - 1 - x) / x^2`` for ``x < 1`` (exact at alpha = 1,
    where it is ``p log^2 p / 2``) and ``(U - p (1 + x)) / (alpha-1)^2`` otherwise.
    """
    eps = alpha - 1.0
    sup = p > 0.0
    logp = tl.where(sup, tl.log2(tl.where(sup, p, 1.0)) * LN2, 0.0)
    x = -eps * logp
    pg_series = p * logp * logp * expm1mx_series(x)
    pg_direct = (u - p * (1.0 + x)) / tl.maximum(eps * eps, 1e-30)
    pg = tl.where(x < 1.0, pg_series, pg_direct)
    return p * logp, pg


@triton.jit
def _tile(
    q, do, k, v, tau, cu, cp, delta, alpha, scale, bias_base, stride_bias_m, stride_bias_n,
    rows, cols, rows_loc, cols_loc, row_ok, col_ok, causal_shift, seed, bh, n_cols_drop, p_drop,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Recompute one tile: weights ``p``, ``U``, ``dP``, the dropped weights ``pd`` and
    ``dS = U (dP - delta)``, all ``[BLOCK_M, BLOCK_N]`` (``delta [BLOCK_M]``)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    valid = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        b_ptrs = bias_base + rows[:, None].to(tl.int64) * stride_bias_m + cols[None, :].to(tl.int64) * stride_bias_n
        s += tl.load(b_ptrs, mask=valid, other=0.0).to(tl.float32)
    if IS_CAUSAL:
        valid = valid & (cols_loc[None, :] <= rows_loc[:, None] + causal_shift)
    s = tl.where(valid, s, float("-inf"))
    p, u = _weights(s, tau, cu, cp, alpha)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, rows, cols, n_cols_drop, p_drop)
        fac = tl.where(keep, 1.0 / (1.0 - p_drop), 0.0)
        dp = dp * fac
        pd = p * fac
    else:
        pd = p
    ds = u * (dp - delta[:, None])
    return p, u, dp, pd, ds


@triton.jit
def _is_live(word_ptr, bit, HAS_LIVE: tl.constexpr):
    """Bit ``bit`` of the liveness word at ``word_ptr``; 1 without a bitmap (``HAS_LIVE`` False)."""
    live = 1
    if HAS_LIVE:
        live = (tl.load(word_ptr) >> bit) & 1
    return live


@triton.jit
def _load_rows(base, idx, offs_d, stride_n, stride_d, ok, d_ok, UPCAST: tl.constexpr):
    """Rows ``idx [BLOCK]`` of a ``(seq, head_dim)`` slice as ``[BLOCK, BLOCK_D]`` (0 outside ``ok``)."""
    x = tl.load(base + idx[:, None].to(tl.int64) * stride_n + offs_d[None, :] * stride_d,
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _key_tile(
    kt, q, do, tau, cu, cp, delta, alpha, scale, K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
    bias_base, stride_bias_m, stride_bias_n, k_start, Lk, rows, rows_loc, row_ok, causal_shift, offs_d, d_ok,
    seed, bh, n_cols_drop, p_drop,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key tile ``kt`` of a query tile: loads its K/V rows and recomputes it with ``_tile``.

    Returns ``p, u, dp, pd, ds`` (``[BLOCK_M, BLOCK_N]``), the keys ``k [BLOCK_N, BLOCK_D]``, their
    global indices ``cols`` and in-sequence flags ``col_ok`` (``[BLOCK_N]``).
    """
    cols_loc = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = k_start + cols_loc
    col_ok = cols_loc < Lk
    k = _load_rows(K_base, cols, offs_d, stride_kn, stride_kd, col_ok, d_ok, UPCAST)
    v = _load_rows(V_base, cols, offs_d, stride_vn, stride_vd, col_ok, d_ok, UPCAST)
    p, u, dp, pd, ds = _tile(
        q, do, k, v, tau, cu, cp, delta, alpha, scale, bias_base, stride_bias_m, stride_bias_n,
        rows, cols, rows_loc, cols_loc, row_ok, col_ok, causal_shift, seed, bh, n_cols_drop, p_drop,
        IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION,
    )
    return p, u, dp, pd, ds, k, cols, col_ok


@triton.jit
def _query_rows(
    Q_base, DO_base, TAU, NORM, DELTA, bh, n_q, rows, row_ok, offs_d, d_ok, alpha,
    stride_qm, stride_qd, stride_dom, stride_dod, UPCAST: tl.constexpr,
):
    """Rows ``rows`` of one (batch, q head) after the dQ kernel: ``q``, ``do`` (``[BLOCK_M, BLOCK_D]``)
    and the per-row ``tau``, ``delta`` and weight factors ``cu``, ``cp`` from the saved ``NORM``."""
    q = _load_rows(Q_base, rows, offs_d, stride_qm, stride_qd, row_ok, d_ok, UPCAST)
    do = _load_rows(DO_base, rows, offs_d, stride_dom, stride_dod, row_ok, d_ok, UPCAST)
    stat_off = bh.to(tl.int64) * n_q + rows.to(tl.int64)
    tau = tl.load(TAU + stat_off, mask=row_ok, other=float("inf"))
    norm = tl.load(NORM + stat_off, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat_off, mask=row_ok, other=0.0)
    cu, cp = _row_factors(alpha, norm)
    return q, do, tau, delta, cu, cp


@triton.jit
def _row_sums(
    q, do, tau, valid, alpha, scale, K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
    bias_base, stride_bias_m, stride_bias_n, live_row, n_kt, k_start, Lk,
    rows, rows_loc, row_ok, causal_shift, offs_d, d_ok, seed, bh, n_cols_drop, p_drop,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Sweep 1 (alpha > 1): per-row ``L = sum r^beta``, ``sum r^(beta-1)`` and ``sum r^(beta-1) dP``,
    each ``[BLOCK_M]``; ``valid`` is 1 for rows with a key, else 0."""
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    su = tl.zeros([BLOCK_M], dtype=tl.float32)
    sud = tl.zeros([BLOCK_M], dtype=tl.float32)
    for kt in range(0, n_kt):
        if _is_live(live_row + kt // 32, kt % 32, HAS_LIVE) != 0:
            # cu = cp = 1 gives U = r^(beta-1), p = r^beta; the dS output (delta unknown yet) is unused
            p, u, dp, pd, ds, k, cols, col_ok = _key_tile(
                kt, q, do, tau, valid, valid, valid, alpha, scale, K_base, V_base, stride_kn, stride_kd, stride_vn,
                stride_vd, bias_base, stride_bias_m, stride_bias_n, k_start, Lk, rows, rows_loc, row_ok, causal_shift,
                offs_d, d_ok, seed, bh, n_cols_drop, p_drop, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                BLOCK_N,
            )
            l_sum += tl.sum(p, 1)
            su += tl.sum(u, 1)
            sud += tl.sum(u * dp, 1)
    return l_sum, su, sud


@triton.jit
def _entmax_attn_bwd_dq_kernel(
    Q, K, V, DO, OUT, TAU, LSUM, ALPHA, BIAS, LIVE, CU_Q, CU_K,
    DQ, DELTA, NORM, DALPHA, DBIAS, DBIAS_ROWS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, kv_group, n_q, n_k, scale, p_drop, seed,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, NEED_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr, NEED_DBIAS_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    hk = h // kv_group
    b, q_start, Lq, k_start, Lk = seq_bounds(CU_Q, CU_K, seq, n_q, n_k, IS_VARLEN)
    if pid_m * BLOCK_M >= Lq:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    bh = b * n_heads + h
    rows_loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = q_start + rows_loc
    row_ok = rows_loc < Lq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows64 = rows.to(tl.int64)

    q = _load_rows(Q + b64 * stride_qb + h64 * stride_qh, rows, offs_d, stride_qm, stride_qd, row_ok, d_ok, UPCAST)
    do = _load_rows(DO + b64 * stride_dob + h64 * stride_doh, rows, offs_d, stride_dom, stride_dod, row_ok, d_ok,
                    UPCAST)
    stat_off = bh.to(tl.int64) * n_q + rows64
    tau = tl.load(TAU + stat_off, mask=row_ok, other=float("inf"))
    lsum = tl.load(LSUM + stat_off, mask=row_ok, other=0.0)
    alpha = tl.load(ALPHA + h)

    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    bias_base = BIAS + b64 * stride_bias_b + h64 * stride_bias_h
    live_row = LIVE + seq.to(tl.int64) * stride_live_b + h64 * stride_live_h + pid_m.to(tl.int64) * stride_live_m
    causal_shift = Lk - Lq
    hi = Lk
    if IS_CAUSAL:
        hi = tl.minimum(Lk, (pid_m + 1) * BLOCK_M + causal_shift)
    n_kt = tl.cdiv(tl.maximum(hi, 0), BLOCK_N)
    n_cols_drop = n_k

    if alpha == 1.0:
        norm = lsum
        o = _load_rows(OUT + b64 * stride_ob + h64 * stride_oh, rows, offs_d, stride_om, stride_od, row_ok, d_ok, False)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    else:
        # the row's own normalizer makes the weights sum to 1 in this kernel's arithmetic
        norm, su, sud = _row_sums(
            q, do, tau, tl.where(lsum > 0.0, 1.0, 0.0), alpha, scale, K_base, V_base, stride_kn, stride_kd,
            stride_vn, stride_vd, bias_base, stride_bias_m, stride_bias_n, live_row, n_kt, k_start, Lk,
            rows, rows_loc, row_ok, causal_shift, offs_d, d_ok, seed, bh, n_cols_drop, p_drop,
            IS_CAUSAL, HAS_BIAS, HAS_LIVE, HAS_DROPOUT, UPCAST, DOT_PRECISION, BLOCK_M, BLOCK_N,
        )
        has_u = su > 0.0
        delta = tl.where(has_u, sud / tl.where(has_u, su, 1.0), 0.0)
    tl.store(DELTA + stat_off, delta, mask=row_ok)
    tl.store(NORM + stat_off, norm, mask=row_ok)
    cu, cp = _row_factors(alpha, norm)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    s_u = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pl = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_g = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_gd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pld = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    dbias_base = DBIAS + bh.to(tl.int64) * n_q * n_k
    for kt in range(0, n_kt):
        if _is_live(live_row + kt // 32, kt % 32, HAS_LIVE) != 0:
            p, u, dp, pd, ds, k, cols, col_ok = _key_tile(
                kt, q, do, tau, cu, cp, delta, alpha, scale, K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd,
                bias_base, stride_bias_m, stride_bias_n, k_start, Lk, rows, rows_loc, row_ok, causal_shift, offs_d,
                d_ok, seed, bh, n_cols_drop, p_drop, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION, BLOCK_N,
            )
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
            if NEED_DBIAS:
                tl.store(dbias_base + rows64[:, None] * n_k + cols[None, :].to(tl.int64), ds,
                         mask=row_ok[:, None] & col_ok[None, :])
            if NEED_DBIAS_ROWS:
                s_ds += tl.sum(ds, 1)
            if NEED_DALPHA:
                plogp, pg = _dalpha_terms(p, u, alpha)
                s_u += tl.sum(u, 1)
                s_pd += tl.sum(p * dp, 1)
                s_pl += tl.sum(plogp, 1)
                s_g += tl.sum(pg, 1)
                s_gd += tl.sum(pg * dp, 1)
                s_pld += tl.sum(plogp * dp, 1)
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows64[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NEED_DBIAS_ROWS:
        tl.store(DBIAS_ROWS + stat_off, s_ds, mask=row_ok)
    if NEED_DALPHA:
        # sum_j dP_j dp_j/dalpha written with the row sums (docs/backward.md): no 1/(alpha-1) blow-up
        has_u = s_u > 0.0
        s_u = tl.where(has_u, s_u, 1.0)
        dalpha = (s_g * s_pd - s_gd) / s_u + (alpha - 1.0) * (s_pl * s_gd - s_g * s_pld) / s_u
        tl.store(DALPHA + stat_off, tl.where(has_u, dalpha, 0.0), mask=row_ok)


@triton.jit
def _entmax_attn_bwd_dkdv_kernel(
    Q, K, V, DO, TAU, NORM, DELTA, ALPHA, BIAS, LIVE, CU_Q, CU_K,
    DK, DV, DBIAS_COLS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, n_kv_heads, kv_group, n_q, n_k, scale, p_drop, seed,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, NEED_DBIAS_COLS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.program_id(2)
    b, q_start, Lq, k_start, Lk = seq_bounds(CU_Q, CU_K, seq, n_q, n_k, IS_VARLEN)
    if pid_n * BLOCK_N >= Lk:
        return
    b64 = b.to(tl.int64)
    cols_loc = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = k_start + cols_loc
    col_ok = cols_loc < Lk
    cols64 = cols.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = col_ok[:, None] & d_ok[None, :]
    hk64 = hk.to(tl.int64)
    k = _load_rows(K + b64 * stride_kb + hk64 * stride_kh, cols, offs_d, stride_kn, stride_kd, col_ok, d_ok, UPCAST)
    v = _load_rows(V + b64 * stride_vb + hk64 * stride_vh, cols, offs_d, stride_vn, stride_vd, col_ok, d_ok, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    causal_shift = Lk - Lq
    mt_lo = 0
    if IS_CAUSAL:
        mt_lo = tl.maximum(pid_n * BLOCK_N - causal_shift, 0) // BLOCK_M
    n_mt = tl.cdiv(Lq, BLOCK_M)
    word = pid_n // 32
    bit = pid_n % 32
    for g in range(0, kv_group):
        h = hk * kv_group + g
        bh = b * n_heads + h
        alpha = tl.load(ALPHA + h)
        h64 = h.to(tl.int64)
        Q_base = Q + b64 * stride_qb + h64 * stride_qh
        DO_base = DO + b64 * stride_dob + h64 * stride_doh
        bias_base = BIAS + b64 * stride_bias_b + h64 * stride_bias_h
        live_head = LIVE + seq.to(tl.int64) * stride_live_b + h64 * stride_live_h + word
        col_ds = tl.zeros([BLOCK_N], dtype=tl.float32)
        for mt in range(mt_lo, n_mt):
            if _is_live(live_head + mt * stride_live_m, bit, HAS_LIVE) != 0:
                rows_loc = mt * BLOCK_M + tl.arange(0, BLOCK_M)
                rows = q_start + rows_loc
                row_ok = rows_loc < Lq
                q, do, tau, delta, cu, cp = _query_rows(
                    Q_base, DO_base, TAU, NORM, DELTA, bh, n_q, rows, row_ok, offs_d, d_ok, alpha,
                    stride_qm, stride_qd, stride_dom, stride_dod, UPCAST,
                )
                p, u, dp, pd, ds = _tile(
                    q, do, k, v, tau, cu, cp, delta, alpha, scale, bias_base, stride_bias_m, stride_bias_n,
                    rows, cols, rows_loc, cols_loc, row_ok, col_ok, causal_shift, seed, bh, n_k, p_drop,
                    IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION,
                )
                dv += tl.dot(tl.trans(pd).to(do.dtype), do, input_precision=DOT_PRECISION)
                dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
                if NEED_DBIAS_COLS:
                    col_ds += tl.sum(ds, 0)
        if NEED_DBIAS_COLS:
            tl.store(DBIAS_COLS + bh.to(tl.int64) * n_k + cols64, col_ds, mask=col_ok)
    dk_ptrs = DK + b64 * stride_dkb + hk64 * stride_dkh + cols64[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + b64 * stride_dvb + hk64 * stride_dvh + cols64[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _entmax_attn_bwd_dbias_kernel(
    Q, K, V, DO, TAU, NORM, DELTA, ALPHA, BIAS, LIVE, CU_Q, CU_K, DBIAS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_live_b, stride_live_h, stride_live_m,
    stride_db_b, stride_db_h,
    n_heads, kv_group, n_q, n_k, scale, p_drop, seed, n_b_loop, n_h_loop,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIVE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """d bias for a mask broadcast over batch and/or heads but not over queries or keys.

    One program per (query tile, mask head, mask batch entry or sequence) owns its ``(Nq, Nk)``
    block of ``DBIAS`` (zero-initialized) and adds ``dS`` of every (batch, head) the mask is
    broadcast over, in a fixed order: no atomics. With ``n_b_loop`` / ``n_h_loop`` > 1 the grid
    axis 2 / 1 has one program and ``b`` / ``h`` run over ``range(n_b_loop)`` / ``range(n_h_loop)``.
    """
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    db_base = DBIAS + pid_b.to(tl.int64) * stride_db_b + pid_h.to(tl.int64) * stride_db_h
    for bi in range(0, n_b_loop):
        seq = pid_b + bi
        b, q_start, Lq, k_start, Lk = seq_bounds(CU_Q, CU_K, seq, n_q, n_k, IS_VARLEN)
        b64 = b.to(tl.int64)
        rows_loc = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = q_start + rows_loc
        row_ok = rows_loc < Lq
        rows64 = rows.to(tl.int64)
        causal_shift = Lk - Lq
        k_hi = Lk
        if IS_CAUSAL:
            k_hi = tl.minimum(Lk, (pid_m + 1) * BLOCK_M + causal_shift)
        n_kt = tl.where(pid_m * BLOCK_M < Lq, tl.cdiv(tl.maximum(k_hi, 0), BLOCK_N), 0)
        for hj in range(0, n_h_loop):
            h = pid_h + hj
            h64 = h.to(tl.int64)
            hk = h // kv_group
            bh = b * n_heads + h
            alpha = tl.load(ALPHA + h)
            q, do, tau, delta, cu, cp = _query_rows(
                Q + b64 * stride_qb + h64 * stride_qh, DO + b64 * stride_dob + h64 * stride_doh, TAU, NORM, DELTA,
                bh, n_q, rows, row_ok, offs_d, d_ok, alpha, stride_qm, stride_qd, stride_dom, stride_dod, UPCAST,
            )
            K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
            V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
            bias_base = BIAS + b64 * stride_bias_b + h64 * stride_bias_h
            live_row = LIVE + seq.to(tl.int64) * stride_live_b + h64 * stride_live_h + pid_m.to(tl.int64) * stride_live_m
            for kt in range(0, n_kt):
                if _is_live(live_row + kt // 32, kt % 32, HAS_LIVE) != 0:
                    p, u, dp, pd, ds, k, cols, col_ok = _key_tile(
                        kt, q, do, tau, cu, cp, delta, alpha, scale, K_base, V_base, stride_kn, stride_kd, stride_vn,
                        stride_vd, bias_base, stride_bias_m, stride_bias_n, k_start, Lk, rows, rows_loc, row_ok,
                        causal_shift, offs_d, d_ok, seed, bh, n_k, p_drop, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, UPCAST,
                        DOT_PRECISION, BLOCK_N,
                    )
                    ptrs = db_base + rows64[:, None] * n_k + cols[None, :].to(tl.int64)
                    ok = row_ok[:, None] & col_ok[None, :]
                    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)


def _new_grad(like: torch.Tensor) -> torch.Tensor:
    """Allocate dq / dk / dv like ``like`` (the kernels overwrite every element; tests replace this to poison it)."""
    return torch.empty_like(like)


def _shape4(bias):
    """The mask's shape left-padded with ones to 4 dims."""
    return (1,) * (4 - bias.ndim) + tuple(bias.shape)


def _dbias_mode(bias, full):
    """How the bias gradient is accumulated without a ``(B, Hq, Nq, Nk)`` buffer unless the mask has that size.

    ``"rows"``: mask broadcast along keys, per-row sums of dS from the dQ kernel (``(B, Hq, Nq)``);
    ``"cols"``: broadcast along queries, per-key sums from the dK/dV kernel (``(B, Hq, Nk)``);
    ``"dense"``: a full ``(B, Hq, Nq, Nk)`` mask (or none), dS written by the dQ kernel;
    ``"blocks"``: broadcast over batch and/or heads only, the dbias kernel sums into the mask's shape.
    """
    if bias is None:
        return "dense"
    shape4 = _shape4(bias)
    if shape4[3] == 1:
        return "rows"
    if shape4[2] == 1:
        return "cols"
    if shape4[0] == full[0] and shape4[1] == full[1]:
        return "dense"
    return "blocks"


def _sum_to_mask(grad, bias):
    """Sum a 4-d gradient over the dims the mask broadcasts along; shaped like ``bias`` (or 4-d if None)."""
    if bias is None:
        return grad
    shape4 = _shape4(bias)
    dims = [d for d in range(4) if shape4[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(bias.shape)


def _check_tensor(name, t, ndim, dtypes):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def entmax_attn_bwd(
    do, q, k, v, out, tau, lsum, alpha, scale, bias=None, is_causal=False, cu_seqlens_q=None,
    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, seed=0,
    live=None, block_m=None, block_n=None, need_dalpha=False, need_dbias=False,
):
    """Gradients of alpha-entmax attention from the forward's per-row statistics.

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output, same dtype as ``q``; any strides.
        q: ``(B, Hq, Nq, D)`` queries, float16 / bfloat16 / float32; any strides.
        k, v: ``(B, Hk, Nk, D)`` keys and values, dtype of ``q``; ``Hq % Hk == 0`` (GQA/MQA).
        out: ``(B, Hq, Nq, D)`` forward output (used for ``delta = dO . O`` on alpha = 1 heads).
        tau, lsum: float32 ``(B, Hq, Nq)`` forward statistics (``docs/design.md``): for
            alpha > 1, ``p = [(alpha-1) s - tau]_+^(1/(alpha-1)) / lsum``; for alpha = 1,
            ``p = exp(s - tau)``. ``lsum == 0`` marks a row with no valid key (zero gradients).
            For alpha > 1 the kernel renormalizes with its own ``sum_j r^beta`` (docs/backward.md),
            so ``lsum`` is only read as that flag.
        alpha: float32 ``(Hq,)`` per-head alpha in ``[1, 2]`` (a Python float is broadcast); the range is
            checked here for CPU tensors only (no device sync), the public API checks it first.
        scale: float, scores are ``scale * q . k + bias``.
        bias: optional float tensor broadcastable (zero strides allowed) to ``(B, Hq, Nq, Nk)``;
            ``-inf`` marks masked pairs. Default None.
        is_causal: bottom-right aligned causal mask. Default False.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` for variable length (then ``B == 1``
            and ``Nq``/``Nk`` are the packed totals). Default None.
        max_seqlen_q, max_seqlen_k: longest sequences (computed from ``cu_seqlens`` when None).
        dropout_p, seed: dropout of the forward, replayed with ``kernels._common.dropout_keep``.
        live: optional int32 ``(B or nseq, Hq, cdiv(max_seqlen_q, block_m), words)`` tile
            liveness bits of the forward; dead tiles are skipped. Requires ``block_m``/``block_n``.
        block_m, block_n: tile sizes (powers of two >= 16); default 64.
        need_dalpha: also return the alpha gradient. Default False.
        need_dbias: also return the bias gradient. Default False.

    Returns:
        ``(dq, dk, dv, dalpha, dbias)``: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``
        (summed over the q heads of each kv group), ``dalpha`` float32 ``(Hq,)`` summed over
        batch and rows or None, ``dbias`` float32 in the shape of ``bias`` (``dS`` summed over the
        dims ``bias`` broadcasts along; ``(B, Hq, Nq, Nk)`` when ``bias`` is None) or None. Extra
        memory for it is O(B Hq (Nq + Nk)) plus the mask's own size: key- or query-broadcast masks
        use per-row / per-key sums from the two kernels, masks broadcast only over batch/heads
        ``_entmax_attn_bwd_dbias_kernel``.

    Raises:
        ValueError: more than 65535 heads or batch entries (sequences): the launch grids are
        ``(tiles, heads, batch or sequences)`` and CUDA caps grid axes 1 and 2 at 65535.
    """
    float_types = (torch.float16, torch.bfloat16, torch.float32)
    _check_tensor("q", q, 4, float_types)
    for name, t in (("k", k), ("v", v), ("do", do), ("out", out)):
        _check_tensor(name, t, 4, (q.dtype,))
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {t.device}")
    B, Hq, Nq, D = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or v.shape != k.shape:
        raise ValueError(f"k, v: expected shape ({B}, Hk, Nk, {D}) each, got {tuple(k.shape)} and {tuple(v.shape)}")
    if do.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"do, out: expected shape {tuple(q.shape)}, got {tuple(do.shape)} and {tuple(out.shape)}")
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"k: number of kv heads must divide the {Hq} query heads, got {Hk}")
    for name, t in (("tau", tau), ("lsum", lsum)):
        _check_tensor(name, t, 3, (torch.float32,))
        if tuple(t.shape) != (B, Hq, Nq):
            raise ValueError(f"{name}: expected shape {(B, Hq, Nq)}, got {tuple(t.shape)}")
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.full((Hq,), float(alpha), dtype=torch.float32, device=q.device)
    if alpha.shape != (Hq,):
        raise ValueError(f"alpha: expected shape ({Hq},), got {tuple(alpha.shape)}")
    if alpha.device.type == "cpu" and not bool(((alpha >= 1.0) & (alpha <= 2.0)).all()):
        raise ValueError(f"alpha: expected values in [1, 2], got {alpha.tolist()}")
    alpha = alpha.detach().to(device=q.device, dtype=torch.float32).contiguous()
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p}")
    if not 16 <= D <= 256:
        raise ValueError(f"q: expected head dim in [16, 256], got {D}")

    if B * Hq * Nq == 0 or Nk == 0:
        dalpha = torch.zeros(Hq, dtype=torch.float32, device=q.device) if need_dalpha else None
        dbias_shape = (B, Hq, Nq, Nk) if bias is None else bias.shape
        dbias = torch.zeros(dbias_shape, dtype=torch.float32, device=q.device) if need_dbias else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dalpha, dbias

    is_varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if is_varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q, cu_seqlens_k: expected both or neither, got only one")
        if B != 1:
            raise ValueError(f"q: expected batch 1 with cu_seqlens (packed varlen), got {B}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.ndim != 1:
            raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected equal 1-d shapes, got {tuple(cu_seqlens_q.shape)} "
                             f"and {tuple(cu_seqlens_k.shape)}")
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
        cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
        n_seq = cu_q.shape[0] - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max())
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max())
    else:
        cu_q = cu_k = torch.empty(1, dtype=torch.int32, device=q.device)
        n_seq = B
        max_seqlen_q, max_seqlen_k = Nq, Nk

    if live is not None and (block_m is None or block_n is None):
        raise ValueError("block_m, block_n: required with live (the forward's tile sizes), got None")
    block_m = _DEFAULT_BLOCK if block_m is None else int(block_m)
    block_n = _DEFAULT_BLOCK if block_n is None else int(block_n)
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {val}")
    n_qt = triton.cdiv(max(max_seqlen_q, 1), block_m)
    if Hq > MAX_GRID_YZ or n_seq > MAX_GRID_YZ:
        raise ValueError(f"q: expected at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries (sequences), "
                         f"got {Hq} heads and {n_seq}")
    n_words = triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), block_n), 32)
    if live is not None:
        _check_tensor("live", live, 4, (torch.int32,))
        if tuple(live.shape) != (n_seq, Hq, n_qt, n_words):
            raise ValueError(f"live: expected shape {(n_seq, Hq, n_qt, n_words)}, got {tuple(live.shape)}")
        live_t = live.contiguous()
    else:
        live_t = torch.empty(1, dtype=torch.int32, device=q.device)

    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias: expected a float tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
        try:
            bias_t = bias.expand(B, Hq, Nq, Nk)
        except RuntimeError:
            raise ValueError(
                f"bias: expected a shape broadcastable to {(B, Hq, Nq, Nk)}, got {tuple(bias.shape)}"
            ) from None
        bias_strides = bias_t.stride()
    else:
        bias_t = q
        bias_strides = (0, 0, 0, 0)

    tau = tau.contiguous()
    lsum = lsum.contiguous()
    upcast = interpreting() or q.dtype == torch.float32
    precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(D))
    num_warps = 4 if block_d <= 64 else 8

    dq, dk, dv = _new_grad(q), _new_grad(k), _new_grad(v)
    if is_varlen:
        for g in (dq, dk, dv):
            g.zero_()
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    norm = torch.empty_like(delta)
    dalpha_rows = torch.zeros((B, Hq, Nq), dtype=torch.float32, device=q.device) if need_dalpha else delta
    dbias_mode = _dbias_mode(bias, (B, Hq, Nq, Nk)) if need_dbias else None
    zeros32 = dict(dtype=torch.float32, device=q.device)
    dbias = torch.zeros((B, Hq, Nq, Nk), **zeros32) if dbias_mode == "dense" else delta
    dbias_rows = torch.zeros((B, Hq, Nq), **zeros32) if dbias_mode == "rows" else delta
    dbias_cols = torch.zeros((B, Hq, Nk), **zeros32) if dbias_mode == "cols" else delta
    common = dict(
        IS_CAUSAL=bool(is_causal), IS_VARLEN=is_varlen, HAS_BIAS=bias is not None, HAS_LIVE=live is not None,
        HAS_DROPOUT=float(dropout_p) > 0.0, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, DOT_PRECISION=precision, num_warps=num_warps, num_stages=1,
    )
    live_strides = live_t.stride()[:3] if live is not None else (0, 0, 0)
    seed = int(seed) & 0x7FFFFFFF
    _entmax_attn_bwd_dq_kernel[(n_qt, Hq, n_seq)](
        q, k, v, do, out, tau, lsum, alpha, bias_t, live_t, cu_q, cu_k,
        dq, delta, norm, dalpha_rows, dbias, dbias_rows,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *out.stride(), *dq.stride(),
        *bias_strides, *live_strides,
        Hq, Hq // Hk, Nq, Nk, float(scale), float(dropout_p), seed,
        NEED_DALPHA=bool(need_dalpha), NEED_DBIAS=dbias_mode == "dense", NEED_DBIAS_ROWS=dbias_mode == "rows",
        **common,
    )
    n_kt = triton.cdiv(max(max_seqlen_k, 1), block_n)
    _entmax_attn_bwd_dkdv_kernel[(n_kt, Hk, n_seq)](
        q, k, v, do, tau, norm, delta, alpha, bias_t, live_t, cu_q, cu_k,
        dk, dv, dbias_cols,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *bias_strides, *live_strides,
        Hq, Hk, Hq // Hk, Nq, Nk, float(scale), float(dropout_p), seed,
        NEED_DBIAS_COLS=dbias_mode == "cols", **common,
    )
    if dbias_mode == "blocks":
        shape4 = _shape4(bias)
        dbias = torch.zeros(shape4, **zeros32)
        full_b, full_h = shape4[0] != 1 or is_varlen, shape4[1] != 1
        _entmax_attn_bwd_dbias_kernel[(n_qt, Hq if full_h else 1, n_seq if full_b else 1)](
            q, k, v, do, tau, norm, delta, alpha, bias_t, live_t, cu_q, cu_k, dbias,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *bias_strides, *live_strides,
            0 if is_varlen else dbias.stride(0), dbias.stride(1),
            Hq, Hq // Hk, Nq, Nk, float(scale), float(dropout_p), seed, 1 if full_b else n_seq, 1 if full_h else Hq,
            **common,
        )
    dalpha = dalpha_rows.double().sum(dim=(0, 2)).float() if need_dalpha else None
    if dbias_mode is None:
        dbias = None
    else:
        dbias = {"rows": dbias_rows[..., None], "cols": dbias_cols[:, :, None]}.get(dbias_mode, dbias)
        dbias = _sum_to_mask(dbias, bias)
    return dq, dk, dv, dalpha, dbias
