"""Host time of one ``entmax_decode`` step, stage by stage, with the kernel launches stubbed: what a decoding step
costs before any GPU work, and how many launches it makes.

The kernels of ``kernels/attn/entmax_decode.py`` are replaced by recorders (a launch costs nothing here; on a GPU each
Triton launch adds its own host time, roughly proportional to its number of arguments, which is printed); every
other line of the call runs as it does on a GPU, on CPU tensors (``TRITON_INTERPRET=1``, only so that the triton
backend accepts them). Stages (inclusive wall time per call, median over ``--steps`` calls after a warm-up):

* ``call``: the whole ``entmax_decode`` call;
* ``prepare``: ``prepare_attention`` (argument checks, the cache checks, the spec);
* ``op``: the custom op ``sparse_attn::entmax_decode`` (dispatch, its checks and the launcher);
* ``launcher``: ``entmax_decode_fwd`` (planning, buffer allocations, the argument dicts, the stubbed launches).

Also counted per call: kernel launches (split and combine), buffers allocated (``torch.empty`` / ``torch.zeros``:
on a GPU every ``zeros`` is one more launch, a memset) and the arguments of each launch.

Usage: ``python benchmarks/decode_host.py [--batch 1 8 32] [--keys 1024 32768] [--alpha 1.0 1.5] [--steps 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import sparse_attn.attn.decode as decode_mod  # noqa: E402
from sparse_attn.attn import attn_inputs  # noqa: E402
from sparse_attn.kernels.attn import entmax_decode as dec  # noqa: E402


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](**kwargs)`` counts the launch and its arguments."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, len(args) + len(kwargs)))
        return launch


def _timed(stage: str, fn, times: dict):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(stage, []).append(time.perf_counter() - t0)
    return wrapper


def measure(batch: int, keys: int, alpha: float, steps: int, heads: int = 32, kv_heads: int = 8, d: int = 128,
            dtype=torch.bfloat16) -> dict:
    """Median host seconds per stage of one decode step, launches and allocations per call."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, d, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, d, generator=g).to(dtype)
    seqlens = torch.full((batch,), keys, dtype=torch.int32)
    log: list = []
    times: dict = {}
    allocs = [0]
    saved = (dec._entmax_decode_split_kernel, dec._entmax_decode_combine_kernel, attn_inputs.prepare_attention,
             decode_mod.prepare_attention, dec.entmax_decode_fwd, torch.empty, torch.zeros)
    real_empty, real_zeros = torch.empty, torch.zeros

    def count(fn):
        def wrapper(*args, **kwargs):
            allocs[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        dec._entmax_decode_split_kernel = _Recorder(log, "split")
        dec._entmax_decode_combine_kernel = _Recorder(log, "combine")
        decode_mod.prepare_attention = _timed("prepare", attn_inputs.prepare_attention, times)
        dec.entmax_decode_fwd = _timed("launcher", saved[4], times)
        op = torch.ops.sparse_attn.entmax_decode

        def step():
            return decode_mod.entmax_decode(q, k, v, seqlens, alpha, backend="triton")

        step()  # warm-up: imports, op registration, first-call caches
        times.clear()
        log.clear()
        torch.empty, torch.zeros = count(real_empty), count(real_zeros)
        allocs[0] = 0
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.setdefault("call", []).append(time.perf_counter() - t0)
        torch.empty, torch.zeros = real_empty, real_zeros
        del op
    finally:
        (dec._entmax_decode_split_kernel, dec._entmax_decode_combine_kernel, attn_inputs.prepare_attention,
         decode_mod.prepare_attention, dec.entmax_decode_fwd, torch.empty, torch.zeros) = saved
    launches = [n for _, n in log]
    row = {stage: statistics.median(t) for stage, t in times.items()}
    row.update(launches=len(launches) / steps, args_per_launch=max(launches) if launches else 0,
               allocs=allocs[0] / steps)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--keys", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0, 1.5])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"host time of one decode step, launches stubbed; torch {torch.__version__}, 32 q / 8 kv heads, head dim "
          f"128, bf16, one query per sequence, {args.steps} steps, median; load average {os.getloadavg()[0]:.2f}\n")
    print("| B | keys | alpha | call us | prepare us | launcher us | launches | args per launch | allocations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        for n in args.keys:
            for a in args.alpha:
                r = measure(b, n, a, args.steps)
                print(f"| {b} | {n} | {a:g} | {r['call'] * 1e6:.0f} | {r['prepare'] * 1e6:.0f} | "
                      f"{r['launcher'] * 1e6:.0f} | {r['launches']:g} | {r['args_per_launch']} | {r['allocs']:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
