"""Host time of one ``entmax_decode`` step, stage by stage, with the kernel launches stubbed: what a decoding step
costs before any GPU work, and how many launches it makes.

The kernels of ``kernels/attn/entmax_decode.py`` are replaced by recorders (a launch costs nothing here; on a GPU each
Triton launch adds its own host time, which grows with its number of arguments, printed); every other line of the
call runs as it does on a GPU, on CPU tensors (``TRITON_INTERPRET=1``, only so that the triton backend accepts them).
As for CUDA tensors, tensor values are not read back for checks (``--read-values``: read them, as CPU tensors are).
Stages (inclusive wall time per call, median over ``--steps`` calls after a warm-up):

* ``call``: the whole ``entmax_decode`` call;
* ``prepare``: the argument gate (``prepare_attention``: the checks, the cache checks, the spec), or its cached form;
* ``op``: the custom op ``sparse_attn::entmax_decode`` (dispatch and the launcher), when the call goes through it
  (eager calls skip it where nothing needs it: ``sparse_attn.attn.decode``);
* ``launcher``: ``launch_decode``, the launcher on the op's spec (``entmax_decode_fwd`` in sources before it): planning,
  buffers, the argument dicts, the stubbed launches;
* ``alloc``: the time spent in ``torch.empty`` / ``torch.zeros`` / ``torch.full`` during the call (all stages).

Also counted per call: kernel launches, buffers allocated (``torch.empty`` / ``torch.zeros`` /
``torch.full``: on a GPU every ``zeros`` and ``full`` is one more launch, a fill kernel) and the arguments of each
launch.

Usage: ``python benchmarks/harness/decode_host.py [--batch 1 8 32] [--keys 1024 32768] [--alpha 1.0 1.5] [--steps 200]
[--route decode attention] [--read-values] [--bind] [--device cuda]``. ``--route attention``: the step through
``entmax_attention`` as a Hugging Face model calls it, a contiguous cache. ``--bind``: also the host time Triton's
launch path spends on the step's launches before the driver calls, binding and specializing the arguments and
finding the compiled kernel, for an sm_90 target, measured with the Triton installed (run it with the GPU machine's
version). ``--device cuda``: on a GPU, CUDA tensors and real launches, the host time of each stage with the GPU
working behind it, Triton's launch path included in ``launcher``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# --bind needs the kernels as JIT functions (their launch signature); otherwise the interpreter only lets the triton
# backend take CPU tensors
os.environ["TRITON_INTERPRET"] = ("0" if "--bind" in sys.argv or "cuda" in sys.argv
                                  else os.environ.get("TRITON_INTERPRET", "1"))

import torch  # noqa: E402

import sparse_attn.attn.decode as decode_mod  # noqa: E402
from sparse_attn import _validation  # noqa: E402
from sparse_attn.attn import attention as attention_mod  # noqa: E402
from sparse_attn.attn import attn_inputs  # noqa: E402
from sparse_attn.kernels.attn import entmax_decode as dec  # noqa: E402

try:  # where the custom op lives (sparse_attn.attn.decode itself in earlier sources)
    import sparse_attn.attn._decode_op as op_mod  # noqa: E402
except ImportError:
    op_mod = decode_mod


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](**kwargs)`` records the launch and its arguments, and launches
    ``real`` (a GPU run) or nothing."""

    def __init__(self, log: list, name: str, real=None):
        self.log, self.name, self.real = log, name, real

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.log.append((self.name, kwargs))
            if self.real is not None:
                self.real[grid](**kwargs)
        return launch


def _count_args(values) -> int:
    """Arguments of a launch, tuples flattened (what the launch passes)."""
    return sum(_count_args(v) if isinstance(v, tuple) else 1 for v in values)


def bind_times(log: list, kernels: dict, repeats: int = 2000) -> float:
    """Median microseconds Triton's launch path spends before the driver call on the recorded launches (triton 3.x:
    binding the arguments and specializing them, ``create_function_from_signature``, and the compiled-kernel key,
    ``compute_cache_key``), for an sm_90 target; summed over the launches of one step."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(GPUTarget("cuda", 90, 32))
    per_launch = []
    for name, kwargs in log:
        kernel = kernels[name]
        binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
        kw = dict(kwargs, debug=False)
        cache: dict = {}
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _, spec, opts = binder(**kw)
            jit.compute_cache_key(cache, spec, opts)
            times.append(time.perf_counter() - t0)
        per_launch.append(statistics.median(times))
    return sum(per_launch)


def _timed(stage: str, fn, times: dict):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(stage, []).append(time.perf_counter() - t0)
    return wrapper


def measure(batch: int, keys: int, alpha: float, steps: int, heads: int = 32, kv_heads: int = 8, d: int = 128,
            dtype=torch.bfloat16, route: str = "decode", read_values: bool = False, bind: bool = False,
            device: str = "cpu") -> dict:
    """Median host seconds per stage of one decode step, launches and allocations per call (``device="cuda"``: real
    tensors and launches, the host time of each stage as the GPU runs behind it)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=g).to(dtype).to(device)
    if device == "cpu":
        # the launches are stubbed, so the cache's values are never read: a broadcast view stands for any cache size
        k = torch.randn(1, 1, 1, d, generator=g).to(dtype).expand(batch, kv_heads, keys, d)
        v = torch.randn(1, 1, 1, d, generator=g).to(dtype).expand(batch, kv_heads, keys, d)
    else:
        k, v = (torch.randn(batch, kv_heads, keys, d, device=device, dtype=dtype) for _ in range(2))
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device=device)
    log: list = []
    times: dict = {}
    allocs = [0, 0.0]
    op = torch.ops.sparse_attn.entmax_decode.default
    names = ("_entmax_decode_split_kernel", "_entmax_decode_combine_kernel", "entmax_decode_fwd", "launch_decode")
    saved_dec = {n: getattr(dec, n) for n in names if hasattr(dec, n)}
    saved_mod = {n: getattr(decode_mod, n) for n in ("prepare_attention", "_gate") if hasattr(decode_mod, n)}
    saved_op = op_mod._decode_op
    saved_torch = (torch.empty, torch.zeros, torch.full)
    saved_free = _validation._FREE_READ_DEVICES
    saved_prepare = attention_mod.prepare_attention

    def count(fn):
        def wrapper(*args, **kwargs):
            allocs[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                allocs[1] += time.perf_counter() - t0
        return wrapper

    saved_interp = attn_inputs.interpreting
    try:
        if bind:  # the triton backend's device check (CPU tensors only under the interpreter) is the one thing to pass
            attn_inputs.interpreting = lambda: True
        if not read_values:
            _validation._FREE_READ_DEVICES = frozenset()
        real = device != "cpu"
        dec._entmax_decode_split_kernel = _Recorder(log, "split", saved_dec["_entmax_decode_split_kernel"] if real
                                                    else None)
        if "_entmax_decode_combine_kernel" in saved_dec:  # earlier sources: a separate combine kernel
            dec._entmax_decode_combine_kernel = _Recorder(
                log, "combine", saved_dec["_entmax_decode_combine_kernel"] if real else None)
        for name in ("prepare_attention", "_gate"):
            if name in saved_mod:
                setattr(decode_mod, name, _timed("prepare", saved_mod[name], times))
        op_mod._decode_op = _timed("op", saved_op, times)
        launcher = "launch_decode" if "launch_decode" in saved_dec else "entmax_decode_fwd"
        setattr(dec, launcher, _timed("launcher", saved_dec[launcher], times))

        if route == "decode":
            def step():
                return decode_mod.entmax_decode(q, k, v, seqlens, alpha, backend="triton")
        else:
            attention_mod.prepare_attention = _timed("prepare", saved_prepare, times)

            def step():
                return attention_mod.entmax_attention(q, k, v, alpha, enable_gqa=True, backend="triton")

        with torch.no_grad():
            step()  # warm-up: imports, op registration, first-call caches
            step()
            times.clear()
            log.clear()
            torch.empty, torch.zeros, torch.full = (count(f) for f in saved_torch)
            allocs[:] = [0, 0.0]
            alloc_times = []
            for _ in range(steps):
                before = allocs[1]
                t0 = time.perf_counter()
                step()
                times.setdefault("call", []).append(time.perf_counter() - t0)
                alloc_times.append(allocs[1] - before)
            torch.empty, torch.zeros, torch.full = saved_torch
            if real:
                torch.cuda.synchronize()
        del op
    finally:
        torch.empty, torch.zeros, torch.full = saved_torch
        _validation._FREE_READ_DEVICES = saved_free
        attn_inputs.interpreting = saved_interp
        attention_mod.prepare_attention = saved_prepare
        for n, f in saved_dec.items():
            setattr(dec, n, f)
        for n, f in saved_mod.items():
            setattr(decode_mod, n, f)
        op_mod._decode_op = saved_op
    n_launches = len(log) // steps
    row = {stage: statistics.median(t) for stage, t in times.items()}
    row.update(alloc=statistics.median(alloc_times), launches=len(log) / steps,
               args_per_launch=max((_count_args(kw.values()) for _, kw in log[-n_launches:]), default=0),
               allocs=allocs[0] / steps)
    if bind:
        one_step = log[-n_launches:]
        row["bind"] = bind_times(one_step, {"split": saved_dec["_entmax_decode_split_kernel"],
                                            "combine": saved_dec.get("_entmax_decode_combine_kernel")})
    return row


def _us(row: dict, stage: str) -> str:
    return f"{row[stage] * 1e6:.0f}" if stage in row else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--keys", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0, 1.5])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--route", nargs="+", default=["decode"], choices=["decode", "attention"])
    ap.add_argument("--read-values", action="store_true", help="read tensor values for checks, as for CPU tensors")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: real tensors and launches on a GPU (the GPU part of the breakdown)")
    ap.add_argument("--bind", action="store_true",
                    help="also time Triton's argument binding and kernel key per launch (an sm_90 target, no GPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    where = "launches stubbed" if args.device == "cpu" else f"on {torch.cuda.get_device_name()}, launches real"
    print(f"host time of one decode step, {where}; torch {torch.__version__}, 32 q / 8 kv heads, head dim "
          f"128, bf16, one query per sequence, {args.steps} steps, median; values "
          f"{'read' if args.read_values else 'not read (as on a GPU)'}; load average {os.getloadavg()[0]:.2f}\n")
    import triton

    bind_col = f" triton bind us per step ({triton.__version__}) |" if args.bind else ""
    print("| route | B | keys | alpha | call us | prepare us | op us | launcher us | alloc us | launches | "
          "args per launch | allocations |" + bind_col)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.bind else ""))
    for route in args.route:
        for b in args.batch:
            for n in args.keys:
                for a in args.alpha:
                    r = measure(b, n, a, args.steps, route=route, read_values=args.read_values, bind=args.bind,
                                device=args.device)
                    print(f"| {route} | {b} | {n} | {a:g} | {_us(r, 'call')} | {_us(r, 'prepare')} | {_us(r, 'op')} | "
                          f"{_us(r, 'launcher')} | {_us(r, 'alloc')} | {r['launches']:g} | {r['args_per_launch']} | "
                          f"{r['allocs']:g} |" + (f" {_us(r, 'bind')} |" if args.bind else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
