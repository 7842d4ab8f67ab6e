"""Pass and tile-visit counters of the fused forward, measured on the CPU interpreter.

For alpha in {1, 1.25, 1.5, 2}, random scores at two temperatures (score std 1 and 3), flat scores
(std 0.3) and locally correlated tokens (AR(1) keys, queries near their own key), it runs the fused
forward (``TRITON_INTERPRET=1``, 64 x 64 tiles) and prints per configuration:

* ``passes``: mean / max of ``n_passes`` over query tiles (the grid pass and the value pass included;
  passes before the value pass = passes - 1),
* ``visits``: mean ``tile_visits`` per query tile, and ``dead``: the fraction of visible key tiles
  dead after the forward,
* ``err``: max |out - out64| against the float64 reference, and ``ratio``: that error over the
  error of a FlashAttention-style pipeline in the same input dtype (fp32 scores, the exact float64
  threshold, weights rounded to the input dtype before the value product, output rounded) - 1.00
  means as accurate as an exact threshold; ``ratio at tau``: the same pipeline run at the kernel's own
  threshold over the pipeline at the exact one (the accuracy a GPU run, which rounds the weights before
  the value product, gets from this threshold).

With ``--grid-counters`` it also counts, on the interpreter, the grid pass's work per key tile (by wrapping
``grid_tile`` (``kernels/attn/_threshold_tiles.py``) where ``kernels._fwd_rows`` calls it, which runs the ring update
and, for a tile live when visited, the per-point block): ``ring``: the fraction of the visible key tiles that reached it
(the others were screened out as dead and plain by ``tile_screen``; every tile reaches it in kernels without the
screen), ``cheap``: the fraction of the tiles dead at the end of the forward whose per-point block the grid pass
skipped (they were already below the ring's lowest point when visited), and ``cheap all``: the fraction of them that
skipped ``grid_tile`` altogether. The counters work on any version of the kernels with ``grid_tile`` or the older
``_fwd_rows._grid_tile`` (point ``PYTHONPATH`` at an older tree to measure it). ``--causal`` runs causal attention;
``--block`` sets the tile size (default 64; the forward's own interpreter tiles are 32 x 32).

Half-precision inputs run as float32 arithmetic on the rounded inputs with the dtype's threshold
tolerance, and the output is rounded to the dtype by torch: the interpreter computes in float32
anyway (its bf16 ``tl.dot`` is wrong) and its float32 -> bfloat16 cast truncates instead of rounding
to nearest as a GPU does. The weights are therefore not rounded before the value product, which a GPU
does (the pipeline does too).

Usage: ``python benchmarks/offline/passes.py [--n 512 1024 2048] [--dtype bf16 fp32] [--quick] [--markdown] [--causal]
[--block 64] [--heads 2] [--grid-counters]``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from sparse_attn.kernels.attn import _fwd_rows  # noqa: E402
from sparse_attn.kernels.attn.entmax_attn_fwd import default_tolerance, entmax_attn_fwd  # noqa: E402
from sparse_attn.mappings import entmax  # noqa: E402

DISTS = ("std1", "std3", "flat", "local")
ALPHAS = (1.0, 1.25, 1.5, 2.0)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_inputs(dist: str, n: int, d: int, heads: int, seed: int):
    """q, k, v of shape (1, heads, n, d) in float32 for one score distribution."""
    g = torch.Generator().manual_seed(seed)
    if dist == "local":
        eps = torch.randn(heads, n, d, generator=g, dtype=torch.float64)
        k = torch.empty_like(eps)
        k[:, 0] = eps[:, 0]
        r = 0.95
        for t in range(1, n):
            k[:, t] = r * k[:, t - 1] + math.sqrt(1 - r * r) * eps[:, t]
        q = k + torch.randn(heads, n, d, generator=g, dtype=torch.float64)
        q, k = q.float(), k.float()
    else:
        level = {"std1": 1.0, "std3": 3.0, "flat": 0.3}[dist]
        k = torch.randn(heads, n, d, generator=g) * math.sqrt(level)
        q = torch.randn(heads, n, d, generator=g) * math.sqrt(level)
    v = torch.randn(heads, n, d, generator=g)
    return q[None], k[None], v[None]


def pipeline_out(q, k, v, alpha: float, scale: float, dtype, tau=None, causal=False):
    """FlashAttention-style low-precision output (see module docstring) with the exact float64 threshold, or with
    ``tau`` (``(B, H, N)``, the z-scale threshold a kernel found; logsumexp at alpha = 1). Returns
    ``(out in dtype as float64, float64 output)``."""
    s32 = (q.float() @ k.float().transpose(-1, -2)) * scale
    s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s32.shape[-2:], dtype=torch.bool).tril()
        s32, s64 = s32.masked_fill(~keep, float("-inf")), s64.masked_fill(~keep, float("-inf"))
    p64 = entmax(s64, alpha, dim=-1) if alpha != 1.0 else torch.softmax(s64, -1)
    if alpha == 1.0:
        lse = torch.logsumexp(s64, -1, keepdim=True).float() if tau is None else tau.float()[..., None]
        p32 = torch.exp(s32 - lse)
    else:
        if tau is None:
            # tau from the float64 weights: tau = z - p^(alpha - 1) on the support, taken at the row max
            z64 = (alpha - 1) * s64
            idx = p64.argmax(-1, keepdim=True)
            tau = (z64.gather(-1, idx) - p64.gather(-1, idx) ** (alpha - 1)).float()
        else:
            tau = tau.float()[..., None]
        p32 = ((alpha - 1) * s32 - tau).clamp_min(0) ** (1 / (alpha - 1))
    lsum = p32.sum(-1, keepdim=True)
    out = (p32.to(dtype).float() @ v.to(dtype).float()) / lsum
    return out.to(dtype).double(), (p64 @ v.double())


class GridCounters:
    """Context manager: counts the grid pass's calls of ``grid_tile`` (``ring``) and those whose tile was
    live, i.e. ran the per-point block (``points``), on the interpreter (module docstring)."""

    def __enter__(self):
        self.ring = self.points = 0
        # the name the forward's rows call it by (older trees: _fwd_rows._grid_tile)
        self._name = "grid_tile" if hasattr(_fwd_rows, "grid_tile") else "_grid_tile"
        self._orig = getattr(_fwd_rows, self._name)

        def counted(*args, **kwargs):
            result = self._orig(*args, **kwargs)
            self.ring += 1
            self.points += int((result[-1].handle.data != 0).any())
            return result

        setattr(_fwd_rows, self._name, counted)
        return self

    def __exit__(self, *exc):
        setattr(_fwd_rows, self._name, self._orig)


def visible_tiles(n: int, block: int, causal: bool) -> int:
    """Key tiles the grid pass visits, summed over the query tiles of one head (square, bottom-right causal)."""
    tiles = math.ceil(n / block)
    if not causal:
        return tiles * tiles
    return sum(math.ceil(min((i + 1) * block, n) / block) for i in range(tiles))


def live_bits(live) -> int:
    """Set bits of a liveness bitmap tensor."""
    return sum(bin(w & 0xFFFFFFFF).count("1") for w in live.flatten().tolist())


def measure(dist, n, alpha, dtype, heads=2, d=64, seed=0, block=64, causal=False, counters=False):
    q, k, v = make_inputs(dist, n, d, heads, seed + n)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = d ** -0.5
    a = torch.full((heads,), alpha, dtype=torch.float32)
    t0 = time.perf_counter()
    # the interpreter computes half-precision kernels in float32 anyway, and its float32 -> bfloat16 cast
    # truncates: run on the rounded inputs in float32 with the dtype's tolerance, round the output like a GPU
    with GridCounters() if counters else contextlib.nullcontext() as cnt:
        res = entmax_attn_fwd(q.float(), k.float(), v.float(), a, scale, block_m=block, block_n=block,
                              tol=default_tolerance(dtype), is_causal=causal)
    secs = time.perf_counter() - t0
    out_lp, out64 = pipeline_out(q, k, v, alpha, scale, dtype, causal=causal)
    err = (res.out.to(dtype).double() - out64).abs().max().item()
    err_ref = (out_lp - out64).abs().max().item()
    # the same pipeline at the kernel's threshold: what a GPU run gives (weights rounded before the product)
    err_tau = (pipeline_out(q, k, v, alpha, scale, dtype, tau=res.tau, causal=causal)[0] - out64).abs().max().item()
    visible = visible_tiles(n, block, causal) * heads
    dead = visible - live_bits(res.live)
    passes = res.n_passes.float()
    row = dict(dist=dist, n=n, alpha=alpha, dtype=str(dtype).replace("torch.", ""), causal=causal, block=block,
               passes=passes.mean().item(), passes_max=int(passes.max().item()),
               visits=res.tile_visits.float().mean().item(), dead=dead / visible,
               err=err, ratio=err / max(err_ref, 1e-30), ratio_tau=err_tau / max(err_ref, 1e-30), secs=secs)
    if counters and alpha != 1.0:
        row.update(ring=cnt.ring / visible, cheap=(visible - cnt.points) / max(dead, 1),
                   cheap_all=(visible - cnt.ring) / max(dead, 1))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--alpha", type=float, nargs="+", default=list(ALPHAS))
    ap.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    ap.add_argument("--quick", action="store_true", help="N = 128, one head (a smoke run)")
    ap.add_argument("--markdown", action="store_true", help="print one markdown table")
    ap.add_argument("--causal", action="store_true", help="causal attention")
    ap.add_argument("--block", type=int, default=64, help="query and key tile size (default 64)")
    ap.add_argument("--heads", type=int, default=2, help="heads (default 2)")
    ap.add_argument("--grid-counters", action="store_true", help="count the grid pass's work per tile (docstring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ns = [128] if args.quick else args.n
    heads = 1 if args.quick else args.heads
    rows = []
    extra = args.grid_counters
    if args.markdown:
        print("| dtype | dist | N | alpha | passes mean/max | visits / q-tile | dead tiles | max err | ratio "
              "| ratio at tau |" + (" ring | cheap | cheap all |" if extra else ""))
        print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if extra else ""))
    for dt in args.dtype:
        for dist in args.dist:
            for n in ns:
                for alpha in args.alpha:
                    r = measure(dist, n, alpha, DTYPES[dt], heads=heads, block=args.block, causal=args.causal,
                                counters=extra)
                    rows.append(r)
                    counted = "ring" in r
                    if args.markdown:
                        print(f"| {dt} | {dist} | {n} | {alpha} | {r['passes']:.2f} / {r['passes_max']} | "
                              f"{r['visits']:.1f} | {r['dead']:.2f} | {r['err']:.1e} | {r['ratio']:.2f} | "
                              f"{r['ratio_tau']:.2f} |" + (f" {r['ring']:.2f} | {r['cheap']:.2f} | "
                                                           f"{r['cheap_all']:.2f} |" if counted else
                                                           (" | | |" if extra else "")), flush=True)
                    else:
                        print(f"{dt:5s} {dist:6s} N={n:5d} alpha={alpha:<5} passes {r['passes']:.2f}/{r['passes_max']}"
                              f"  visits {r['visits']:6.1f}  dead {r['dead']:.2f}  err {r['err']:.1e}"
                              f"  ratio {r['ratio']:.2f}  at tau {r['ratio_tau']:.2f}"
                              + (f"  ring {r['ring']:.2f}  cheap {r['cheap']:.2f}  cheap all {r['cheap_all']:.2f}"
                                 if counted else "") + f"  ({r['secs']:.1f} s)", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
