"""Fused backward of alpha-entmax attention: dQ, dK, dV, d alpha per head and d bias.

Layout ``(batch, heads, seq, head_dim)``. The weights are recomputed tile by tile from the
forward's per-row statistics (``tau`` in the z-scale, ``lsum``); see ``docs/design.md`` for the
conventions and ``docs/backward.md`` for the derivation. With ``U = p^(2-alpha)`` on the support:

    dP = dO V^T (times the replayed dropout factor)   delta_i = sum_j U_ij dP_ij / sum_j U_ij = dO_i . out_u_i
    dS = U (dP - delta)    dQ = scale dS K    dK = scale dS^T Q    dV = P^T dO    d bias = dS

``out_u = sum_j U_ij v_j / sum_j U_ij`` (float32) comes from the forward's value pass (``need_out_u``; the
unrounded output at alpha = 1), so ``delta`` is an O(N D) product per row and no kernel sweeps K only for it.
Three kernels, no atomics, so every gradient is bitwise reproducible:

* ``_entmax_attn_bwd_dq_kernel``, one program per (query tile, q head, batch): ``delta``, then one sweep over
  the live key tiles accumulating dQ and the d alpha row sums and writing dS (or its row sums) when asked.
* ``_entmax_attn_bwd_dkdv_kernel``, one program per (key tile, kv head, batch): loops over the q
  heads of its group and their live query tiles, so dK/dV of GQA are summed in a fixed order.
* ``_entmax_attn_bwd_dbias_kernel`` (only for a mask broadcast over batch/heads but not over
  queries or keys): one program per mask block sums dS over the broadcast (batch, head) pairs.

Every loop walks a compacted list of its live tiles built from the liveness bits in registers
(``_masking.bit_rank``, ``live_tile``), with no branch per tile, so its loads are pipelined. The alpha
class is a compile-time constant as in the forward (``_common.ALPHA_CLASSES``; device alpha: one filtered
launch per class): alpha = 1 uses ``exp2``, alpha = 1.5 and alpha = 2 use no transcendental function per
score, other values one ``log2``, one ``exp2`` and one division.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import triton
import triton.language as tl

from .. import _common, _masking
from .._common import (
    alpha_class_id,
    load_rows,
    slice_base,
    store_rows,
)
from .._masking import (
    key_tile_range,
    live_tile,
    program_mods,
    query_tile_range,
    seq_bounds,
    sink_tile,
    tile_indices,
)
from ._bwd_tiles import (
    _column_tile_bits,
    _dalpha_terms,
    _head_dims,
    _in_launch,
    _key_tile,
    _live_base,
    _query_rows,
    _row_factors,
    _row_tau,
    _row_tile_bits,
    _tile,
    _tile_rows,
    _weights,
)

_DEFAULT_BLOCK = 64
# the liveness map's strides change with the sequence length: not specialized, one build serves every length
_LIVE_STRIDES = ["stride_live_b", "stride_live_h", "stride_live_m"]


@triton.jit(do_not_specialize=_LIVE_STRIDES)
def _entmax_attn_bwd_dq_kernel(
    Q, K, V, DO, OUT_U, TAU, LSUM, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS,
    DQ, DELTA, DALPHA, DBIAS, DBIAS_ROWS, DSINKS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_oub, stride_ouh, stride_oum, stride_oud, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    NEED_DALPHA: tl.constexpr, NEED_DBIAS: tl.constexpr, NEED_DBIAS_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (query tile ``pid_m``, q head ``h``, batch entry or sequence ``seq``): delta, dQ, d alpha and,
    with sinks (``SCORE[3]``), each row's sink gradient ``-U_sink delta`` into ``DSINKS`` (float32 ``(B, Hq, Nq)``).
    The sink is a virtual key with ``dP = 0`` (``_masking.sink_tile``): its weights join the d alpha row sums.

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

    # delta = dO . (sum_j U v_j / sum_j U): out_u from the forward's value pass (the output at alpha = 1)
    o_u = load_rows(slice_base(OUT_U, b, h, q_start, stride_oub, stride_ouh, stride_oum), rows, offs_dv, stride_oum,
                    stride_oud, row_ok, dv_ok, False)
    delta = tl.sum(do.to(tl.float32) * o_u.to(tl.float32), 1)
    tl.store(DELTA + stat_offs, delta, mask=row_ok)
    cu, cp, log_l = _row_factors(alpha, lsum)
    inv_eps2 = 1.0 / tl.maximum((alpha - 1.0) * (alpha - 1.0), 1e-30)

    qrow = (q, do, tau, cu, cp, log_l, delta)
    kv = (slice_base(K, b, h_kv, k_start, stride_kb, stride_kh, stride_kn), slice_base(V, b, h_kv, k_start, stride_vb,
          stride_vh, stride_vn), stride_kn, stride_kd, stride_vn, stride_vd)
    mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
    drop = (seed, bh, total_k, dropout_p)
    live_row = (_live_base(LIVE, seq, h, stride_live_b, stride_live_h)
                + (pid_m * BLOCK_M // LIVE_BLOCK_M).to(tl.int64) * stride_live_m)
    kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    s_u = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pl = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_g = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_gd = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_pld = tl.zeros([BLOCK_M], dtype=tl.float32)
    s_ds = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SCORE[3]:
        p_s, u_s, logp_s = _weights(sink_tile(mods[4], BLOCK_M, BLOCK_N), tau, cu, cp, log_l, alpha, ALPHA_CLASS)
        tl.store(DSINKS + stat_offs, -tl.sum(u_s, 1) * delta, mask=row_ok)
        if NEED_DALPHA:
            plogp_s, pg_s = _dalpha_terms(p_s, u_s, logp_s, alpha, inv_eps2)
            s_u += tl.sum(u_s, 1)
            s_pl += tl.sum(plogp_s, 1)
            s_g += tl.sum(pg_s, 1)
    dbias_base = DBIAS + bh.to(tl.int64) * total_q * total_k
    for wd in range(kt_lo // 32, tl.cdiv(kt_hi, 32)):
        bits, rank, n_set = _row_tile_bits(live_row, wd, kt_lo, kt_hi, HAS_LIVE)
        for i in range(0, n_set):
            cols, cols_global, col_ok, k, v = _key_tile(live_tile(bits, rank, i, wd), kv, k_start, seqlen_k, dims,
                                                        UPCAST, BLOCK_N)
            p, u, logp, dp, _, ds, ds_qk = _tile(
                qrow, k, v, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), alpha, scale, mods, drop,
                MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT, DOT_PRECISION)
            dq += tl.dot(ds_qk.to(k.dtype), k, input_precision=DOT_PRECISION)
            if NEED_DBIAS:
                tl.store(dbias_base + rows_global.to(tl.int64)[:, None] * total_k + cols_global.to(tl.int64)[None, :],
                         ds, mask=row_ok[:, None] & col_ok[None, :])
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
    store_rows(slice_base(DQ, b, h, q_start, stride_dqb, stride_dqh, stride_dqm), rows, offs_d, stride_dqm, stride_dqd,
               dq * scale, row_ok, d_ok)
    if NEED_DBIAS_ROWS:
        tl.store(DBIAS_ROWS + stat_offs, s_ds, mask=row_ok)
    if NEED_DALPHA:
        # sum_j dP_j dp_j/dalpha written with the row sums (docs/backward.md): no 1/(alpha-1) blow-up
        has_u = s_u > 0.0
        s_u = tl.where(has_u, s_u, 1.0)
        dalpha = (s_g * s_pd - s_gd) / s_u + (alpha - 1.0) * (s_pl * s_gd - s_g * s_pld) / s_u
        tl.store(DALPHA + stat_offs, tl.where(has_u, dalpha, 0.0), mask=row_ok)


@triton.jit(do_not_specialize=_LIVE_STRIDES)
def _entmax_attn_bwd_dkdv_kernel(
    Q, K, V, DO, TAU, LSUM, DELTA, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS,
    DK, DV, DBIAS_COLS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_live_b, stride_live_h, stride_live_m,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    NEED_DBIAS_COLS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (key tile ``pid_n``, kv head ``h_kv``, batch entry or sequence ``seq``): dK, dV, d bias cols.

    With ``HEAD_FILTER`` (one launch per alpha class) only the group's heads of this class are summed, and added to
    what the launches before wrote (the launcher zeroes ``DK``, ``DV``, float32 partials for GQA in fp16/bf16); a
    program with none of them writes nothing.
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
            qdo = (slice_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm), slice_base(DO, b, h, q_start,
                   stride_dob, stride_doh, stride_dom), stride_qm, stride_qd, stride_dom, stride_dod)
            mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
            drop = (seed, bh, total_k, dropout_p)
            live_col = _live_base(LIVE, seq, h, stride_live_b, stride_live_h) + pid_n // 32
            col_ds = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c in range(qt_lo // 32, tl.cdiv(qt_hi, 32)):
                bits, rank, n_set = _column_tile_bits(live_col, c, pid_n, qt_lo, qt_hi, stride_live_m, HAS_LIVE,
                                                      BLOCK_M, LIVE_BLOCK_M)
                for i in range(0, n_set):
                    qt = live_tile(bits, rank, i, c)
                    rows, rows_global, row_ok = tile_indices(qt, q_start, seqlen_q, BLOCK_M)
                    qrow = _query_rows(qdo, (TAU, LSUM, DELTA), bh, total_q, rows, rows_global, row_ok, dims, alpha,
                                       UPCAST)
                    p, u, logp, dp, pd, ds, ds_qk = _tile(
                        qrow, k, v, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), alpha, scale, mods,
                        drop, MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT, DOT_PRECISION)
                    q, do = qrow[0], qrow[1]
                    dv += tl.dot(tl.trans(pd).to(do.dtype), do, input_precision=DOT_PRECISION)
                    dk += tl.dot(tl.trans(ds_qk).to(q.dtype), q, input_precision=DOT_PRECISION)
                    if NEED_DBIAS_COLS:
                        col_ds += tl.sum(ds, 0)
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
    Q, K, V, DO, TAU, LSUM, DELTA, ALPHA, LIVE, CU_SEQLENS_Q, CU_SEQLENS_K, MODS, DBIAS,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_live_b, stride_live_h, stride_live_m,
    stride_dbias_b, stride_dbias_h,
    n_heads, kv_group, total_q, total_k, scale, dropout_p, seed, MASK, SCORE, n_b_loop, n_h_loop,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr,
    IS_VARLEN: tl.constexpr, BIAS_KIND: tl.constexpr, HAS_LIVE: tl.constexpr, LIVE_BLOCK_M: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
            qrow = _query_rows(qdo, (TAU, LSUM, DELTA), bh, total_q, rows, rows_global, row_ok, dims, alpha, UPCAST)
            kv = (slice_base(K, b, h_kv, k_start, stride_kb, stride_kh, stride_kn), slice_base(V, b, h_kv, k_start,
                  stride_vb, stride_vh, stride_vn), stride_kn, stride_kd, stride_vn, stride_vd)
            mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
            drop = (seed, bh, total_k, dropout_p)
            live_row = (_live_base(LIVE, seq, h, stride_live_b, stride_live_h)
                        + (pid_m * BLOCK_M // LIVE_BLOCK_M).to(tl.int64) * stride_live_m)
            kt_end = tl.where(_in_launch(alpha, ALPHA_CLASS, HEAD_FILTER), kt_hi, kt_lo)  # no tiles: another launch's
            for wd in range(kt_lo // 32, tl.cdiv(kt_end, 32)):
                bits, rank, n_set = _row_tile_bits(live_row, wd, kt_lo, kt_end, HAS_LIVE)
                for i in range(0, n_set):
                    cols, cols_global, col_ok, k, v = _key_tile(live_tile(bits, rank, i, wd), kv, k_start, seqlen_k,
                                                                dims, UPCAST, BLOCK_N)
                    _, _, _, _, _, ds, _ = _tile(
                        qrow, k, v, (rows, cols, rows_global, cols_global, seqlen_q, seqlen_k), alpha, scale, mods,
                        drop, MASK, SCORE, ALPHA_CLASS, BIAS_KIND, HAS_DROPOUT, DOT_PRECISION)
                    ptrs = dbias_base + rows_global.to(tl.int64)[:, None] * total_k + cols_global.to(tl.int64)[None, :]
                    ok = row_ok[:, None] & col_ok[None, :]
                    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + ds, mask=ok)


def _pick_config(head_dim: int, interpret: bool) -> dict:
    """``{kernel: (block_m, num_warps, num_stages)}`` for ``"dq"``, ``"dkdv"``, ``"dbias"``: the query-tile rows (at
    most; they must divide the forward's) and the pinned launch config of each backward kernel for this head dim. On a
    GPU these are the configs of the offline sm_90 builds (docs/backward.md), free of spills, and the first
    ``triton.autotune`` tries; the interpreter runs them as is."""
    if interpret:
        return dict.fromkeys(("dq", "dkdv", "dbias"), (_DEFAULT_BLOCK, 4, 1))
    head_dim_block = _common.head_dim_block(head_dim)
    # (block_m, num_warps): the largest query tiles whose builds do not spill with every flag on (d alpha and the
    # dense d bias tiles in the dQ kernel, column sums in the dK/dV kernel); the key tiles are the forward's
    if head_dim_block <= 64:
        tiles = dict(dq=(32, 8), dkdv=(64, 4), dbias=(64, 4))
    elif head_dim_block <= 128:
        tiles = dict(dq=(32, 4), dkdv=(32, 8), dbias=(64, 8))
    else:
        tiles = dict(dq=(16, 4), dkdv=(16, 8), dbias=(64, 8))
    return {name: (block_m, warps, 2) for name, (block_m, warps) in tiles.items()}


def _pinned(kernel: str):
    """``head_dim -> (num_warps, num_stages)`` of ``kernel``'s pinned GPU config (``_common.prune_to_pinned``)."""
    return lambda head_dim: _pick_config(head_dim, False)[kernel][1:]


_TUNE_KEY = ["HEAD_DIM", "HEAD_DIM_V", "BLOCK_M", "BLOCK_N", "ALPHA_CLASS", "HEAD_FILTER", "BIAS_KIND", "MASK",
             "IS_VARLEN", "HAS_LIVE", "HAS_DROPOUT", "DOT_PRECISION"]
# on a GPU each kernel is autotuned per head dim, tile, alpha class, feature flags and precision; the interpreter
# runs the pinned config (autotuning several fails there)
_entmax_attn_bwd_dq_autotuned = triton.autotune(
    configs=_common.launch_configs(), key=_TUNE_KEY + ["NEED_DALPHA", "NEED_DBIAS", "NEED_DBIAS_ROWS"],
    prune_configs_by={"early_config_prune": _common.prune_to_pinned(_pinned("dq"))},
)(_entmax_attn_bwd_dq_kernel)
# the dK/dV kernel adds into DK, DV with HEAD_FILTER, the dbias kernel into DBIAS: every autotuning run restores them
_entmax_attn_bwd_dkdv_autotuned = triton.autotune(
    configs=_common.launch_configs(), key=_TUNE_KEY + ["NEED_DBIAS_COLS"], restore_value=["DK", "DV"],
    prune_configs_by={"early_config_prune": _common.prune_to_pinned(_pinned("dkdv"))},
)(_entmax_attn_bwd_dkdv_kernel)
_entmax_attn_bwd_dbias_autotuned = triton.autotune(
    configs=_common.launch_configs(), key=_TUNE_KEY, restore_value=["DBIAS"],
    prune_configs_by={"early_config_prune": _common.prune_to_pinned(_pinned("dbias"))},
)(_entmax_attn_bwd_dbias_kernel)


def _launch(name: str, grid: tuple, args: dict, alpha_class: str) -> None:
    """Launch kernel ``name`` (``"dq"``, ``"dkdv"``, ``"dbias"``) once per alpha class (``_common.class_launches``):
    autotuned on a GPU, pinned under the interpreter or with ``SPARSE_ATTN_PINNED=1``."""
    for cls, head_filter in _common.class_launches(alpha_class):
        launch = dict(args, ALPHA_CLASS=cls, HEAD_FILTER=head_filter)
        if _common.pinned_launch():
            _, warps, stages = _pick_config(args["HEAD_DIM"], _common.interpreting())[name]
            globals()[f"_entmax_attn_bwd_{name}_kernel"][grid](**launch, num_warps=warps, num_stages=stages)
        else:
            globals()[f"_entmax_attn_bwd_{name}_autotuned"][grid](**launch)


def _check_args(do, q, k, v, out, out_u, tau, tau_lo, lsum, bias, cu_seqlens_q, cu_seqlens_k, live, block_m,
                block_n):
    """Cheap consistency asserts; ``sparse_attn.entmax_attention`` validates user input before this."""
    assert q.ndim == 4 and q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q: got {q.dtype} {q.shape}"
    assert all(t.dtype == q.dtype and t.device == q.device for t in (k, v, do, out)), "k, v, do, out: q's dtype"
    out_shape = (*q.shape[:3], v.shape[3])
    assert do.shape == out_shape and out.shape == out_shape, f"do, out: expected shape {out_shape}"
    assert out_u is None or (out_u.shape == out_shape and out_u.dtype in (torch.float32, q.dtype)), (
        "out_u: expected the output's shape, float32 (or q's dtype)")
    assert v.shape[:3] == k.shape[:3] and k.ndim == 4 and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3], (
        "k, v: shape")
    assert 16 <= v.shape[3] <= 256, f"v: head dim must be in [16, 256], got {v.shape[3]}"
    assert k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0, f"k: kv heads must divide {q.shape[1]}, got {k.shape[1]}"
    assert all(t.shape == q.shape[:3] and t.dtype == torch.float32 for t in (tau, lsum)), "tau, lsum: (B, Hq, Nq) fp32"
    assert tau_lo is None or (tau_lo.shape == tau.shape and tau_lo.dtype == torch.float32), "tau_lo: like tau"
    assert 16 <= q.shape[3] <= 256, f"q: head dim must be in [16, 256], got {q.shape[3]}"
    assert bias is None or bias.is_floating_point() or bias.dtype in (torch.bool, torch.uint8), "bias: float or bool"
    assert (cu_seqlens_q is None) == (cu_seqlens_k is None), "cu_seqlens_q, cu_seqlens_k: expected both or neither"
    assert cu_seqlens_q is None or (q.shape[0] == 1 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32), (
        "cu_seqlens_q, cu_seqlens_k: expected int32 offsets and batch 1")
    assert live is None or (block_m is not None and block_n is not None), "block_m, block_n: required with live"


def _live_args(live, like) -> dict:
    """``LIVE`` and its ``stride_live_b/h/m`` kernel arguments (``like`` and 0 without a bitmap)."""
    live = like if live is None else live.contiguous()
    strides = live.stride()[:3] if live is not like else (0, 0, 0)
    return dict(LIVE=live, stride_live_b=strides[0], stride_live_h=strides[1], stride_live_m=strides[2])


def _zero_grads(q, k, v, bias, need_dalpha, need_dbias):
    """The gradients of a problem without rows or keys: all zero."""
    zeros32 = dict(dtype=torch.float32, device=q.device)
    dalpha = torch.zeros(q.shape[1], **zeros32) if need_dalpha else None
    dbias_shape = (*q.shape[:3], k.shape[2]) if bias is None else bias.shape
    dbias = torch.zeros(dbias_shape, **zeros32) if need_dbias else None
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dalpha, dbias


# what the kernels write: gradients, per-row delta / d alpha partials, and the d bias accumulation
# mode (``_masking.dbias_mode``, None when not needed) with its buffers
_Buffers = namedtuple("_Buffers", "dq dk dv delta dalpha_rows mode dbias dbias_rows dbias_cols")


def _buffers(q, k, v, bias, is_varlen, need_dalpha, need_dbias) -> _Buffers:
    """Allocate what the kernels write; d bias buffers are zeroed float32 (``delta`` stands in where unused)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if is_varlen:
        # rows and keys outside every sequence are never visited
        for g in (dq, dk, dv):
            g.zero_()
    full = (*q.shape[:3], k.shape[2])
    delta = torch.empty(full[:3], dtype=torch.float32, device=q.device)
    mode = _masking.dbias_mode(bias, full) if need_dbias else None
    zeros32 = dict(dtype=torch.float32, device=q.device)
    return _Buffers(
        dq, dk, dv, delta, torch.zeros_like(delta) if need_dalpha else delta, mode,
        torch.zeros(full, **zeros32) if mode == "dense" else delta,
        torch.zeros(full[:3], **zeros32) if mode == "rows" else delta,
        torch.zeros((*full[:2], full[3]), **zeros32) if mode == "cols" else delta,
    )


def _common_args(q, k, v, do, tau, tau_lo, lsum, alpha, bias, cu_seqlens_q, cu_seqlens_k, live, scale, is_causal,
                 dropout_p, seed, live_block_m: int, block_n: int, window_size=None, alibi_slopes=None, softcap=None,
                 sinks=None, block_mask=None) -> dict:
    """Keyword arguments the three backward kernels share (``TAU`` is the pair ``(tau, tau_lo)``, zeros without
    ``tau_lo``)."""
    args = _common.attention_args(q, k, v, alpha, bias, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed,
                                  window_size, alibi_slopes, softcap, sinks, block_mask,
                                  None if live is None else (live_block_m, block_n))
    return dict(
        args, DO=do, TAU=(tau.contiguous(), torch.zeros_like(tau) if tau_lo is None else tau_lo.contiguous()),
        LSUM=lsum.contiguous(), **_common.stride_args("stride_do", do, "bhmd"),
        **_live_args(live, q), HAS_LIVE=live is not None, LIVE_BLOCK_M=live_block_m, BLOCK_N=block_n,
    )


def entmax_attn_bwd(
    do, q, k, v, out, tau, lsum, alpha, scale, bias=None, is_causal=False, cu_seqlens_q=None,
    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, seed=0,
    live=None, block_m=None, block_n=None, need_dalpha=False, need_dbias=False, *, out_u=None, alpha_class=None,
    window_size=None, alibi_slopes=None, softcap=None, sinks=None, block_mask=None, tau_lo=None,
):
    """Gradients of alpha-entmax attention from the forward's per-row statistics.

    Arguments are validated by the caller (``sparse_attn.entmax_attention``); here only cheap
    asserts and the launch-grid limit.

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output, same dtype as ``q``; any strides.
        q: ``(B, Hq, Nq, D)`` queries, float16 / bfloat16 / float32; any strides. ``16 <= D <= 256``.
        k, v: ``(B, Hk, Nk, D)`` keys and values, dtype of ``q``; ``Hq % Hk == 0`` (GQA/MQA).
        out: ``(B, Hq, Nq, D)`` forward output (``delta = dO . O`` when ``out_u`` is None: softmax only).
        tau, lsum: float32 ``(B, Hq, Nq)`` forward statistics (``docs/design.md``): for
            alpha > 1, ``p = [(alpha-1) s - tau]_+^(1/(alpha-1)) / lsum``; for alpha = 1,
            ``p = exp(s - tau)``. ``lsum == 0`` marks a row with no valid key (zero gradients).
            The forward's value pass sums its weights at exactly the saved ``tau``, so ``lsum`` normalizes them.
        tau_lo: float32 ``(B, Hq, Nq)``, the forward's ``tau_lo`` (the rounding residual of ``tau``): the scores are
            taken relative to ``tau + tau_lo`` (docs/kernels.md, "Shift invariance"). None: zeros (``tau`` exact),
            which loses the weights of rows whose scores are large (a huge additive mask constant). Default None.
        alpha: float32 ``(Hq,)`` per-head alpha in ``[1, 2]`` (a Python float is broadcast).
        scale: float, scores are ``scale * q . k + bias``.
        bias: optional float tensor broadcastable (zero strides allowed) to ``(B, Hq, Nq, Nk)``;
            ``-inf`` marks masked pairs. Default None.
        is_causal: bottom-right aligned causal mask (``kernels/_masking.py``). Default False.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` for variable length (then ``B == 1``
            and ``Nq``/``Nk`` are the packed totals). Default None.
        max_seqlen_q, max_seqlen_k: longest sequences (computed from ``cu_seqlens`` when None).
        dropout_p, seed: dropout of the forward, replayed with ``kernels._common.dropout_keep``.
        live: optional int32 ``(B or nseq, Hq, cdiv(max_seqlen_q, block_m), words)`` tile
            liveness bits of the forward; dead tiles are skipped. Requires ``block_m``/``block_n``.
        block_m, block_n: the forward's tile sizes (powers of two >= 16; default 64), which index ``live``;
            the backward's query tiles have ``min(block_m, 64)`` rows and its key tiles ``block_n`` keys.
        need_dalpha: also return the alpha gradient. Default False.
        need_dbias: also return the bias gradient. Default False.
        out_u: ``(B, Hq, Nq, D)`` float32 (or ``q.dtype``), the forward's ``sum_j U_ij v_j / sum_j U_ij``
            (``entmax_attn_fwd(..., need_out_u=True).out_u``), from which ``delta = dO . out_u``; may be None
            when every head is softmax (then ``out`` serves, rounded to ``q.dtype``). Default None.
        alpha_class: compile-time alpha class as in ``entmax_attn_fwd`` (``"softmax"``, ``"sparsemax"``,
            ``"entmax15"``, ``"general"`` or ``"mixed"``: one filtered launch of each kernel per class); default from
            the values of a Python float or a CPU tensor (no device sync), else ``"mixed"``.
        window_size, alibi_slopes, softcap: the forward's sliding window, ALiBi slopes and soft cap
            (``entmax_attn_fwd``), or None.
        sinks: the forward's ``(Hq,)`` per-head sink logits (``entmax_attn_fwd``), or None. Default None.
        block_mask: the forward's ``(mask, (bq, bk))`` block mask, or None (key tiles it hides are dead in ``live``).

    Returns:
        ``(dq, dk, dv, dalpha, dbias)``: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``
        (summed over the q heads of each kv group), ``dalpha`` float32 ``(Hq,)`` summed over
        batch and rows or None, ``dbias`` float32 in the shape of ``bias`` (``dS`` summed over the
        dims ``bias`` broadcasts along; ``(B, Hq, Nq, Nk)`` when ``bias`` is None) or None. Extra
        memory for it is O(B Hq (Nq + Nk)) plus the mask's own size: key- or query-broadcast masks
        use per-row / per-key sums from the two kernels, masks broadcast only over batch/heads
        ``_entmax_attn_bwd_dbias_kernel``. With ``sinks`` a sixth entry follows: ``dsinks``, ``(Hq,)`` in the dtype
        of ``sinks`` (float32 per-row gradients summed over batch and rows).

    Raises:
        ValueError: more than 65535 heads or batch entries (sequences) (``_masking.tile_plan``).
    """
    _check_args(do, q, k, v, out, out_u, tau, tau_lo, lsum, bias, cu_seqlens_q, cu_seqlens_k, live, block_m, block_n)
    n_heads = q.shape[1]
    assert sinks is None or sinks.shape == (n_heads,), f"sinks: expected shape ({n_heads},)"
    if q.shape[0] * n_heads * q.shape[2] == 0 or k.shape[2] == 0:
        grads = _zero_grads(q, k, v, bias, need_dalpha, need_dbias)
        return grads if sinks is None else (*grads, torch.zeros_like(sinks))
    config = _pick_config(q.shape[3], _common.interpreting())
    # the bitmap's tiles are the forward's (block_m x block_n); the backward's query tiles divide them
    live_m = _DEFAULT_BLOCK if block_m is None else int(block_m)
    block_n = _DEFAULT_BLOCK if block_n is None else int(block_n)
    live_plan = _masking.tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, live_m, block_n)
    live_shape = (live_plan.n_seq, n_heads, live_plan.n_q_tiles, live_plan.n_words)
    assert live is None or (live.shape == live_shape and live.dtype == torch.int32), f"live: expected {live_shape}"
    alpha_class = _common.resolve_alpha_class(alpha, alpha_class)
    assert out_u is not None or alpha_class == "softmax", (
        "out_u: required unless every head has alpha = 1 (entmax_attn_fwd(..., need_out_u=True).out_u)")
    # query tiles of each kernel: at most its configured rows, dividing the forward's
    plans = {name: _masking.tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      min(live_m, block_m), block_n) for name, (block_m, *_) in config.items()}
    buf = _buffers(q, k, v, bias, cu_seqlens_q is not None, need_dalpha, need_dbias)
    if alpha_class == "mixed" and n_heads > k.shape[1] and k.dtype != torch.float32:
        # each class launch of the dK/dV kernel adds the group's heads of its class: partial sums in float32
        buf = buf._replace(dk=torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                           dv=torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    elif alpha_class == "mixed":
        # one class per dK/dV row (no GQA), or float32 already: the launches add into zeros exactly
        buf.dk.zero_()
        buf.dv.zero_()
    common = _common_args(q, k, v, do, tau, tau_lo, lsum, alpha, bias, cu_seqlens_q, cu_seqlens_k, live, scale,
                          is_causal, dropout_p, seed, live_m, block_n, window_size, alibi_slopes, softcap, sinks,
                          block_mask)
    out_u = out if out_u is None else out_u
    # rows outside every packed sequence are never visited
    dsinks_rows = None if sinks is None else torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    plan = plans["dq"]
    _launch("dq", (plan.n_q_tiles, n_heads, plan.n_seq), dict(
        common, OUT_U=out_u, DQ=buf.dq, DELTA=buf.delta, DALPHA=buf.dalpha_rows, DBIAS=buf.dbias,
        DSINKS=buf.delta if dsinks_rows is None else dsinks_rows,
        DBIAS_ROWS=buf.dbias_rows, **_common.stride_args("stride_ou", out_u, "bhmd"),
        **_common.stride_args("stride_dq", buf.dq, "bhmd"),
        NEED_DALPHA=bool(need_dalpha), NEED_DBIAS=buf.mode == "dense", NEED_DBIAS_ROWS=buf.mode == "rows",
        BLOCK_M=plan.block_m,
    ), alpha_class)
    common.update(DELTA=buf.delta)
    plan = plans["dkdv"]
    _launch("dkdv", (plan.n_k_tiles, k.shape[1], plan.n_seq), dict(
        common, DK=buf.dk, DV=buf.dv, DBIAS_COLS=buf.dbias_cols, **_common.stride_args("stride_dk", buf.dk, "bhnd"),
        **_common.stride_args("stride_dv", buf.dv, "bhnd"), NEED_DBIAS_COLS=buf.mode == "cols", BLOCK_M=plan.block_m,
    ), alpha_class)
    dalpha = buf.dalpha_rows.double().sum(dim=(0, 2)).float() if need_dalpha else None
    buf = buf._replace(dk=buf.dk.to(k.dtype), dv=buf.dv.to(v.dtype))  # no copy unless float32 partials
    dbias = None if buf.mode is None else _dbias(buf, bias, cu_seqlens_q, plans, n_heads, common, alpha_class)
    if sinks is None:
        return buf.dq, buf.dk, buf.dv, dalpha, dbias
    return buf.dq, buf.dk, buf.dv, dalpha, dbias, dsinks_rows.double().sum(dim=(0, 2)).to(sinks.dtype)


def _dbias(buf, bias, cu_seqlens_q, plans, n_heads, common, alpha_class):
    """d bias in the shape of ``bias`` from the kernels' buffers (and the dbias kernel for batch/head broadcasts)."""
    if buf.mode == "blocks":
        dbias = _dbias_blocks(_masking.mask_shape4(bias), cu_seqlens_q is not None, plans["dbias"], n_heads,
                              dict(common, BLOCK_M=plans["dbias"].block_m), alpha_class)
    else:
        dbias = {"rows": buf.dbias_rows[..., None], "cols": buf.dbias_cols[:, :, None]}.get(buf.mode, buf.dbias)
    return _masking.sum_to_mask(dbias, bias)


def _dbias_blocks(bias_shape, is_varlen, plan, n_heads, common, alpha_class):
    """d bias of a mask broadcast over batch and/or heads only, in the mask's 4-d shape (dbias kernel)."""
    dbias = torch.zeros(bias_shape, dtype=torch.float32, device=common["Q"].device)
    full_b, full_h = bias_shape[0] != 1 or is_varlen, bias_shape[1] != 1
    _launch("dbias", (plan.n_q_tiles, n_heads if full_h else 1, plan.n_seq if full_b else 1), dict(
        common, DBIAS=dbias, stride_dbias_b=0 if is_varlen else dbias.stride(0), stride_dbias_h=dbias.stride(1),
        n_b_loop=1 if full_b else plan.n_seq, n_h_loop=1 if full_h else n_heads,
    ), alpha_class)
    return dbias
