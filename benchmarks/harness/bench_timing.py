"""How the attention benchmark times: ``do_bench`` on CUDA (CUDA events for slow calls), a wall clock
on CPU, peak memory, failure statuses, and the stamp of where and how a run was made."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_common import ERROR, OK, OOM, OOM_ERRORS, REPO_ROOT, UNAVAILABLE, Unavailable, free_memory


def cpu_bench(fn: Callable[[], object], grad_to_none, warmup: int, reps: int) -> tuple[float, float, float]:
    """Median and 20/80% quantiles in ms of ``reps`` wall-clock calls after ``warmup`` calls (CPU stand-in
    for do_bench)."""
    times = []
    for i in range(warmup + reps):
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return median_q20_q80(times)


def median_q20_q80(times: list[float]) -> tuple[float, float, float]:
    """Median and 20% / 80% quantiles (linear interpolation) of a list of timings."""
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


def cuda_event_bench(fn: Callable[[], object], grad_to_none, reps: int) -> tuple[float, float, float]:
    """Median and 20/80% quantiles in ms of ``reps`` calls timed with CUDA events (for calls too slow for do_bench)."""
    times = []
    for _ in range(reps):
        for t in grad_to_none:
            t.grad = None
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return median_q20_q80(times)


@dataclass
class Timing:
    """How to time: ``do_bench`` on CUDA (calls slower than ``slow_ms`` get ``slow_reps`` CUDA-event runs), a
    wall clock on CPU."""

    device: str
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    cpu_warmup: int = 0
    cpu_reps: int = 1
    slow_ms: float = 200.0
    slow_reps: int = 3

    def bench(self, fn, grad_to_none, first_call_ms: float) -> tuple[float, float, float, str]:
        if self.device != "cuda":
            return (*cpu_bench(fn, grad_to_none, self.cpu_warmup, self.cpu_reps), "")
        if first_call_ms > self.slow_ms:
            return (*cuda_event_bench(fn, grad_to_none, self.slow_reps), f"slow: {self.slow_reps} CUDA-event runs")
        import triton.testing

        med, q20, q80 = triton.testing.do_bench(
            fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return float(med), float(q20), float(q80), ""


def measure(build_fwd: Callable[[], torch.Tensor], mode: str, dout: torch.Tensor, grads: list, timing: Timing,
            saved: list | None = None) -> dict:
    """Time one mode of one method; returns ``status``, ``note``, ``ms``, quantiles and ``peak_mem_mib``.

    On CUDA a first untimed call compiles / autotunes, a second measures the peak memory and
    decides between ``do_bench`` and the slow-call timer. Out-of-memory
    gives ``status="OOM"`` (memory is freed before returning); :class:`Unavailable`
    ``"unavailable"``; any other exception ``"error"`` with its first line as ``note``.
    ``saved`` is a one-item list shared by the modes of one method: ``fwd`` leaves its last output
    there (with its graph), ``bwd`` times the backward of that graph instead of running another
    forward, and later modes keep only the detached output (used for the error check).
    """
    device = timing.device
    out = call = None
    saved = saved if saved is not None else [None]
    try:
        if mode == "fwd":
            def call():
                saved[0] = build_fwd()
        elif mode == "bwd":
            out = saved[0] if saved[0] is not None and saved[0].grad_fn is not None else build_fwd()
            saved[0] = None

            def call():
                out.backward(dout, retain_graph=True)
        else:
            saved[0] = saved[0].detach() if saved[0] is not None else None

            def call():
                build_fwd().backward(dout)
        peak, first_ms = None, float("nan")
        if device == "cuda":
            call()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            begin = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - begin) * 1e3
            peak = torch.cuda.max_memory_allocated() / 2**20
        ms, q20, q80, note = timing.bench(call, grads, first_ms)
        if out is not None:
            saved[0] = out.detach()
        return {"status": OK, "note": note, "ms": ms, "ms_q20": q20, "ms_q80": q80, "peak_mem_mib": peak}
    except OOM_ERRORS as exc:
        note = str(exc).splitlines()[0][:120] if str(exc) else "out of memory"
        out = call = saved[0] = None
        free_memory(device, collect=True)
        return {"status": OOM, "note": note}
    except Unavailable as exc:
        return {"status": UNAVAILABLE, "note": str(exc)}
    except Exception as exc:  # a failing method is reported, the run goes on
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        saved[0] = None
        return {"status": ERROR, "note": f"{type(exc).__name__}: {first}"[:160]}
    finally:
        out = call = None
        for t in grads:
            t.grad = None


def _run_info(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT).stdout.strip()
    except Exception:
        return ""


def environment_stamp(device: str, argv: list[str], script: str = "benchmarks/harness/bench_attention.py") -> dict:
    """GPU name, driver, torch / triton / CUDA / Python versions, git commit, UTC date and command line (``script``
    run with ``argv``)."""
    import triton

    if device == "cuda":
        gpu = torch.cuda.get_device_name()
        driver = _run_info(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
        driver = driver[0] if driver else "unknown"
    else:
        gpu = f"cpu-smoke ({platform.processor() or platform.machine()}, Triton interpreter)"
        driver = "n/a"
    commit = os.environ.get("BENCH_COMMIT") or _run_info(["git", "rev-parse", "HEAD"]) or "unknown"
    if commit != "unknown" and _run_info(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (tracked files modified)"
    return {
        "gpu": gpu,
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "n/a",
        "python": platform.python_version(),
        "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(shlex.quote(a) for a in ["python", script, *argv]),
    }


def start_run(script: str, argv: list[str], smoke: bool, what: str, sub: str = "") -> tuple[str, dict, Path]:
    """``(device, stamp, default output folder)`` of a run of ``script`` (``benchmarks/results/<gpu-name>/<sub>``,
    ``cpu-smoke`` without CUDA). Without CUDA only a ``--smoke`` run may go on: ``SystemExit`` saying that ``what``
    needs a GPU otherwise."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        raise SystemExit(f"{script.rsplit('/', 1)[-1]}: {what} needs a CUDA GPU; use --smoke on CPU")
    stamp = environment_stamp(device, argv, script)
    slug = gpu_slug(stamp["gpu"]) if device == "cuda" else "cpu-smoke"
    return device, stamp, REPO_ROOT / "benchmarks" / "results" / slug / sub


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"
