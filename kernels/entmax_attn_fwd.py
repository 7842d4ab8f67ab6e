"""Fused forward of alpha-entmax attention: every sweep over K in one Triton launch.

One program owns one query tile of one (batch or sequence, head). It computes, tile by tile
and without storing the scores:

1. a first sweep for the row maximum ``m`` of ``z = (alpha - 1) * s`` and the number of valid
   keys (alpha == 1 instead runs the whole flash-style online softmax in this single sweep);
2. Newton sweeps on the Tsallis norm ``f(tau)^(1/beta) - 1`` from ``tau = m - 1``, which are
   monotone from the left, so key tiles found with ``z <= tau`` for every row are marked dead in
   the liveness bitmap and skipped from then on; they stop once every row of the tile has
   ``|f(tau) - 1| <= tol`` (then one last Newton update is applied);
3. a value sweep over the live tiles accumulating ``sum_j p_ij v_j`` and ``sum_j p_ij``, divided
   at the end so that every row sums to one.

The derivation, the stopping rule and the cost model are in ``docs/kernels.md``; the
conventions (statistics, bitmap layout, varlen, causal alignment, GQA, dropout) in
``docs/design.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common, _masking
from ._common import LN2, LOG2E, bias_base_ptr, dropout_keep, load_rows, log2_1p, slice_base
from ._masking import key_tile_range, mask_scores, seq_bounds

DEFAULT_TOL = 1e-3
DEFAULT_MAX_SWEEPS = 32


class EntmaxAttnFwdResult(NamedTuple):
    """What :func:`entmax_attn_fwd` returns.

    out:      ``(B, Hq, Nq, D)`` in ``q.dtype``.
    tau:      float32 ``(B, Hq, Nq)``, threshold in the z-scale (logsumexp of the scores at alpha == 1),
              ``+inf`` for rows with no valid key.
    lsum:     float32 ``(B, Hq, Nq)``, ``sum_j [z_ij - tau_i]_+^beta`` (1 at alpha == 1, 0 for empty rows).
    nnz:      int32 ``(B, Hq, Nq)``, support size (number of valid keys at alpha == 1).
    n_valid:  int32 ``(B, Hq, Nq)``, number of keys the row may attend to (not masked).
    live:     int32 ``(B_or_nseq, Hq, cdiv(max_seqlen_q, block_m), cdiv(cdiv(max_seqlen_k, block_n), 32))``
              tile liveness bitmap (docs/design.md).
    n_sweeps: int32 ``(B_or_nseq, Hq, cdiv(max_seqlen_q, block_m))``, Newton sweeps done per query tile
              (0 at alpha == 1); the kernel makes ``n_sweeps + 2`` passes over K when alpha > 1, one otherwise.
    block_m, block_n: the tile sizes used (the backward must use the same).
    """

    out: torch.Tensor
    tau: torch.Tensor
    lsum: torch.Tensor
    nnz: torch.Tensor
    n_valid: torch.Tensor
    live: torch.Tensor
    n_sweeps: torch.Tensor
    block_m: int
    block_n: int


@triton.jit
def _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k, stride_kn, stride_kd, stride_bias_m,
                stride_bias_n, z_scale, bias_scale, MASK, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores ``z_scale * q.k + bias_scale * bias`` of one tile, ``-inf`` where masked. [BLOCK_M, BLOCK_N]"""
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = k_base + cols.to(tl.int64)[None, :] * stride_kn + offs_d.to(tl.int64)[:, None] * stride_kd
    k = tl.load(k_ptrs, mask=(cols[None, :] < seqlen_k) & (offs_d[:, None] < HEAD_DIM), other=0.0)  # [BLOCK_D, BLOCK_N]
    if UPCAST:
        k = k.to(tl.float32)
    z = tl.dot(q, k, input_precision=DOT_PRECISION) * z_scale
    return mask_scores(z, rows, cols, seqlen_q, seqlen_k, bias_base, stride_bias_m, stride_bias_n, bias_scale, MASK,
                       HAS_BIAS)


@triton.jit
def _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr):
    """Value rows of one key tile. [BLOCK_N, BLOCK_D]"""
    offs_d = tl.arange(0, BLOCK_D)
    return load_rows(v_base, cols, offs_d, stride_vn, stride_vd, cols < seqlen_k, offs_d < HEAD_DIM, UPCAST)


@triton.jit
def _apply_dropout(p, seed, bh, rows_global, cols_global, total_k, dropout_p, inv_keep, HAS_DROPOUT: tl.constexpr):
    """Weights after dropout (kept ones scaled by ``inv_keep``). [BLOCK_M, BLOCK_N]"""
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, rows_global, cols_global, total_k, dropout_p)
        p = tl.where(keep, p * inv_keep, 0.0)
    return p


@triton.jit
def _tsallis_terms(x, beta, pow_kind):
    """``[r]_+^beta``, ``[r]_+^(beta - 1)`` and ``r > 0`` for ``r = z - tau``. [BLOCK_M, BLOCK_N] each

    ``pow_kind`` 1 (beta = 1) and 2 (beta = 2) take ``x = r`` and use no transcendental function.
    The general path takes ``x = r - 1 = z - (tau + 1)`` and forms ``log r = log1p(x)``: near
    alpha = 1, ``r`` is within O(alpha - 1) of 1 and rounding it would cost ``beta`` ulps in ``p``.
    """
    if pow_kind == 1:
        pos = x > 0
        p = tl.where(pos, x, 0.0)
        g = pos.to(tl.float32)
    elif pow_kind == 2:
        pos = x > 0
        g = tl.where(pos, x, 0.0)
        p = g * g
    else:
        pos = x > -1.0
        w = tl.where(pos, x, 0.0)
        g = tl.where(pos, tl.exp2((beta - 1.0) * log2_1p(w)), 0.0)
        p = g * (1.0 + w)
    return p, g, pos


@triton.jit
def _newton_step(f, g, beta, pow_kind):
    """Newton step on ``f^(1/beta) - 1`` given ``f = sum [z - tau]_+^beta``, ``g = sum [z - tau]_+^(beta-1)``."""
    f_safe = tl.where(f > 0, f, 1.0)
    if pow_kind == 1:
        root = tl.full(f.shape, 1.0, tl.float32)
    elif pow_kind == 2:
        root = tl.sqrt(f_safe)
    else:
        root = tl.exp2((1.0 - 1.0 / beta) * tl.log2(f_safe))
    return tl.where(g > 0, (f - root) / tl.where(g > 0, g, 1.0), 0.0)


@triton.jit
def _softmax_forward(q, k_base, v_base, bias_base, o_ptrs, o_mask, rows, rows_global, seqlen_q, seqlen_k, kt_lo, kt_hi,
                     n_words, live_base, stat_offs, TAU, LSUM, NNZ, N_VALID, sweep_ptr, scale,
                     seed, bh, k_start, total_k, dropout_p, inv_keep,
                     stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """alpha == 1: one online-softmax sweep (base-2 exponentials); writes out, stats and the bitmap."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for w in range(0, n_words):
        word = tl.zeros([], tl.int32)
        for kt in range(tl.maximum(w * 32, kt_lo), tl.minimum(w * 32 + 32, kt_hi)):
            cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            s = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k, stride_kn, stride_kd, stride_bias_m,
                            stride_bias_n, scale * LOG2E, LOG2E, MASK, HEAD_DIM, BLOCK_D, HAS_BIAS, UPCAST,
                            DOT_PRECISION)
            ok = s > float("-inf")
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            corr = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_sum = l_sum * corr + tl.sum(p, 1)
            n_valid += tl.sum(ok.to(tl.int32), 1)
            word = word | (tl.max(ok.to(tl.int32)) << (kt - w * 32))
            p = _apply_dropout(p, seed, bh, rows_global, k_start + cols, total_k, dropout_p, inv_keep, HAS_DROPOUT)
            v = _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM, BLOCK_D, UPCAST)
            acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        tl.store(live_base + w, word)
    valid = n_valid > 0
    l_safe = tl.where(valid, l_sum, 1.0)
    out = acc / l_safe[:, None]
    row_ok = rows < seqlen_q
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)
    tl.store(TAU + stat_offs, tl.where(valid, (m + tl.log2(l_safe)) * LN2, float("inf")), mask=row_ok)
    tl.store(LSUM + stat_offs, tl.where(valid, 1.0, 0.0), mask=row_ok)
    tl.store(NNZ + stat_offs, n_valid, mask=row_ok)
    tl.store(N_VALID + stat_offs, n_valid, mask=row_ok)
    tl.store(sweep_ptr, 0)


@triton.jit
def _live_sweep(q, tau, beta, k_base, v_base, bias_base, rows, rows_global, seqlen_q, seqlen_k, kt_lo, kt_hi,
                live_base, z_scale, bias_scale, pow_kind, seed, bh, k_start, total_k, dropout_p, inv_keep,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
                VALUES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One pass over the live key tiles at threshold ``tau``, re-marking tiles with no ``z > tau`` dead.

    ``tau`` [BLOCK_M] is shifted by +1 on the general-beta path (``pow_kind`` 0), see ``_tsallis_terms``.

    Returns ``(f, g, nnz, acc)``: ``f = sum [z - tau]_+^beta`` [BLOCK_M]; with VALUES also
    ``nnz`` [BLOCK_M] and ``acc = sum p v`` [BLOCK_M, BLOCK_D] (dropout applied), else
    ``g = sum [z - tau]_+^(beta-1)`` for the Newton step.
    """
    f = tl.zeros([BLOCK_M], tl.float32)
    g = tl.zeros([BLOCK_M], tl.float32)
    nnz = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for w in range(kt_lo // 32, tl.cdiv(kt_hi, 32)):
        word = tl.load(live_base + w)
        new_word = tl.zeros([], tl.int32)
        for kt in range(tl.maximum(w * 32, kt_lo), tl.minimum(w * 32 + 32, kt_hi)):
            bit = kt - w * 32
            if ((word >> bit) & 1) != 0:
                cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
                z = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k, stride_kn, stride_kd,
                                stride_bias_m, stride_bias_n, z_scale, bias_scale, MASK, HEAD_DIM, BLOCK_D, HAS_BIAS,
                                UPCAST, DOT_PRECISION)
                p, gp, pos = _tsallis_terms(z - tau[:, None], beta, pow_kind)
                new_word = new_word | (tl.max(pos.to(tl.int32)) << bit)
                if VALUES:
                    f += tl.sum(p, 1)
                    nnz += tl.sum(pos.to(tl.int32), 1)
                    p = _apply_dropout(p, seed, bh, rows_global, k_start + cols, total_k, dropout_p, inv_keep,
                                       HAS_DROPOUT)
                    v = _value_tile(v_base, cols, seqlen_k, stride_vn, stride_vd, HEAD_DIM, BLOCK_D, UPCAST)
                    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                else:
                    f += tl.sum(p, 1)
                    g += tl.sum(gp, 1)
        tl.store(live_base + w, new_word)
    tl.debug_barrier()
    return f, g, nnz, acc


@triton.jit
def _entmax_forward(q, k_base, v_base, bias_base, o_ptrs, o_mask, rows, rows_global, seqlen_q, seqlen_k, kt_lo, kt_hi,
                    n_words, live_base, stat_offs, TAU, LSUM, NNZ, N_VALID, sweep_ptr, scale, alpha, tol, max_sweeps,
                    seed, bh, k_start, total_k, dropout_p, inv_keep,
                    stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """alpha in (1, 2]: max sweep, Newton sweeps on the Tsallis norm, value sweep; writes everything."""
    am1 = alpha - 1.0
    beta = 1.0 / am1
    pow_kind = tl.where(alpha == 2.0, 1, tl.where(alpha == 1.5, 2, 0))
    z_scale = scale * am1
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.int32)
    for w in range(0, n_words):
        word = tl.zeros([], tl.int32)
        for kt in range(tl.maximum(w * 32, kt_lo), tl.minimum(w * 32 + 32, kt_hi)):
            cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            z = _score_tile(q, k_base, bias_base, rows, cols, seqlen_q, seqlen_k, stride_kn, stride_kd, stride_bias_m,
                            stride_bias_n, z_scale, am1, MASK, HEAD_DIM, BLOCK_D, HAS_BIAS, UPCAST, DOT_PRECISION)
            ok = z > float("-inf")
            m = tl.maximum(m, tl.max(z, 1))
            n_valid += tl.sum(ok.to(tl.int32), 1)
            word = word | (tl.max(ok.to(tl.int32)) << (kt - w * 32))
        tl.store(live_base + w, word)
    tl.debug_barrier()
    valid = n_valid > 0
    # the general path iterates on tau + 1 (two small numbers near alpha = 1, see _tsallis_terms)
    shift = tl.where(pow_kind == 0, 1.0, 0.0)
    tau = tl.where(valid, m - (1.0 - shift), 0.0)
    n_sweeps = tl.zeros([], tl.int32)
    go = (tl.max(valid.to(tl.int32)) > 0) & (n_sweeps < max_sweeps)
    while go:
        f, g, _, _ = _live_sweep(
            q, tau, beta, k_base, v_base, bias_base, rows, rows_global, seqlen_q, seqlen_k, kt_lo, kt_hi, live_base,
            z_scale, am1, pow_kind, seed, bh, k_start, total_k, dropout_p, inv_keep,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
            False, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION)
        err = tl.where(valid, tl.abs(f - 1.0), 0.0)
        tau = tl.where(valid, tau + _newton_step(f, g, beta, pow_kind), tau)
        n_sweeps += 1
        go = (tl.max(err) > tol) & (n_sweeps < max_sweeps)
    # round to the saved tau so that lsum and the backward's (tau + 1) see the same threshold
    tau_saved = tau - shift
    tau = tau_saved + shift
    l_sum, _, nnz, acc = _live_sweep(
        q, tau, beta, k_base, v_base, bias_base, rows, rows_global, seqlen_q, seqlen_k, kt_lo, kt_hi, live_base,
        z_scale, am1, pow_kind, seed, bh, k_start, total_k, dropout_p, inv_keep,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
        True, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION)
    valid = valid & (l_sum > 0)
    l_safe = tl.where(valid, l_sum, 1.0)
    out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
    row_ok = rows < seqlen_q
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=o_mask)
    tl.store(TAU + stat_offs, tl.where(valid, tau_saved, float("inf")), mask=row_ok)
    tl.store(LSUM + stat_offs, tl.where(valid, l_sum, 0.0), mask=row_ok)
    tl.store(NNZ + stat_offs, tl.where(valid, nnz, 0), mask=row_ok)
    tl.store(N_VALID + stat_offs, n_valid, mask=row_ok)
    tl.store(sweep_ptr, n_sweeps)


@triton.jit
def _entmax_attn_fwd_kernel(
    Q, K, V, OUT, BIAS, ALPHA, TAU, LSUM, NNZ, N_VALID, LIVE, N_SWEEPS, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    n_heads, kv_group, total_q, total_k, n_q_tiles, n_words,
    scale, tol, max_sweeps, seed, dropout_p, inv_keep, MASK,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (query tile ``pid_m``, q head ``h``, batch entry or sequence ``seq``); see the module doc."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    h_kv = h // kv_group
    bh = b * n_heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen_q
    rows_global = (q_start + rows).to(tl.int64)

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
              + rows_global[:, None] * stride_qm + offs_d.to(tl.int64)[None, :] * stride_qd)
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    o_ptrs = (OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + rows_global[:, None] * stride_om + offs_d.to(tl.int64)[None, :] * stride_od)
    k_base = slice_base(K, b, h_kv, k_start, stride_kb, stride_kh, stride_kn)
    v_base = slice_base(V, b, h_kv, k_start, stride_vb, stride_vh, stride_vn)
    bias_base = bias_base_ptr(BIAS, b, h, q_start, k_start, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n)
    stat_offs = bh.to(tl.int64) * total_q + rows_global
    tile_id = (seq.to(tl.int64) * n_heads + h) * n_q_tiles + pid_m
    live_base = LIVE + tile_id * n_words
    sweep_ptr = N_SWEEPS + tile_id
    kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)

    alpha = tl.load(ALPHA + h)
    if alpha == 1.0:
        _softmax_forward(q, k_base, v_base, bias_base, o_ptrs, q_mask, rows, rows_global, seqlen_q, seqlen_k, kt_lo,
                         kt_hi, n_words, live_base, stat_offs, TAU, LSUM, NNZ, N_VALID, sweep_ptr, scale,
                         seed, bh, k_start, total_k, dropout_p, inv_keep,
                         stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
                         BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION)
    else:
        _entmax_forward(q, k_base, v_base, bias_base, o_ptrs, q_mask, rows, rows_global, seqlen_q, seqlen_k, kt_lo,
                        kt_hi, n_words, live_base, stat_offs, TAU, LSUM, NNZ, N_VALID, sweep_ptr, scale, alpha, tol,
                        max_sweeps, seed, bh, k_start, total_k, dropout_p, inv_keep,
                        stride_kn, stride_kd, stride_vn, stride_vd, stride_bias_m, stride_bias_n, MASK,
                        BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, HAS_BIAS, HAS_DROPOUT, UPCAST, DOT_PRECISION)


def _pick_config(head_dim: int, interpret: bool):
    """``(block_m, block_n, num_warps, num_stages)``: one pinned config per head dim.

    GPU choices are the sm_90 builds with the fewest register spills (ptxas report, all four
    alpha paths compiled in); see docs/kernels.md.
    """
    if interpret:
        return 32, 32, 4, 1
    if _common.head_dim_block(head_dim) <= 128:
        return 64, 64, 8, 2
    return 64, 32, 8, 1


def fwd_block_sizes(head_dim: int) -> tuple:
    """Default ``(block_m, block_n)`` of :func:`entmax_attn_fwd` for this head dim (the liveness map's tiles)."""
    block_m, block_n, _, _ = _pick_config(head_dim, _common.interpreting())
    return block_m, block_n


def entmax_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    tol: float | None = None,
    max_sweeps: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> EntmaxAttnFwdResult:
    """Fused entmax attention forward (one kernel launch).

    Arguments are validated by the caller (``sparse_attn.entmax_attention``); here only cheap
    asserts and the launch-grid limit (``ValueError``).

    Args:
        q: ``(B, Hq, Nq, D)``, fp16/bf16/fp32, any strides; with varlen ``(1, Hq, total_q, D)``.
        k, v: ``(B, Hk, Nk, D)`` (``Hq % Hk == 0``, q head ``h`` reads kv head ``h // (Hq // Hk)``),
            same dtype and device as ``q``; with varlen ``(1, Hk, total_k, D)``. ``16 <= D <= 256``.
        alpha: float32 ``(Hq,)`` (each in ``[1, 2]``, mixed per head), or a Python float for every head.
        scale: float multiplying ``q . k``.
        bias: None or a float tensor broadcastable to ``(B, Hq, Nq, Nk)`` (read with zero strides;
            ``-inf`` masks), added to the scaled scores. Default None.
        is_causal: bottom-right aligned causal mask (key ``j`` visible to row ``i`` iff
            ``j <= i + Nk - Nq``, per sequence; ``kernels/_masking.py``). Default False.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` packed-sequence offsets (then ``B == 1``).
        max_seqlen_q, max_seqlen_k: longest sequences; computed from ``cu_seqlens`` when None.
        dropout_p: probability of dropping a weight after the entmax (kept ones scaled by
            ``1 / (1 - dropout_p)``), drawn by ``kernels._common.dropout_keep``. Default 0.
        seed: int RNG seed of the dropout. Default 0.
        tol: stop the Newton sweeps once every row of a query tile has ``|sum_j [z - tau]_+^beta - 1| <= tol``
            (default 1e-3).
        max_sweeps: cap on the Newton sweeps (default 32).
        block_m, block_n: tile sizes (powers of two >= 16); default by head dim.

    Returns:
        :class:`EntmaxAttnFwdResult` ``(out, tau, lsum, nnz, n_valid, live, n_sweeps, block_m, block_n)``.

    Raises:
        ValueError: more than 65535 heads or batch entries (sequences) (``_masking.tile_plan``).
    """
    batch, n_heads, total_q, head_dim = q.shape
    assert 16 <= head_dim <= 256, f"q: head dim must be in [16, 256], got {head_dim}"
    default_m, default_n, num_warps, num_stages = _pick_config(head_dim, _common.interpreting())
    plan = _masking.tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              default_m if block_m is None else block_m, default_n if block_n is None else block_n)
    n_seq, block_m, block_n, n_q_tiles = plan.n_seq, plan.block_m, plan.block_n, plan.n_q_tiles

    stats = dict(size=(batch, n_heads, total_q), device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tau = torch.empty(**stats, dtype=torch.float32)
    lsum = torch.empty(**stats, dtype=torch.float32)
    nnz = torch.empty(**stats, dtype=torch.int32)
    n_valid = torch.empty(**stats, dtype=torch.int32)
    live = torch.empty((n_seq, n_heads, n_q_tiles, plan.n_words), dtype=torch.int32, device=q.device)
    n_sweeps = torch.empty((n_seq, n_heads, n_q_tiles), dtype=torch.int32, device=q.device)
    result = EntmaxAttnFwdResult(out, tau, lsum, nnz, n_valid, live, n_sweeps, block_m, block_n)
    if cu_seqlens_q is not None and out.numel() > 0:
        # rows outside every sequence are never visited
        out.zero_()
        tau.fill_(float("inf"))
        lsum.zero_()
        nnz.zero_()
        n_valid.zero_()
    if n_q_tiles == 0 or n_seq == 0 or n_heads == 0:
        return result

    dropout_p = float(dropout_p)
    _entmax_attn_fwd_kernel[(n_q_tiles, n_heads, n_seq)](
        **_common.attention_args(q, k, v, alpha, bias, cu_seqlens_q, cu_seqlens_k, scale, is_causal, dropout_p, seed),
        OUT=out, TAU=tau, LSUM=lsum, NNZ=nnz, N_VALID=n_valid, LIVE=live, N_SWEEPS=n_sweeps,
        **_common.stride_args("stride_o", out, "bhmd"), n_q_tiles=n_q_tiles, n_words=plan.n_words,
        tol=DEFAULT_TOL if tol is None else float(tol),
        max_sweeps=DEFAULT_MAX_SWEEPS if max_sweeps is None else int(max_sweeps),
        inv_keep=1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )
    return result
