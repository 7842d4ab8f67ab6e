"""Block-sparse masks on a GPU: correctness against float64 and the time a block mask saves.

For bf16 inputs ``(B, H, N, D)`` and a random block grid (``--keep`` of the ``--block`` x ``--block`` blocks kept,
the diagonal always), runs ``entmax_attention(..., block_mask=...)`` forward and forward + backward, checks the output
and ``dq`` against the float64 reference on the same (rounded) inputs, and times it next to the same call without a
block mask (``triton.testing.do_bench``, medians). Also one decode step (4 queries against the N keys) with the block
mask against float64. Prints a markdown table (and writes it to ``--out``/block_mask.md).

Usage: ``python benchmarks/gpu/block_mask_check.py [--n 8192] [--d 128] [--block 128] [--keep 0.25] [--alphas 1,1.5,2]
[--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess

import torch
import triton

import sparse_attn as sa
from sparse_attn.reference import entmax_attention_reference


def _err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _bench(fn, return_mode):
    """Median ms: ``triton.testing.do_bench`` on a GPU, one timed call on the CPU (the dry run)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, return_mode=return_mode)
    import time
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--keep", type=float, default=0.25)
    p.add_argument("--alphas", default="1,1.5,2")
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script on the library's CPU path)")
    args = p.parse_args()
    dev = args.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, h, n, d, bs = 1, args.heads, args.n, args.d, args.block
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    nb = triton.cdiv(n, bs)
    grid = torch.rand(1, h, nb, nb, generator=gen) < args.keep
    grid[..., torch.arange(nb), torch.arange(nb)] = True
    bm = sa.BlockSparseMask(grid.to(dev), (bs, bs))
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                              text=True).stdout.strip()
    lines = [f"# Block-sparse masks on {torch.cuda.get_device_name() if dev == 'cuda' else dev}", "",
             f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
             f"- commit {commit}",
             f"- B {b}, H {h}, N {n}, D {d}, bf16, block {bs} x {bs}, kept blocks {float(grid.float().mean()):.3f}",
             "- err: max |out - float64| / max |float64| (float64 reference on the same bf16 inputs)", "",
             "| alpha | mode | ms with block mask | ms without | ratio | err out | err dq |",
             "|---|---|---|---|---|---|---|"]
    dense_rows = 2048  # the float64 reference on the first rows only (its memory is O(N^2))
    alphas = [float(a) for a in args.alphas.split(",")]
    for alpha in alphas:
        qg = q.clone().requires_grad_()
        out = sa.entmax_attention(qg, k, v, alpha, block_mask=bm)
        do = torch.randn_like(out)
        (dq,) = torch.autograd.grad(out, qg, do)
        q64 = q[:, :, :dense_rows].double().requires_grad_()
        bm_rows = sa.BlockSparseMask(grid[:, :, : triton.cdiv(dense_rows, bs)].to(dev), (bs, bs))
        ref = entmax_attention_reference(q64, k.double(), v.double(), alpha, block_mask=bm_rows)
        (dq64,) = torch.autograd.grad(ref, q64, do[:, :, :dense_rows].double())
        e_out, e_dq = _err(out[:, :, :dense_rows], ref), _err(dq[:, :, :dense_rows], dq64)
        del ref, dq64, q64
        for mode in ("fwd", "fwd+bwd"):
            def run(mask, alpha=alpha, mode=mode, do=do):
                qq = q.clone().requires_grad_(mode != "fwd")
                o = sa.entmax_attention(qq, k, v, alpha, block_mask=mask)
                if mode != "fwd":
                    o.backward(do)
            t_m = _bench(lambda: run(bm), return_mode="median")
            t_0 = _bench(lambda: run(None), return_mode="median")
            lines.append(f"| {alpha:g} | {mode} | {t_m:.3g} | {t_0:.3g} | {t_m / t_0:.3f} | {e_out:.3g} | {e_dq:.3g} "
                         "|")
            print(lines[-1], flush=True)
    # one decode step: the last 4 queries against every key
    qd = q[:, :, -4:]
    for alpha in alphas:
        bm_last = sa.BlockSparseMask(grid[:, :, -1:].to(dev), (bs, bs))
        out = sa.entmax_attention(qd, k, v, alpha, block_mask=bm_last)
        ref = entmax_attention_reference(qd.double(), k.double(), v.double(), alpha, block_mask=bm_last)
        lines.append(f"| {alpha:g} | decode (4 queries) |  |  |  | {_err(out, ref):.3g} |  |")
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "block_mask.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
