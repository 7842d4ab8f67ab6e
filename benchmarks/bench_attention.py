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
import csv
import datetime as _dt
import functools
import gc
import importlib
import importlib.util
import io
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

MODES = ("fwd", "bwd", "fwd+bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
OK, OOM, UNAVAILABLE, ERROR, SKIPPED = "ok", "OOM", "unavailable", "error", "skipped"
MIXED, LEARNABLE = "mixed", "learnable"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}

COLUMNS = (
    "group", "method", "backend", "alpha", "mode", "dtype", "batch", "heads", "seq_q", "seq_k",
    "head_dim", "causal", "score_mult", "target_density", "status", "note", "ms", "ms_q20",
    "ms_q80", "tflops", "peak_mem_mib", "density", "tiles_skipped", "sweeps_mean", "sweeps_max",
    "time_vs_sdpa_flash", "max_abs_err",
)
FLOAT_COLUMNS = (
    "score_mult", "target_density", "ms", "ms_q20", "ms_q80", "tflops", "peak_mem_mib", "density",
    "tiles_skipped", "sweeps_mean", "sweeps_max", "time_vs_sdpa_flash", "max_abs_err",
)
INT_COLUMNS = ("batch", "heads", "seq_q", "seq_k", "head_dim")
CASE_COLUMNS = ("group", "dtype", "batch", "heads", "seq_q", "seq_k", "head_dim", "causal",
                "score_mult", "target_density")
ROW_KEY_COLUMNS = CASE_COLUMNS + ("method", "backend", "alpha", "mode")
STAMP_KEYS = ("gpu", "driver", "torch", "triton", "cuda", "python", "commit", "date", "command")

_OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
_NO_SDPA_KERNEL = ("No viable backend", "No available kernel")


class Unavailable(RuntimeError):
    """A method that cannot run on this machine or shape (e.g. a pinned SDPA backend without a kernel)."""


def _import_sparse_attn():
    """Import the package from an installed copy, or straight from this checkout.

    ``sparse_attn.kernels`` lives in the top-level ``kernels/`` folder (a package-dir mapping of
    the installed package), so an uninstalled checkout needs that folder on the package path.
    """
    try:
        import sparse_attn
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import sparse_attn
    try:
        importlib.import_module("sparse_attn.kernels")
    except ImportError:
        sparse_attn.__path__.append(str(REPO_ROOT))
    return sparse_attn


_import_sparse_attn()

from sparse_attn.attention import entmax_attention  # noqa: E402
from sparse_attn import mappings as _mappings  # noqa: E402
from sparse_attn.reference import causal_keep  # noqa: E402


def _optional(module: str):
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # any import failure means "not available here"
        return None, f"{type(exc).__name__}: {exc}"


FUSED_MODULES = ("sparse_attn.kernels.entmax_attn_fwd", "sparse_attn.kernels.entmax_attn_bwd",
                 "sparse_attn._attn_autograd")


def fused_forward_launcher():
    """Return ``(entmax_attn_fwd, "")``, or ``(None, reason)`` when a fused-kernel module does not exist.

    A module that exists but fails to import is not a reason to skip: the ``sparse_attn`` rows
    then run and report the error.
    """
    for name in FUSED_MODULES:
        if importlib.util.find_spec(name) is None:
            return None, f"fused kernel module {name} missing"
    fwd_mod, _ = _optional(FUSED_MODULES[0])
    return getattr(fwd_mod, "entmax_attn_fwd", None), ""


@dataclass(frozen=True)
class Case:
    """One input shape. Layout ``(batch, heads, seq, head_dim)``; ``score_mult`` scales ``q``."""

    group: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    dtype: str
    score_mult: float = 1.0
    target_density: float | None = None
    alpha: str = ""

    def fields(self) -> dict:
        return {
            "group": self.group, "dtype": self.dtype, "batch": self.batch, "heads": self.heads,
            "seq_q": self.seq_q, "seq_k": self.seq_k, "head_dim": self.head_dim,
            "causal": self.causal, "score_mult": self.score_mult,
            "target_density": self.target_density,
        }


@dataclass
class Method:
    """One benchmarked implementation: ``build(inputs)`` returns a zero-argument forward callable."""

    method: str
    backend: str
    alpha: str
    build: Callable[["Inputs"], Callable[[], torch.Tensor]]
    extra_grads: Callable[["Inputs"], list] = field(default=lambda inputs: [])
    fused_alpha: Callable[["Inputs"], torch.Tensor] | None = None


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    mixed_alpha: torch.Tensor
    learnable_alpha: torch.Tensor
    causal: bool


def dense_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, mode: str) -> float:
    """Dense-equivalent FLOPs: ``4 B H Nq Nk D`` forward (halved when causal), x2.5 bwd, x3.5 fwd+bwd."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def visitable_tiles(seq_q: int, seq_k: int, block_m: int, block_n: int, causal: bool) -> int:
    """Number of (query tile, key tile) pairs holding at least one unmasked pair (per batch-head).

    Causal masking is bottom-right aligned (row ``i`` sees key ``j`` iff ``j <= i + seq_k - seq_q``).
    """
    n_kt = -(-seq_k // block_n)
    total = 0
    for qt in range(-(-seq_q // block_m)):
        last_row = min((qt + 1) * block_m, seq_q) - 1
        last_col = last_row + seq_k - seq_q if causal else seq_k - 1
        if last_col >= 0:
            total += min(n_kt, last_col // block_n + 1)
    return total


def count_live_tiles(live: torch.Tensor, n_key_tiles: int) -> int:
    """Set bits of an int32 tile bitmap ``(..., words)`` (bit ``kt % 32`` of word ``kt // 32``) with ``kt < n_key_tiles``."""
    words = live.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=live.device)) & 1
    kt = torch.arange(words.shape[-1], device=live.device)[:, None] * 32 + torch.arange(32, device=live.device)
    return int((bits * (kt < n_key_tiles)).sum().item())


def tile_stats(res, seq_q: int, seq_k: int, causal: bool, batch_heads: int, blocks: tuple[int, int]) -> dict:
    """Fraction of visitable tiles a fused forward result marks dead, and its Newton sweeps per query tile.

    ``res`` is what :func:`sparse_attn.kernels.entmax_attn_fwd.entmax_attn_fwd` returns (``live``,
    ``n_sweeps``); ``blocks`` its ``(block_m, block_n)``.
    """
    block_m, block_n = blocks
    visit = visitable_tiles(seq_q, seq_k, block_m, block_n, causal) * batch_heads
    live = count_live_tiles(res.live, -(-seq_k // block_n))
    sweeps = res.n_sweeps.float()
    return {
        "tiles_skipped": 1.0 - live / visit if visit else float("nan"),
        "sweeps_mean": float(sweeps.mean().item()),
        "sweeps_max": float(sweeps.max().item()),
    }


def _torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    """Random Gaussian ``q, k, v, dout`` of the case (``q`` times ``score_mult``), all requiring grad."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = _torch_dtype(case.dtype)

    def rand(n, mult=1.0):
        x = torch.randn(case.batch, case.heads, n, case.head_dim, generator=gen) * mult
        return x.to(device=device, dtype=dtype)

    q = rand(case.seq_q, case.score_mult).requires_grad_()
    k = rand(case.seq_k).requires_grad_()
    v = rand(case.seq_k).requires_grad_()
    dout = rand(case.seq_q)
    mixed = torch.linspace(1.0, 2.0, case.heads, device=device)
    return Inputs(q, k, v, dout, mixed, mixed.clone().requires_grad_(), case.causal)


def _alpha_arg(alpha: str, inputs: Inputs):
    if alpha == MIXED:
        return inputs.mixed_alpha
    if alpha == LEARNABLE:
        return inputs.learnable_alpha
    return float(alpha)


def alpha_label(value: float) -> str:
    return f"{value:g}"


def sparse_attn_method(alpha: str) -> Method:
    def build(inputs: Inputs):
        a = _alpha_arg(alpha, inputs)
        return lambda: entmax_attention(inputs.q, inputs.k, inputs.v, a, is_causal=inputs.causal, backend="triton")

    def fused_alpha(inputs: Inputs):
        a = _alpha_arg(alpha, inputs)
        return a if isinstance(a, torch.Tensor) else torch.full((inputs.q.shape[1],), a, device=inputs.q.device)

    extra = (lambda inputs: [inputs.learnable_alpha]) if alpha == LEARNABLE else (lambda inputs: [])
    return Method("sparse_attn", "triton", alpha, build, extra, fused_alpha)


def sdpa_method(backend: str) -> Method:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = getattr(SDPBackend, SDPA_BACKENDS[backend])

    def build(inputs: Inputs):
        def run():
            try:
                with sdpa_kernel(pinned):
                    return torch.nn.functional.scaled_dot_product_attention(
                        inputs.q, inputs.k, inputs.v, is_causal=inputs.causal)
            except RuntimeError as exc:
                if any(msg in str(exc) for msg in _NO_SDPA_KERNEL):
                    raise Unavailable(f"SDPA backend {backend!r} has no kernel for this input") from exc
                raise
        return run

    return Method("sdpa", backend, "1", build)


def flash_attn_method(module) -> Method:
    def build(inputs: Inputs):
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        return lambda: module.flash_attn_func(q, k, v, causal=inputs.causal).transpose(1, 2)

    return Method("flash_attn", getattr(module, "__version__", "?"), "1", build)


def adasplash_method(module, alpha: str) -> Method:
    def build(inputs: Inputs):
        return lambda: module.adasplash(inputs.q, inputs.k, inputs.v, alpha=float(alpha), is_causal=inputs.causal)

    return Method("adasplash", getattr(module, "__version__", "?"), alpha, build)


def recipe_impl():
    """The row mappings of the materialized recipe: the ``entmax`` package if importable, else ours."""
    pkg, _ = _optional("entmax")
    if pkg is not None:
        version = _package_version("entmax")
        return f"entmax {version}", pkg.entmax15, pkg.sparsemax, pkg.entmax_bisect
    return "sparse_attn.mappings", _mappings.entmax15, _mappings.sparsemax, _mappings.entmax


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def recipe_method(alpha: str) -> Method:
    """What a user writes without a fused kernel: materialize the scores in float32, map the rows, aggregate."""
    impl, entmax15, sparsemax, general = recipe_impl()

    def build(inputs: Inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        scale = q.shape[-1] ** -0.5
        a = _alpha_arg(alpha, inputs)
        if isinstance(a, torch.Tensor):
            mapping = functools.partial(general, alpha=a.reshape(1, -1, 1, 1), dim=-1)
        elif a in (1.0, 1.5, 2.0):
            mapping = functools.partial({1.0: torch.softmax, 1.5: entmax15, 2.0: sparsemax}[a], dim=-1)
        else:
            mapping = functools.partial(general, alpha=a, dim=-1)
        keep = causal_keep(q.shape[2], k.shape[2], q.device) if inputs.causal else None

        def run():
            s = torch.matmul(q, k.transpose(-2, -1)).float() * scale
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            return torch.matmul(mapping(s).to(v.dtype), v)
        return run

    return Method("torch_recipe", impl, alpha, build)


def _free(device: str, collect: bool = False):
    """Return cached CUDA memory; ``collect`` also runs the (slow) cycle collector, used after an OOM."""
    if collect:
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def cpu_bench(fn: Callable[[], object], grad_to_none, warmup: int, reps: int) -> tuple[float, float, float]:
    """Median and 20/80% quantiles in ms of ``reps`` wall-clock calls after ``warmup`` calls (CPU stand-in for do_bench)."""
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
    """How to time: ``do_bench`` on CUDA (calls slower than ``slow_ms`` get ``slow_reps`` CUDA-event runs), a wall clock on CPU."""

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
    except _OOM_ERRORS as exc:
        note = str(exc).splitlines()[0][:120] if str(exc) else "out of memory"
        out = call = saved[0] = None
        _free(device, collect=True)
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


def reference_error(fn_out: torch.Tensor, inputs: Inputs, alpha, max_elems: int, cache: dict) -> float:
    """Max abs error of the output's last query rows (first batch item) against the float64 reference.

    Only the last ``r`` rows are compared (``r`` chosen so the reference scores hold at most
    ``max_elems`` entries); bottom-right causal alignment makes those rows a self-contained problem.
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    heads, n_q, n_k = q.shape[1], q.shape[2], k.shape[2]
    rows = min(n_q, 128, max(1, max_elems // max(1, heads * n_k)))
    key = (alpha if not isinstance(alpha, torch.Tensor) else tuple(alpha.detach().flatten().tolist()), rows)
    if key not in cache:
        a = alpha.detach().double() if isinstance(alpha, torch.Tensor) else alpha
        with torch.no_grad():
            cache[key] = entmax_attention(
                q[:1, :, n_q - rows:].detach().double(), k[:1].detach().double(), v[:1].detach().double(), a,
                is_causal=inputs.causal, backend="reference")
    ref = cache[key]
    got = fn_out[:1, :, n_q - rows:].detach().double()
    return float((got - ref).abs().max().item())


def flash_grid(args) -> list[Case]:
    """FlashAttention's grid: ``batch = tokens // seq``, ``heads = hidden // head_dim``; shortest sequences first."""
    cases = []
    for seq in args.seqs:
        for head_dim in args.head_dims:
            for causal in args.causal:
                cases.append(Case("flash", max(1, args.tokens // seq), max(1, args.hidden // head_dim), seq, seq,
                                  head_dim, causal, args.dtype))
    return cases


def calibrate_mult(inputs: Inputs, alpha: float, target: float, sample_rows: int = 64) -> float:
    """Multiplier of the scores giving mean support fraction ``target`` on a sample of rows (bisection in log)."""
    q, k = inputs.q.detach(), inputs.k.detach()
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        s = (q[:1, :, :sample_rows].float() @ k[:1].float().transpose(-2, -1)) * scale
        lo, hi = math.log(1e-4), math.log(1e4)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            dens = (_mappings.entmax(s * math.exp(mid), alpha=alpha, dim=-1) > 0).float().mean().item()
            if dens > target:
                lo = mid
            else:
                hi = mid
    return math.exp(0.5 * (lo + hi))


def sparsity_grid(args, device: str) -> list[Case]:
    """Cases of the sparsity sweep: per alpha and target density, the calibrated score multiplier."""
    cases = []
    seq, head_dim = args.sweep_seq, args.sweep_head_dim
    base = Case("sparsity", max(1, args.tokens // seq), max(1, args.hidden // head_dim), seq, seq, head_dim,
                False, args.dtype)
    probe = make_inputs(base, device)
    for alpha in args.sweep_alphas:
        if alpha == 1.0:
            continue
        for target in args.sweep_targets:
            frac = target / seq if target >= 1 else target
            mult = calibrate_mult(probe, alpha, frac)
            cases.append(replace(base, score_mult=round(mult, 6), target_density=frac, alpha=alpha_label(alpha)))
    return cases


def mixed_grid(args) -> list[Case]:
    cases = []
    for head_dim in args.mixed_head_dims:
        for causal in args.mixed_causal:
            seq = args.mixed_seq
            cases.append(Case("mixed", max(1, args.tokens // seq), max(1, args.hidden // head_dim), seq, seq,
                              head_dim, causal, args.dtype))
    return cases


def methods_for(case: Case, args, providers: dict) -> list[Method]:
    """The methods run on a case, by group."""
    flash = [sdpa_method("flash")]
    if case.group == "flash":
        out = [sparse_attn_method(alpha_label(a)) for a in args.alphas]
        out += [sdpa_method(b) for b in args.sdpa_backends]
        if providers.get("flash_attn"):
            out.append(flash_attn_method(providers["flash_attn"]))
        if providers.get("adasplash"):
            out += [adasplash_method(providers["adasplash"], alpha_label(a)) for a in args.alphas if a > 1]
        out += [recipe_method(alpha_label(a)) for a in args.recipe_alphas]
        return out
    if case.group == "sparsity":
        out = [sparse_attn_method(case.alpha)] + flash
        if providers.get("adasplash"):
            out.append(adasplash_method(providers["adasplash"], case.alpha))
        return out
    return [sparse_attn_method(MIXED), sparse_attn_method(LEARNABLE), sparse_attn_method("1.5")] + flash + [
        recipe_method(MIXED)]


def _run_info(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT).stdout.strip()
    except Exception:
        return ""


def environment_stamp(device: str, argv: list[str]) -> dict:
    """GPU name, driver, torch / triton / CUDA / Python versions, git commit, UTC date and command line."""
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
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_attention.py", *argv]),
    }


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _fmt(value, digits: int = 3) -> str:
    """Cell text: ``""`` for a value not measured (None), ``"nan"`` for a measured NaN."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isnan(value):
        return f"{value:.{digits}g}"
    return str(value)


def _num(value) -> float:
    return float("nan") if value is None else float(value)


def write_csv(path: Path, stamp: dict, notes: list[str], rows: list[dict]):
    """CSV with ``# key: value`` stamp lines first (read with ``pandas.read_csv(path, comment="#")``)."""
    buf = io.StringIO()
    for key in STAMP_KEYS:
        buf.write(f"# {key}: {stamp[key]}\n")
    for note in notes:
        buf.write(f"# note: {note}\n")
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: _fmt(row.get(c), 6) for c in COLUMNS})
    path.write_text(buf.getvalue())


def read_csv(path: Path) -> list[dict]:
    """Rows of a results CSV written by :func:`write_csv`, numbers parsed back."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    rows = []
    for raw in csv.DictReader(lines):
        row = dict(raw)
        for c in FLOAT_COLUMNS:
            row[c] = float(row[c]) if row.get(c) not in (None, "") else None
        for c in INT_COLUMNS:
            row[c] = int(row[c])
        row["causal"] = row["causal"] == "True"
        rows.append(row)
    return rows


MD_CASE_COLUMNS = (
    ("method", "method"), ("backend", "backend"), ("alpha", "α"), ("batch", "B"), ("heads", "H"),
    ("seq_q", "N"), ("head_dim", "D"), ("causal", "causal"), ("score_mult", "score ×"),
    ("density", "density"), ("tiles_skipped", "tiles skipped"), ("sweeps_mean", "sweeps mean"),
    ("sweeps_max", "sweeps max"), ("max_abs_err", "max err"),
)
GROUP_TITLES = {
    "flash": "FlashAttention grid (batch x seq = const tokens)",
    "sparsity": "Sparsity sweep (scores scaled to set the support size)",
    "mixed": "Per-head mixed alpha (linspace(1, 2, H)); learnable = requires_grad",
}


def _mode_cells(row: dict | None) -> list[str]:
    """``ms (q20-q80)``, ``TFLOP/s``, ``time / SDPA flash`` and peak MiB of one mode, or its status."""
    if row is None:
        return ["", "", "", ""]
    if row["status"] != OK:
        return [row["status"], "", "", ""]
    return [f"{_fmt(row['ms'])} ({_fmt(row['ms_q20'])}–{_fmt(row['ms_q80'])})", _fmt(row["tflops"]),
            _fmt(row["time_vs_sdpa_flash"]), _fmt(row["peak_mem_mib"], 4)]


def summary_lines(rows: list[dict], modes=MODES) -> list[str]:
    """Flash-grid summary: per mode, ``time / SDPA flash`` of every other method, one line per shape."""
    grid = [r for r in rows if r["group"] == "flash"]
    series = list(dict.fromkeys(_series_label(r) for r in grid if not (r["method"] == "sdpa" and r["backend"] == "flash")))
    if not series:
        return []
    lines = ["## Summary: time / SDPA flash on the FlashAttention grid (below 1 = faster than flash)", ""]
    for mode in modes:
        by_shape: dict[tuple, dict] = {}
        for r in grid:
            if r["mode"] == mode:
                by_shape.setdefault((r["head_dim"], r["causal"], r["seq_q"]), {})[_series_label(r)] = r
        if not by_shape:
            continue
        lines += [f"### {mode}", "", "| D | causal | N | " + " | ".join(series) + " |", "|" + "---|" * (3 + len(series))]
        for (hd, causal, seq), cells in by_shape.items():
            vals = []
            for label in series:
                r = cells.get(label)
                vals.append("" if r is None else _fmt(r["time_vs_sdpa_flash"]) if r["status"] == OK else r["status"])
            lines.append(f"| {hd} | {causal} | {seq} | " + " | ".join(vals) + " |")
        lines.append("")
    return lines


def write_markdown(path: Path, stamp: dict, notes: list[str], rows: list[dict], modes=MODES):
    """Stamp, notes, the flash-grid summary, then tables, one per group, one line per (case, method)
    and four cells per mode (see benchmarks/README.md)."""
    lines = ["# Attention benchmark", ""]
    lines += [f"- **{key}**: `{stamp[key]}`" for key in STAMP_KEYS]
    lines += [f"- note: {n}" for n in notes]
    lines.append("")
    lines += summary_lines(rows, modes)
    header = [h for _, h in MD_CASE_COLUMNS]
    for mode in modes:
        header += [f"{mode} ms (q20–q80)", f"{mode} TFLOP/s", f"{mode} / SDPA flash", f"{mode} peak MiB"]
    header.append("notes")
    for group, title in GROUP_TITLES.items():
        lines_by_key: dict[tuple, dict] = {}
        for r in rows:
            if r["group"] != group:
                continue
            key = tuple(str(r[c]) for c in CASE_COLUMNS) + (r["method"], r["backend"], r["alpha"])
            lines_by_key.setdefault(key, {})[r["mode"]] = r
        if not lines_by_key:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for by_mode in lines_by_key.values():
            first = next(iter(by_mode.values()))
            cells = [_fmt(first.get(c)) for c, _ in MD_CASE_COLUMNS]
            for mode in modes:
                cells += _mode_cells(by_mode.get(mode))
            cells.append("; ".join(dict.fromkeys(r["note"] for r in by_mode.values() if r.get("note"))))
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def _stamp_text(stamp: dict) -> str:
    return (f"{stamp['gpu']} | driver {stamp['driver']} | torch {stamp['torch']} | triton {stamp['triton']} | "
            f"commit {stamp['commit'][:16]} | {stamp['date']}\n{stamp['command']}")


def _series_label(r: dict) -> str:
    alpha = "" if r["method"] in ("sdpa", "flash_attn") else f" α={r['alpha']}"
    backend = f"[{r['backend']}]" if r["method"] in ("sdpa", "torch_recipe") else ""
    return f"{r['method']}{backend}{alpha}"


def write_plots(out: Path, stamp: dict, rows: list[dict]) -> list[Path]:
    """``plot_grid.png`` (TFLOP/s vs seq), ``plot_sparsity.png`` (time ratio, skipped tiles, sweeps vs density), ``plot_mixed.png``."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", flush=True)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in rows if r["status"] == OK]
    footer = _stamp_text(stamp)

    grid = [r for r in ok if r["group"] == "flash"]
    panels = sorted({(r["head_dim"], r["causal"]) for r in grid}) or [(0, False)]
    fig, axes = plt.subplots(len(MODES), len(panels), figsize=(4.5 * len(panels), 3.4 * len(MODES)), squeeze=False)
    for i, mode in enumerate(MODES):
        for j, (hd, causal) in enumerate(panels):
            ax = axes[i][j]
            sel = [r for r in grid if r["mode"] == mode and r["head_dim"] == hd and r["causal"] == causal]
            for label in sorted({_series_label(r) for r in sel}):
                pts = sorted((r["seq_q"], r["tflops"]) for r in sel if _series_label(r) == label)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, D={hd}, causal={causal}", fontsize=9)
            ax.set_xlabel("seq")
            ax.set_ylabel("dense-equiv. TFLOP/s")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=7)
    fig.text(0.01, 0.005, footer, fontsize=6, family="monospace")
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, hspace=0.45, wspace=0.3)
    written.append(_save(fig, out / "plot_grid.png"))

    sweep = [r for r in ok if r["group"] == "sparsity"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode in MODES:
        for alpha in sorted({r["alpha"] for r in sweep if r["method"] == "sparse_attn"}):
            sel = sorted((_num(r["density"]), _num(r["time_vs_sdpa_flash"])) for r in sweep
                         if r["method"] == "sparse_attn" and r["alpha"] == alpha and r["mode"] == mode)
            axes[0].plot([p[0] for p in sel], [p[1] for p in sel], marker="o", label=f"{mode} α={alpha}")
    fwd_rows = [r for r in sweep if r["method"] == "sparse_attn" and r["mode"] == "fwd"]
    for alpha in sorted({r["alpha"] for r in fwd_rows}):
        sel = sorted((_num(r["density"]), _num(r["tiles_skipped"]), _num(r["sweeps_mean"]))
                     for r in fwd_rows if r["alpha"] == alpha)
        axes[1].plot([p[0] for p in sel], [p[1] for p in sel], marker="o", label=f"α={alpha}")
        axes[2].plot([p[0] for p in sel], [p[2] for p in sel], marker="o", label=f"α={alpha}")
    for ax, ylabel in zip(axes, ("time / SDPA flash", "fraction of tiles skipped", "Newton sweeps (mean per q tile)")):
        ax.set_xscale("log")
        ax.set_xlabel("realized density (nnz / valid keys)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.text(0.01, 0.005, footer, fontsize=6, family="monospace")
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.22, top=0.95, wspace=0.3)
    written.append(_save(fig, out / "plot_sparsity.png"))

    mixed = [r for r in ok if r["group"] == "mixed"]
    shapes = sorted({(r["head_dim"], r["causal"]) for r in mixed}) or [(0, False)]
    fig, axes = plt.subplots(1, len(shapes), figsize=(max(9.0, 5.5 * len(shapes)), 4.2), squeeze=False)
    for j, (hd, causal) in enumerate(shapes):
        ax = axes[0][j]
        sel = [r for r in mixed if r["head_dim"] == hd and r["causal"] == causal]
        labels = sorted({_series_label(r) for r in sel})
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            ys = [next((r["ms"] for r in sel if r["mode"] == m and _series_label(r) == label), float("nan")) for m in MODES]
            ax.bar([x + i * width for x in range(len(MODES))], ys, width=width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(MODES))], MODES)
        ax.set_ylabel("ms (median)")
        ax.set_yscale("log")
        ax.set_title(f"D={hd}, causal={causal}", fontsize=9)
        if labels:
            ax.legend(fontsize=7)
    fig.text(0.01, 0.005, footer, fontsize=6, family="monospace")
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.22, top=0.92, wspace=0.3)
    written.append(_save(fig, out / "plot_mixed.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_ratios(rows: list[dict]):
    """Fill ``tflops`` and ``time_vs_sdpa_flash`` (method time / SDPA flash time on the same case and mode)."""
    flash = {tuple(r[c] for c in CASE_COLUMNS) + (r["mode"],): r["ms"]
             for r in rows if r["method"] == "sdpa" and r["backend"] == "flash" and r["status"] == OK}
    for r in rows:
        if r["status"] != OK:
            r["tflops"] = r["time_vs_sdpa_flash"] = None
            continue
        r["tflops"] = dense_flops(r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["head_dim"], r["causal"],
                                  r["mode"]) / (r["ms"] * 1e-3) / 1e12
        base = flash.get(tuple(r[c] for c in CASE_COLUMNS) + (r["mode"],))
        r["time_vs_sdpa_flash"] = r["ms"] / base if base else float("nan")


def _row_key(row: dict) -> tuple:
    return tuple(_fmt(row[c], 6) for c in ROW_KEY_COLUMNS)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny float32 shapes (CPU + Triton interpreter without CUDA)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu-name>/)")
    p.add_argument("--groups", default="flash,sparsity,mixed", help="comma list of flash, sparsity, mixed (default all)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default bf16 (fp32 with --smoke)")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--seqs", default=None, help="comma list (default 512,...,32768)")
    p.add_argument("--head-dims", default=None, help="comma list (default 64,128)")
    p.add_argument("--causal", default=None, help="causal values of the flash grid (default false,true; false with --smoke)")
    p.add_argument("--alphas", default="1,1.5,2,1.25", help="sparse_attn alphas on the flash grid (default 1,1.5,2,1.25)")
    p.add_argument("--recipe-alphas", default=None,
                   help="materialized-recipe alphas on the flash grid (default 1.5; 1,1.5,2,1.25 with --smoke)")
    p.add_argument("--sdpa-backends", default="flash,cudnn", help="pinned SDPA backends among flash, cudnn, efficient, math (default flash,cudnn; flash always runs)")
    p.add_argument("--sweep-seq", type=int, default=None, help="sequence length of the sparsity sweep (default 8192)")
    p.add_argument("--sweep-head-dim", type=int, default=None, help="head dim of the sparsity sweep (default 128)")
    p.add_argument("--sweep-alphas", default=None, help="alphas of the sweep (default 1.5,2,1.25)")
    p.add_argument("--sweep-targets", default=None,
                   help="target support: values >= 1 are key counts, < 1 fractions (default 4,0.01,0.05,0.2,0.5,0.9)")
    p.add_argument("--mixed-seq", type=int, default=None, help="sequence length of the mixed-alpha case (default 4096)")
    p.add_argument("--mixed-head-dims", default=None, help="head dims of the mixed-alpha case (default 64,128)")
    p.add_argument("--mixed-causal", default=None, help="causal values of the mixed-alpha case (default false,true)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up in ms (default 10)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench measuring time in ms (default 50)")
    p.add_argument("--slow-ms", type=float, default=200.0,
                   help="calls slower than this many ms are timed by --slow-reps CUDA-event runs instead of do_bench (default 200)")
    p.add_argument("--slow-reps", type=int, default=3, help="timed runs of a slow call (default 3)")
    p.add_argument("--cpu-reps", type=int, default=1, help="timed calls per measurement on CPU (default 1)")
    p.add_argument("--check-max-elems", type=int, default=2**26,
                   help="cap on the float64 reference scores used for the max_abs_err column (default 2**26)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new method after this many seconds (rows left are 'skipped'); the files stay complete")
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench_attention.py: the full grid needs a CUDA GPU; use --smoke on CPU")
    start = time.monotonic()
    stamp = environment_stamp(device, argv)
    out = args.out or REPO_ROOT / "benchmarks" / "results" / (gpu_slug(stamp["gpu"]) if device == "cuda" else "cpu-smoke")
    out.mkdir(parents=True, exist_ok=True)

    fwd, fused_missing = fused_forward_launcher()
    providers = {}
    notes = [f"mixed alpha = torch.linspace(1, 2, heads); recipe = float32 scores + {recipe_impl()[0]}"]
    for name in ("flash_attn", "adasplash"):
        mod, why = _optional(name)
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
        previous = {_row_key(r): r for r in read_csv(args.resume_from) if r["status"] != SKIPPED}
        notes.append(f"{len(previous)} rows kept from {args.resume_from} (an earlier run, see its own stamp)")
    rows: list[dict] = []
    cases = []
    for group in args.groups:
        if group == "flash":
            cases += flash_grid(args)
        elif group == "sparsity":
            cases += sparsity_grid(args, device)
        else:
            cases += mixed_grid(args)
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
            todo = []
            for mode in args.modes:
                row = {**base, "mode": mode}
                kept = previous.get(_row_key(row))
                if kept is None:
                    todo.append(row)
                    continue
                rows.append(kept)
                if kept["status"] == OOM:
                    oom_at.setdefault(series + (mode,), case.seq_q)
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
                print(_progress(rows[-1]), flush=True)
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
        _free(device)
        flush()
    flush()
    written = write_plots(out, stamp, rows)
    print(f"wrote {out / 'results.md'}, {out / 'results.csv'}, " + ", ".join(str(w) for w in written), flush=True)
    if budget_hit:
        print("INCOMPLETE: time budget reached; rerun with --resume-from " + str(out / "results.csv"), flush=True)
    return out


def fused_blocks(res, head_dim: int) -> tuple[int, int]:
    """``(block_m, block_n)`` of a fused forward result, else from the module's ``fwd_block_sizes(head_dim)``."""
    if getattr(res, "block_m", None) is not None:
        return int(res.block_m), int(res.block_n)
    module = importlib.import_module(FUSED_MODULES[0])
    block_m, block_n = module.fwd_block_sizes(head_dim)[:2]
    return int(block_m), int(block_n)


def visible_pairs(batch: int, heads: int, seq_q: int, seq_k: int, causal: bool) -> int:
    """Number of unmasked (query, key) pairs; causal is bottom-right aligned."""
    if not causal:
        return batch * heads * seq_q * seq_k
    per_row = (torch.arange(seq_q) + seq_k - seq_q + 1).clamp(0, seq_k)
    return batch * heads * int(per_row.sum().item())


def case_extras(method: Method, inputs: Inputs, fwd, args, ref_cache: dict, device: str,
                out: torch.Tensor | None = None) -> dict:
    """Untimed per-(case, method) numbers: max error vs the float64 reference and, for ``sparse_attn``,
    realized density, fraction of tiles skipped and Newton sweeps (one call of the fused forward).

    ``out`` is the output of a timed forward when there was one (else the method runs once more).
    """
    extra = {}
    try:
        a = _alpha_arg(method.alpha, inputs)
        with torch.no_grad():
            if method.method == "sparse_attn":
                q, k = inputs.q, inputs.k
                alpha_t = method.fused_alpha(inputs).detach().float().reshape(-1).expand(q.shape[1]).contiguous()
                res = fwd(q.detach(), k.detach(), inputs.v.detach(), alpha_t, q.shape[-1] ** -0.5,
                          is_causal=inputs.causal)
                pairs = visible_pairs(q.shape[0], q.shape[1], q.shape[2], k.shape[2], inputs.causal)
                extra["density"] = float(res.nnz.double().sum().item()) / max(1, pairs)
                extra.update(tile_stats(res, q.shape[2], k.shape[2], inputs.causal, q.shape[0] * q.shape[1],
                                        fused_blocks(res, q.shape[-1])))
                out = res.out if out is None else out
            elif out is None:
                out = method.build(inputs)()
            extra["max_abs_err"] = reference_error(out, inputs, a, args.check_max_elems, ref_cache)
            if not bool(torch.isfinite(out).all()):
                extra["note"] = "output has NaN/inf"
    except _OOM_ERRORS:
        _free(device, collect=True)
    except Exception as exc:  # the timing stands even if the untimed extras fail
        extra["note"] = f"extras failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return extra


def _progress(row: dict) -> str:
    return (f"[{row['group']}] {row['method']}:{row['backend']} a={row['alpha']} {row['mode']} B={row['batch']} "
            f"H={row['heads']} N={row['seq_q']} D={row['head_dim']} causal={row['causal']} "
            f"x{_fmt(row['score_mult'])} -> {row['status']} {_fmt(row.get('ms'))} ms {row.get('note', '')}")


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
