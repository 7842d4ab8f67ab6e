"""Fused forward of alpha-entmax attention: every pass over K in one Triton launch.

One program owns one query tile of one (batch or sequence, head). It computes, tile by tile and
without storing the scores ``z = (alpha - 1) * s``:

1. a **grid pass** over the visible key tiles: the row maximum ``m``, the number of valid keys
   and ``f``, ``g`` (and the key count) at ``GRID_K`` points ``ref + i / (GRID_K - 1)`` just below
   the running maximum (``ref``: the row's reference score, every later quantity is relative to it; docs/kernels.md,
   "Shift invariance"), kept in a ring so that they are exact over all keys when the pass ends;
   key tiles with every score below the lowest point are dead (the threshold is at least ``m - 1``);
   the tiles are visited max-first (the diagonal tile first when causal, else the diagonal or window centre, then
   outward: ``_masking.max_first_tile``), so that far tiles are already dead when seen and cost little more than
   their score product (``_fwd_rows.tile_screen``);
2. **candidate passes** over the live tiles, only while some row of the tile has not pinned its
   threshold down to the dtype's tolerance: ``f``, ``g`` at ``CAND_P`` points of the certified bracket
   (kernels/attn/_threshold.py), tiles with no score above the certified lower bound marked dead;
3. a **value pass** over the live tiles accumulating ``sum_j p_ij v_j`` and ``sum_j p_ij``, divided at
   the end so that every row sums to one; when gradients are needed also ``sum_j U_ij v_j`` and
   ``sum_j U_ij`` (``U = p^(2 - alpha)``, the backward's ``delta``, docs/backward.md).

alpha == 1 instead runs the whole flash-style online softmax in one pass. The alpha class
(softmax, sparsemax, 1.5-entmax, other alpha, or mixed per head with a run-time branch) is a
compile-time constant. Later passes walk the liveness bitmap word by word and visit only the set
bits, with no branch per tile. The derivation, the measured pass counts and the cost model are in
``docs/kernels.md``; the conventions (statistics, bitmap layout, varlen, causal alignment, GQA,
dropout) in ``docs/design.md``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _args
from .._args import ALPHA_CLASSES, CLASS_POW, class_launches, resolve_alpha_class
from .._args import alpha_class_of as alpha_class_of  # re-exported: the public place of the class rule
from .._common import alpha_class_id, load_rows, rows_source, slice_base, store_rows
from .._masking import key_tile_range, max_first_tile, program_mods, seq_bounds
from .._spec import kernel_spec
from ._fwd_entmax import entmax_rows
from ._fwd_rows import KeyTiles, Rows, Scalars, Tiles, softmax_rows, value_rows
from ._fwd_split import threshold_rows
from ._threshold import FWD_MAX_PASSES as DEFAULT_MAX_PASSES  # re-exported: the public place of the default
from ._threshold import FWD_POINTS
from ._threshold import default_tolerance as default_tolerance  # re-exported


class EntmaxAttnFwdResult(NamedTuple):
    """What :func:`entmax_attn_fwd` returns.

    out:         ``(B, Hq, Nq, Dv)`` in ``q.dtype``.
    out_u:       float32 ``(B, Hq, Nq, Dv)``, ``sum_j U_ij v_j / sum_j U_ij`` with ``U = p^(2 - alpha)`` (dropout
                 applied to the numerator's weights; the output before rounding on alpha = 1 heads, where
                 ``U = p``), from which the backward takes ``delta = dO . out_u`` (docs/backward.md); only with
                 ``need_out_u``, else None. Float32 because ``delta`` cancels against ``dP`` where the weights
                 saturate: from an fp16/bf16 ``out_u`` its rounding would dominate the q and k gradients.
    tau:         float32 ``(B, Hq, Nq)``, threshold in the z-scale (logsumexp of the scores at alpha == 1),
                 ``+inf`` for rows with no valid key, NaN for rows with a NaN or ``+inf`` score.
    tau_lo:      float32 ``(B, Hq, Nq)``, the rounding residual of ``tau``: the threshold is ``tau + tau_lo``
                 exactly (0 where ``tau`` is not finite). The kernels compute relative to a per-row reference score
                 (docs/kernels.md, "Shift invariance"); the backward forms ``z - tau - tau_lo`` from the two, so
                 that a huge constant added to a row (a padding mask of ``finfo.min``) is not lost in ``tau``.
    lsum:        float32 ``(B, Hq, Nq)``, ``sum_j [z_ij - tau_i]_+^beta`` (1 at alpha == 1, 0 for empty rows).
    nnz:         int32 ``(B, Hq, Nq)``, support size (number of valid keys at alpha == 1).
    n_valid:     int32 ``(B, Hq, Nq)``, number of keys the row may attend to (not masked).
    live:        int32 ``(B_or_nseq, Hq, cdiv(max_seqlen_q, block_m), cdiv(cdiv(max_seqlen_k, block_n), 32))``
                 tile liveness bitmap (docs/design.md).
    n_passes:    int32 ``(B_or_nseq, Hq, cdiv(max_seqlen_q, block_m))``, passes over the key range per query
                 tile, the grid pass and the value pass included (1 at alpha == 1).
    tile_visits: int32, same shape, key tiles loaded per query tile, summed over all passes.
    block_m, block_n: the tile sizes used (the backward must use the same).
    """

    out: torch.Tensor
    out_u: torch.Tensor | None
    tau: torch.Tensor
    tau_lo: torch.Tensor
    lsum: torch.Tensor
    nnz: torch.Tensor
    n_valid: torch.Tensor
    live: torch.Tensor
    n_passes: torch.Tensor
    tile_visits: torch.Tensor
    block_m: int
    block_n: int


# size-like ints that differ between sequence lengths are not specialized (divisibility by 16, == 1): one build
# serves every length; their sm_90 builds are the same with and without (docs/kernels.md)
@triton.jit(do_not_specialize=["n_q_tiles", "n_words"])
def _entmax_attn_fwd_kernel(
    Q, K, V, OUT, OUT_U, ALPHA, TAU, TAU_LO, LSUM, NNZ, N_VALID, LIVE, N_PASSES, TILE_VISITS, CU_SEQLENS_Q,
    CU_SEQLENS_K, MODS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_oub, stride_ouh, stride_oum, stride_oud,
    n_heads, kv_group, total_q, total_k, n_q_tiles, n_words,
    scale, tol, max_passes, seed, dropout_p, inv_keep, MASK, SCORE,
    ALPHA_CLASS: tl.constexpr, HEAD_FILTER: tl.constexpr, POW: tl.constexpr, GRID_K: tl.constexpr,
    CAND_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BIAS_KIND: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, NEED_OUT_U: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGE: tl.constexpr = 0, USE_TMA: tl.constexpr = False,
):
    """One program per (query tile, q head ``h``, batch entry or sequence ``seq``); see the module doc.

    Query tiles run longest first: program 0 takes the last tile, whose causal key range is the longest. ``STAGE``
    (alpha in (1, 2] only): 0 the fused forward, every pass in this launch; 1 the split forward's threshold kernel
    (``_fwd_split.threshold_rows``: stores the rows' reference scores in ``TAU``, the thresholds and certified lower
    bounds relative to them in ``TAU_LO`` and ``LSUM``, the NaN / +inf flags in ``NNZ``, the valid-key counts, passes,
    visits and the bitmap); 2 its value kernel (reads them, writes every output). ``POW``, ``GRID_K``, ``CAND_P``:
    the class's threshold arithmetic and points, from the host (``_args.CLASS_POW``, ``_threshold.FWD_POINTS``).
    """
    pid_m = n_q_tiles - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    if HEAD_FILTER:
        # one launch per alpha class over all heads: a program whose head is of another class has nothing to do
        if alpha_class_id(tl.load(ALPHA + h)) != ALPHA_CLASS:
            return
    b, q_start, seqlen_q, k_start, seqlen_k = seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, seq, total_q, total_k, IS_VARLEN)
    h_kv = h // kv_group
    bh = b * n_heads + h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < seqlen_q

    q_base = slice_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm)
    q = load_rows(q_base, rows, offs_d, stride_qm, stride_qd, row_ok, offs_d < HEAD_DIM, UPCAST)  # [BLOCK_M, BLOCK_D]
    # the program's run-time values, built once and handed down as tuples (kernels/attn/_fwd_rows.py)
    kv = KeyTiles(rows_source(K, b, h_kv, k_start, seqlen_k, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_N,
                              BLOCK_D, USE_TMA),
                  rows_source(V, b, h_kv, k_start, seqlen_k, stride_vb, stride_vh, stride_vn, HEAD_DIM_V, BLOCK_N,
                              BLOCK_DV, USE_TMA), stride_kn, stride_kd, stride_vn,
                  stride_vd, tl.arange(0, BLOCK_N), offs_d < HEAD_DIM, offs_dv < HEAD_DIM_V)
    rw = Rows(rows, seqlen_q, seqlen_k, q_start, k_start, total_k, bh, seed, dropout_p, inv_keep)
    mods = program_mods(MODS, b, seq, h, q_start, k_start, SCORE)
    tile_id = (seq.to(tl.int64) * n_heads + h) * n_q_tiles + pid_m
    live_base = LIVE + tile_id * n_words
    kt_lo, kt_hi = key_tile_range(pid_m, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
    if STAGE != 2:
        for wd in range(0, n_words):
            tl.store(live_base + wd, 0)
        tl.debug_barrier()

    alpha = tl.load(ALPHA + h)
    # unchecked device alpha outside [1, 2] (or NaN) reaches the general class: that head's outputs are NaN
    a_ok = (alpha >= 1.0) & (alpha <= 2.0)
    sc = Scalars(scale, tl.where(a_ok, alpha, 1.5), tol, max_passes)
    kt_first = max_first_tile(pid_m, seqlen_q, seqlen_k, kt_lo, kt_hi, MASK, BLOCK_M, BLOCK_N)
    tiles = Tiles(kt_lo, kt_hi, kt_first, n_words, live_base)
    if STAGE == 1:
        # for stage 2, in the statistics it will overwrite: the rows' reference scores (TAU), the thresholds and the
        # certified lower bounds relative to them (TAU_LO, LSUM), the NaN / +inf flags (NNZ) and the valid-key counts
        tau, tau_lo, lsum, nnz, n_valid, passes, visits = threshold_rows(q, kv, rw, mods, tiles, sc, POW, BIAS_KIND,
                                                                         MASK, SCORE, DOT_PRECISION)
    elif ALPHA_CLASS == 0:
        out, tau, tau_lo, lsum, nnz, n_valid, visits = softmax_rows(
            q, kv, rw, Tiles(kt_lo, kt_hi, kt_lo, n_words, live_base), mods, scale, BIAS_KIND, MASK, SCORE,
            HAS_DROPOUT, DOT_PRECISION)
        passes = tl.full([], 1, tl.int32)
        out_u = out  # U = p
    else:
        if STAGE == 0:
            out, out_u, tau, tau_lo, lsum, nnz, n_valid, passes, visits = entmax_rows(
                q, kv, rw, tiles, mods, sc, POW, GRID_K, CAND_P, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, NEED_OUT_U,
                DOT_PRECISION)
        else:
            stat_offs = bh.to(tl.int64) * total_q + (q_start + rows).to(tl.int64)
            n_valid = tl.load(N_VALID + stat_offs, mask=row_ok, other=0)
            ref = tl.load(TAU + stat_offs, mask=row_ok, other=0.0)
            lo_kill = tl.load(LSUM + stat_offs, mask=row_ok, other=0.0)
            tau_rel = tl.load(TAU_LO + stat_offs, mask=row_ok, other=0.0)
            vr = (tau_rel, lo_kill, sc.alpha, scale * (sc.alpha - 1.0), ref, n_valid > 0,
                  tl.load(NNZ + stat_offs, mask=row_ok, other=0), tl.load(N_PASSES + tile_id),
                  tl.load(TILE_VISITS + tile_id))
            out, out_u, tau, tau_lo, lsum, nnz, passes, visits = value_rows(
                q, kv, rw, tiles, mods, vr, POW, BIAS_KIND, MASK, SCORE, HAS_DROPOUT, NEED_OUT_U, DOT_PRECISION)
        out = tl.where(a_ok, out, float("nan"))
        tau = tl.where(a_ok, tau, float("nan"))
        lsum = tl.where(a_ok, lsum, float("nan"))
        out_u = tl.where(a_ok, out_u, float("nan"))
    # formed where they are stored, after the passes
    stat_offs = bh.to(tl.int64) * total_q + (q_start + rows).to(tl.int64)
    tl.store(TAU + stat_offs, tau, mask=row_ok)
    tl.store(TAU_LO + stat_offs, tau_lo, mask=row_ok)
    tl.store(LSUM + stat_offs, lsum, mask=row_ok)
    tl.store(NNZ + stat_offs, nnz, mask=row_ok)
    tl.store(N_VALID + stat_offs, n_valid, mask=row_ok)
    if STAGE != 1:
        # the output first, then out_u: one float32 tile and its addresses live at a time
        store_rows(slice_base(OUT, b, h, q_start, stride_ob, stride_oh, stride_om), rows, offs_dv, stride_om,
                   stride_od, out, row_ok, offs_dv < HEAD_DIM_V)
        if NEED_OUT_U:
            store_rows(slice_base(OUT_U, b, h, q_start, stride_oub, stride_ouh, stride_oum), rows, offs_dv, stride_oum,
                       stride_oud, out_u, row_ok, offs_dv < HEAD_DIM_V)
    tl.store(N_PASSES + tile_id, passes)
    tl.store(TILE_VISITS + tile_id, visits)


# alpha classes the split forward runs by default: those where it models cheaper than the fused kernel per key tile,
# dense and at 60% / 90% dead tiles, under triton 3.6 and 3.9 (docs/kernels.md, "Which forward runs"); the general
# class (any other alpha) keeps the fused kernel, whose grid pass needs no separate max pass
SPLIT_CLASSES = frozenset({"entmax15", "sparsemax"})
# register caps of the split forward's threshold kernel by (BLOCK_M, BLOCK_N, num_warps, BLOCK_D) and ALPHA_CLASS, so
# that more programs share an SM (3 of 4 warps at 168 registers): the sm_90 builds under triton 3.6 and 3.9, causal or
# not, spill nothing inside a loop with them (docs/kernels.md; sparsemax would at 168 under 3.6, general alpha at 128
# when causal under 3.9); other configs uncapped
SPLIT_MAXNREG = {(64, 64, 4, 128): {2: 168, 3: 168}}

# the launches that load their K / V tiles with TMA descriptors on sm_90 (``USE_TMA``, ``takes_tma``): every launch
# whose BLOCK_D and BLOCK_DV are in FWD_TMA_BLOCK_D (the head dims built offline) but those in FWD_NO_TMA, by
# (ALPHA_CLASS, STAGE, NEED_OUT_U, BLOCK_D), whose sm_90 builds spill more inside a loop with the descriptors than
# without under triton 3.6 or 3.9 (spill accesses in loops, pointer loads -> descriptors) or model no fewer cycles
# per key tile (docs/kernels.md, "TMA descriptors for K / V")
FWD_TMA_BLOCK_D = frozenset({64, 128, 256})
FWD_NO_TMA = frozenset({
    (1, 2, False, 64), (1, 2, True, 64), (2, 2, False, 64), (2, 2, True, 64),  # value kernels: 8-14 more cycles
    (2, 1, False, 128), (2, 1, True, 128),  # the 1.5-entmax threshold kernel at its 168-register cap: 3.6 0 -> 1
    (1, 2, True, 128), (2, 2, True, 128),  # the training value kernels: 3.6 0 -> 2, 3.9 0 -> 6 / 7
    (1, 0, False, 128),  # sparsemax, fused: 3.6 0 -> 1
    (2, 0, True, 128),  # 1.5-entmax, fused training: 3.9 15 -> 19
    (3, 0, True, 128), (3, 0, True, 256),  # general alpha, training: 3.6 41 -> 61 / 0 -> 5, 3.9 80 -> 102 / 0 -> 10
    # general alpha split (not the default): threshold kernel 3.6 0 -> 1; value kernels 3.6 0 -> 15 (128), training
    # 0 -> 30 (64), 3 -> 35 (128), 0 -> 1 (256), 3.9 23 -> 50 (128), 0 -> 3 (256)
    (3, 1, False, 128), (3, 1, True, 128), (3, 2, False, 128), (3, 2, True, 64), (3, 2, True, 128), (3, 2, True, 256),
})

# on a GPU the kernel is autotuned per head dim, tile, alpha class, mask kind, causal flag and precision;
# the interpreter runs one pinned config (autotuning several fails there)
_entmax_attn_fwd_autotuned = triton.autotune(
    configs=_args.launch_configs(), prune_configs_by={"early_config_prune": _args.prune_to_pinned(
        lambda args: _pick_config(args["HEAD_DIM"], False, args["Q"].element_size(),
                                  args.get("HEAD_DIM_V"))[2:], by_args=True)},
    key=["HEAD_DIM", "HEAD_DIM_V", "BLOCK_M", "BLOCK_N", "ALPHA_CLASS", "HEAD_FILTER", "BIAS_KIND", "MASK", "SCORE",
         "IS_VARLEN", "HAS_DROPOUT", "NEED_OUT_U", "DOT_PRECISION", "USE_TMA"],
)(_entmax_attn_fwd_kernel)


def _pick_config(head_dim: int, interpret: bool, elem_size: int = 2, head_dim_v: int | None = None):
    """``(block_m, block_n, num_warps, num_stages)``: one pinned config per head dim (and, for float32 inputs, value
    head dim: ``elem_size``, ``head_dim_v``, default ``head_dim``).

    GPU: up to head dim 64, 128 x 64 tiles on 8 warps; up to 128, 64 x 64 on 4 warps; above, 64 x 32 on 8 warps; two
    pipeline stages. Head dims 64 and 256 keep the configs of the offline sm_90 builds (the smallest tiles free of
    spills for every alpha class); head dim 128 takes the winner of an H200 sweep (1.12-1.40x the former 128 x 32 /
    8 warps at alpha 1.5 and 1.25, 1.47-1.62x at alpha 1, forward and forward + backward, causal or not; a few bytes
    spilled): benchmarks/results/nvidia-h200/tune/ and docs/kernels.md. Float32 inputs whose head dim or value head
    dim is above 128 take one stage: two need 272-288 KiB of shared memory, above sm_90's 227 KiB (an H200 launch
    failed so; sm_90 builds).
    """
    if interpret:
        return 32, 32, 4, 1
    head_dim_block = _args.head_dim_block(head_dim)
    stages = 1 if elem_size > 2 and _args.head_dim_block(max(head_dim, head_dim_v or head_dim)) > 128 else 2
    if head_dim_block <= 64:
        return 128, 64, 8, stages
    if head_dim_block <= 128:
        return 64, 64, 4, stages
    return 64, 32, 8, stages


def fwd_block_sizes(head_dim: int) -> tuple:
    """Default ``(block_m, block_n)`` of :func:`entmax_attn_fwd` for this head dim (the liveness map's tiles)."""
    block_m, block_n, _, _ = _pick_config(head_dim, _args.interpreting())
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
    max_passes: int | None = None,
    *,
    alpha_class: str | None = None,
    need_out_u: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window_size: tuple | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_mask: tuple | None = None,
    split: bool | None = None,
) -> EntmaxAttnFwdResult:
    """Fused entmax attention forward (one kernel launch).

    Arguments are validated by the caller (``sparse_attn.entmax_attention``); here only cheap
    asserts and the launch-grid limit (``ValueError``).

    Args:
        q: ``(B, Hq, Nq, D)``, fp16/bf16/fp32, any strides; with varlen ``(1, Hq, total_q, D)``.
        k, v: ``(B, Hk, Nk, D)`` and ``(B, Hk, Nk, Dv)`` (``16 <= Dv <= 256``; ``Hq % Hk == 0``, q head ``h`` reads
            kv head ``h // (Hq // Hk)``),
            same dtype and device as ``q``; with varlen ``(1, Hk, total_k, D)``. ``16 <= D <= 256``.
        alpha: float32 ``(Hq,)`` (each in ``[1, 2]``, mixed per head), or a Python float for every head.
        scale: float multiplying ``q . k``.
        bias: None, an additive float mask or a boolean (uint8) keep mask (True = may attend), broadcastable
            to ``(B, Hq, Nq, Nk)`` and read at its own shape with zero strides (``-inf`` in a float mask
            masks). Default None.
        is_causal: bottom-right aligned causal mask (key ``j`` visible to row ``i`` iff
            ``j <= i + Nk - Nq``, per sequence; ``kernels/_masking.py``). Default False.
        window_size: ``(left, right)`` sliding window, bottom-right aligned like ``is_causal``: row ``i`` sees key
            ``j`` iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (``-1`` = unbounded side); key tiles
            outside it are never visited. Default None (no window).
        alibi_slopes: float32 ``(Hq,)`` or ``(B or nseq, Hq)``: adds ``-slope * |i + Nk - Nq - j|`` to the scores
            (flash-attn's ALiBi), computed in the kernel. Default None.
        softcap: scores ``scale * q.k`` become ``softcap * tanh(scale * q.k / softcap)`` before masks and
            ALiBi. Default None (off).
        sinks: ``(Hq,)`` per-head sink logits (read as float32): each row is normalized over its keys plus a virtual
            key of score ``sinks[h]`` (not scaled, capped or masked) and zero value; ``lsum`` and ``tau`` include it.
            A NaN or ``+inf`` sink makes that head's rows NaN. Default None.
        block_mask: ``(mask, (bq, bk))``: key ``j`` is hidden from row ``i`` (sequence-local) when
            ``mask[b or seq, h, i // bq, j // bk]`` is False (``mask`` boolean ``(B or nseq or 1, Hq or 1, q blocks,
            k blocks)``). Default None.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` packed-sequence offsets (then ``B == 1``).
        max_seqlen_q, max_seqlen_k: longest sequences; computed from ``cu_seqlens`` when None.
        dropout_p: probability of dropping a weight after the entmax (kept ones scaled by
            ``1 / (1 - dropout_p)``), drawn by ``kernels._common.dropout_keep``. Default 0.
        seed: int RNG seed of the dropout. Default 0.
        tol: a row's threshold counts as found once its certified bracket is narrower than
            ``tol * (1 + |tau|)`` (default by dtype, :func:`default_tolerance`).
        max_passes: cap on the passes over the key range per query tile (default 32).
        alpha_class: ``"softmax"``, ``"sparsemax"``, ``"entmax15"``, ``"general"`` (every head strictly between
            1 and 2, none 1.5) or ``"mixed"`` (any alpha per head: one launch per class over every head, a
            program skipping heads of other classes; alpha outside [1, 2] or NaN gives NaN outputs for that
            head). Default: from the values for a Python float or a CPU tensor (no device sync), else ``"mixed"``.
        need_out_u: also compute ``out_u`` (float32) for the backward (alpha != 1: one more tensor-core product and
            a few operations per score of the value pass, docs/backward.md); off for inference. Default False.
        block_m, block_n: tile sizes (powers of two >= 16); default by head dim.
        num_warps, num_stages: force this launch config (a power of two in [1, 32] warps, 1 to 8 pipeline stages; the
            one not given is the pinned one of this head dim) instead of the GPU's ``triton.autotune`` over
            ``_args.launch_configs``; for tuning (``benchmarks/gpu/tune_tiles.py``). Default None (autotuned on a GPU,
            pinned under the interpreter or with ``SPARSE_ATTN_PINNED=1``).
        split: True: run the heads of alpha in (1, 2] by the split forward (a threshold kernel, then a value kernel
            that knows tau: ``kernels/attn/_fwd_split.py``) with the pinned launch config; False: by the fused kernel;
            None: per alpha class as :func:`runs_split` says. Default None.

    Returns:
        :class:`EntmaxAttnFwdResult`.

    Raises:
        ValueError: more than 65535 heads or batch entries (sequences) (``_args.tile_plan``); ``num_warps`` or
            ``num_stages`` out of range (``TypeError`` when not an int).
    """
    spec = kernel_spec(q, k, v, alpha, scale, bias=bias, is_causal=is_causal, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       dropout_p=dropout_p, alpha_class=alpha_class, window_size=window_size,
                       alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, block_mask=block_mask)
    return launch_fwd(spec, seed, tol=tol, max_passes=max_passes, need_out_u=need_out_u, block_m=block_m,
                      block_n=block_n, num_warps=num_warps, num_stages=num_stages, split=split)


@_args.launches_on(lambda spec, *args, **kwargs: spec.q)
def launch_fwd(spec, seed: int = 0, *, tol: float | None = None, max_passes: int | None = None,
               need_out_u: bool = False, block_m: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               split: bool | None = None) -> EntmaxAttnFwdResult:
    """:func:`entmax_attn_fwd` of an ``AttnSpec`` (``kernels/_spec.py``: the fused op's spec, or ``kernel_spec`` of
    the launcher's keywords), with the dropout ``seed`` and the launch options of :func:`entmax_attn_fwd`."""
    forced = _forced_options(num_warps, num_stages, spec.q.shape[-1], spec.q.element_size(), spec.v.shape[-1])
    plan = _plan(spec, seed, tol, max_passes, need_out_u, block_m, block_n)
    split_classes = {ALPHA_CLASSES[c] for c in ("sparsemax", "entmax15", "general") if runs_split(c, split)}
    # K / V tiles by TMA descriptors where the device and the layout allow, in the launches that gain (takes_tma);
    # 16-bit inputs only: the builds measured (float32 ones spill with pointer loads and with descriptors); their
    # scratch (two descriptors per program) within 8 MiB or the output's size
    tma = (bool(plan.launches) and spec.k.element_size() == 2 and _args.tma_device(spec.q.device)
           and _args.tma_rows(spec.k) and _args.tma_rows(spec.v)
           and _args.tma_scratch_fits(plan.grid, 2, plan.result.out))
    for args in plan.launches:
        if args["ALPHA_CLASS"] in split_classes:
            # the split forward: the threshold kernel, then the value kernel, with the pinned (or forced) config
            options = plan.options if forced is None else forced
            for stage in (1, 2):
                _entmax_attn_fwd_kernel[plan.grid](**args, STAGE=stage, USE_TMA=tma and takes_tma(args, stage),
                                                   **_split_options(stage, args, options))
        else:
            args = dict(args, USE_TMA=tma and takes_tma(args, 0))
            if forced is not None:
                _entmax_attn_fwd_kernel[plan.grid](**args, **forced)
            elif _args.pinned_launch():
                _entmax_attn_fwd_kernel[plan.grid](**args, **plan.options)
            else:
                _entmax_attn_fwd_autotuned[plan.grid](**args)
    return plan.result


def takes_tma(args: dict, stage: int) -> bool:
    """Whether the launch of ``args`` (a ``_plan`` launch) at ``stage`` loads its K / V tiles with TMA descriptors on
    sm_90: its ``BLOCK_D`` and ``BLOCK_DV`` are in :data:`FWD_TMA_BLOCK_D` and its (alpha class, stage, training,
    ``BLOCK_D``) not in :data:`FWD_NO_TMA`."""
    return (args["BLOCK_D"] in FWD_TMA_BLOCK_D and args["BLOCK_DV"] in FWD_TMA_BLOCK_D
            and (args["ALPHA_CLASS"], stage, bool(args["NEED_OUT_U"]), args["BLOCK_D"]) not in FWD_NO_TMA)


def runs_split(alpha_class: str, split: bool | None = None) -> bool:
    """Whether :func:`entmax_attn_fwd` runs the heads of ``alpha_class`` (``"sparsemax"``, ``"entmax15"`` or
    ``"general"``; ``"softmax"`` never) by the split forward: ``split`` when given, else ``SPARSE_ATTN_FWD_SPLIT``
    (``1``: every class, ``0``: none) when the environment sets it, else the class's default (``SPLIT_CLASSES``)."""
    if alpha_class == "softmax":
        return False
    if split is None:
        env = os.environ.get("SPARSE_ATTN_FWD_SPLIT")
        return alpha_class in SPLIT_CLASSES if env is None else env == "1"
    return bool(split)


def _split_options(stage: int, args: dict, options: dict) -> dict:
    """Launch options of a split forward stage: ``options``, plus the threshold kernel's register cap
    (``SPLIT_MAXNREG``) at the configs it was measured at."""
    cap = SPLIT_MAXNREG.get((args["BLOCK_M"], args["BLOCK_N"], options["num_warps"], args["BLOCK_D"]), {})
    if stage == 1 and args["ALPHA_CLASS"] in cap and not _args.interpreting():
        return dict(options, maxnreg=cap[args["ALPHA_CLASS"]])
    return options


def _forced_options(num_warps, num_stages, head_dim: int, elem_size: int = 2,
                    head_dim_v: int | None = None) -> dict | None:
    """``num_warps`` / ``num_stages`` launch options of a forced config (the one not given pinned for ``head_dim``,
    the inputs' ``elem_size`` and ``head_dim_v``), or
    None when neither is given. Raises ``ValueError`` naming an argument out of range."""
    if num_warps is None and num_stages is None:
        return None
    for name, value, allowed, expected in (("num_warps", num_warps, (1, 2, 4, 8, 16, 32), "a power of two in [1, 32]"),
                                           ("num_stages", num_stages, range(1, 9), "an int in [1, 8]")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name}: expected {expected} or None, got {type(value).__name__} {value!r}")
        if value is not None and value not in allowed:
            raise ValueError(f"{name}: expected {expected} or None, got {value!r}")
    _, _, warps, stages = _pick_config(head_dim, _args.interpreting(), elem_size, head_dim_v)
    return dict(num_warps=warps if num_warps is None else num_warps,
                num_stages=stages if num_stages is None else num_stages)


class _Launch(NamedTuple):
    grid: tuple | None
    launches: list
    options: dict
    result: EntmaxAttnFwdResult


def _plan(spec, seed, tol, max_passes, need_out_u, block_m, block_n) -> _Launch:
    """Allocate the outputs and name every kernel argument of one forward launch of ``spec``."""
    q, k, v, cu_seqlens_q = spec.q, spec.k, spec.v, spec.cu_seqlens_q
    batch, n_heads, total_q, head_dim = q.shape
    assert 16 <= head_dim <= 256, f"q: head dim must be in [16, 256], got {head_dim}"
    default_m, default_n, num_warps, num_stages = _pick_config(head_dim, _args.interpreting(), q.element_size(),
                                                               v.shape[3])
    plan = _args.tile_plan(q, k, cu_seqlens_q, spec.cu_seqlens_k, spec.max_seqlen_q, spec.max_seqlen_k,
                           default_m if block_m is None else block_m, default_n if block_n is None else block_n)
    n_seq, n_q_tiles = plan.n_seq, plan.n_q_tiles
    alpha_class = resolve_alpha_class(spec.alpha, spec.alpha_class)

    stats = dict(size=(batch, n_heads, total_q), device=q.device)
    out_shape = (*q.shape[:3], v.shape[3])
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    out_u = torch.empty(out_shape, dtype=torch.float32, device=q.device) if need_out_u else None
    tau = torch.empty(**stats, dtype=torch.float32)
    tau_lo = torch.empty(**stats, dtype=torch.float32)
    lsum = torch.empty(**stats, dtype=torch.float32)
    nnz = torch.empty(**stats, dtype=torch.int32)
    n_valid = torch.empty(**stats, dtype=torch.int32)
    live = torch.empty((n_seq, n_heads, n_q_tiles, plan.n_words), dtype=torch.int32, device=q.device)
    n_passes = torch.empty((n_seq, n_heads, n_q_tiles), dtype=torch.int32, device=q.device)
    tile_visits = torch.empty_like(n_passes)
    result = EntmaxAttnFwdResult(out, out_u, tau, tau_lo, lsum, nnz, n_valid, live, n_passes, tile_visits, plan.block_m,
                                 plan.block_n)
    if cu_seqlens_q is not None and out.numel() > 0:
        # rows outside every sequence are never visited
        out.zero_()
        if out_u is not None:
            out_u.zero_()
        tau.fill_(float("inf"))
        tau_lo.zero_()
        lsum.zero_()
        nnz.zero_()
        n_valid.zero_()
    if n_q_tiles == 0 or n_seq == 0 or n_heads == 0:
        return _Launch(None, [], {}, result)

    dropout_p = float(spec.dropout_p)
    args = dict(
        **_args.attention_args(spec, seed, (plan.block_m, plan.block_n)),
        OUT=out, OUT_U=out if out_u is None else out_u, TAU=tau, TAU_LO=tau_lo, LSUM=lsum, NNZ=nnz, N_VALID=n_valid,
        LIVE=live, N_PASSES=n_passes, TILE_VISITS=tile_visits, **_args.stride_args("stride_o", out, "bhmd"),
        **_args.stride_args("stride_ou", out if out_u is None else out_u, "bhmd"), NEED_OUT_U=out_u is not None,
        n_q_tiles=n_q_tiles, n_words=plan.n_words,
        tol=default_tolerance(q.dtype) if tol is None else float(tol),
        max_passes=DEFAULT_MAX_PASSES if max_passes is None else int(max_passes),
        inv_keep=1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
    )
    # per class its threshold arithmetic and points (FWD_POINTS read here: benchmarks/offline/points_sweep.py sets it)
    launches = [dict(args, ALPHA_CLASS=c, HEAD_FILTER=f, POW=CLASS_POW[c], GRID_K=FWD_POINTS[CLASS_POW[c]][0],
                     CAND_P=FWD_POINTS[CLASS_POW[c]][1]) for c, f in class_launches(alpha_class)]
    return _Launch((n_q_tiles, n_heads, n_seq), launches, dict(num_warps=num_warps, num_stages=num_stages), result)


def entmax_attn_fwd_split(*args, **kwargs) -> EntmaxAttnFwdResult:
    """:func:`entmax_attn_fwd` with ``split=True``: the same arguments and result."""
    return entmax_attn_fwd(*args, split=True, **kwargs)
