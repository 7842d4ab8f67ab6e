"""The CPU path of ``entmax_attention`` against the dense alternatives: median wall time and peak extra memory.

Methods (each measured in its own subprocess, so that its peak resident memory is its own):

* ``ours``: ``sparse_attn.entmax_attention`` on CPU tensors (``backend="auto"``: the query-chunked reference,
  ``sparse_attn.attn._cpu_chunked``).
* ``old``: ``sparse_attn.reference.entmax_attention_reference``, the materialized reference that the CPU path
  ran before it was chunked (the whole ``(B, H, N, N)`` score matrix).
* ``entmax``: the materialized recipe with the ``entmax`` pip package: scores, ``-inf`` above the causal
  diagonal, ``entmax.entmax15`` (``sparsemax`` at alpha 2, ``entmax_bisect`` otherwise), ``@ v``. Skipped when the
  package is not installed (it is not a dependency of sparse_attn).
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (softmax attention: the speed of light).

Peak memory is the growth of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
once the inputs exist; ``ru_maxrss`` where that is not possible) while the method runs: the inputs are not counted,
the output and every temporary are. ``max |out - ours|`` checks that the entmax methods compute the same function.
Timings on a shared machine depend on its load: with two threads, every parallel operation waits for the second
core, so a busy neighbour slows the methods with many operations most; ``--threads 1`` is steadier, the "CPU ms"
column (the median of the process's CPU time per run, ``time.process_time``, every thread counted) moves least, and
the table's header gives the load average before and after the run.

Usage::

    .venv/bin/python benchmarks/harness/cpu_path.py                      # 1 x 8 x 2048 x 64, causal, alpha 1.5, float32
    .venv/bin/python benchmarks/harness/cpu_path.py --seq 4096 --modes fwd
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
METHODS = ("ours", "old", "entmax", "sdpa")
MODES = ("fwd", "fwd+bwd")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the peak resident set (``VmHWM``) to the current one; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _method(name: str, args, q, k, v):
    """A function ``() -> out`` computing ``name`` on the inputs (raises ImportError when unavailable)."""
    import torch
    import torch.nn.functional as F

    from sparse_attn import entmax_attention
    from sparse_attn.reference import entmax_attention_reference

    alpha = _alpha(args, q.shape[1], q.requires_grad)
    if name == "ours":
        return lambda: entmax_attention(q, k, v, alpha, is_causal=args.causal)
    if name == "old":
        return lambda: entmax_attention_reference(q, k, v, alpha, is_causal=args.causal)
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    if name == "entmax":
        import entmax

        if isinstance(alpha, float) and alpha == 1.5:
            mapping = entmax.entmax15
        elif isinstance(alpha, float) and alpha == 2.0:
            mapping = entmax.sparsemax
        else:
            a = alpha if isinstance(alpha, float) else alpha.view(1, -1, 1, 1)

            def mapping(x, dim):
                return entmax.entmax_bisect(x, a, dim=dim)

        n_q, n_k = q.shape[2], k.shape[2]
        drop = None
        if args.causal:
            drop = torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1)

        def run():
            s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
            if drop is not None:
                s = s.masked_fill(drop, float("-inf"))
            return torch.matmul(mapping(s, dim=-1), v)

        return run
    raise ValueError(f"unknown method {name!r}")


def _alpha(args, heads: int, grad: bool):
    """The benchmark's alpha: a Python number, or ``learnable``: one alpha per head, ``linspace(1, 2, heads)``, a
    tensor that requires a gradient in the ``fwd+bwd`` mode (as a module's learnable alpha)."""
    import torch

    if args.alpha == "learnable":
        return torch.linspace(1.0, 2.0, heads).requires_grad_(grad)
    return float(args.alpha)


def worker(args) -> dict:
    """Measure one method in this process; returns the result row (and saves the output to ``args.out``)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    grad = args.mode == "fwd+bwd"
    q, k, v = (torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3))
    d_out = torch.randn(shape, generator=g, dtype=dtype)
    try:
        fn = _method(args.method, args, q, k, v)
    except ImportError as exc:
        return {"method": args.method, "mode": args.mode, "status": f"skipped ({exc.name} not installed)"}

    def step():
        if grad:
            out = fn()
            torch.autograd.backward(out, d_out)
            for t in (q, k, v):
                t.grad = None
            return out.detach()
        with torch.no_grad():
            return fn()

    import gc

    gc.collect()
    exact_peak = _reset_peak()
    base_kib = _status_kib("VmRSS") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu_times = [], []
    out = step()  # warm-up
    total = 0.0
    for i in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        dt = time.perf_counter() - t0
        times.append(dt)
        cpu_times.append(time.process_time() - c0)
        total += dt
        if i >= 2 and total > args.max_seconds:
            break
    peak_kib = _status_kib("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save(out, args.out)
    return {"method": args.method, "mode": args.mode, "status": "ok", "ms": 1e3 * statistics.median(times),
            "cpu_ms": 1e3 * statistics.median(cpu_times),
            "runs": len(times), "peak_mib": max(0, peak_kib - base_kib) / 1024, "threads": torch.get_num_threads(),
            "peak_source": "VmHWM" if exact_peak else "ru_maxrss"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048, help="queries = keys (default 2048)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--alpha", default="1.5",
                        help="a number in [1, 2], or 'learnable': linspace(1, 2, heads), one alpha per head, "
                             "differentiated in fwd+bwd (default 1.5)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="full attention (default causal)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up (median reported)")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="stop a method's timed runs after this long (at least 3 runs)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    for name, given, allowed in (("method", methods, METHODS), ("mode", modes, MODES)):
        bad = [m for m in given if m not in allowed]
        if bad:
            parser.error(f"unknown {name}(s) {bad}; choose from {allowed}")
    rows = []
    load_before = _load()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            outs = {}
            for method in methods:
                out_path = Path(tmp) / f"{method}_{mode.replace('+', '_')}.pt"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method, "--mode", mode,
                       "--out", str(out_path)]
                for opt in ("batch", "heads", "seq", "head_dim", "alpha", "dtype", "repeats", "max_seconds", "seed",
                            "threads"):
                    cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
                if not args.causal:
                    cmd.append("--no-causal")
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
                if res.returncode != 0:
                    row = {"method": method, "mode": mode, "status": f"error: {res.stderr.strip()[-300:]}"}
                else:
                    row = json.loads(res.stdout.strip().splitlines()[-1])
                    if row["status"] == "ok":
                        outs[method] = out_path
                rows.append(row)
                print(f"# {mode} {method}: {row.get('status')} {row.get('ms', float('nan')):.1f} ms", file=sys.stderr)
            _compare(rows, outs, mode)
    _print_table(rows, args, load_before)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


def _load() -> str:
    """The 1-minute load average, or '?'."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def _compare(rows: list[dict], outs: dict, mode: str) -> None:
    """``max |out - ours|`` of the entmax methods of one mode."""
    import torch

    if "ours" not in outs:
        return
    ref = torch.load(outs["ours"])
    for row in rows:
        if row["mode"] == mode and row["method"] in outs and row["method"] not in ("ours", "sdpa"):
            row["max_abs_diff"] = float((torch.load(outs[row["method"]]) - ref).abs().max())


def _print_table(rows: list[dict], args, load_before: str) -> None:
    import torch

    threads = next((r["threads"] for r in rows if "threads" in r), "?")
    print(f"CPU path, B x H x N x D = {args.batch} x {args.heads} x {args.seq} x {args.head_dim}, "
          f"{'causal' if args.causal else 'full'}, alpha {args.alpha}, {args.dtype}; torch {torch.__version__}, "
          f"{threads} threads, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"load average {load_before} before, {_load()} after\n")
    sdpa = {r["mode"]: r["ms"] for r in rows if r["method"] == "sdpa" and r["status"] == "ok"}
    print("| method | mode | median ms | CPU ms | x SDPA | peak extra MiB | max abs diff vs ours | runs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['method']} | {r['mode']} | {r['status']} | | | | | |")
            continue
        ratio = f"{r['ms'] / sdpa[r['mode']]:.1f}" if r["mode"] in sdpa else ""
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else ""
        print(f"| {r['method']} | {r['mode']} | {r['ms']:.0f} | {r['cpu_ms']:.0f} | {ratio} | {r['peak_mib']:.0f} "
              f"| {diff} | {r['runs']} |")


if __name__ == "__main__":
    sys.exit(main())
