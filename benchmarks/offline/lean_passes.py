"""Prototype pass loops of the forward's threshold designs, built offline for sm_90 and priced per key tile.

A study tool (docs/kernels.md, "Design study: threshold passes"), not a kernel of the package: each prototype is one
Triton kernel whose one tile loop does the work of one pass of a candidate design on plain tiles (no mask, not
causal, every key valid), written in the style of ``kernels/attn/_fwd_rows.py`` (the K tile loaded as there, the
point sums of ``kernels/attn/_threshold.py``), so that its SASS is what such a pass would issue:

* ``max``: the row max of the raw scores and their row sum (a NaN / +inf flag: a finite sum means finite scores);
  the first pass of a design that knows ``m`` before any threshold work;
* ``points``: ``f``, ``g`` (per-lane partial sums) at ``NPTS`` points ``m - 1 + i w`` fixed per row (the row max is
  known: no ring, no restarts), a key tile whose scores all lie at or below ``m - 1`` skipping the point work (one
  row max and one CTA-wide compare), and the tile's live bit; ``NPTS`` 1 / 2 over the live tiles (bitmap walk) is a
  refinement pass (Newton / Halley / two points straddling the estimate);
* ``hist``: a packed-counter histogram of ``z - (m - 1)`` in 16 bins of width ``1 / 16`` (4-bit fields, two words
  per row, flushed into integer counts every tile), the cheap certified bracket of AdaSplash-2's kind;
* ``value``: the value pass of a kernel that knows the threshold: ``p = [z - tau]_+^beta``, ``acc += p V``,
  ``l += p`` (and with ``nnz`` the support count and the refined live bit), over the live tiles; no running max, no
  rescale;
* ``threshold``: a whole threshold kernel (max pass, a 4-point pass, refinement passes while a row is not done,
  ``tau`` stored): its registers decide how many CTAs share an SM (``--maxnreg``).

Usage (from the project root; ``PYTHONPATH=.`` with triton 3.6's venv)::

    python benchmarks/offline/lean_passes.py [--d 128] [--block 64 64] [--warps 4] [--json FILE] [--maxnreg 128]

Prints per prototype: registers / spill bytes of the build and, per tile loop, instructions per warp per key tile,
the binding resource and the cycles of ``benchmarks/offline/sass_cost.py``'s H100 SM model, and instructions per score.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_cost  # noqa: E402
import sm90_build  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sparse_attn.kernels._args import ALPHA_CLASSES, CLASS_POW  # noqa: E402
from sparse_attn.kernels._common import load_rows  # noqa: E402
from sparse_attn.kernels._masking import live_tile, word_bits  # noqa: E402
from sparse_attn.kernels.attn._threshold import point_sums, row_sums, weights  # noqa: E402


@triton.jit
def _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k):
    """Key tile ``kt`` transposed, ``[BLOCK_D, BLOCK_N]`` (as ``_fwd_rows._score_tile`` loads it)."""
    cols = kt * offs_n.shape[0] + offs_n
    return tl.load(K + cols.to(tl.int64)[None, :] * stride_kn + offs_d[:, None], mask=cols[None, :] < seqlen_k,
                   other=0.0)


@triton.jit
def _v_tile(V, kt, offs_n, offs_d, stride_vn, seqlen_k):
    cols = kt * offs_n.shape[0] + offs_n
    return load_rows(V, cols, offs_d, stride_vn, 1, cols < seqlen_k, offs_d < offs_d.shape[0], False)


@triton.jit
def _q_tile(Q, stride_qm, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return rows, load_rows(Q, rows, offs_d, stride_qm, 1, rows >= 0, offs_d < BLOCK_D, False)


@triton.jit
def _walked_tile(q, K, bits, rank, i, wd, offs_n, offs_d, stride_kn, seqlen_k, z_scale, lo, new_word):
    """The ``i``-th live tile of bitmap word ``wd`` (``word_bits``): its scores ``z`` and ``new_word`` with the tile's
    bit set when some row max lies above ``lo``."""
    kt = live_tile(bits, rank, i, wd)
    z = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k)) * z_scale
    return z, new_word | (tl.max((tl.max(z, 1) > lo).to(tl.int32), 0) << (kt - wd * 32))


@triton.jit
def _max_kernel(Q, K, M_OUT, BAD_OUT, stride_qm, stride_kn, seqlen_k, n_tiles, z_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    tot = tl.zeros([BLOCK_M], tl.float32)
    for kt in range(0, n_tiles):
        s = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k))
        m = tl.maximum(m, tl.max(s, 1))
        tot += tl.sum(s, 1)
    tl.store(M_OUT + rows, m * z_scale)
    tl.store(BAD_OUT + rows, (tl.abs(tot) == float("inf")) | (tot != tot))


@triton.jit
def _fixed_points(z, kt, word, t_low, width, pts, F, G, bm1, POW: tl.constexpr, LANES: tl.constexpr, LIVE):
    """One score tile ``z`` of a points pass at the points ``t_low + i width`` (``i < pts.shape[0]``): the per-lane
    sums added to ``F``, ``G`` unless no score lies above ``t_low``; its live bit set in ``word`` and stored. Returns
    ``(word, F, G)``."""
    live = tl.max((tl.max(z, 1) > t_low).to(tl.int32), 0)
    lane = kt % 32
    word = tl.where(lane == 0, 0, word) | (live << lane)
    if live != 0:
        for i in tl.static_range(pts.shape[0]):
            f, g, _ = point_sums(z, t_low + i * width, POW, bm1, t_low, LANES)
            sel = (pts == i)[None, :, None]
            F += tl.where(sel, f[:, None, :], 0.0)
            G += tl.where(sel, g[:, None, :], 0.0)
    tl.store(LIVE + kt // 32, word)
    return word, F, G


@triton.jit
def _points_kernel(Q, K, M_IN, F_OUT, G_OUT, LIVE, stride_qm, stride_kn, seqlen_k, n_tiles, z_scale, bm1, width,
                   POW: tl.constexpr, NPTS: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(M_IN + rows)
    t_low = m - 1.0
    pts = tl.arange(0, NPTS).to(tl.float32)
    F = tl.zeros([BLOCK_M, NPTS, LANES], tl.float32)
    G = tl.zeros([BLOCK_M, NPTS, LANES], tl.float32)
    word = tl.zeros([], tl.int32)
    for kt in range(0, n_tiles):
        z = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k)) * z_scale
        word, F, G = _fixed_points(z, kt, word, t_low, width, pts, F, G, bm1, POW, LANES, LIVE)
    offs_p = tl.arange(0, NPTS)
    tl.store(F_OUT + rows[:, None] * NPTS + offs_p[None, :], tl.sum(F, 2))
    tl.store(G_OUT + rows[:, None] * NPTS + offs_p[None, :], tl.sum(G, 2))


@triton.jit
def _refine_pass(q, K, LIVE, n_words, t, lo, kv, bm1, POW: tl.constexpr, LANES: tl.constexpr, COUNT: tl.constexpr):
    """A refinement pass over the live tiles: per-lane ``f``, ``g`` (and with ``COUNT`` the key counts) at the points
    ``t [BLOCK_M, NPTS]``, ``[BLOCK_M, NPTS, LANES]`` each; tiles whose row maxima all lie at or below ``lo`` die.
    ``kv = (offs_n, offs_d, stride_kn, seqlen_k, z_scale)``."""
    offs_n, offs_d, stride_kn, seqlen_k, z_scale = kv
    BLOCK_M: tl.constexpr = t.shape[0]
    NPTS: tl.constexpr = t.shape[1]
    offs_p = tl.arange(0, NPTS)
    F = tl.zeros([BLOCK_M, NPTS, LANES], tl.float32)
    G = tl.zeros([BLOCK_M, NPTS, LANES], tl.float32)
    C = tl.zeros([BLOCK_M, NPTS, LANES], tl.float32)
    for wd in range(0, n_words):
        bits, rank, n_set = word_bits(tl.load(LIVE + wd))
        new_word = tl.zeros([], tl.int32)
        for i in range(0, n_set):
            z, new_word = _walked_tile(q, K, bits, rank, i, wd, offs_n, offs_d, stride_kn, seqlen_k, z_scale, lo,
                                       new_word)
            for p in tl.static_range(NPTS):
                sel = (offs_p == p)[None, :]
                t_p = tl.sum(tl.where(sel, t, 0.0), 1)
                f, g, c = point_sums(z, t_p, POW, bm1, t_p, LANES)
                F += tl.where(sel[:, :, None], f[:, None, :], 0.0)
                G += tl.where(sel[:, :, None], g[:, None, :], 0.0)
                if COUNT:
                    C += tl.where(sel[:, :, None], c[:, None, :], 0.0)
        tl.store(LIVE + wd, new_word)
    return F, G, C


@triton.jit
def _refine_kernel(Q, K, T_IN, LO_IN, F_OUT, G_OUT, C_OUT, LIVE, stride_qm, stride_kn, seqlen_k, n_words, z_scale,
                   bm1, POW: tl.constexpr, NPTS: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, NPTS)
    t = tl.load(T_IN + rows[:, None] * NPTS + offs_p[None, :])  # [BLOCK_M, NPTS]
    lo = tl.load(LO_IN + rows)
    F, G, C = _refine_pass(q, K, LIVE, n_words, t, lo, (offs_n, offs_d, stride_kn, seqlen_k, z_scale), bm1, POW,
                           LANES, POW != 0)
    tl.store(F_OUT + rows[:, None] * NPTS + offs_p[None, :], tl.sum(F, 2))
    tl.store(G_OUT + rows[:, None] * NPTS + offs_p[None, :], tl.sum(G, 2))
    tl.store(C_OUT + rows[:, None] * NPTS + offs_p[None, :], tl.sum(C, 2))


@triton.jit
def _hist_kernel(Q, K, M_IN, H_OUT, LIVE, stride_qm, stride_kn, seqlen_k, n_tiles, z_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """16 bins of ``u = 16 (z - (m - 1))`` in [0, 16): ``floor(u)`` read from the mantissa of ``u + 1.5 * 2**23 -
    0.5`` (no F2I), a 4-bit field per bin in two words per row and lane, unpacked into int32 counts every tile (a
    thread holds at most 16 scores of a row per tile, the field at most 15: the 16th is caught by a 5th bit)."""
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.load(M_IN + rows)
    base = 12582912.0 - 0.5 - 16.0 * (m - 1.0)  # [BLOCK_M]
    fld = tl.arange(0, 8)
    H0 = tl.zeros([BLOCK_M, 8], tl.int32)
    H1 = tl.zeros([BLOCK_M, 8], tl.int32)
    word = tl.zeros([], tl.int32)
    for kt in range(0, n_tiles):
        z = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k)) * (16.0 * z_scale) + base[:, None]
        b = z.to(tl.int32, bitcast=True) - 0x4B400000  # floor(16 (z - (m - 1))), exact for |.| < 2**22
        live = tl.max((tl.max(b, 1) >= 0).to(tl.int32), 0)
        lane = kt % 32
        word = tl.where(lane == 0, 0, word) | (live << lane)
        if live != 0:
            b = tl.minimum(b, 15)
            inc = tl.where(b >= 0, 1 << ((b & 7) * 4), 0)
            w0 = tl.sum(tl.where(b < 8, inc, 0), 1)
            w1 = tl.sum(tl.where(b >= 8, inc, 0), 1)
            H0 += (w0[:, None] >> (fld * 4)[None, :]) & 15
            H1 += (w1[:, None] >> (fld * 4)[None, :]) & 15
        tl.store(LIVE + kt // 32, word)
    tl.store(H_OUT + rows[:, None] * 16 + fld[None, :], H0)
    tl.store(H_OUT + rows[:, None] * 16 + 8 + fld[None, :], H1)


@triton.jit
def _value_kernel(Q, K, V, TAU_IN, OUT, L_OUT, NNZ_OUT, LIVE, stride_qm, stride_kn, stride_vn, stride_om, seqlen_k,
                  n_words, z_scale, beta, POW: tl.constexpr, NNZ: tl.constexpr, LANES: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tau = tl.load(TAU_IN + rows)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if LANES == 0:
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        nnz = tl.zeros([BLOCK_M], tl.float32)
    else:
        l_sum = tl.zeros([BLOCK_M, LANES], tl.float32)
        nnz = tl.zeros([BLOCK_M, LANES], tl.float32)
    for wd in range(0, n_words):
        bits, rank, n_set = word_bits(tl.load(LIVE + wd))
        new_word = tl.zeros([], tl.int32)
        for i in range(0, n_set):
            kt = live_tile(bits, rank, i, wd)
            z = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k)) * z_scale
            p = weights(z, tau, POW, beta, True)
            l_sum += row_sums(p, LANES)
            if NNZ:
                pos = p > 0.0
                nnz += row_sums(pos.to(tl.float32), LANES)
                new_word = new_word | (tl.max(tl.max(pos.to(tl.int32), 1), 0) << (kt - wd * 32))
            v = _v_tile(V, kt, offs_n, offs_d, stride_vn, seqlen_k)
            acc += tl.dot(p.to(v.dtype), v)
        if NNZ:
            tl.store(LIVE + wd, new_word)
    if LANES == 0:
        l_tot = l_sum
        n_tot = nnz
    else:
        l_tot = tl.sum(l_sum, 1)
        n_tot = tl.sum(nnz, 1)
    out = acc / l_tot[:, None]
    tl.store(OUT + rows[:, None] * stride_om + offs_d[None, :], out.to(OUT.dtype.element_ty))
    tl.store(L_OUT + rows, l_tot)
    tl.store(NNZ_OUT + rows, n_tot.to(tl.int32))


@triton.jit
def _threshold_kernel(Q, K, TAU_OUT, LIVE, stride_qm, stride_kn, seqlen_k, n_tiles, n_words, z_scale, bm1, tol,
                      max_passes, POW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """A whole threshold kernel of design (b) for its register count: max pass, a 4-point pass at ``m - 1 + i/3``,
    then 2-point refinement passes (around a secant estimate) over the live tiles while a row is not done."""
    rows, q = _q_tile(Q, stride_qm, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for kt in range(0, n_tiles):
        s = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k))
        m = tl.maximum(m, tl.max(s, 1))
    m = m * z_scale
    t_low = m - 1.0
    pts = tl.arange(0, 4).to(tl.float32)
    F = tl.zeros([BLOCK_M, 4, 4], tl.float32)
    G = tl.zeros([BLOCK_M, 4, 4], tl.float32)
    word = tl.zeros([], tl.int32)
    for kt in range(0, n_tiles):
        z = tl.dot(q, _k_tile(K, kt, offs_n, offs_d, stride_kn, seqlen_k)) * z_scale
        word, F, G = _fixed_points(z, kt, word, t_low, 1.0 / 3.0, pts, F, G, bm1, POW, 4, LIVE)
    tl.debug_barrier()
    f4 = tl.sum(F, 2)
    above = tl.sum((f4 >= 1.0).to(tl.float32), 1) - 1.0
    lo = t_low + above / 3.0
    hi = tl.minimum(lo + 1.0 / 3.0, m)
    passes = 2
    f1 = tl.zeros([BLOCK_M], tl.float32)
    go = tl.max(hi - lo, 0) > tol
    while go:
        est = 0.5 * (lo + hi)
        t0 = est - 0.5 * tol
        t1 = est + 0.5 * tol
        pair = tl.arange(0, 2)[None, :, None]
        t = tl.where(tl.arange(0, 2)[None, :] == 0, t0[:, None], t1[:, None])
        F2, G2, _ = _refine_pass(q, K, LIVE, n_words, t, lo, (offs_n, offs_d, stride_kn, seqlen_k, z_scale), bm1, POW,
                                 4, False)
        tl.debug_barrier()
        f0 = tl.sum(tl.sum(tl.where(pair == 0, F2, 0.0), 2), 1)
        f1 = tl.sum(tl.sum(tl.where(pair == 1, F2, 0.0), 2), 1)
        g0 = tl.sum(tl.sum(tl.where(pair == 0, G2, 0.0), 2), 1)
        lo = tl.where(f0 >= 1.0, tl.maximum(lo, t0 + (f0 - 1.0) / tl.maximum(g0, 1e-30)), lo)
        hi = tl.where(f1 < 1.0, tl.minimum(hi, t1), hi)
        passes += 1
        go = (tl.max(hi - lo, 0) > tol) & (passes < max_passes)
    tl.store(TAU_OUT + rows, tl.where(f1 > 0.0, 0.5 * (lo + hi), lo))


def _tensors(d, n, dtype=torch.bfloat16, block_m=64, npts=8):
    q = torch.empty(n, d, dtype=dtype)
    k = torch.empty(n, d, dtype=dtype)
    v = torch.empty(n, d, dtype=dtype)
    f32 = torch.empty(n * max(npts, 16), dtype=torch.float32)
    i32 = torch.empty(n * 16, dtype=torch.int32)
    live = torch.empty(n // 32 + 1, dtype=torch.int32)
    return q, k, v, f32, i32, live


POW_ALPHA = {1: 2.0, 2: 1.5, 0: 1.25}


def prototypes(d: int, n: int, block_m: int, block_n: int, classes, npts_list=(1, 2, 4, 8)):
    """``(name, kernel, args, constexprs)`` of every prototype build."""
    q, k, v, f32, i32, live = _tensors(d, n)
    n_tiles, n_words = n // block_n, (n // block_n + 31) // 32
    blk = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d)
    common = dict(Q=q, K=k, stride_qm=q.stride(0), stride_kn=k.stride(0), seqlen_k=n, z_scale=0.5 * d ** -0.5)
    out = [("max", _max_kernel, dict(common, M_OUT=f32, BAD_OUT=i32, n_tiles=n_tiles), blk),
           ("hist16", _hist_kernel, dict(common, M_IN=f32, H_OUT=i32, LIVE=live, n_tiles=n_tiles), blk)]
    for cls in classes:
        pow_ = CLASS_POW[ALPHA_CLASSES[cls]]
        alpha = POW_ALPHA[pow_]
        beta = 1.0 / (alpha - 1.0)
        for npts in npts_list:
            out.append((f"points{npts} {cls}", _points_kernel,
                        dict(common, M_IN=f32, F_OUT=f32, G_OUT=f32, LIVE=live, n_tiles=n_tiles, bm1=beta - 1.0,
                             width=1.0 / max(npts - 1, 1)), dict(blk, POW=pow_, NPTS=npts, LANES=4)))
        for npts in (1, 2):
            out.append((f"refine{npts} {cls}", _refine_kernel,
                        dict(common, T_IN=f32, LO_IN=f32, F_OUT=f32, G_OUT=f32, C_OUT=f32, LIVE=live,
                             n_words=n_words, bm1=beta - 1.0), dict(blk, POW=pow_, NPTS=npts, LANES=4)))
        for nnz in (True, False):
            out.append((f"value{'+nnz' if nnz else ''} {cls}", _value_kernel,
                        dict(common, V=v, TAU_IN=f32, OUT=q, L_OUT=f32, NNZ_OUT=i32, LIVE=live,
                             stride_vn=v.stride(0), stride_om=q.stride(0), n_words=n_words, beta=beta),
                        dict(blk, POW=pow_, NNZ=nnz, LANES=4)))
        out.append((f"threshold {cls}", _threshold_kernel,
                    dict(common, TAU_OUT=f32, LIVE=live, n_tiles=n_tiles, n_words=n_words, bm1=beta - 1.0, tol=1e-3,
                         max_passes=32), dict(blk, POW=pow_)))
    return out


def tile_loops(compiled, block_m, block_n, d, warps):
    """Every innermost loop holding HGMMA work, with the cycles of its longest and shortest iteration
    (``sass_cost``'s paths, counts and SM model)."""
    ins = sass_cost.disassemble(compiled.asm["cubin"])
    blocks = sass_cost.blocks_of(ins)
    loops = sass_cost.natural_loops(blocks)

    def has_mma(lp):
        return any(ins[i].base == "HGMMA" for i in sass_cost._block_ins(blocks, lp.body))

    res = []
    for lp in sorted(loops, key=lambda x: blocks[x.header].first):
        if not has_mma(lp) or any(has_mma(c) for c in lp.children):
            continue
        paths = sass_cost.iteration_paths(blocks, lp, ins)
        region = sass_cost.mask_region(blocks, lp, ins)  # a full tile skips the per-score mask
        paths["interior"] = (sass_cost.iteration_paths(blocks, lp, ins, avoid=region)["live"] if region
                             else paths["live"])
        rec = dict(addr=hex(ins[blocks[lp.header].first].addr))
        for name in ("live", "interior", "dead"):
            cnt = sass_cost.count_path(ins, paths[name], warps)
            cost = sass_cost.cycles(cnt, warps)
            rec[name] = dict(instr=cnt["total"], cycles=round(cost["cycles"]), bound=cost["bound"],
                             macs=cnt["macs"], per_score=cnt["total"] * 32 * warps / (block_m * block_n),
                             mufu=cnt["by_class"].get("mufu", 0))
        res.append(rec)
    return res


def split_builds(d: int, n: int, classes, need_out_u: bool = False, causal: bool = False, options=None):
    """The real split forward (``kernels/attn/_fwd_split.py``: stages 1 and 2 of the forward kernel) built as a launch
    builds it (CPU tensors, the JIT's specialization, the pinned config, or ``options`` over it: the launcher's
    ``block_m``, ``block_n``, ``num_warps``, ``num_stages``, and ``maxnreg`` for the threshold kernel):
    ``[(name, compiled, block_m, block_n, warps)]`` for the threshold and the value kernel of each class."""
    from sparse_attn.kernels.attn import entmax_attn_fwd as fwd

    options = dict(options or {})
    launch = {k: options.pop(k) for k in ("block_m", "block_n", "num_warps", "num_stages") if k in options}
    maxnreg = options.pop("maxnreg", None)
    out = []
    for cls in classes:
        q, k, v, _ = sm90_build._problem(d, n, torch.bfloat16, False)
        alpha = torch.full((q.shape[1],), sm90_build.ALPHA_OF_CLASS[cls])
        kernel, launches = sm90_build.captured_launches(fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, q, k, v,
                                                        alpha, d ** -0.5, is_causal=causal, alpha_class=cls,
                                                        need_out_u=need_out_u, split=True, **launch)
        for _, args, kwargs in launches:
            kwargs = dict(kwargs, **options)
            if maxnreg and kwargs["STAGE"] == 1:
                kwargs["maxnreg"] = maxnreg
            compiled = sm90_build.compile_like_launch(kernel, args, kwargs)
            kind = "threshold" if kwargs["STAGE"] == 1 else "value"
            out.append((f"split {kind}{'+out_u' if need_out_u else ''} {cls}", compiled, kwargs["BLOCK_M"],
                        kwargs["BLOCK_N"], kwargs["num_warps"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--block", type=int, nargs=2, default=None, help="tiles (default 64 64; --split: the pinned)")
    ap.add_argument("--warps", type=int, default=None, help="warps (default 4; --split: the pinned)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default 2; --split: the pinned)")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap of the threshold kernel builds")
    ap.add_argument("--classes", nargs="+", default=["entmax15", "sparsemax", "general"])
    ap.add_argument("--only", nargs="*", default=None, help="prototype names starting with these")
    ap.add_argument("--json", default=None)
    ap.add_argument("--causal", action="store_true", help="--split: the causal builds")
    ap.add_argument("--split", action="store_true",
                    help="build the real split forward (kernels/attn/_fwd_split.py) instead of the prototypes")
    ap.add_argument("--no-tma", action="store_true",
                    help="pointer loads everywhere instead of TMA descriptors (as with SPARSE_ATTN_TMA=0)")
    args = ap.parse_args(argv)
    sm90_build.TMA = not args.no_tma
    if args.split:
        rows = []
        opts = {k: v for k, v in (("num_warps", args.warps), ("num_stages", args.stages), ("maxnreg", args.maxnreg))
                if v is not None}
        if args.block:
            opts.update(block_m=args.block[0], block_n=args.block[1])
        print(f"# lean_passes --split: triton {triton.__version__}, sm_90, bf16, d {args.d}, N {args.n}, "
              f"{'causal' if args.causal else 'not causal'}" + (f", {opts}" if opts else ""), flush=True)
        for need_out_u in (False, True):
            for name, compiled, bm, bn, warps in split_builds(args.d, args.n, args.classes, need_out_u, args.causal,
                                                              options=opts):
                info = sm90_build.analyse(compiled)
                loops = tile_loops(compiled, bm, bn, args.d, warps)
                rows.append(dict(name=name, triton=triton.__version__, regs=info["regs"], spill=info["spill"],
                                 smem=info["smem"], loop_ldst=info["loop_ldst"], block=f"{bm}x{bn}", num_warps=warps,
                                 loops=loops))
                print(f"{name:28s} {bm}x{bn} w{warps} regs {info['regs']:3d} spill {info['spill']:4d} (in loops "
                      f"{info['loop_ldst']}) smem {info['smem']} | " + "; ".join(
                          f"{lp['live']['cycles']}" + (f" [full {lp['interior']['cycles']}]"
                                                        if lp["interior"]["instr"] != lp["live"]["instr"] else "") +
                          (f" ({lp['dead']['cycles']})" if lp["dead"]["instr"] != lp["interior"]["instr"] else "") +
                          f" {lp['live']['per_score']:.1f}/score {lp['live']['bound']}" for lp in loops), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    block_m, block_n = args.block or (64, 64)
    args.warps = args.warps or 4
    args.stages = args.stages or 2
    print(f"# lean_passes: triton {triton.__version__}, sm_90, bf16, d {args.d}, N {args.n}, {block_m}x{block_n}, "
          f"{args.warps} warps, {args.stages} stages" + (f", maxnreg {args.maxnreg}" if args.maxnreg else ""),
          flush=True)
    rows = []
    for name, kernel, kargs, consts in prototypes(args.d, args.n, block_m, block_n, args.classes):
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        t = time.time()
        opts = dict(num_warps=args.warps, num_stages=args.stages)
        if args.maxnreg and name.startswith("threshold"):
            opts["maxnreg"] = args.maxnreg
        compiled = sm90_build.compile_like_launch(kernel, (), dict(kargs, **consts, **opts))
        info = sm90_build.analyse(compiled)
        loops = tile_loops(compiled, block_m, block_n, args.d, args.warps)
        rec = dict(name=name, triton=triton.__version__, regs=info["regs"], spill=info["spill"], smem=info["smem"],
                   block=f"{block_m}x{block_n}",
                   loop_ldst=info["loop_ldst"], loops=loops, **{k: v for k, v in opts.items()})
        rows.append(rec)
        desc = "; ".join(f"loop {lp['addr']}: live {lp['live']['instr']} instr ({lp['live']['per_score']:.1f}/score) "
                         f"{lp['live']['cycles']} cyc {lp['live']['bound']}" +
                         (f", dead {lp['dead']['instr']} instr {lp['dead']['cycles']} cyc {lp['dead']['bound']}"
                          if lp["dead"]["instr"] != lp["live"]["instr"] else "") for lp in loops)
        print(f"{name:22s} regs {info['regs']:3d} spill {info['spill']:4d} (in loops {info['loop_ldst']}) | {desc} "
              f"({time.time() - t:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
