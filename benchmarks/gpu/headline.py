"""The headline GPU run: the fused entmax kernels next to SDPA's flash and cuDNN backends on the cases users ask
about first, sized to fit the first minutes a GPU is at hand.

Cases (``--seqs``, ``--head-dims``; bf16, ``batch * seq = --tokens`` (16k), ``heads = --hidden / head_dim``):

* ``headline``: N = 4096 and 16384, head dim 128, causal and not. Methods: ``sparse_attn`` at alpha 1 (our own
  softmax class, with statistics), 1.5, 2 and ``learnable`` (``linspace(1, 2, H)`` requiring grad: the backward
  also computes d alpha); SDPA pinned to ``flash`` and to ``cudnn``.
* ``local``: N = ``--local-seq`` (8192), head dim 128, not causal, locally concentrated scores (a positional term
  ``strength * cos(pi (i - j) / N)`` added to random scores through two dimensions of q and k), the strength
  calibrated per alpha (1.5 and 2) so that ``--dead`` (60% and 90%) of the key tiles hold no weight; the same
  SDPA backends on the same inputs.

Modes ``fwd`` (training forward) and ``fwd+bwd``. Each row: median ms of at least ``--min-runs`` timed runs
(``triton.testing.do_bench``, L2 flushed), dense-equivalent TFLOP/s, the ratio to SDPA flash and to cuDNN, passes,
tile visits, dead-tile fraction and density (from the fused forward), peak memory, and a correctness check of the
timed path: the max error of its output on the last rows of the first batch item against float64, next to the
error of a FlashAttention-style pipeline (exact float64 weights rounded to bf16, products accumulated in float32,
output rounded) on the same rows; ``check`` is ``ok`` when the error is at most twice that plus one ulp, ``ok (tol)``
within the tests' kernel slack (``KERNEL_SLACK``) above that, else ``FAIL``.

Before any timing, every kernel the run launches is built in ``--jobs`` parallel processes (one per
(case, method), each running the case once untimed) that share the Triton cache; the log says how many kernels
were built, how long it took, and how many were built during the timings (0 when the warm-up was complete). A cache
shipped by ``precompile.py`` (its ``manifest.json`` in ``TRITON_CACHE_DIR``) is checked first: the log's first line
says whether this machine's Triton key and kernel sources match it, and the line after the warm-up how many
distinct kernels the warm-up processes loaded from the cache and how many they compiled, per kernel, and how many
of the shipped kernels they used.

Writes ``headline.md``, ``headline.csv`` and ``headline.png`` under ``--out``, stamped like ``bench_attention.py``.
``--smoke`` runs tiny float32 shapes on the CPU under the Triton interpreter (the CI rehearsal of the whole run).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder and the timing harness (benchmarks/harness/: cases, methods, timing, reports)
sys.path[:0] = [str(HERE), str(HERE.parent / "harness")]

import torch  # noqa: E402
import triton_cache  # noqa: E402
from bench_cases import Case, Inputs, dense_flops, make_inputs  # noqa: E402
from bench_common import LEARNABLE, OK, OOM_ERRORS, fmt, free_memory  # noqa: E402
from bench_extras import fused_stats  # noqa: E402
from bench_methods import Method, fused_forward_launcher, sdpa_method, sparse_attn_method  # noqa: E402
from bench_report import write_csv  # noqa: E402
from bench_timing import Timing, measure, start_run  # noqa: E402

from sparse_attn import mappings  # noqa: E402

MODES = ("fwd", "fwd+bwd")
# The fused kernels' forward slack over twice the baseline in the project's tests (tests/helpers.py,
# "eps_attention_kernel"): the threshold is refined to the dtype's tolerance, not to the last bit.
KERNEL_SLACK = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
COLUMNS = ("group", "method", "backend", "alpha", "mode", "dtype", "batch", "heads", "seq_q", "seq_k", "head_dim",
           "causal", "score_mult", "target_density", "status", "note", "ms", "ms_q20", "ms_q80", "runs", "tflops",
           "vs_flash", "vs_cudnn", "passes_mean", "passes_max", "visits_mean", "tiles_skipped", "density",
           "peak_mem_mib", "max_err", "flash_style_err", "check")



def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny float32 shapes on the CPU (Triton interpreter)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu>/headline)")
    p.add_argument("--seqs", default=None, help="comma list (default 4096,16384)")
    p.add_argument("--head-dims", default=None, help="comma list (default 128)")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--local-seq", type=int, default=None, help="sequence length of the local cases (default 8192)")
    p.add_argument("--dead", default="0.6,0.9", help="dead key-tile fractions of the local cases (default 0.6,0.9)")
    p.add_argument("--groups", default="headline,local", help="comma list of headline, local")
    p.add_argument("--causal", default="false,true", help="causal values of the headline cases (default false,true)")
    p.add_argument("--min-runs", type=int, default=10, help="timed runs per row at least (default 10)")
    p.add_argument("--jobs", type=int, default=12, help="parallel warm-up processes (default 12; 0: no warm-up)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new row after this many seconds")
    p.add_argument("--warm-only", action="store_true", help="only build the kernels (parallel warm-up), no timing")
    p.add_argument("--warm-one", default=None, help=argparse.SUPPRESS)  # internal: "<case index>:<method index>"
    args = p.parse_args(argv)
    smoke = args.smoke
    args.seqs = [int(x) for x in (args.seqs or ("64" if smoke else "4096,16384")).split(",")]
    args.head_dims = [int(x) for x in (args.head_dims or ("32" if smoke else "128")).split(",")]
    args.tokens = args.tokens or (128 if smoke else 16384)
    args.hidden = args.hidden or (64 if smoke else 2048)
    args.local_seq = args.local_seq or (96 if smoke else 8192)
    args.dead = [float(x) for x in args.dead.split(",") if x.strip()]
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    for g in args.groups:
        if g not in ("headline", "local"):
            p.error(f"--groups takes headline, local; got {g!r}")
    args.causal = [x.strip().lower() in ("1", "true", "yes") for x in args.causal.split(",") if x.strip()]
    args.dtype = "fp32" if smoke else "bf16"
    return args


# ---------------------------------------------------------------------------------------------- cases and inputs
def cases_of(args) -> list[Case]:
    cases = []
    if "headline" in args.groups:
        for seq in args.seqs:
            for hd in args.head_dims:
                for causal in args.causal:
                    cases.append(Case("headline", max(1, args.tokens // seq), max(1, args.hidden // hd), seq, seq,
                                      hd, causal, args.dtype))
    if "local" in args.groups:
        seq, hd = args.local_seq, args.head_dims[-1]
        for alpha in ("1.5",) if args.smoke else ("1.5", "2"):
            for dead in args.dead[:1] if args.smoke else args.dead:
                cases.append(Case("local", max(1, args.tokens // seq), max(1, args.hidden // hd), seq, seq, hd, False,
                                  args.dtype, target_density=dead, alpha=alpha))
    return cases


def methods_of(case: Case) -> list[Method]:
    if case.group == "headline":
        fused = [sparse_attn_method(a) for a in ("1", "1.5", "2", LEARNABLE)]
    else:
        fused = [sparse_attn_method(case.alpha)]
    return fused + [sdpa_method("flash"), sdpa_method("cudnn")]


def local_inputs(case: Case, device: str, strength: float, seed: int = 0) -> Inputs:
    """Random inputs whose scores also hold ``strength * cos(pi (i - j) / N)`` (largest on the diagonal, falling
    with ``|i - j|``): dimensions 0 and 1 of q and k carry ``sqrt(strength * sqrt(D)) (cos, sin)(pi i / N)``."""
    inputs = make_inputs(case, device, seed)
    n, d = case.seq_q, case.head_dim
    angle = math.pi * torch.arange(n, dtype=torch.float64) / n
    amp = math.sqrt(strength * math.sqrt(d))
    pos = torch.stack([angle.cos(), angle.sin()], -1) * amp  # (N, 2)
    with torch.no_grad():
        for t in (inputs.q, inputs.k):
            t[..., :2] = pos.to(device=device, dtype=t.dtype)
    return inputs


def calibrate_local(case: Case, device: str, blocks: tuple[int, int], sample_tiles: int = 4) -> float:
    """Positional strength giving ``case.target_density`` dead key tiles at ``case.alpha`` (bisection in log).

    Measured on a few query tiles of head 0, batch 0: their scores are the random part plus ``strength * cos(pi (i -
    j) / N)`` (what :func:`local_inputs` builds, before rounding to the input dtype), mapped in float32 on the CPU; a
    key tile is dead when no row of the query tile gives it weight."""
    block_m, block_n = blocks
    base = make_inputs(case, device)
    q, k = base.q.detach()[0, 0].float().cpu(), base.k.detach()[0, 0].float().cpu()
    q[:, :2] = 0
    k[:, :2] = 0
    n, d = q.shape
    n_qt = -(-n // block_m)
    picks = sorted({round(i * (n_qt - 1) / max(1, sample_tiles - 1)) for i in range(sample_tiles)})
    angle = math.pi * torch.arange(n, dtype=torch.float32) / n
    samples = []
    for qt in picks:
        rows = slice(qt * block_m, min(n, (qt + 1) * block_m))
        samples.append((q[rows] @ k.T * d ** -0.5, torch.cos(angle[rows, None] - angle[None, :])))

    def dead(strength: float) -> float:
        n_dead = total = 0
        for s_rand, s_pos in samples:
            p = mappings.entmax(s_rand + strength * s_pos, alpha=float(case.alpha), dim=-1)
            tiles = torch.nn.functional.pad((p > 0).any(0), (0, (-n) % block_n)).reshape(-1, block_n).any(1)
            n_dead += int((~tiles).sum())
            total += tiles.numel()
        return n_dead / total

    lo, hi = math.log(0.01), math.log(1e4)
    for _ in range(16):
        mid = 0.5 * (lo + hi)
        if dead(math.exp(mid)) < case.target_density:
            lo = mid
        else:
            hi = mid
    return round(math.exp(0.5 * (lo + hi)), 4)


def inputs_of(case: Case, device: str) -> Inputs:
    if case.group == "local":
        return local_inputs(case, device, case.score_mult)
    return make_inputs(case, device)


# ---------------------------------------------------------------------------------------------- checks and stats
def alpha_of(method: Method, inputs: Inputs):
    if method.method == "sdpa":
        return 1.0
    a = method.fused_alpha(inputs).detach()
    return float(a[0]) if method.alpha not in ("mixed", LEARNABLE) else a


def check_rows(out: torch.Tensor, inputs: Inputs, alpha, rows: int) -> dict:
    """Error of ``out``'s last ``rows`` rows (batch 0) and of a FlashAttention-style pipeline, both against float64."""
    q, k, v = inputs.q.detach(), inputs.k.detach(), inputs.v.detach()
    n_q, n_k = q.shape[2], k.shape[2]
    rows = min(rows, n_q)
    q64, k64, v64 = q[:1, :, n_q - rows:].double(), k[:1].double(), v[:1].double()
    s = q64 @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    if inputs.causal:
        i = torch.arange(n_q - rows, n_q, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(n_k, device=s.device)[None, :] > i + n_k - n_q, float("-inf"))
    a = alpha.double().reshape(1, -1, 1, 1) if isinstance(alpha, torch.Tensor) else alpha
    p = torch.softmax(s, -1) if not isinstance(a, torch.Tensor) and a == 1.0 else mappings.entmax(s, alpha=a, dim=-1)
    exact = p @ v64
    base = (p.to(q.dtype).float() @ v64.float()).to(q.dtype).double()
    got = out.detach()[:1, :, n_q - rows:].double()
    err = float((got - exact).abs().max())
    base_err = float((base - exact).abs().max())
    ulp = torch.finfo(q.dtype).eps * float(exact.abs().max())
    finite = bool(torch.isfinite(got).all())
    if not finite:
        check = "not finite"
    elif err <= 2 * base_err + ulp:
        check = "ok"
    elif err <= 2 * base_err + KERNEL_SLACK[q.dtype]:
        check = "ok (tol)"
    else:
        check = "FAIL"
    return {"max_err": err, "flash_style_err": base_err, "check": check}


class HeadlineTiming(Timing):
    """``do_bench`` with its measuring time stretched so that at least ``min_runs`` runs are timed."""

    min_runs: int = 10

    def bench(self, fn, grad_to_none, first_call_ms: float):
        if self.device != "cuda":
            return super().bench(fn, grad_to_none, first_call_ms)
        import triton.testing

        rep = max(self.rep_ms, 1.3 * self.min_runs * first_call_ms)
        med, q20, q80 = triton.testing.do_bench(fn, warmup=max(self.warmup_ms, 2 * first_call_ms), rep=rep,
                                                grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return float(med), float(q20), float(q80), f"do_bench rep {rep:.0f} ms"


# ---------------------------------------------------------------------------------------------- the run
def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def cubins() -> set:
    """The compiled kernels in the Triton cache (one ``.cubin`` each)."""
    root = cache_dir()
    return set(root.glob("*/*.cubin")) if root.exists() else set()


def n_built() -> int:
    return len(cubins())


def kernel_names(paths) -> list[str]:
    """``name (constexprs...)`` of compiled kernels, from the metadata JSON beside each ``.cubin``."""
    import json

    names = []
    for p in sorted(paths):
        try:
            meta = json.loads(p.with_suffix(".json").read_text())
        except (OSError, ValueError):
            names.append(p.stem)
            continue
        names.append(f"{meta.get('name', p.stem)} w{meta.get('num_warps')} s{meta.get('num_stages')}")
    return names


def run_case_once(case: Case, method: Method, inputs: Inputs, fwd) -> None:
    """Every launch a timed row of this (case, method) makes, untimed: the forward, forward + backward, and the
    statistics' forward."""
    grads = [inputs.q, inputs.k, inputs.v] + method.extra_grads(inputs)
    method.build(inputs)().backward(inputs.dout)
    for t in grads:
        t.grad = None
    if method.method == "sparse_attn":
        fused_stats(fwd, method, inputs)


def warm_up(args, cases: list[Case], device: str, argv: list[str]) -> list[str]:
    """Build every kernel of the run in ``args.jobs`` processes sharing the Triton cache; returns log lines: the
    warm-up's, then the kernels its processes loaded from the cache and compiled (``triton_cache.summary_line``)."""
    pairs = [(ci, mi) for ci, case in enumerate(cases) for mi in range(len(methods_of(case)))
             if methods_of(case)[mi].method == "sparse_attn"]
    if args.jobs <= 0 or not pairs:
        return ["warm-up: none"]
    before, begin = n_built(), time.monotonic()
    script = str(Path(__file__).resolve())
    base = [a for a in argv if not a.startswith("--warm-one") and a != "--warm-only"]
    log = tempfile.TemporaryDirectory(prefix="headline-compiles-")
    env = dict(os.environ, **{triton_cache.LOG_ENV: log.name})

    def build(pair):
        res = subprocess.run([sys.executable, script, *base, f"--warm-one={pair[0]}:{pair[1]}"],
                             capture_output=True, text=True, env=env)
        last = (res.stdout + res.stderr).strip().splitlines()[-1:]
        return None if res.returncode == 0 else f"{pair}: exit {res.returncode}: {last}"

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        failed = [f for f in pool.map(build, pairs) if f is not None]
    took = time.monotonic() - begin
    line = (f"warm-up: {len(pairs)} (case, method) pairs in {args.jobs} processes, {n_built() - before} kernels built "
            f"in {took:.1f} s ({n_built()} in the cache {cache_dir()})")
    if failed:
        line += f"; {len(failed)} warm-up processes failed: " + " | ".join(failed)[:600]
    summary = triton_cache.summarize(triton_cache.read_events(Path(log.name)), triton_cache.read_manifest(cache_dir()))
    log.cleanup()
    return [line, triton_cache.summary_line(summary)]


def warm_one(args, cases: list[Case], device: str, spec: str) -> int:
    ci, mi = (int(x) for x in spec.split(":"))
    case, method = cases[ci], methods_of(cases[ci])[mi]
    if os.environ.get(triton_cache.LOG_ENV):
        triton_cache.log_compiles_to(os.environ[triton_cache.LOG_ENV])
    fwd, _ = fused_forward_launcher()
    run_case_once(case, method, inputs_of(case, device), fwd)
    if device == "cuda":
        torch.cuda.synchronize()
    return 0


def add_ratios(rows: list[dict]) -> None:
    def key(r):
        return (r["group"], r["seq_q"], r["head_dim"], r["causal"], r["score_mult"], r["mode"])

    base = {(key(r), r["backend"]): r["ms"] for r in rows if r["method"] == "sdpa" and r["status"] == OK}
    for r in rows:
        if r["status"] != OK:
            continue
        r["tflops"] = dense_flops(r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["head_dim"], r["causal"],
                                  r["mode"]) / (r["ms"] * 1e-3) / 1e12
        for name, backend in (("vs_flash", "flash"), ("vs_cudnn", "cudnn")):
            b = base.get((key(r), backend))
            r[name] = r["ms"] / b if b else None


def write_markdown(path: Path, stamp: dict, notes: list[str], rows: list[dict]) -> None:
    lines = ["# Headline: fused entmax attention vs SDPA flash / cuDNN", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in stamp.items()] + [f"- note: {n}" for n in notes] + [""]
    lines += ["Times are medians (ms) of at least 10 runs; `× flash` / `× cuDNN` = time / SDPA's time on the same "
              "inputs and mode (above 1 = slower). TFLOP/s are dense-equivalent (`4 B H N² D`, halved when causal, "
              "x3.5 for fwd+bwd). `check`: `ok` when the timed output's error against float64 is at most twice a "
              "FlashAttention-style pipeline's (+1 ulp), `ok (tol)` within the tests' kernel slack above that "
              "(bf16 2e-2, the threshold being refined to the dtype's tolerance), else `FAIL`.", ""]
    head = ["group", "N", "D", "causal", "dead target", "method", "α", "mode", "ms", "TFLOP/s", "× flash", "× cuDNN",
            "passes", "visits", "dead tiles", "density", "peak MiB", "max err", "FA-style err", "check", "status"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        method = r["method"] if r["method"] != "sdpa" else f"sdpa[{r['backend']}]"
        cells = [r["group"], r["seq_q"], r["head_dim"], r["causal"], fmt(r.get("target_density")), method,
                 r["alpha"], r["mode"], fmt(r.get("ms")), fmt(r.get("tflops")), fmt(r.get("vs_flash")),
                 fmt(r.get("vs_cudnn")), fmt(r.get("passes_mean")), fmt(r.get("visits_mean")),
                 fmt(r.get("tiles_skipped")), fmt(r.get("density")), fmt(r.get("peak_mem_mib"), 5),
                 fmt(r.get("max_err")), fmt(r.get("flash_style_err")), r.get("check", ""),
                 r["status"] + (f": {r['note']}" if r["status"] != OK and r.get("note") else "")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, stamp: dict, rows: list[dict]) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == OK and r.get("vs_flash") is not None and r["method"] != "sdpa"]
    fig, axes = plt.subplots(1, len(MODES), figsize=(7 * len(MODES), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], MODES):
        sel = [r for r in ok if r["mode"] == mode]
        labels = [f"{r['group'][:5]} N={r['seq_q']} {'c' if r['causal'] else 'nc'}"
                  + (f" dead {r['target_density']:g}" if r["group"] == "local" else "") + f" α={r['alpha']}"
                  for r in sel]
        ax.barh(range(len(sel)), [r["vs_flash"] for r in sel], color="tab:orange", label="time / SDPA flash")
        ax.set_yticks(range(len(sel)), labels, fontsize=6)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{mode}: time / SDPA flash (below 1 = faster)", fontsize=9)
        ax.invert_yaxis()
    fig.text(0.01, 0.005, f"{stamp['gpu']} | torch {stamp['torch']} | triton {stamp['triton']} | commit "
             f"{stamp['commit'][:16]} | {stamp['date']}", fontsize=6, family="monospace")
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.1, top=0.93, wspace=0.45)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(argv: list[str] | None = None) -> Path | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = cases_of(args)
    if args.warm_one is not None:
        # a warm-up process: the local cases' strength does not change which kernels are built
        warm_one(args, cases, device, args.warm_one)
        return None
    start = time.monotonic()
    device, stamp, default_out = start_run("benchmarks/gpu/headline.py", argv, args.smoke, "the headline run",
                                           "headline")
    out = args.out or default_out
    out.mkdir(parents=True, exist_ok=True)
    fwd, missing = fused_forward_launcher()
    if missing:
        raise SystemExit(f"headline: {missing}")
    notes = [f"pinned launch configs: SPARSE_ATTN_PINNED={os.environ.get('SPARSE_ATTN_PINNED', '0')}",
             "learnable = torch.linspace(1, 2, heads) requiring grad (d alpha computed in fwd+bwd)"]
    print(triton_cache.shipped_cache_line(cache_dir()), flush=True)
    print(f"headline: {len(cases)} cases, Triton cache {cache_dir()} holds {n_built()} kernels", flush=True)
    lines = warm_up(args, cases, device, argv)
    print("\n".join(lines), flush=True)
    if args.warm_only:
        return None
    notes.extend(lines)
    built_before_timing = n_built()
    cubins_before = cubins()

    from sparse_attn.kernels.attn.entmax_attn_fwd import fwd_block_sizes

    timing = HeadlineTiming(device, warmup_ms=10.0, rep_ms=50.0, cpu_warmup=0, cpu_reps=1, slow_ms=float("inf"))
    timing.min_runs = args.min_runs
    rows: list[dict] = []

    def flush():
        add_ratios(rows)
        write_csv(out / "headline.csv", stamp, notes, rows, COLUMNS)
        write_markdown(out / "headline.md", stamp, notes, rows)

    for case in cases:
        if case.group == "local":
            blocks = fwd_block_sizes(case.head_dim)
            case = replace(case, score_mult=calibrate_local(case, device, blocks))
        inputs = inputs_of(case, device)
        for method in methods_of(case):
            base = {**case.fields(), "method": method.method, "backend": method.backend, "alpha": method.alpha}
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                rows.extend({**base, "mode": m, "status": "skipped", "note": "time budget reached"} for m in MODES)
                continue
            saved: list = [None]
            extra: dict = {}
            for mode in MODES:
                grads = [inputs.q, inputs.k, inputs.v] + method.extra_grads(inputs)
                res = measure(method.build(inputs), mode, inputs.dout, grads, timing, saved)
                if res["status"] == OK and device == "cuda":
                    res["runs"] = args.min_runs
                rows.append({**base, "mode": mode, **res})
                r = rows[-1]
                print(f"[{case.group}] N={case.seq_q} D={case.head_dim} causal={case.causal} "
                      f"{'dead=' + str(case.target_density) + ' ' if case.target_density else ''}"
                      f"{method.method}:{method.backend} a={method.alpha} {mode} -> {r['status']} "
                      f"{fmt(r.get('ms'))} ms {r.get('note', '')}", flush=True)
            try:
                # the timed forward's own output: a no-grad forward would build other kernels (no out_u)
                out_t = saved[0]
                if out_t is None:
                    with torch.no_grad():
                        out_t = method.build(inputs)()
                rows_checked = 32 if device == "cuda" else 8
                extra.update(check_rows(out_t, inputs, alpha_of(method, inputs), rows_checked))
                if method.method == "sparse_attn":
                    extra.update(fused_stats(fwd, method, inputs)[0])
            except OOM_ERRORS:
                free_memory(device, collect=True)
            except Exception as exc:  # the timings stand
                extra["note"] = f"checks failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            for r in rows[-len(MODES):]:
                r.update({k: v for k, v in extra.items() if k != "note"})
                if extra.get("note"):
                    r["note"] = "; ".join(x for x in (r.get("note"), extra["note"]) if x)
            print(f"    check {extra.get('check')} err {fmt(extra.get('max_err'))} (FA-style "
                  f"{fmt(extra.get('flash_style_err'))}) dead {fmt(extra.get('tiles_skipped'))} "
                  f"passes {fmt(extra.get('passes_mean'))} density {fmt(extra.get('density'))}", flush=True)
            flush()
        inputs = None
        free_memory(device)
    built = n_built() - built_before_timing
    line = f"kernels built during the timings: {built} (0 = the warm-up built everything)"
    if built:
        line += ": " + ", ".join(kernel_names(cubins() - cubins_before))[:1500]
    print(line, flush=True)
    notes.append(line)
    if args.budget_s is not None and time.monotonic() - start > args.budget_s:
        notes.append(f"incomplete: time budget of {args.budget_s:g} s reached")
    flush()
    plot = write_plot(out / "headline.png", stamp, rows)
    print(f"wrote {out / 'headline.md'}, {out / 'headline.csv'}" + (f", {plot}" if plot else ""), flush=True)
    fails = [r for r in rows if r.get("check") not in (None, "", "ok", "ok (tol)")]
    if fails:
        print(f"headline: {len(fails)} rows failed the correctness check", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
