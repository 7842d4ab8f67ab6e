"""Sweep of the forward's threshold points per alpha class: grid points ``GRID_K`` x candidate points ``CAND_P``.

For every setting ``(K, P)``, K in {2, 4, 8}, P in {1, 2, 4} (powers of two: ``tl.arange``), it gathers

* ``cycles``: the static cycles per key tile of each pass (grid, grid on a dead tile, candidate, value) and of the
  softmax loop of the same build config, from offline sm_90 builds (``benchmarks/offline/sass_cost.py``'s model; the
  kernel's ``FWD_POINTS`` is overridden for the build, ``--config`` overrides the pinned tile config);
* ``passes``: the pass counts of the real kernel on the Triton interpreter (``benchmarks/offline/passes.py``'s
  ``measure``, bf16 emulated as there) with ``FWD_POINTS`` overridden, per distribution, alpha, N and causality;
* ``emulate``: the same pass counts from a float32 emulation of the threshold passes (a study script kept outside
  this repository, ``grid_cost_spike.py``, given by ``--spike PATH``), with its tile shape set by ``--block``
  (fast, torch);
* ``report``: per class and setting, the per-pass cycles, passes mean / max per distribution and the modeled dense
  cost ``(grid + (passes - 2) * cand + value) / softmax`` (passes = mean over every configuration of the source),
  and the cheapest setting whose mean passes stay within the limit (3 for alpha 1.5 and 2, 3.2 for general alpha).

Each subcommand appends JSON lines to ``--out``. Usage (from the project root, ``PYTHONPATH=.``)::

    python benchmarks/offline/points_sweep.py cycles --out C.jsonl [--d 128] [--config 64,64,4,2] [--points 8,1 4,1 ...]
    python benchmarks/offline/points_sweep.py passes --out P.jsonl [--n 512] [--block 64]
    python benchmarks/offline/points_sweep.py emulate --out E.jsonl [--n 1024 4096] [--block 64 64]
    python benchmarks/offline/points_sweep.py report C.jsonl P.jsonl E.jsonl [--markdown]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import itertools
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SETTINGS = [(k, p) for k in (8, 4, 2) for p in (1, 2, 4)]
CLASS_ALPHA = {"entmax15": 1.5, "sparsemax": 2.0, "general": 1.25}
LIMIT = {1.5: 3.0, 2.0: 3.0, 1.25: 3.2}
DISTS = ("flat", "std1", "std3", "local")
SPIKE_DIST = {"flat": "g0.3", "std1": "g1", "std3": "g3", "local": "ar"}


def points_arg(text: str) -> tuple:
    k, p = (int(x) for x in text.split(","))
    return k, p


def write(fo, rec: dict) -> None:
    fo.write(json.dumps(rec) + "\n")
    fo.flush()


def cmd_cycles(args) -> None:
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import sass_cost
    import triton

    fwd = sass_cost.sm90_build.fwd
    if args.config:
        cfg = tuple(int(x) for x in args.config.split(","))
        fwd._pick_config = lambda head_dim, interpret, _c=cfg: _c
    saved = dict(fwd.FWD_POINTS)
    with open(args.out, "a") as fo:
        for d, causal in itertools.product(args.d, args.causal):
            compiled, info = sass_cost.build(d, "softmax", causal, args.n)
            soft = sass_cost.analyse_build(compiled, info, "softmax", d)["loops"]["softmax"]["cost"]["cycles"]
            for cls in args.classes:
                for kp in args.points:
                    t = time.time()
                    assumed = None
                    sass_cost.set_points(kp)
                    try:
                        compiled, info = sass_cost.build(d, cls, causal, args.n)
                        an = sass_cost.analyse_build(compiled, info, cls, d)
                    except sass_cost.LoopError as exc:  # e.g. a rolled point loop the model cannot count
                        print(f"cycles d{d} causal={causal} {cls} K{kp[0]} P{kp[1]}: LoopError: "
                              f"{str(exc).splitlines()[0]}", flush=True)
                        if not args.assume_trips:
                            continue
                        an = analyse_assuming(sass_cost, compiled, info, cls, d, kp[0])
                        assumed = kp[0]
                    finally:
                        fwd.FWD_POINTS.update(saved)
                    cyc = {k: v["cost"]["cycles"] for k, v in an["loops"].items()}
                    rec = dict(kind="cycles", triton=triton.__version__, d=d, causal=causal, cls=cls,
                               trips_assumed=assumed,
                               alpha=CLASS_ALPHA[cls], K=kp[0], P=kp[1], block=info["block"], warps=an["warps"],
                               regs=info["regs"], spill=info["spill"], softmax=soft, **cyc)
                    write(fo, rec)
                    print(f"cycles d{d} causal={causal} {cls} K{kp[0]} P{kp[1]} {info['block']} w{an['warps']}: "
                          f"grid {cyc['grid']:.0f} (dead {cyc['grid_dead']:.0f}) cand {cyc['cand']:.0f} value "
                          f"{cyc['value']:.0f} softmax {soft:.0f} regs {info['regs']} spill {info['spill']}" +
                          (f" (nested loops priced at {assumed} trips: assumed)" if assumed else "") +
                          f" ({time.time() - t:.0f} s)", flush=True)


def analyse_assuming(sass_cost, compiled, info, cls, d, trips):
    """``sass_cost.analyse_build`` with every nested loop whose trip count it cannot prove priced at ``trips``
    iterations (``--assume-trips``: the general class's rolled ``range(GRID_K)`` point loop at GRID_K 2 ends on a
    flag, not on a counter compare)."""
    orig = sass_cost.trip_count

    def trip_count(blocks, lp, ins):
        try:
            return orig(blocks, lp, ins)
        except sass_cost.LoopError:
            return trips

    sass_cost.trip_count = trip_count
    try:
        return sass_cost.analyse_build(compiled, info, cls, d)
    finally:
        sass_cost.trip_count = orig


def cmd_passes(args) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import passes
    import torch

    from sparse_attn.kernels._args import ALPHA_CLASSES, CLASS_POW, alpha_class_of
    from sparse_attn.kernels.attn import entmax_attn_fwd as fwd

    saved = dict(fwd.FWD_POINTS)
    with open(args.out, "a") as fo:
        for n, causal, alpha, dist, kp in itertools.product(args.n, args.causal, args.alpha, args.dist, args.points):
            fwd.FWD_POINTS[CLASS_POW[ALPHA_CLASSES[alpha_class_of([alpha])]]] = kp
            try:
                r = passes.measure(dist, n, alpha, torch.bfloat16, heads=args.heads, block=args.block,
                                   causal=causal)
            finally:
                fwd.FWD_POINTS.update(saved)
            rec = dict(kind="passes", src=f"interp{args.block}", K=kp[0], P=kp[1], heads=args.heads, **r)
            write(fo, rec)
            print(f"interp {dist:5s} N{n} causal={causal} alpha {alpha} K{kp[0]} P{kp[1]}: passes "
                  f"{r['passes']:.2f}/{r['passes_max']} ratio {r['ratio']:.2f} at tau {r['ratio_tau']:.2f} "
                  f"({r['secs']:.0f} s)", flush=True)


def load_spike(path: str):
    spec = importlib.util.spec_from_file_location("grid_cost_spike", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_emulate(args) -> None:
    import torch

    sp = load_spike(args.spike)
    sp.BM, sp.BN = args.block
    bm, bn = args.block
    with open(args.out, "a") as fo:
        for n, dist, causal in itertools.product(args.n, args.dist, args.causal):
            t = time.time()
            q, k, v, rows, qts = sp.gen(SPIKE_DIST[dist], n, causal, args.seed + n)
            s32 = (q @ k.T) * (1.0 / math.sqrt(sp.D))
            s64 = (q.double() @ k.double().T) * (1.0 / math.sqrt(sp.D))
            if causal:
                msk = torch.arange(n)[None, :] > rows[:, None]
                s32, s64 = s32.masked_fill(msk, float("-inf")), s64.masked_fill(msk, float("-inf"))
            for alpha in args.alpha:
                beta = round(1 / (alpha - 1))
                pow_ = {1: 1, 2: 2}.get(beta, 0)
                for qi, qt in enumerate(qts):
                    sl = slice(qi * bm, (qi + 1) * bm)
                    nt = ((qt + 1) * bm + bn - 1) // bn if causal else n // bn
                    z = (s32[sl, :nt * bn] * (alpha - 1)).float()
                    z64 = s64[sl, :nt * bn] * (alpha - 1)
                    vv = v[:nt * bn]
                    t64 = sp.oracle(z64, beta)
                    oex = sp.out_exact(z64, t64, beta, vv)
                    eref = (sp.out_bf16(z, t64.float(), beta, vv) - oex).abs().max().item()
                    m = z.max(1).values
                    tm = z.view(bm, nt, bn).max(2).values
                    qpos = min((qt * bm + bm // 2) // bn, nt - 1)
                    order = sp.order_of(nt, qpos, "diag" if causal or dist == "local" else "ltr")
                    for kk, pp in args.points:
                        # the grid pass counts keys only at alpha 2 (there the count is g), docs/kernels.md
                        est, lo, live, npass, visits = sp.strat_grid(z, tm, m, beta, pow_, kk, pp, 1e-3, order,
                                                                     count=(pow_ == 1))
                        t_use, kill = sp.finish(z, tm, est, lo, m, live, visits)
                        err = (sp.out_bf16(z, t_use, beta, vv) - oex).abs().max().item()
                        write(fo, dict(kind="passes", src=f"emul{bm}x{bn}", K=kk, P=pp, block=bm, dist=dist, n=n,
                                       alpha=alpha, causal=causal, qt=qt, passes=npass + 1, passes_max=npass + 1,
                                       ratio=err / max(eref, 1e-30), kill_ok=bool((kill.double() <= t64 + 1e-6).all())))
            print(f"emulate {bm}x{bn} {dist} N{n} causal={causal} ({time.time() - t:.0f} s)", flush=True)


def cmd_report(args) -> None:
    recs = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    cyc = {}
    for r in recs:
        if r["kind"] == "cycles" and (args.causal_cycles is None or r["causal"] == args.causal_cycles):
            cyc.setdefault((r["alpha"], r["K"], r["P"]), []).append(r)
    groups = collections.defaultdict(list)  # (src, alpha, K, P) -> pass records
    for r in recs:
        if r["kind"] == "passes":
            groups[(r["src"], r["alpha"], r["K"], r["P"])].append(r)
    srcs = sorted({k[0] for k in groups})
    md = args.markdown
    sep = " | " if md else "  "
    for alpha in sorted({k[0] for k in cyc} | {k[1] for k in groups}, key=lambda a: (a != 1.5, a != 2.0, a)):
        print(f"\n## alpha {alpha} (limit: mean passes <= {LIMIT[alpha]}; cycles: non-causal; causal, * = nested "
              f"loop priced at GRID_K trips, assumed; model: with those cycles)")
        head = ["K,P", "cycles grid (dead) / cand / value / softmax", "spill"]
        for s in srcs:
            head += [f"{s} " + "/".join(DISTS) + " mean (max)", f"{s} all mean/max", f"{s} worst ratio",
                     f"{s} model"]
        if md:
            print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        else:
            print(sep.join(head))
        best, fewest = {}, {}
        for kk, pp in SETTINGS:
            c = cyc.get((alpha, kk, pp))
            row = [f"{kk},{pp}"]
            if c:
                cs = [f"{x['grid']:.0f} ({x['grid_dead']:.0f}) / {x['cand']:.0f} / {x['value']:.0f} / "
                      f"{x['softmax']:.0f}" + ("*" if x.get("trips_assumed") else "") for x in c]
                row += ["; ".join(cs), "/".join(str(x["spill"]) for x in c)]
            else:
                row += ["-", "-"]
            for s in srcs:
                g = groups.get((s, alpha, kk, pp), [])
                if not g:
                    row += ["-"] * 4
                    continue
                per = []
                for dist in DISTS:
                    gd = [x["passes"] for x in g if x["dist"] == dist]
                    per.append(f"{sum(gd) / len(gd):.2f} ({max(x['passes_max'] for x in g if x['dist'] == dist)})"
                               if gd else "-")
                mean = sum(x["passes"] for x in g) / len(g)
                fewest.setdefault(s, []).append((mean, f"{kk},{pp}"))
                mx = max(x["passes_max"] for x in g)
                worst = max(x["ratio"] for x in g)
                model = "-"
                if c:
                    ratios = [(x["grid"] + (mean - 2) * x["cand"] + x["value"]) / x["softmax"] for x in c]
                    model = "/".join(f"{v:.2f}" for v in ratios)
                    if mean <= LIMIT[alpha] + 1e-9:
                        best.setdefault(s, []).append((ratios[0], f"{kk},{pp}"))
                row += [" ".join(per), f"{mean:.2f}/{mx}", f"{worst:.2f}", model]
            print(("| " + " | ".join(row) + " |") if md else sep.join(row))
        for s in srcs:
            if s in best:
                r, kp = min(best[s])
                print(f"{'- ' if md else ''}cheapest within the limit by {s}: K,P = {kp} (model {r:.2f}x)")
            elif fewest.get(s):
                m, kp = min(fewest[s])
                print(f"{'- ' if md else ''}no setting within the limit by {s}; fewest passes: K,P = {kp} ({m:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    causal = dict(type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False, True],
                  help="causal settings (default: 0 1)")
    pts = dict(type=points_arg, nargs="+", default=SETTINGS, metavar="K,P", help="settings (default: all nine)")
    c = sub.add_parser("cycles", help="static cycles per key tile per pass (sm_90 builds)")
    c.add_argument("--out", required=True)
    c.add_argument("--d", type=int, nargs="+", default=[128])
    c.add_argument("--classes", nargs="+", default=list(CLASS_ALPHA), choices=list(CLASS_ALPHA))
    c.add_argument("--config", help="BLOCK_M,BLOCK_N,WARPS,STAGES instead of the pinned config, e.g. 64,64,4,2")
    c.add_argument("--n", type=int, default=None, help="sequence length of the builds (default sass_cost's)")
    c.add_argument("--causal", **causal)
    c.add_argument("--points", **pts)
    c.add_argument("--assume-trips", action="store_true",
                   help="price a nested loop sass_cost cannot count at GRID_K trips instead of skipping the build")
    p = sub.add_parser("passes", help="pass counts of the kernel on the Triton interpreter (bf16)")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, nargs="+", default=[512])
    p.add_argument("--alpha", type=float, nargs="+", default=[1.5, 2.0, 1.25])
    p.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--causal", **causal)
    p.add_argument("--points", **pts)
    e = sub.add_parser("emulate", help="pass counts from the float32 emulation of grid_cost_spike.py")
    e.add_argument("--out", required=True)
    e.add_argument("--spike", required=True, help="path of the emulation script (grid_cost_spike.py)")
    e.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    e.add_argument("--alpha", type=float, nargs="+", default=[1.5, 2.0, 1.25])
    e.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    e.add_argument("--block", type=int, nargs=2, default=[64, 64], metavar=("BLOCK_M", "BLOCK_N"))
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--causal", **causal)
    e.add_argument("--points", **pts)
    r = sub.add_parser("report", help="the table per class and the cheapest setting within the pass limit")
    r.add_argument("files", nargs="+")
    r.add_argument("--markdown", action="store_true")
    r.add_argument("--causal-cycles", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                   help="use the cycles of causal (1) or non-causal (0) builds only (default: both, listed)")
    args = ap.parse_args(argv)
    {"cycles": cmd_cycles, "passes": cmd_passes, "emulate": cmd_emulate, "report": cmd_report}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
