"""Benchmark entmax attention against SDPA, flash-attn, AdaSplash and the materialized recipe.

One run times every method of one grid and writes, under ``--out`` (default
``benchmarks/results/<gpu-name>/``): ``results.md`` (tables), ``results.csv`` (raw numbers) and
``plot_grid.png``, ``plot_sparsity.png``, ``plot_mixed.png``, each stamped with the GPU name,
driver, torch / triton versions, git commit, date and the command line (see
``benchmarks/README.md`` for the columns and the exact GPU command).

Groups of cases:

* ``flash``: FlashAttention's grid, ``batch * seq = 16k`` tokens, hidden 2048, head dim 64 and 128,
  seq 512 -> 32k, causal and not, bf16. Methods: ``sparse_attn`` at each alpha of ``--alphas``,
  SDPA with its backend pinned (``--sdpa-backends``), flash-attn and AdaSplash when importable,
  and the materialized PyTorch recipe (scores + the ``entmax`` package, else
  ``sparse_attn.mappings``), which runs until it runs out of memory.
* ``sparsity``: one shape, the queries scaled so that the entmax support covers from a few keys
  to most keys (scale calibrated per alpha on a sample of rows); realized density reported.
* ``mixed``: one alpha per head (``linspace(1, 2, H)``), fixed and learnable (``requires_grad``).

Modes ``fwd`` (training forward: inputs require grad), ``bwd`` (backward of a saved graph) and
``fwd+bwd``. CUDA timings use ``triton.testing.do_bench`` (median and 20/80% quantiles, L2
flushed); ``--smoke`` runs tiny float32 shapes on CPU under the Triton interpreter with a
wall-clock timer, so the harness is exercised by CI.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cases import (  # noqa: E402
    GROUP_TITLES,
    Case,
    Inputs,
    all_cases,
    alpha_label,
    calibrate_mult,
    dense_flops,
    flash_grid,
    make_inputs,
    mixed_grid,
    sparsity_grid,
)
from bench_common import (  # noqa: E402
    CASE_COLUMNS,
    COLUMNS,
    ERROR,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    LEARNABLE,
    MIXED,
    MODE_FLOP_FACTOR,
    MODES,
    OK,
    OOM,
    REPO_ROOT,
    ROW_KEY_COLUMNS,
    SDPA_BACKENDS,
    SKIPPED,
    STAMP_KEYS,
    UNAVAILABLE,
    Unavailable,
    free_memory,
    optional_import,
    row_key,
    split_resumed,
)
from bench_extras import (  # noqa: E402
    case_extras,
    count_live_tiles,
    fused_blocks,
    reference_error,
    tile_stats,
    visible_pairs,
    visitable_tiles,
)
from bench_methods import (  # noqa: E402
    FUSED_MODULES,
    Method,
    adasplash_method,
    flash_attn_method,
    fused_forward_launcher,
    methods_for,
    recipe_impl,
    recipe_method,
    sdpa_method,
    sparse_attn_method,
)
from bench_report import (  # noqa: E402
    MD_CASE_COLUMNS,
    add_ratios,
    progress_line,
    read_csv,
    summary_lines,
    write_csv,
    write_markdown,
    write_plots,
)
from bench_timing import (  # noqa: E402
    Timing,
    cpu_bench,
    cuda_event_bench,
    environment_stamp,
    gpu_slug,
    measure,
    median_q20_q80,
    start_run,
)

# The names this script offered before it was split into modules (tests and other scripts import them).
__all__ = [
    "REPO_ROOT", "MODES", "MODE_FLOP_FACTOR", "OK", "OOM", "UNAVAILABLE", "ERROR", "SKIPPED", "MIXED", "LEARNABLE",
    "SDPA_BACKENDS", "COLUMNS", "FLOAT_COLUMNS", "INT_COLUMNS", "CASE_COLUMNS", "ROW_KEY_COLUMNS", "STAMP_KEYS",
    "MD_CASE_COLUMNS", "GROUP_TITLES", "FUSED_MODULES", "Unavailable", "Case", "Method", "Inputs", "Timing",
    "fused_forward_launcher", "dense_flops", "visitable_tiles", "count_live_tiles", "tile_stats", "make_inputs",
    "alpha_label", "sparse_attn_method", "sdpa_method", "flash_attn_method", "adasplash_method", "recipe_impl",
    "recipe_method", "cpu_bench", "median_q20_q80", "cuda_event_bench", "measure", "reference_error", "flash_grid",
    "calibrate_mult", "sparsity_grid", "mixed_grid", "methods_for", "environment_stamp", "gpu_slug", "write_csv",
    "read_csv", "summary_lines", "write_markdown", "write_plots", "add_ratios", "parse_args", "run", "fused_blocks",
    "visible_pairs", "case_extras", "main",
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny float32 shapes (CPU + Triton interpreter without CUDA)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu-name>/)")
    p.add_argument("--groups", default="flash,sparsity,mixed",
                   help="comma list of flash, sparsity, mixed (default all)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default bf16 (fp32 with --smoke)")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--seqs", default=None, help="comma list (default 512,...,32768)")
    p.add_argument("--head-dims", default=None, help="comma list (default 64,128)")
    p.add_argument("--causal", default=None,
                   help="causal values of the flash grid (default false,true; false with --smoke)")
    p.add_argument("--alphas", default="1,1.5,2,1.25",
                   help="sparse_attn alphas on the flash grid (default 1,1.5,2,1.25)")
    p.add_argument("--recipe-alphas", default=None,
                   help="materialized-recipe alphas on the flash grid (default 1.5; 1,1.5,2,1.25 with --smoke)")
    p.add_argument("--sdpa-backends", default="flash,cudnn",
                   help="pinned SDPA backends among flash, cudnn, efficient, math "
                        "(default flash,cudnn; flash always runs)")
    p.add_argument("--sweep-seq", type=int, default=None, help="sequence length of the sparsity sweep (default 8192)")
    p.add_argument("--sweep-head-dim", type=int, default=None, help="head dim of the sparsity sweep (default 128)")
    p.add_argument("--sweep-alphas", default=None, help="alphas of the sweep (default 1.5,2,1.25)")
    p.add_argument("--sweep-targets", default=None,
                   help="target support: values >= 1 are key counts, < 1 fractions (default 4,0.01,0.05,0.2,0.5,0.9)")
    p.add_argument("--mixed-seq", type=int, default=None,
                   help="sequence length of the mixed-alpha case (default 4096)")
    p.add_argument("--mixed-head-dims", default=None, help="head dims of the mixed-alpha case (default 64,128)")
    p.add_argument("--mixed-causal", default=None, help="causal values of the mixed-alpha case (default false,true)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up in ms (default 10)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench measuring time in ms (default 50)")
    p.add_argument("--slow-ms", type=float, default=200.0,
                   help="calls slower than this many ms are timed by --slow-reps CUDA-event runs instead of do_bench "
                        "(default 200)")
    p.add_argument("--slow-reps", type=int, default=3, help="timed runs of a slow call (default 3)")
    p.add_argument("--cpu-reps", type=int, default=1, help="timed calls per measurement on CPU (default 1)")
    p.add_argument("--check-max-elems", type=int, default=2**26,
                   help="cap on the float64 reference scores used for the max_abs_err column (default 2**26)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new method after this many seconds (rows left are 'skipped'); "
                        "the files stay complete")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="results.csv of an earlier run: its rows are kept and not run again")
    args = p.parse_args(argv)

    def floats(s):
        return [float(x) for x in s.split(",") if x.strip()]

    def ints(s):
        return [int(x) for x in s.split(",") if x.strip()]

    def _bools(s):
        return [x.strip().lower() in ("1", "true", "yes") for x in s.split(",") if x.strip()]

    smoke = args.smoke
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    for g in args.groups:
        if g not in GROUP_TITLES:
            p.error(f"--groups takes flash, sparsity, mixed; got {g!r}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes takes {', '.join(MODES)}; got {m!r}")
    args.dtype = args.dtype or ("fp32" if smoke else "bf16")
    args.tokens = args.tokens or (64 if smoke else 16384)
    args.hidden = args.hidden or (32 if smoke else 2048)
    args.seqs = ints(args.seqs or ("64" if smoke else "512,1024,2048,4096,8192,16384,32768"))
    args.head_dims = ints(args.head_dims or ("32" if smoke else "64,128"))
    args.causal = _bools(args.causal or ("false" if smoke else "false,true"))
    args.alphas = floats(args.alphas)
    args.recipe_alphas = floats(args.recipe_alphas or ("1,1.5,2,1.25" if smoke else "1.5"))
    args.sdpa_backends = [b.strip() for b in args.sdpa_backends.split(",") if b.strip()]
    for b in args.sdpa_backends:
        if b not in SDPA_BACKENDS:
            p.error(f"--sdpa-backends takes {', '.join(SDPA_BACKENDS)}; got {b!r}")
    if "flash" not in args.sdpa_backends:
        args.sdpa_backends.insert(0, "flash")
    args.sweep_seq = args.sweep_seq or (64 if smoke else 8192)
    args.sweep_head_dim = args.sweep_head_dim or (32 if smoke else 128)
    args.sweep_alphas = floats(args.sweep_alphas or ("1.5" if smoke else "1.5,2,1.25"))
    for name in ("alphas", "recipe_alphas", "sweep_alphas"):
        bad = [a for a in getattr(args, name) if not 1.0 <= a <= 2.0]
        if bad:
            p.error(f"--{name.replace('_', '-')} takes alphas in [1, 2]; got {bad}")
    args.sweep_targets = floats(args.sweep_targets or ("4,0.9" if smoke else "4,0.01,0.05,0.2,0.5,0.9"))
    args.mixed_seq = args.mixed_seq or (32 if smoke else 4096)
    args.mixed_causal = _bools(args.mixed_causal or ("true" if smoke else "false,true"))
    args.mixed_head_dims = ints(args.mixed_head_dims or ("16" if smoke else "64,128"))
    if smoke:
        args.check_max_elems = max(args.check_max_elems, 2**22)
    return args


def run(argv: list[str] | None = None) -> Path:
    """Run the benchmark described by ``argv`` (see ``--help``); returns the output folder."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    start = time.monotonic()
    device, stamp, default_out = start_run("benchmarks/harness/bench_attention.py", argv, args.smoke, "the full grid")
    out = args.out or default_out
    out.mkdir(parents=True, exist_ok=True)

    fwd, fused_missing = fused_forward_launcher()
    providers = {}
    notes = [f"mixed alpha = torch.linspace(1, 2, heads); recipe = float32 scores + {recipe_impl()[0]}"]
    for name in ("flash_attn", "adasplash"):
        mod, why = optional_import(name)
        providers[name] = mod
        if mod is None:
            notes.append(f"{name} not run: {why.split(':')[0]} (not importable)")
    if fused_missing:
        notes.append(f"sparse_attn rows skipped: {fused_missing}")
    if device == "cpu":
        notes.append("CPU smoke run: Triton interpreter, wall-clock timer, numbers mean nothing for speed")

    timing = Timing(device, args.warmup_ms, args.rep_ms, 0, args.cpu_reps, args.slow_ms, args.slow_reps)
    previous = {}
    if args.resume_from:
        previous = {row_key(r): r for r in read_csv(args.resume_from) if r["status"] != SKIPPED}
        notes.append(f"{len(previous)} rows kept from {args.resume_from} (an earlier run, see its own stamp)")
    rows: list[dict] = []
    cases = all_cases(args, device)
    oom_at: dict[tuple, int] = {}

    def flush():
        add_ratios(rows)
        write_csv(out / "results.csv", stamp, notes, rows)
        write_markdown(out / "results.md", stamp, notes, rows, args.modes)

    budget_hit = False
    for case in cases:
        inputs = None
        ref_cache: dict = {}
        for method in methods_for(case, args, providers):
            if args.budget_s is not None and not budget_hit and time.monotonic() - start > args.budget_s:
                budget_hit = True
                notes.append(f"incomplete: time budget of {args.budget_s:g} s reached; rows left are 'skipped'")
            base = {**case.fields(), "method": method.method, "backend": method.backend, "alpha": method.alpha}
            series = (case.group, method.method, method.backend, method.alpha, case.head_dim, case.causal)
            todo, kept = split_resumed(base, args.modes, previous)
            rows.extend(kept)
            for old in kept:
                if old["status"] == OOM:
                    oom_at.setdefault(series + (old["mode"],), case.seq_q)
            if not todo:
                continue
            reason = ""
            if budget_hit:
                reason = "time budget reached"
            elif method.method == "sparse_attn" and fused_missing:
                reason = fused_missing
            if reason:
                rows.extend({**r, "status": SKIPPED, "note": reason} for r in todo)
                continue
            if inputs is None:
                inputs = make_inputs(case, device)
            extra = None
            saved: list = [None]
            for row in todo:
                key = series + (row["mode"],)
                if key in oom_at and oom_at[key] < case.seq_q:
                    rows.append({**row, "status": SKIPPED, "note": f"OOM at seq {oom_at[key]}"})
                    continue
                grads = [inputs.q, inputs.k, inputs.v] + method.extra_grads(inputs)
                result = measure(method.build(inputs), row["mode"], inputs.dout, grads, timing, saved)
                if result["status"] == OOM:
                    oom_at[key] = case.seq_q
                rows.append({**row, **result})
                print(progress_line(rows[-1]), flush=True)
                if result["status"] == OK and extra is None:
                    extra = {}
            if extra is not None:
                extra = case_extras(method, inputs, fwd, args, ref_cache, device, saved[0])
                mine = [r for r in rows[-len(todo):] if r["status"] == OK]
                for r in mine:
                    note = "; ".join(n for n in (r["note"], extra.get("note", "")) if n)
                    r.update({**extra, "note": note})
            saved[0] = None
            flush()
        inputs = None
        free_memory(device)
        flush()
    flush()
    written = write_plots(out, stamp, rows)
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, " + ", ".join(str(w) for w in written), flush=True)
    if budget_hit:
        print("INCOMPLETE: time budget reached; rerun with --resume-from " + str(out / "results.csv"), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
