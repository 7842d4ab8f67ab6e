"""The fused backward's three kernels (launched by ``kernels/attn/entmax_attn_bwd.py``, whose docstring describes
them): dQ (``_entmax_attn_bwd_dq_kernel``), dK/dV (``_entmax_attn_bwd_dkdv_kernel``) and d bias for a mask broadcast
over batch or heads (``_entmax_attn_bwd_dbias_kernel``). Their tile-level work is in ``_bwd_tiles.py``; derivations in
docs/backward.md.
"""

import triton
import triton.language as tl

from .._common import _wide, alpha_class_id, load_rows, rows_source, slice_base, store_rows
from .._masking import (
    key_tile_range,
    live_tile,
    program_mods,
    query_tile_range,
    seq_bounds,
    sink_tile,
    tile_indices,
    tile_inside,
)
from ._bwd_tiles import (
    _dalpha_rows,
    _dalpha_terms,
    _head_dims,
    _in_launch,
    _key_tile,
    _live_base,
    _live_bits,
    _products_by_keys,
    _products_by_rows,
    _query_rows,
    _row_factors,
    _row_tau,
    _tile,
    _tile_rows,
    _weights,
)

# the liveness map's strides change with the sequence length: not specialized, one build serves every length
_LIVE_STRIDES = ["stride_live_b", "stride_live_h", "stride_live_m"]


@triton.jit(do_not_specialize=_LIVE_STRIDES)
def _entmax_attn_bwd_dq_kernel(
    Q, K, V, DO, OUT_U, TAU, LSUM, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS,
    DQ, DELTA, ROW_FACTORS, DALPHA, DBIAS, DBIAS_ROWS, DSINKS, ROW_SUMS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_oub, stride_ouh, stride_oum, stride_oud, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr, PHASE: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    LIVE_BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    NEED_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr, NEED_DBIAS_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One program per (query tile ``pid_m``, q head ``h``, batch entry or sequence ``seq``): delta, dQ, d alpha and,
    with sinks (``SCORE.has_sinks``), each row's sink gradient ``-U_sink delta`` into ``DSINKS`` (float32
    ``(B, Hq, Nq)``). The sink is a virtual key with ``dP = 0`` (``_masking.sink_tile``): its weights join the d alpha
    row sums.

    ``PHASE`` 0: all of it (the deterministic backward). Without determinism the dK/dV kernel computes dQ and the row
    sums, and this kernel runs twice without its sweep over the keys: ``PHASE`` 1 before it (delta, the sinks'
    gradient), ``PHASE`` 2 after it (d alpha from the six row sums ``ROW_SUMS``, float32 ``(B, Hq, Nq, 6)``, that the
    dK/dV kernel added up).

    With ``HEAD_FILTER`` (one launch per alpha class) a program whose head is of another class returns at once.
    """
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    alpha = tl.load(ALPHA + h)
    if HEAD_FILTER:
        if alpha_class_id(alpha) != ALPHA_CLASS:
            return
    h_kv = h // kv_group
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    if pid_m * BLOCK_M >= seqlen_q:
        return
    bh = b * n_heads + h
    rows, rows_global, row_ok, dims, q, do = _tile_rows(
        Q, DO, b, h, q_start, seqlen_q, pid_m, (stride_qb, stride_qh, stride_qm, stride_qd),
        (stride_dob, stride_doh, stride_dom, stride_dod), HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M, UPCAST)
    offs_d, d_ok, offs_dv, dv_ok = dims
    stat_offs = bh.to(tl.int64) * total_q + rows_global.to(tl.int64)
    tau = _row_tau(TAU, stat_offs, row_ok)
    lsum = tl.load(LSUM + stat_offs, mask=row_ok, other=0.0)

    if PHASE == 2:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)  # not read: d alpha needs the row sums only
    else:
        # delta = dO . (sum_j U v_j / sum_j U): out_u from the forward's value pass (the output at alpha = 1)
        o_u = load_rows(slice_base(OUT_U, b, h, q_start, stride_oub, stride_ouh, stride_oum), rows, offs_dv,
                        stride_oum, stride_oud, row_ok, dv_ok, False)
        delta = tl.sum(do.to(tl.float32) * o_u.to(tl.float32), 1)
        tl.store(DELTA + stat_offs, delta, mask=row_ok)
    cu, cp, log_l = _row_factors(alpha, lsum)
    if PHASE != 2:
        # for the dK/dV and d bias kernels, which would otherwise recompute them on every tile they visit
        factors = ROW_FACTORS + stat_offs * 3
        tl.store(factors, cu, mask=row_ok)
        tl.store(factors + 1, cp, mask=row_ok)
        tl.store(factors + 2, log_l, mask=row_ok)
    inv_eps2 = 1.0 / tl.maximum((alpha - 1.0) * (alpha - 1.0), 1e-30)

    s_u = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pl = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_g = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_gd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pld = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
    if SCORE.has_sinks:
        p_s, u_s, logp_s = _weights(sink_tile(mods.sink, BLOCK_M, BLOCK_N), tau, cu, cp, log_l, alpha, ALPHA_CLASS)
        if PHASE != 2:
            tl.store(DSINKS + stat_offs, -tl.sum(u_s, 1) * delta, mask=row_ok)
        if NEED_DALPHA:
            plogp_s, pg_s = _dalpha_terms(p_s, u_s, logp_s, alpha, inv_eps2)
            s_u += tl.sum(u_s, 1)
            s_pl += tl.sum(plogp_s, 1)
            s_g += tl.sum(pg_s, 1)
    if PHASE == 0:
        qrow = (q, do, tau, cu, cp, log_l, delta)
        kv = (rows_source(K, b, h_kv, k_start, seqlen_k, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D,
                          USE_TMA),
              rows_source(V, b, h_kv, k_start, seqlen_k, stride_vb, stride_vh, stride_vn, HEAD_DIM_V, BLOCK_N,
                          BLOCK_DV, USE_TMA), stride_kn, stride_kd, stride_vn, stride_vd)
        drop = (seed, bh, total_k, dropout_p)
        live_base = _live_base(LIVE, seq, h, stride_live_b, stride_live_h)
        kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dbias_base = DBIAS + bh.to(tl.int64) * total_q * total_k
        for wd in range(kt_lo // 32, tl.cdiv(kt_hi, 32)):
            kts = wd * 32 + tl.arange(0, 32)
            bits, rank, n_set = _live_bits(live_base, pid_m, kts, (kts >= kt_lo) & (kts < kt_hi), seqlen_q,
                                           stride_live_m, HAS_LIVE, BLOCK_M, BLOCK_N, LIVE_BLOCK_M, LIVE_BLOCK_N)
            for i in range(0, n_set):
                kt = live_tile(bits, rank, i, wd)
                cols, cols_global, col_ok, k, v = _key_tile(kt, kv, k_start, seqlen_k, dims, UPCAST, BLOCK_N)
                s, dp = _products_by_rows(q, do, k, v, scale, DOT_PRECISION)
                inside = tile_inside(pid_m * BLOCK_M, kt * BLOCK_N, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
                p, u, logp, dp, _, ds, ds_qk = _tile(
                    qrow, s, dp, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), inside, alpha, mods,
                    drop, MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT)
                dq += tl.dot(ds_qk.to(k.dtype), k, input_precision=DOT_PRECISION)
                if NEED_DBIAS:
                    tl.store(dbias_base + rows_global.to(tl.int64)[:, None] * total_k
                             + cols_global.to(tl.int64)[None, :], ds, mask=row_ok[:, None] & col_ok[None, :])
                if NEED_DBIAS_ROWS:
                    s_ds += tl.sum(ds, 1)
                if NEED_DALPHA:
                    plogp, pg = _dalpha_terms(p, u, logp, alpha, inv_eps2)
                    s_u += tl.sum(u, 1)
                    s_pd += tl.sum(p * dp, 1)
                    s_pl += tl.sum(plogp, 1)
                    s_g += tl.sum(pg, 1)
                    s_gd += tl.sum(pg * dp, 1)
                    s_pld += tl.sum(plogp * dp, 1)
        store_rows(slice_base(DQ, b, h, q_start, stride_dqb, stride_dqh, stride_dqm), rows, offs_d, stride_dqm,
                   stride_dqd, dq * scale, row_ok, d_ok)
        if NEED_DBIAS_ROWS:
            tl.store(DBIAS_ROWS + stat_offs, s_ds, mask=row_ok)
    if PHASE == 2:
        sums = ROW_SUMS + stat_offs * 6
        s_u += tl.load(sums, mask=row_ok, other=0.0)
        s_pd += tl.load(sums + 1, mask=row_ok, other=0.0)
        s_pl += tl.load(sums + 2, mask=row_ok, other=0.0)
        s_g += tl.load(sums + 3, mask=row_ok, other=0.0)
        s_gd += tl.load(sums + 4, mask=row_ok, other=0.0)
        s_pld += tl.load(sums + 5, mask=row_ok, other=0.0)
    if NEED_DALPHA and PHASE != 1:
        tl.store(DALPHA + stat_offs, _dalpha_rows(s_u, s_pd, s_pl, s_g, s_gd, s_pld, alpha), mask=row_ok)


@triton.jit(do_not_specialize=_LIVE_STRIDES)
def _entmax_attn_bwd_dkdv_kernel(
    Q, K, V, DO, TAU, ROW_FACTORS, DELTA, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS,
    DK, DV, DBIAS_COLS, DQ, ROW_SUMS, DBIAS, DBIAS_ROWS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    LIVE_BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    NEED_DBIAS_COLS: tl.constexpr, NEED_DQ: tl.constexpr, NEED_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr,
    NEED_DBIAS_ROWS: tl.constexpr, KEYS_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One program per (key tile ``pid_n``, kv head ``h_kv``, batch entry or sequence ``seq``): dK, dV, d bias cols.
    With ``KEYS_M`` the two recomputed products are taken with the keys as the MMA's M (``_products_by_keys``), else
    with the query rows (``_products_by_rows``: head dims above 128, where the float32 dK, dV of 64 keys do not fit a
    warpgroup's registers).

    With ``HEAD_FILTER`` (one launch per alpha class) only the group's heads of this class are summed, and added to
    what the launches before wrote (the launcher zeroes ``DK``, ``DV``, float32 partials for GQA in fp16/bf16); a
    program with none of them writes nothing.

    Without determinism (``NEED_DQ``) the program also adds ``scale dS K`` of each of its tiles into the float32 dQ
    buffer ``DQ`` with atomics (five products per tile instead of the two kernels' seven), and what the dQ kernel's
    sweep would give: the six d alpha row sums into ``ROW_SUMS`` (``NEED_DALPHA``, atomics), the dS tiles into the
    dense ``DBIAS`` (``NEED_DBIAS``, each written once) and dS row sums into ``DBIAS_ROWS`` (``NEED_DBIAS_ROWS``,
    atomics).
    """
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1)
    seq = tl.program_id(2)
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    if pid_n * BLOCK_N >= seqlen_k:
        return
    cols, cols_global, col_ok, dims, k, v = _tile_rows(
        K, V, b, h_kv, k_start, seqlen_k, pid_n, (stride_kb, stride_kh, stride_kn, stride_kd),
        (stride_vb, stride_vh, stride_vn, stride_vd), HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, UPCAST)
    offs_d, d_ok, offs_dv, dv_ok = dims
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qt_lo, qt_hi = query_tile_range(pid_n, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
    n_done = tl.zeros([], dtype=tl.int32)
    for g in range(0, kv_group):
        h = h_kv * kv_group + g
        alpha = tl.load(ALPHA + h)
        if _in_launch(alpha, ALPHA_CLASS, HEAD_FILTER):
            bh = b * n_heads + h
            qdo = (rows_source(Q, b, h, q_start, seqlen_q, stride_qb, stride_qh, stride_qm, HEAD_DIM, BLOCK_M,
                               BLOCK_D, USE_TMA),
                   rows_source(DO, b, h, q_start, seqlen_q, stride_dob, stride_doh, stride_dom, HEAD_DIM_V, BLOCK_M,
                               BLOCK_DV, USE_TMA), stride_qm, stride_qd, stride_dom, stride_dod)
            mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
            drop = (seed, bh, total_k, dropout_p)
            live_base = _live_base(LIVE, seq, h, stride_live_b, stride_live_h)
            inv_eps2 = 1.0 / tl.maximum((alpha - 1.0) * (alpha - 1.0), 1e-30)
            dq_base = slice_base(DQ, b, h, q_start, stride_dqb, stride_dqh, stride_dqm)
            dbias_base = DBIAS + bh.to(tl.int64) * total_q * total_k
            col_ds = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c in range(qt_lo // 32, tl.cdiv(qt_hi, 32)):
                qts = c * 32 + tl.arange(0, 32)
                bits, rank, n_set = _live_bits(live_base, qts, pid_n, (qts >= qt_lo) & (qts < qt_hi), seqlen_q,
                                               stride_live_m, HAS_LIVE, BLOCK_M, BLOCK_N, LIVE_BLOCK_M, LIVE_BLOCK_N)
                for i in range(0, n_set):
                    qt = live_tile(bits, rank, i, c)
                    rows, rows_global, row_ok = tile_indices(qt, q_start, seqlen_q, BLOCK_M)
                    qrow = _query_rows(qdo, (TAU, ROW_FACTORS, DELTA), bh, total_q, qt * BLOCK_M, rows, rows_global,
                                       row_ok, dims, UPCAST)
                    q, do = qrow[0], qrow[1]
                    if KEYS_M:
                        s, dp = _products_by_keys(q, do, k, v, scale, DOT_PRECISION)
                    else:
                        s, dp = _products_by_rows(q, do, k, v, scale, DOT_PRECISION)
                    inside = tile_inside(qt * BLOCK_M, pid_n * BLOCK_N, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
                    p, u, logp, dp, pd, ds, ds_qk = _tile(
                        qrow, s, dp, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), inside, alpha, mods,
                        drop, MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT)
                    dv += tl.dot(tl.trans(pd).to(do.dtype), do, input_precision=DOT_PRECISION)
                    dk += tl.dot(tl.trans(ds_qk).to(q.dtype), q, input_precision=DOT_PRECISION)
                    if NEED_DQ:
                        # dQ^T = K^T dS^T: the head dim is the M of the product (a warpgroup's 64 rows whatever the
                        # query step), dS^T the operand the dK product used
                        dq_t = tl.dot(tl.trans(k), tl.trans(ds_qk).to(k.dtype), input_precision=DOT_PRECISION)
                        tl.atomic_add(dq_base + _wide(rows)[None, :] * stride_dqm + offs_d[:, None] * stride_dqd,
                                      dq_t * scale, mask=row_ok[None, :] & d_ok[:, None], sem="relaxed")
                    if NEED_DBIAS_COLS:
                        col_ds += tl.sum(ds, 0)
                    if NEED_DBIAS:
                        tl.store(dbias_base + rows_global.to(tl.int64)[:, None] * total_k
                                 + cols_global.to(tl.int64)[None, :], ds, mask=row_ok[:, None] & col_ok[None, :])
                    stat_offs = bh.to(tl.int64) * total_q + rows_global.to(tl.int64)
                    if NEED_DBIAS_ROWS:
                        tl.atomic_add(DBIAS_ROWS + stat_offs, tl.sum(ds, 1), mask=row_ok, sem="relaxed")
                    if NEED_DALPHA:
                        plogp, pg = _dalpha_terms(p, u, logp, alpha, inv_eps2)
                        sums = ROW_SUMS + stat_offs * 6
                        tl.atomic_add(sums, tl.sum(u, 1), mask=row_ok, sem="relaxed")
                        tl.atomic_add(sums + 1, tl.sum(p * dp, 1), mask=row_ok, sem="relaxed")
                        tl.atomic_add(sums + 2, tl.sum(plogp, 1), mask=row_ok, sem="relaxed")
                        tl.atomic_add(sums + 3, tl.sum(pg, 1), mask=row_ok, sem="relaxed")
                        tl.atomic_add(sums + 4, tl.sum(pg * dp, 1), mask=row_ok, sem="relaxed")
                        tl.atomic_add(sums + 5, tl.sum(plogp * dp, 1), mask=row_ok, sem="relaxed")
            if NEED_DBIAS_COLS:
                tl.store(DBIAS_COLS + bh.to(tl.int64) * total_k + cols_global.to(tl.int64), col_ds, mask=col_ok)
            n_done += 1
    dk = dk * scale
    dk_base = slice_base(DK, b, h_kv, k_start, stride_dkb, stride_dkh, stride_dkn)
    dv_base = slice_base(DV, b, h_kv, k_start, stride_dvb, stride_dvh, stride_dvn)
    write = col_ok
    if HEAD_FILTER:
        write = col_ok & (tl.zeros([BLOCK_N], tl.int32) + n_done > 0)  # a [BLOCK_N] mask: the interpreter needs one
        dk += load_rows(dk_base, cols, offs_d, stride_dkn, stride_dkd, write, d_ok, False).to(tl.float32)
        dv += load_rows(dv_base, cols, offs_dv, stride_dvn, stride_dvd, write, dv_ok, False).to(tl.float32)
    store_rows(dk_base, cols, offs_d, stride_dkn, stride_dkd, dk, write, d_ok)
    store_rows(dv_base, cols, offs_dv, stride_dvn, stride_dvd, dv, write, dv_ok)


@triton.jit(do_not_specialize=_LIVE_STRIDES)
def _entmax_attn_bwd_dbias_kernel(
    Q, K, V, DO, TAU, ROW_FACTORS, DELTA, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS, DBIAS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_live_b, stride_live_h, stride_live_m,
    stride_dbias_b, stride_dbias_h,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE, n_b_loop, n_h_loop,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    LIVE_BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """d bias for a mask broadcast over batch and/or heads but not over queries or keys.

    One program per (query tile, mask head, mask batch entry or sequence) owns its ``(Nq, Nk)``
    block of ``DBIAS`` (zero-initialized) and adds ``dS`` of every (batch, head) the mask is
    broadcast over, in a fixed order: no atomics. With ``n_b_loop`` / ``n_h_loop`` > 1 the grid
    axis 2 / 1 has one program and ``b`` / ``h`` run over ``range(n_b_loop)`` / ``range(n_h_loop)``. With
    ``HEAD_FILTER`` (one launch per alpha class) the heads of other classes are skipped.
    """
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    dims = _head_dims(HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV)
    dbias_base = DBIAS + pid_b.to(tl.int64) * stride_dbias_b + pid_h.to(tl.int64) * stride_dbias_h
    for bi in range(0, n_b_loop):
        seq = pid_b + bi
        b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k,
                                                             IS_VARLEN)
        rows, rows_global, row_ok = tile_indices(pid_m, q_start, seqlen_q, BLOCK_M)
        kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
        for hj in range(0, n_h_loop):
            h = pid_h + hj
            h_kv = h // kv_group
            bh = b * n_heads + h
            alpha = tl.load(ALPHA + h)
            qdo = (slice_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm), slice_base(DO, b, h, q_start,
                   stride_dob, stride_doh, stride_dom), stride_qm, stride_qd, stride_dom, stride_dod)
            qrow = _query_rows(qdo, (TAU, ROW_FACTORS, DELTA), bh, total_q, pid_m * BLOCK_M, rows, rows_global,
                               row_ok, dims, UPCAST)
            kv = (rows_source(K, b, h_kv, k_start, seqlen_k, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_N,
                              BLOCK_D, USE_TMA),
                  rows_source(V, b, h_kv, k_start, seqlen_k, stride_vb, stride_vh, stride_vn, HEAD_DIM_V, BLOCK_N,
                              BLOCK_DV, USE_TMA), stride_kn, stride_kd, stride_vn, stride_vd)
            mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
            drop = (seed, bh, total_k, dropout_p)
            live_base = _live_base(LIVE, seq, h, stride_live_b, stride_live_h)
            kt_end = tl.where(_in_launch(alpha, ALPHA_CLASS, HEAD_FILTER), kt_hi, kt_lo)  # no tiles: another launch's
            for wd in range(kt_lo // 32, tl.cdiv(kt_end, 32)):
                kts = wd * 32 + tl.arange(0, 32)
                bits, rank, n_set = _live_bits(live_base, pid_m, kts, (kts >= kt_lo) & (kts < kt_end), seqlen_q,
                                               stride_live_m, HAS_LIVE, BLOCK_M, BLOCK_N, LIVE_BLOCK_M, LIVE_BLOCK_N)
                for i in range(0, n_set):
                    kt = live_tile(bits, rank, i, wd)
                    cols, cols_global, col_ok, k, v = _key_tile(kt, kv, k_start, seqlen_k, dims, UPCAST, BLOCK_N)
                    s, dp = _products_by_rows(qrow[0], qrow[1], k, v, scale, DOT_PRECISION)
                    inside = tile_inside(pid_m * BLOCK_M, kt * BLOCK_N, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
                    _, _, _, _, _, ds, _ = _tile(
                        qrow, s, dp, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), inside, alpha, mods,
                        drop, MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT)
                    ptrs = dbias_base + rows_global.to(tl.int64)[:, None] * total_k + cols_global.to(tl.int64)[None, :]
                    ok = row_ok[:, None] & col_ok[None, :]
                    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)
