"""One case of the fused forward for profiling, and the summary of the profile (``profile.md``).

The case: alpha 1.5 (the ``entmax15`` class), N = 8192, head dim 128, bf16, 16k tokens and
hidden 2048 (batch 2, 16 heads), not causal, the training forward (``need_out_u``, as the ``fwd`` rows of
``bench_attention.py``; ``--inference`` without it), at the pinned launch config forced past the autotuner (or
``--config``), so that every call launches ``_entmax_attn_fwd_kernel`` exactly once.

* ``launch``: what Nsight Compute runs (``benchmarks/gpu/profile_ncu.sh``): ``--warmup`` calls (the first compiles),
  then one call inside the NVTX range ``profiled`` (profile it with ``--nvtx --nvtx-include profiled/``, or with
  ``--launch-skip <warmup> --launch-count 1``).
* ``report``: writes ``profile.md`` into ``--out``: with ``--ncu-csv`` (``ncu --import ... --csv --page details``,
  and ``--ncu-raw`` for ``--page raw``) the top warp stall reasons with their share, achieved and theoretical
  occupancy, registers, shared memory and duration from Nsight Compute; on every path the kernel's registers,
  spills and shared memory read from the compiled kernel, an occupancy estimate from them, and ``torch.profiler``
  timings of ``--reps`` calls. ``--why`` says why the Nsight Compute numbers are missing (the fallback path).

``--smoke`` swaps in a tiny float32 case for CPU (Triton interpreter: no GPU numbers, the code path only).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder and the timing harness (benchmarks/harness/: cases, methods, timing, reports)
sys.path[:0] = [str(HERE), str(HERE.parent / "harness")]

import torch  # noqa: E402
from bench_cases import Case  # noqa: E402
from bench_report import stamp_lines  # noqa: E402
from bench_timing import start_run  # noqa: E402
from tune_tiles import fwd_kwargs, fwd_resources, make_problem, parse_config, pinned_config  # noqa: E402

from sparse_attn.kernels.attn import entmax_attn_fwd as fwd  # noqa: E402

KERNEL = "_entmax_attn_fwd_kernel"
NVTX_RANGE = "profiled"
STALL_PATTERNS = (re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
                  re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+)$"))
# (label, names in the details page, names in the raw page): the first one present is reported
NCU_METRICS = (
    ("Duration", ("Duration",), ("gpu__time_duration.sum",)),
    ("Achieved occupancy", ("Achieved Occupancy",), ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    ("Theoretical occupancy", ("Theoretical Occupancy",), ("sm__maximum_warps_per_active_cycle_pct",)),
    ("Achieved active warps per SM", ("Achieved Active Warps Per SM",), ("sm__warps_active.avg.per_cycle_active",)),
    ("Registers per thread", ("Registers Per Thread",), ("launch__registers_per_thread",)),
    ("Dynamic shared memory per block", ("Dynamic Shared Memory Per Block",),
     ("launch__shared_mem_per_block_dynamic",)),
    ("Static shared memory per block", ("Static Shared Memory Per Block",), ("launch__shared_mem_per_block_static",)),
    ("Block limit: registers", ("Block Limit Registers",), ("launch__occupancy_limit_registers",)),
    ("Block limit: shared memory", ("Block Limit Shared Mem",), ("launch__occupancy_limit_shared_mem",)),
    ("Block limit: warps", ("Block Limit Warps",), ("launch__occupancy_limit_warps",)),
    ("Warp cycles per issued instruction", ("Warp Cycles Per Issued Instruction",),
     ("smsp__average_warp_latency_per_inst_issued.ratio",)),
    ("Issue slots busy", ("Issue Slots Busy",), ("sm__inst_issued.avg.pct_of_peak_sustained_active",)),
    ("No eligible (scheduler)", ("No Eligible",), ("smsp__issue_inst0.avg.pct_of_peak_sustained_active",)),
    ("Compute (SM) throughput", ("Compute (SM) Throughput",), ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("Memory throughput", ("Memory Throughput",),
     ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("DRAM throughput", ("DRAM Throughput",), ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("Grid size", ("Grid Size",), ("launch__grid_size",)),
    ("Block size", ("Block Size",), ("launch__block_size",)),
    ("Waves per SM", ("Waves Per SM",), ("launch__waves_per_multiprocessor",)),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("launch", "report"))
    p.add_argument("--smoke", action="store_true", help="tiny float32 case on CPU (Triton interpreter)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 8192)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--alpha-class", default="entmax15", help="alpha class (default entmax15, alpha = 1.5)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default bf16")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--causal", action="store_true", help="causal (default not)")
    p.add_argument("--inference", action="store_true", help="the inference forward (no need_out_u)")
    p.add_argument("--config", default=None, help="launch config like 128x32w8s2 (default the pinned one)")
    p.add_argument("--warmup", type=int, default=3, help="launch: calls before the profiled one (default 3)")
    p.add_argument("--reps", type=int, default=20, help="report: calls timed by torch.profiler (default 20)")
    p.add_argument("--out", type=Path, default=None, help="report: output folder (default "
                   "benchmarks/results/<gpu>/profile/)")
    p.add_argument("--ncu-csv", type=Path, default=None, help="report: ncu --csv --page details of the profile")
    p.add_argument("--ncu-raw", type=Path, default=None, help="report: ncu --csv --page raw of the profile")
    p.add_argument("--ncu-version", default="", help="report: the ncu version line, for the summary")
    p.add_argument("--why", default="", help="report: why the Nsight Compute numbers are missing (fallback path)")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.seq = args.seq or (32 if smoke else 8192)
    args.head_dim = args.head_dim or (32 if smoke else 128)
    args.dtype = args.dtype or ("fp32" if smoke else "bf16")
    args.tokens = args.tokens or (32 if smoke else 16384)
    args.hidden = args.hidden or (32 if smoke else 2048)
    try:
        args.config = pinned_config(args.head_dim) if args.config is None else parse_config(args.config)
    except ValueError as exc:
        p.error(str(exc))
    return args


def case_call(args, device: str):
    """``(case, launch kwargs, zero-argument call)`` of the profiled forward."""
    case = Case("profile", max(1, args.tokens // args.seq), max(1, args.hidden // args.head_dim), args.seq, args.seq,
                args.head_dim, args.causal, args.dtype)
    kwargs = fwd_kwargs(make_problem(case, device), args.alpha_class, args.causal, args.config)
    kwargs["need_out_u"] = not args.inference
    return case, kwargs, lambda: fwd.entmax_attn_fwd(**kwargs)


def launch(args, device: str) -> None:
    """Warm-up calls, then one call inside the NVTX range ``profiled`` (what ncu profiles)."""
    _, _, call = case_call(args, device)
    for _ in range(args.warmup):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NVTX_RANGE)
    call()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profile_case: {args.warmup} warm-up calls, then 1 call in NVTX range {NVTX_RANGE!r}", flush=True)


def _number(text: str) -> float | None:
    """A metric value as ncu prints it (thousands separators allowed); None for ``n/a`` and the like."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels of an ``ncu --csv`` export, long (``--page details``: one row per metric, columns ``Section Name``,
    ``Metric Name``, ``Metric Unit``, ``Metric Value``) or wide (``--page raw``: one column per metric, a row of
    units under the header). Each kernel: ``{"id", "name", "block", "grid", "metrics": {name: (unit, text)}}``;
    lines before the ``"ID",...`` header (ncu's own messages) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    fields = reader.fieldnames or []
    kernels: dict[str, dict] = {}
    units: dict[str, str] = {}
    for row in reader:
        if "Metric Name" not in fields and not row.get("ID", "").strip():
            units = {k: v for k, v in row.items() if k}
            continue
        kernel = kernels.setdefault(row["ID"], {"id": row["ID"], "name": row.get("Kernel Name", ""),
                                                "block": row.get("Block Size", ""), "grid": row.get("Grid Size", ""),
                                                "metrics": {}})
        if "Metric Name" in fields:
            if row.get("Metric Name"):
                kernel["metrics"][row["Metric Name"]] = (row.get("Metric Unit", ""), row.get("Metric Value", ""))
        else:
            kernel["metrics"].update({k: (units.get(k, ""), v) for k, v in row.items() if k and k not in (
                "ID", "Kernel Name")})
    return list(kernels.values())


def pick_kernel(kernels: list[dict]) -> dict | None:
    """The profiled forward among the kernels of an export (the first whose name holds ``entmax_attn_fwd``)."""
    return next((k for k in kernels if "entmax_attn_fwd" in k["name"]), kernels[0] if kernels else None)


def stall_reasons(metrics: dict) -> list[tuple[str, float, float]]:
    """``(reason, value, share)`` sorted by value: per-reason warp stall metrics (cycles per issued instruction,
    ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``; else sampled counts,
    ``smsp__pcsamp_warps_issue_stalled_<reason>``), share = value / sum over reasons. ``selected`` is the issuing
    state, kept for the sum."""
    for pattern in STALL_PATTERNS:
        found = {}
        for name, (_, text) in metrics.items():
            m = pattern.match(name)
            value = _number(text) if m else None
            if m and not m.group(1).endswith("_not_issued") and value is not None:
                found[m.group(1)] = value
        total = sum(found.values())
        if found and total > 0:
            return sorted(((r, v, v / total) for r, v in found.items()), key=lambda t: -t[1])
    return []


def ncu_summary(details: list[dict], raw: list[dict]) -> dict:
    """``{"kernel", "metrics": [(label, value, unit)], "stalls": [...]}`` of the profiled kernel, each metric from
    the details page when there, else from the raw page."""
    kd, kr = pick_kernel(details), pick_kernel(raw)
    md = kd["metrics"] if kd else {}
    mr = kr["metrics"] if kr else {}
    rows = []
    for label, detail_names, raw_names in NCU_METRICS:
        hit = next(((md[n][1], md[n][0]) for n in detail_names if n in md), None)
        hit = hit or next(((mr[n][1], mr[n][0]) for n in raw_names if n in mr), None)
        if hit is not None:
            rows.append((label, hit[0], hit[1]))
    stalls = stall_reasons(md) or stall_reasons(mr)
    kernel = kd or kr
    return {"kernel": kernel["name"] if kernel else "", "block": kernel["block"] if kernel else "",
            "grid": kernel["grid"] if kernel else "", "metrics": rows, "stalls": stalls}


def occupancy_estimate(regs: int, smem: int, num_warps: int) -> tuple[float, str] | None:
    """Theoretical occupancy (fraction of the SM's warp slots) from registers per thread, shared memory per block
    and warps per block, with the device's limits (registers allocated per warp in units of 256): an estimate for
    the fallback path, not a measurement; None without the device properties."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    max_threads = getattr(props, "max_threads_per_multi_processor", None)
    regs_sm = getattr(props, "regs_per_multiprocessor", None)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if not (max_threads and regs_sm and smem_sm):
        return None
    limits = {"warps": max_threads // (32 * num_warps),
              "registers": regs_sm // (math.ceil(regs * 32 / 256) * 256 * num_warps) if regs else 10**9,
              "shared memory": smem_sm // (smem + 1024) if smem else 10**9}
    blocks = min(limits.values())
    limiter = ", ".join(k for k, v in limits.items() if v == blocks)
    return blocks * num_warps * 32 / max_threads, f"{blocks} block(s) per SM, limited by {limiter}"


def profiler_timings(call, reps: int, device: str) -> list[tuple[str, int, float]]:
    """``(event, calls, mean us)`` from ``torch.profiler`` over ``reps`` calls: the launcher call (host side) and, on
    CUDA, the forward kernel's device time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    call()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            with record_function("entmax_attn_fwd (launcher call)"):
                call()
        if device == "cuda":
            torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        if e.key == "entmax_attn_fwd (launcher call)":
            out.append((e.key + ", host", e.count, e.cpu_time_total / max(1, e.count)))
        elif KERNEL in e.key and device == "cuda":
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            out.append((e.key + ", device", e.count, total / max(1, e.count)))
    return out


def report(args, device: str, stamp: dict, out: Path) -> Path:
    """Write ``profile.md`` into ``out`` (and print it): the Nsight Compute summary if given, the compiled kernel,
    the torch.profiler timings."""
    out.mkdir(parents=True, exist_ok=True)
    case, kwargs, call = case_call(args, device)
    details = parse_ncu_csv(args.ncu_csv.read_text()) if args.ncu_csv and args.ncu_csv.exists() else []
    raw = parse_ncu_csv(args.ncu_raw.read_text()) if args.ncu_raw and args.ncu_raw.exists() else []
    summary = ncu_summary(details, raw) if details or raw else None
    if summary and (summary["metrics"] or summary["stalls"]):
        path = f"Nsight Compute ({args.ncu_version or 'ncu'}) on one launch; compiled-kernel numbers and torch.profiler"
    else:
        why = args.why or ("the ncu export holds no metrics of the kernel" if args.ncu_csv else "no ncu export given")
        path = f"fallback: torch.profiler and compiled-kernel numbers, no Nsight Compute (why: {why})"
        summary = None
    notes = [f"path: {path}"]
    if device == "cpu":
        notes.append("CPU smoke run: Triton interpreter, tiny float32 case; no GPU numbers")
    mode = "inference forward" if args.inference else "training forward (need_out_u)"
    lines = [f"# Profile: fused forward, {args.alpha_class}, N = {case.seq_q}, head dim {case.head_dim}, {case.dtype}",
             "", *stamp_lines(stamp, notes), "", "## Case", "",
             f"batch {case.batch}, heads {case.heads}, N = {case.seq_q}, D = {case.head_dim}, {case.dtype}, "
             f"{'causal' if case.causal else 'not causal'}, {mode}, launch config {args.config.label} "
             f"({'pinned' if args.config == pinned_config(case.head_dim) else 'forced by --config'}).", ""]
    if summary:
        lines += [f"## Nsight Compute: `{summary['kernel'][:80]}` (block {summary['block']}, grid {summary['grid']})",
                  "", "| metric | value | unit |", "|---|---|---|"]
        lines += [f"| {label} | {value} | {unit} |" for label, value, unit in summary["metrics"]]
        lines += ["", "### Top warp stall reasons (share of the warp cycles per issued instruction)", ""]
        if summary["stalls"]:
            lines += ["| reason | value | share |", "|---|---|---|"]
            lines += [f"| {r}{' (issuing)' if r == 'selected' else ''} | {v:.4g} | {100 * s:.1f}% |"
                      for r, v, s in summary["stalls"][:8]]
        else:
            lines.append("No per-reason stall metric in the export (run with the --metrics of profile_ncu.sh).")
        lines.append("")
    lines += ["## Compiled kernel", ""]
    res = fwd_resources(kwargs)
    if res.get("regs") is not None:
        lines += [f"- registers per thread: {res['regs']}", f"- spilled bytes per thread (local memory): "
                  f"{res['spill_bytes']}", f"- shared memory per block: {res['smem_bytes']} bytes",
                  f"- warps {args.config.num_warps}, pipeline stages {args.config.num_stages}"]
        est = occupancy_estimate(res["regs"], res["smem_bytes"], args.config.num_warps)
        if est is not None:
            lines.append(f"- theoretical occupancy, estimated from these (not measured): {100 * est[0]:.1f}% "
                         f"({est[1]})")
    else:
        lines.append(f"- not available: {res.get('note') or 'the Triton interpreter builds no GPU kernel'}")
    lines += ["", f"## torch.profiler ({args.reps} calls)", "", "| event | calls | mean µs |", "|---|---|---|"]
    lines += [f"| {name} | {n} | {us:.4g} |" for name, n, us in profiler_timings(call, args.reps, device)]
    text = "\n".join(lines) + "\n"
    (out / "profile.md").write_text(text)
    print(text, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    start = time.monotonic()
    device, stamp, default_out = start_run("benchmarks/gpu/profile_case.py", argv, args.smoke, "the case", "profile")
    if args.action == "launch":
        launch(args, device)
    else:
        report(args, device, stamp, args.out or default_out)
    print(f"profile_case: {args.action} took {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
