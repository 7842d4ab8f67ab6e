"""Design study of the forward's threshold passes: pass and tile-visit counts of candidate strategies (a float32
emulation of 64-row query tiles that stop together, against a float64 oracle), priced with the static cycles per key
tile of their prototype loops (``benchmarks/offline/lean_passes.py``), as modelled time per query tile.

Strategies (``z = (alpha - 1) s``, ``m`` the row max, ``tol`` by dtype as the kernel's ``default_tolerance``; every
bracket certified as in ``kernels/attn/_threshold.py``: tangent roots of the convex ``phi = f^(1/beta) - 1`` are
lower bounds, secants upper bounds, equal counts at both ends an exact root for beta in {1, 2}):

* ``today K,P`` (design c): the fused kernel's grid pass (``f``, ``g`` at ``K`` absolute points ``i / (K - 1)`` below
  the running max, counts only at alpha 2), then candidate passes of ``P`` points (the estimate, or ``P`` points
  spread over the bracket) over the live tiles until every row of the tile is done, then the value pass;
* ``rel K,P`` (designs a and b): a max pass, then one pass with ``f``, ``g`` at ``K`` points spread over the certified
  ``[m - 1, m - n^(1 - alpha)]`` (fixed per row: no ring), then refinement passes of ``P`` points (``P = 1``: the
  estimate, a Newton / Hermite step; ``P = 2``: two points straddling the estimate by ``tol / 2`` each side, so that
  a good estimate ends the row in that pass), then the value pass;
* ``hist B,P``: a max pass, a histogram pass (counts of ``z`` in ``B`` bins over ``[m - 1, m]``: certified bounds
  ``f_lo <= f <= f_hi`` from the bin edges give a bracket, a mid-bin sum the estimate), then refinement passes as
  ``rel``.

Per query tile it records the passes (max and value pass included) and, per pass, the key tiles visited in full and
those screened as dead (a key tile is dead for a pass once every score of every row lies at or below the row's
certified lower bound known before that pass; in the first pass that knows ``m - 1`` a dead tile costs the screen
only). The output error of the value pass at the final estimate is compared with a FlashAttention-style pipeline
at the exact threshold (``benchmarks/offline/passes.py``'s ``pipeline_out``): ``ratio`` 1.00 = as accurate.

Usage (from the project root)::

    python benchmarks/offline/threshold_study.py emulate --out E.jsonl [--n 1024 4096] [--alpha 1.5 2 1.25]
        [--dtype bf16 fp16] [--dist std1 std3 local flat] [--strategies "today 8,1" "rel 4,2" ...]
    python benchmarks/offline/threshold_study.py model E.jsonl --cycles C39.json [--markdown]

``model`` prices each strategy per query tile with the cycles of the prototype loops (``lean_passes.py --json``) and
prints it against the softmax loop (``--softmax`` cycles of the same config) dense and at 60% / 90% dead key tiles.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOL = {"bf16": 1e-3, "fp16": 3e-4, "fp32": 1e-6}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_STRATEGIES = ("today 8,1", "today 8,4", "today 4,1", "rel 8,1", "rel 4,1", "rel 4,2", "rel 2,2", "rel 8,2",
                      "hist 16,1", "hist 16,2", "hist 32,2")


def make_scores(dist, n, d, heads, seed, dtype):
    """Scores ``q k^T / sqrt(d)`` (float32 from inputs rounded to ``dtype``, float64 from the same rounded inputs)
    and ``v``, per head: ``(s32 [H, n, n], s64, v [H, n, d])``. ``dist``: ``std1`` / ``std3`` (Gaussian scores of
    std 1 / 3: two temperatures), ``flat`` (std 0.3), ``local`` (AR(1) keys, queries near their own key); the
    generator of ``benchmarks/offline/passes.py``."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from passes import make_inputs

    q, k, v = (x[0].to(dtype) for x in make_inputs(dist, n, d, heads, seed))
    scale = d ** -0.5
    s32 = (q.float() @ k.float().transpose(-1, -2)) * scale
    s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
    return s32, s64, v


def f_g(z, t, beta):
    """``f = sum [z - t]_+^beta``, ``g = sum [z - t]_+^(beta - 1)`` and ``c = #{z > t}`` per row and point:
    ``z [R, N]``, ``t [R, P]`` -> three ``[R, P]``."""
    r = (z[:, None, :] - t[:, :, None]).clamp_min(0)
    c = (r > 0).to(z.dtype).sum(-1)
    if beta == 1.0:
        return r.sum(-1), c, c
    if beta == 2.0:
        return (r * r).sum(-1), r.sum(-1), c
    rb1 = torch.where(r > 0, r ** (beta - 1), torch.zeros_like(r))
    return (rb1 * r).sum(-1), rb1.sum(-1), c


def phi_of(f, g, beta):
    pos = f > 0
    fs = torch.where(pos, f, torch.ones_like(f))
    ph = torch.where(pos, fs ** (1 / beta) - 1, -torch.ones_like(f))
    dph = torch.where(pos, -(fs ** (1 / beta - 1)) * g, -torch.ones_like(f))
    dph = torch.where(dph < 0, dph, -torch.ones_like(f))
    return ph, dph


class Bracket:
    """Per-row bracket ``[a, b]``, ``phi(a) >= 0 > phi(b)``, with ``phi``, ``phi'``, ``f``, ``g`` and the count at
    ``a`` and ``phi``, ``phi'``, count at ``b`` (NaN ``phi``: not evaluated there, e.g. an end from a histogram or
    ``m - n^(1 - alpha)``); ``b`` at the row max has ``phi = phi' = -1`` (``top``). As ``_threshold.Bracket``."""

    def __init__(self, m, a, a_known):
        nan = torch.full_like(m, float("nan"))
        self.a = a.clone()
        self.pa = torch.where(a_known, torch.zeros_like(m), nan)
        self.da, self.fa, self.ga, self.ca = nan.clone(), nan.clone(), nan.clone(), torch.zeros_like(m)
        self.b, self.pb, self.db, self.cb = m.clone(), -torch.ones_like(m), -torch.ones_like(m), torch.zeros_like(m)
        self.top = torch.ones_like(m, dtype=torch.bool)

    def merge(self, t, ph, dph, f, g, c, act):
        """Merge points ``t [R, P]`` (``phi``, ... there) on the rows ``act``."""
        for p in range(t.shape[1]):
            tp, php = t[:, p], ph[:, p]
            up_a = act & (php >= 0) & (tp >= self.a)
            self.a = torch.where(up_a, tp, self.a)
            self.pa = torch.where(up_a, php, self.pa)
            self.da = torch.where(up_a, dph[:, p], self.da)
            self.fa = torch.where(up_a, f[:, p], self.fa)
            self.ga = torch.where(up_a, g[:, p], self.ga)
            self.ca = torch.where(up_a, c[:, p], self.ca)
            up_b = act & (php < 0) & (tp <= self.b)
            self.b = torch.where(up_b, tp, self.b)
            self.pb = torch.where(up_b, php, self.pb)
            self.db = torch.where(up_b, dph[:, p], self.db)
            self.cb = torch.where(up_b, c[:, p], self.cb)
            self.top = self.top & ~up_b

    def set_b(self, b, act):
        """An upper end whose ``phi`` is unknown (``phi <= 0`` certified)."""
        up = act & (b < self.b)
        self.b = torch.where(up, b, self.b)
        self.pb = torch.where(up, torch.full_like(b, float("nan")), self.pb)
        self.db = torch.where(up, torch.full_like(b, float("nan")), self.db)
        self.cb = torch.where(up, torch.zeros_like(b), self.cb)
        self.top = self.top & ~up

    def solve(self, beta, counted):
        """``(est, lo, hi, exact)`` as ``_threshold.solve``; ends with unknown ``phi`` give no tangent / secant."""
        a, pa, da, b, pb, db = self.a, self.pa, self.da, self.b, self.pb, self.db
        ka, kb = pa == pa, pb == pb
        h = (b - a).clamp_min(1e-30)
        tan_a = torch.where(ka & (da < 0), a - pa / da, a)
        tan_b = torch.where(kb & (db < 0), b - pb / db, a)
        lo = torch.maximum(torch.maximum(tan_a, tan_b), a)
        sec = a + h * (pa / (pa - pb).clamp_min(1e-30))
        hi = torch.where(ka & kb, torch.minimum(sec, b), b)
        lo = torch.minimum(lo, hi)
        exact = torch.zeros_like(lo, dtype=torch.bool)
        if counted and beta in (1.0, 2.0):
            exact = torch.where(self.top, self.ca == 1, (self.ca == self.cb)) & (self.ca > 0) & ka & kb
            cs = self.ca.clamp_min(1)
            if beta == 1.0:
                root = a + (self.fa - 1) / cs
            else:
                disc = (self.ga * self.ga - cs * (self.fa - 1)).clamp_min(0)
                root = a + (self.fa - 1) / (self.ga + disc.sqrt()).clamp_min(1e-30)
            root = torch.minimum(torch.maximum(root, a), b)
            lo = torch.where(exact, root, lo)
            hi = torch.where(exact, root, hi)
        # the cubic Hermite interpolant of phi where both ends are known; else the tangent root from the known end
        s_lo, s_hi = (lo - a) / h, (hi - a) / h
        s = 0.5 * (s_lo + s_hi)
        for _ in range(6):
            s2, s3 = s * s, s * s * s
            p = ((2 * s3 - 3 * s2 + 1) * pa + (s3 - 2 * s2 + s) * h * da + (3 * s2 - 2 * s3) * pb + (s3 - s2) * h * db)
            dp = ((6 * s2 - 6 * s) * pa + (3 * s2 - 4 * s + 1) * h * da + (6 * s - 6 * s2) * pb
                  + (3 * s2 - 2 * s) * h * db)
            s = s - p / torch.where(dp < 0, dp, -torch.ones_like(dp))
            s = torch.minimum(torch.maximum(s, s_lo), s_hi)
        est = torch.where(ka & kb, a + s * h, torch.where(ka, lo, 0.5 * (lo + hi)))
        est = torch.where(exact, lo, est)
        est = torch.where(est == est, est, lo)
        return torch.minimum(torch.maximum(est, lo), hi), lo, hi, exact


def width_done(exact, lo, hi, tol):
    return exact | (hi - lo <= tol + 4.8e-7 * lo.abs())


def tile_live(z, lo, block_n):
    """Per key tile of ``block_n`` keys: some row has a score above its ``lo`` (``[n_tiles]`` bool)."""
    above = (z > lo[:, None]).any(0)
    return torch.nn.functional.pad(above, (0, (-above.numel()) % block_n)).view(-1, block_n).any(1)


def hist_bracket(z, m, n_bins, beta):
    """Certified ``(lo, hi)`` and a mid-bin estimate from the counts of ``z`` in ``n_bins`` bins of ``[m - 1, m]``:
    ``f_lo(t) = sum_j n_j [e_j - t]_+^beta`` (each key above its bin's lower edge; the max key exact) and
    ``f_hi(t) = sum_j n_j [e_(j+1) - t]_+^beta`` bound ``f``; their roots bound ``tau`` (per-row bisection on
    chip: work per row, not per score)."""
    w = 1.0 / n_bins
    u = ((z - (m[:, None] - 1.0)) / w).floor().clamp(max=n_bins - 1)
    cnt = torch.stack([(u == j).sum(-1) for j in range(n_bins)], -1).to(torch.float64)  # [R, B]
    edges = (m[:, None] - 1.0).double() + w * torch.arange(n_bins + 1, dtype=torch.float64)
    m64 = m.double()
    top = (cnt[:, -1] - 1).clamp_min(0)

    def root(fun):
        lo_t, hi_t = m64 - 1.0, m64
        for _ in range(40):
            mid = 0.5 * (lo_t + hi_t)
            big = fun(mid) >= 1.0
            lo_t, hi_t = torch.where(big, mid, lo_t), torch.where(big, hi_t, mid)
        return lo_t, hi_t

    def f_lo(t):
        lower = torch.cat([cnt[:, :-1], top[:, None]], -1)
        return ((edges[:, :-1] - t[:, None]).clamp_min(0) ** beta * lower).sum(-1) + (m64 - t).clamp_min(0) ** beta

    def f_hi(t):
        return ((edges[:, 1:] - t[:, None]).clamp_min(0) ** beta * cnt).sum(-1)

    def f_mid(t):
        return ((0.5 * (edges[:, :-1] + edges[:, 1:]) - t[:, None]).clamp_min(0) ** beta * cnt).sum(-1)

    lo = root(f_lo)[0]  # f_lo(lo) >= 1: f(lo) >= 1
    hi = root(f_hi)[1]  # f_hi(hi) < 1: f(hi) < 1
    est = root(f_mid)[0].clamp(lo, hi)
    slack = 1e-6 * (1 + m64.abs())  # the kernel's bins are rounded: widen by a few ulps
    return (lo - slack).float(), (hi + slack).float(), est.float()


def run_strategy(z, m, n_valid, beta, tol, kind, K, P, block_n, max_passes=16, spread=0.0):
    """Emulate one strategy on one query tile ``z [R, N]`` (float32). Returns ``(tau estimate [R], lo [R], passes,
    visits)``, ``visits`` a list of ``(pass name, full tiles, screened tiles)``."""
    n_tiles = math.ceil(z.shape[1] / block_n)
    visits = []
    counted = True
    if kind == "today":
        j_top = torch.floor(m * (K - 1))
        t = (j_top[:, None] - torch.arange(K, dtype=z.dtype)) / (K - 1)  # [R, K], t[:, -1] lowest
        t_low = t[:, -1] - 4.8e-7 * t[:, -1].abs()
        live = tile_live(z, t_low, block_n)
        visits.append(("grid", int(live.sum()), n_tiles - int(live.sum())))
        f, g, c = f_g(z, t, beta)
        if beta != 1.0:
            c = torch.zeros_like(c)  # the grid pass counts only at alpha 2
        br = Bracket(m, torch.full_like(m, float("-inf")), torch.zeros_like(m, dtype=torch.bool))
        ph, dph = phi_of(f, g, beta)
        ph[:, -1] = ph[:, -1].clamp_min(0)
        f[:, -1] = f[:, -1].clamp_min(1)
        br.merge(t.flip(1), ph.flip(1), dph.flip(1), f.flip(1), g.flip(1), c.flip(1), torch.ones_like(m, dtype=bool))
        passes = 1
    else:
        visits.append(("max", n_tiles, 0))
        t_low = m - 1.0
        live = tile_live(z, t_low - 4.8e-7 * t_low.abs(), block_n)
        top = m - n_valid.to(z.dtype) ** (-1 / beta)  # n^(1 - alpha): f(top) <= 1, phi(top) <= 0
        br = Bracket(m, t_low, torch.ones_like(m, dtype=torch.bool))
        if kind == "rel":
            visits.append(("points", int(live.sum()), n_tiles - int(live.sum())))
            t = t_low[:, None] + (top - t_low)[:, None] * torch.arange(K, dtype=z.dtype) / max(K - 1, 1)
            f, g, c = f_g(z, t, beta)
            if beta != 1.0:
                c = torch.zeros_like(c)
            ph, dph = phi_of(f, g, beta)
            ph[:, 0] = ph[:, 0].clamp_min(0)
            f[:, 0] = f[:, 0].clamp_min(1)
            br.merge(t, ph, dph, f, g, c, torch.ones_like(m, dtype=torch.bool))
            br.set_b(top, torch.ones_like(m, dtype=torch.bool))
        else:
            visits.append(("hist", int(live.sum()), n_tiles - int(live.sum())))
            h_lo, h_hi, h_est = hist_bracket(z, m, K, beta)
            br.a = torch.maximum(br.a, h_lo)
            br.pa = torch.full_like(m, float("nan"))
            br.set_b(torch.minimum(h_hi, top), torch.ones_like(m, dtype=torch.bool))
        passes = 2
    est, lo, hi, exact = br.solve(beta, counted)
    if kind == "hist":
        est = torch.minimum(torch.maximum(h_est, lo), hi)
    done = width_done(exact, lo, hi, tol)
    while not bool(done.all()) and passes + 1 < max_passes:
        act = ~done
        live = tile_live(z, lo, block_n) & live
        visits.append(("cand" if kind == "today" else "refine", int(live.sum()), 0))
        if P == 1:
            t = est[:, None]
        elif kind == "today":
            widen = 1e-6 * (1 + lo.abs())
            t = (lo - widen)[:, None] + ((hi - lo + 2 * widen) / (P - 1))[:, None] * torch.arange(P, dtype=z.dtype)
        else:
            # straddle the estimate: a quarter of the certified width (``spread``) or half the tolerance each side;
            # both ends of a straddling pair give the tangent and secant bounds, whose gap is quadratic in it
            half = torch.maximum(spread * (hi - lo), 0.45 * (tol + 4.8e-7 * est.abs()))
            t = torch.stack([torch.maximum(est - half, lo), torch.minimum(est + half, hi)], 1)
            if P == 3:
                t = torch.cat([t, est[:, None]], 1)
        f, g, c = f_g(z, t, beta)
        ph, dph = phi_of(f, g, beta)
        br.merge(t, ph, dph, f, g, c, act)
        n_est, n_lo, n_hi, n_exact = br.solve(beta, counted)
        lo = torch.where(act, torch.maximum(lo, n_lo), lo)
        hi = torch.where(act, torch.minimum(hi, n_hi), hi)
        lo = torch.minimum(lo, hi)
        est = torch.minimum(torch.maximum(torch.where(act, n_est, est), lo), hi)
        exact = torch.where(act, n_exact, exact)
        passes += 1
        done = width_done(exact, lo, hi, tol)
    live = tile_live(z, lo, block_n) & live
    visits.append(("value", int(live.sum()), 0))
    return est, lo, passes + 1, visits


def oracle_tau(z64, beta):
    """float64 threshold by bisection on ``[m - 1, m]`` (80 halvings)."""
    m = z64.max(-1).values
    lo, hi = m - 1.0, m.clone()
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        f = ((z64 - mid[:, None]).clamp_min(0) ** beta).sum(-1)
        big = f >= 1.0
        lo, hi = torch.where(big, mid, lo), torch.where(big, hi, mid)
    return 0.5 * (lo + hi)


def out_error(z32, tau, v, beta, dtype, z64, tau64):
    """Max |output - float64| of a value pass at ``tau`` (weights rounded to ``dtype`` before the product,
    renormalized; output rounded), and of the same pipeline at the exact threshold."""
    p64 = (z64 - tau64[:, None]).clamp_min(0) ** beta
    o64 = (p64 @ v.double()) / p64.sum(-1, keepdim=True)

    def pipe(t):
        p = (z32 - t[:, None]).clamp_min(0) ** beta
        return ((p.to(dtype).float() @ v.to(dtype).float()) / p.sum(-1, keepdim=True)).to(dtype).double()

    return (pipe(tau) - o64).abs().max().item(), (pipe(tau64.float()) - o64).abs().max().item()


def cmd_emulate(args):
    strategies = []
    for text in args.strategies:
        kind, nums = text.split()
        nums = nums.split(",")
        strategies.append((kind, int(nums[0]), int(nums[1]), float(nums[2]) if len(nums) > 2 else 0.0))
    with open(args.out, "a") as fo:
        for dt in args.dtype:
            for dist in args.dist:
                for n in args.n:
                    s32_all, s64_all, v_all = make_scores(dist, n, args.d, args.heads, args.seed, DTYPES[dt])
                    n_qt = n // args.block
                    pick = sorted(set(round(i * (n_qt - 1) / max(args.qtiles - 1, 1)) for i in range(args.qtiles)))
                    for alpha in args.alpha:
                        beta = 1.0 / (alpha - 1.0)
                        t0 = time.time()
                        agg = collections.defaultdict(list)
                        for h in range(args.heads):
                            for qt in pick:
                                rows = slice(qt * args.block, (qt + 1) * args.block)
                                z32 = (alpha - 1) * s32_all[h, rows]
                                z64 = (alpha - 1) * s64_all[h, rows]
                                tau64 = oracle_tau(z64, beta)
                                m = z32.max(-1).values
                                n_valid = torch.full_like(m, n)
                                for kind, K, P, spread in strategies:
                                    est, lo, passes, visits = run_strategy(z32, m, n_valid, beta, TOL[dt], kind, K, P,
                                                                           args.block, spread=spread)
                                    err, err_ref = out_error(z32, est, v_all[h], beta, DTYPES[dt], z64, tau64)
                                    agg[(kind, K, P, spread)].append(dict(
                                        passes=passes, visits=visits, ratio=err / max(err_ref, 1e-30),
                                        kill_ok=bool((lo <= tau64.float() + 1e-6 * (1 + tau64.abs().float())).all())))
                        for (kind, K, P, spread), recs in agg.items():
                            name = f"{kind} {K},{P}" + (f",{spread:g}" if spread else "")
                            rec = dict(dtype=dt, dist=dist, n=n, alpha=alpha, strategy=name,
                                       block=args.block, tiles=len(recs),
                                       passes=sum(r["passes"] for r in recs) / len(recs),
                                       passes_max=max(r["passes"] for r in recs),
                                       ratio=max(r["ratio"] for r in recs), kill_ok=all(r["kill_ok"] for r in recs),
                                       visits=[r["visits"] for r in recs])
                            fo.write(json.dumps(rec) + "\n")
                            fo.flush()
                            print(f"{dt} {dist:5s} N{n:5d} a{alpha:<4} {rec['strategy']:10s} passes {rec['passes']:.2f}"
                                  f"/{rec['passes_max']} ratio {rec['ratio']:.2f} kill_ok {rec['kill_ok']}", flush=True)
                        print(f"# {dt} {dist} N{n} alpha {alpha}: {time.time() - t0:.0f} s", flush=True)


CLASS_OF_ALPHA = {1.5: "entmax15", 2.0: "sparsemax", 1.25: "general"}
TODAY_POINTS = {1.5: (8, 1), 2.0: (8, 4), 1.25: (4, 1)}  # the kernel's FWD_POINTS, what sass_cost builds


def _ctas_per_sm(regs, smem, warps):
    """CTAs one H100 SM holds: 64K registers (allocated per warp in units of 256, i.e. per thread rounded up to 8),
    227 KB of shared memory, 64 warps."""
    by_regs = 65536 // (((regs + 7) // 8) * 8 * 32 * warps)
    by_smem = (227 * 1024) // max(smem, 1)
    return max(1, min(by_regs, by_smem, 64 // warps))


def issue_share(regs, smem, warps, cpi):
    """Share of cycles a scheduler issues with ``W`` warps of this kernel on it: ``min(1, W / cpi)``, ``cpi`` the
    cycles per issued instruction of one warp (Nsight Compute measured 3.7-4.0 on the fused forward at the former
    pin). An assumption to check on a GPU, not a measurement."""
    w = _ctas_per_sm(regs, smem, warps) * warps / 4
    return min(1.0, w / cpi), w


def _lean(cycles_json):
    with open(cycles_json) as f:
        rows = json.load(f)
    out = {}
    for r in rows:
        loops = r["loops"]
        main = max(loops, key=lambda lp: lp["live"]["cycles"])
        out[r["name"]] = dict(live=main["live"]["cycles"], dead=main["dead"]["cycles"], regs=r["regs"],
                              spill=r["spill"], smem=r.get("smem", 0), warps=r["num_warps"],
                              loops=[lp["live"]["cycles"] for lp in loops])
    return out


def _today(sass_json, warps):
    with open(sass_json) as f:
        doc = json.load(f)
    out = {}
    for b in doc["builds"]:
        out[b["cls"]] = dict({k: v["cycles"] for k, v in b["loops"].items()}, regs=b["info"]["regs"],
                             smem=b["info"]["smem"], spill=b["info"]["spill"], warps=b["warps"])
    return out


def cmd_model(args):
    recs = [json.loads(line) for path in args.emulation for line in open(path)]
    lean, today = _lean(args.cycles), _today(args.today, 4)
    soft = today["softmax"]
    soft_u, soft_w = issue_share(soft["regs"], soft["smem"], soft["warps"], args.cpi)
    md = args.markdown
    dists = args.dist
    print(f"# model: cycles per visible key tile ({args.cycles}, {args.today}); softmax loop {soft['softmax']:.0f} "
          f"cycles, {soft['regs']} regs, {soft_w:g} warps / scheduler; issue share min(1, W / {args.cpi:g})")
    for alpha in sorted({r["alpha"] for r in recs}):
        cls = CLASS_OF_ALPHA[alpha]
        t = today[cls]
        head = ["strategy", "passes " + " / ".join(dists) + " (bf16; fp16 mean)", "cycles per pass",
                "dense", "60% dead", "90% dead", "regs (W)", "dense, issue share", "90% dead, issue share"]
        rows = []
        for strat in dict.fromkeys(r["strategy"] for r in recs if r["alpha"] == alpha):
            kind, nums = strat.split()
            K, P = (int(x) for x in nums.split(",")[:2])
            sel = [r for r in recs if r["alpha"] == alpha and r["strategy"] == strat and r["dist"] in dists]
            if not sel:
                continue
            per_dist = []
            for d in dists:
                xs = [r for r in sel if r["dist"] == d and r["dtype"] == "bf16"]
                per_dist.append(sum(r["passes"] for r in xs) / max(len(xs), 1))
            fp16 = [r["passes"] for r in sel if r["dtype"] == "fp16"]
            # mean number of passes of each kind per query tile, over every record's query tiles (bf16)
            kinds = collections.Counter()
            n_tiles = 0
            for r in sel:
                if r["dtype"] != "bf16":
                    continue
                for v in r["visits"]:
                    n_tiles += 1
                    for name, _, _ in v:
                        kinds[name] += 1
            mean = {k: c / n_tiles for k, c in kinds.items()}
            if kind == "today":
                if (K, P) != TODAY_POINTS[alpha]:
                    key = f"points_{K}_{P}"
                    if key not in t:
                        continue
                cyc = dict(grid=t["grid"], cand=t["cand"], value=t["value"])
                dead = t["grid_dead"]
                regs_t, share = t["regs"], issue_share(t["regs"], t["smem"], t["warps"], args.cpi)
                shares = {k: share for k in cyc}
            else:
                first = "hist16" if kind == "hist" else f"points{K} {cls}"
                ref = f"refine{min(P, 2)} {cls}"
                refine = lean[ref]["live"]
                if P == 3:  # one more point than refine2: priced by refine2 - refine1
                    refine = 2 * lean[ref]["live"] - lean[f"refine1 {cls}"]["live"]
                cyc = dict(max=lean["max"]["live"], points=lean[first]["live"], hist=lean[first]["live"],
                           refine=refine, value=lean[f"{args.value} {cls}"]["live"])
                dead = lean["max"]["live"]
                thr, val = lean[f"threshold {cls}"], lean[f"{args.value} {cls}"]
                # design (b): a threshold kernel (its registers) and a value kernel; (a) one kernel: the larger
                u_thr = issue_share(thr["regs"], thr["smem"], thr["warps"], args.cpi)
                u_val = issue_share(val["regs"], val["smem"], val["warps"], args.cpi)
                if args.fused:
                    big = max(thr["regs"], val["regs"])
                    u_thr = u_val = issue_share(big, max(thr["smem"], val["smem"]), val["warps"], args.cpi)
                shares = dict(max=u_thr, points=u_thr, hist=u_thr, refine=u_thr, value=u_val)
                regs_t, share = (thr["regs"], val["regs"]), (u_thr, u_val)
            dense = sum(mean.get(k, 0) * cyc[k] for k in cyc)
            dense_u = sum(mean.get(k, 0) * cyc[k] / shares[k][0] for k in cyc)
            dead_u = dead / (shares["grid"][0] if kind == "today" else shares["max"][0])
            s0 = soft["softmax"]
            su = s0 / soft_u
            ratio = [dense / s0] + [((1 - d) * dense + d * dead) / s0 for d in (0.6, 0.9)]
            ratio_u = [dense_u / su, (0.1 * dense_u + 0.9 * dead_u) / su]
            cyc_text = " + ".join(f"{mean.get(k, 0):.2f} x {k} {cyc[k]:.0f}" for k in cyc if mean.get(k, 0))
            w_text = (f"{regs_t} ({share[1]:g})" if kind == "today" else
                      f"{regs_t[0]} / {regs_t[1]} ({share[0][1]:g} / {share[1][1]:g})")
            rows.append([strat, " / ".join(f"{x:.2f}" for x in per_dist) + f" ({sum(fp16) / max(len(fp16), 1):.2f})",
                         cyc_text + f" (dead {dead:.0f})", *(f"{x:.2f}x" for x in ratio), w_text,
                         *(f"{x:.2f}x" for x in ratio_u)])
        print(f"\n## alpha {alpha} ({cls}): ratio to the softmax loop per key tile")
        if md:
            print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
            for r in rows:
                print("| " + " | ".join(r) + " |")
        else:
            for r in rows:
                print("  ".join(r))


def _per_tile(cycles, block, ref=(64, 64)):
    """Cycles of a loop over ``block`` (``"BMxBN"``) tiles, per ``ref`` tile's worth of scores."""
    bm, bn = (int(x) for x in block.split("x"))
    return cycles * ref[0] * ref[1] / (bm * bn)


def cmd_after(args):
    """The built split forward (``lean_passes.py --split --json``) priced like ``model``: max pass (its plain path),
    bracket pass, refinement passes (the mean count of ``--strategy`` in the emulation, bf16) and the value pass,
    against today's kernel (``sass_cost.py --json``) and its softmax loop, static and with the issue share. Cycles are
    per 64 x 64 tile's worth of scores (builds at other tiles scaled), so that configs compare; the value pass of the
    general class is its fast-log2 loop (the shorter of its two)."""
    recs = [json.loads(line) for path in args.emulation for line in open(path)]
    with open(args.split) as f:
        split = {r["name"]: r for r in json.load(f)}
    with open(args.today) as f:
        blocks = {b["cls"]: b["info"]["block"] for b in json.load(f)["builds"]}
    today = _today(args.today, 4)
    for cls, t in today.items():
        for k in ("grid", "grid_dead", "cand", "value", "softmax"):
            if k in t:
                t[k] = _per_tile(t[k], blocks[cls])
    soft = today["softmax"]
    soft_u = issue_share(soft["regs"], soft["smem"], soft["warps"], args.cpi)[0]
    print("| class | threshold kernel: max (plain) / 4 points / 2-point refinement, regs / spill | value kernel, "
          "regs / spill | refinements | dense / 60% / 90% dead, static | today's | dense / 90% dead, issue share | "
          "today's |")
    print("|---|---|---|---|---|---|---|---|")
    for alpha, cls in CLASS_OF_ALPHA.items():
        thr, val = split.get(f"split threshold {cls}"), split.get(f"split value {cls}")
        if thr is None or val is None:
            continue
        mx, pts, ref = (_per_tile(lp["live"]["cycles"], thr["block"]) for lp in thr["loops"])
        mx_plain = _per_tile(thr["loops"][0]["dead"]["cycles"], thr["block"])
        vv = _per_tile(min(lp["live"]["cycles"] for lp in val["loops"]), val["block"])
        sel = [r for r in recs if r["alpha"] == alpha and r["strategy"] == args.strategy and r["dtype"] == "bf16"]
        n_ref = sum(sum(1 for name, _, _ in v if name == "refine") for r in sel for v in r["visits"]) / max(
            sum(len(r["visits"]) for r in sel), 1)
        dense = mx_plain + pts + n_ref * ref + vv
        u_t = issue_share(thr["regs"], thr["smem"], thr["num_warps"], args.cpi)[0]
        u_v = issue_share(val["regs"], val["smem"], val["num_warps"], args.cpi)[0]
        dense_u = (mx_plain + pts + n_ref * ref) / u_t + vv / u_v
        t = today[cls]
        t_dense = t["grid"] + t["cand"] * (1.12 if alpha == 2.0 else 1.0) + t["value"]
        t_u = issue_share(t["regs"], t["smem"], t["warps"], args.cpi)[0]
        s0 = soft["softmax"]
        stat = [dense / s0] + [((1 - d) * dense + d * mx_plain) / s0 for d in (0.6, 0.9)]
        t_stat = [t_dense / s0] + [((1 - d) * t_dense + d * t["grid_dead"]) / s0 for d in (0.6, 0.9)]
        occ = [dense_u / (s0 / soft_u), (0.1 * dense_u + 0.9 * mx_plain / u_t) / (s0 / soft_u)]
        t_occ = [t_dense / t_u / (s0 / soft_u), (0.1 * t_dense + 0.9 * t["grid_dead"]) / t_u / (s0 / soft_u)]
        print(f"| {cls} | {mx:.0f} ({mx_plain:.0f}) / {pts:.0f} / {ref:.0f}, {thr['regs']} / {thr['spill']} | "
              f"{vv:.0f}, {val['regs']} / {val['spill']} | {n_ref:.2f} | "
              + " / ".join(f"{x:.2f}x" for x in stat) + " | " + " / ".join(f"{x:.2f}x" for x in t_stat) + " | "
              + " / ".join(f"{x:.2f}x" for x in occ) + f" (W {u_t * args.cpi:g} / {u_v * args.cpi:g}) | "
              + " / ".join(f"{x:.2f}x" for x in t_occ) + " |")


def cmd_table(args):
    """One markdown row per prototype: for each ``lean_passes.py --json`` file, registers / spill bytes and the main
    tile loop's cycles (dead path), instructions per score and binding resource."""
    docs = []
    for path in args.cycles:
        with open(path) as f:
            docs.append({r["name"]: r for r in json.load(f)})
    names = list(dict.fromkeys(n for d in docs for n in d))
    vers = [next(iter(d.values()))["triton"] for d in docs]
    cols = " | ".join(f"triton {v}: regs / spill, cycles (dead), instr per score, bound" for v in vers)
    print(f"| prototype | {cols} |\n|---|" + "---|" * len(docs))
    for n in names:
        cells = []
        for d in docs:
            r = d.get(n)
            if r is None:
                cells.append("-")
                continue
            lps = []
            for lp in r["loops"]:
                live, dead = lp["live"], lp["dead"]
                lps.append(f"{live['cycles']}" + (f" ({dead['cycles']})" if dead["instr"] != live["instr"] else "")
                           + f", {live['per_score']:.1f}, {live['bound']}")
            cells.append(f"{r['regs']} / {r['spill']}: " + "; ".join(lps))
        print(f"| {n} | " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    em = sub.add_parser("emulate")
    em.add_argument("--out", required=True)
    em.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    em.add_argument("--alpha", type=float, nargs="+", default=[1.5, 2.0, 1.25])
    em.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=sorted(TOL))
    em.add_argument("--dist", nargs="+", default=["std1", "std3", "local", "flat"])
    em.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    em.add_argument("--d", type=int, default=128)
    em.add_argument("--heads", type=int, default=2)
    em.add_argument("--qtiles", type=int, default=4, help="query tiles per head, spread over the sequence")
    em.add_argument("--block", type=int, default=64)
    em.add_argument("--seed", type=int, default=0)
    mo = sub.add_parser("model")
    mo.add_argument("emulation", nargs="+")
    mo.add_argument("--cycles", required=True, help="lean_passes.py --json output")
    mo.add_argument("--today", required=True, help="sass_cost.py --json output of the same config (today's kernel)")
    mo.add_argument("--value", default="value+nnz", choices=["value+nnz", "value"])
    mo.add_argument("--dist", nargs="+", default=["std1", "std3", "local", "flat"])
    mo.add_argument("--cpi", type=float, default=4.0)
    mo.add_argument("--fused", action="store_true", help="design (a): one kernel, the larger register count")
    mo.add_argument("--markdown", action="store_true")
    af = sub.add_parser("after")
    af.add_argument("emulation", nargs="+")
    af.add_argument("--split", required=True, help="lean_passes.py --split --json output")
    af.add_argument("--today", required=True)
    af.add_argument("--strategy", default="rel 4,2,0.1")
    af.add_argument("--cpi", type=float, default=4.0)
    tb = sub.add_parser("table")
    tb.add_argument("cycles", nargs="+", help="lean_passes.py --json outputs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    {"emulate": cmd_emulate, "model": cmd_model, "table": cmd_table, "after": cmd_after}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
