"""The headline GPU run: the fused entmax kernels next to SDPA's flash and cuDNN backends on the cases users ask
about first, sized to fit the first minutes a GPU is at hand.

Cases (``--seqs``, ``--head-dims``; bf16, ``batch * seq = --tokens`` (16k), ``heads = --hidden / head_dim``):

* ``headline``: N = 4096 and 16384, head dim 128, causal and not. Methods: ``sparse_attn`` at alpha 1 (our own
  softmax class, with statistics), 1.5, 2 and ``learnable`` (``linspace(1, 2, H)`` requiring grad: the backward
  also computes d alpha); SDPA pinned to ``flash`` and to ``cudnn``.
* ``local``: N = ``--local-seq`` (8192), head dim 128, not causal, locally concentrated scores (a positional term
  ``strength * cos(pi (i - j) / N)`` added to random scores through two dimensions of q and k), the strength
  calibrated per alpha (1.5 and 2) so that the realized 64 x 64 block sparsity is ``--dead`` (60% and 90%); the same
  SDPA backends on the same inputs.
* ``adasplash`` (opt-in: ``--groups adasplash``): AdaSplash-2's own setting, causal alpha 1.5 at N = ``--sweep-seqs``
  (4k, 8k, 16k, 32k; ``batch * seq = --tokens``, batch 1 at 32k), each head dim, on random inputs ("dense" heads) and
  on local scores calibrated to the block sparsities ``--block-sparsity`` (50%, 58%, 64%, 70%, 85%). Methods:
  ``sparse_attn`` at 1.5, ``adasplash_v2``, ``adasplash_v1``, SDPA cuDNN and flash.

AdaSplash (``pip install adasplash``; never a dependency) is an optional peer in every group, called explicitly:
``adasplash_v1(q, k, v, alpha, is_causal)`` (AdaSplash-1, its default ``niter=10``) at the case's alpha (1.5 and 2 in
the headline cases) and ``adasplash_v2(q, k, v)`` (AdaSplash-2, ``niter=1``) at 1.5, on the same contiguous
``(B, H, N, D)`` inputs (its scale is ``1/sqrt(D)`` as ours), timed as its users run it: its kernels are built in the
warm-up and its own ``triton.autotune`` picks their configs at the first (untimed) call of each timing process; the
``backend`` column holds its version. A case it cannot run (AdaSplash-2 non-causal or at another alpha, N not a
power of two, a head dim outside 16-256, the package not importable) is a row ``unavailable`` whose note says why.
``--no-adasplash`` leaves its rows out.

**Block sparsity** (``block_sparsity`` column, the local and adasplash groups): per head, the (query, key) plane is
cut into 64 x 64 tiles (AdaSplash-2's block mask); a tile is in the causal region when it holds at least one
unmasked pair (every tile when not causal) and dead when every float64 weight in it is zero (the exact alpha-entmax
of the float64 scores of the actual, rounded inputs). ``block_sparsity`` = dead tiles / tiles in the causal region:
tiles wholly above the diagonal are counted neither as dead nor in the total, so dense causal attention reads 0 and
the number is the share of a causal kernel's work that sparsity can skip (``block_sparsity_with_mask`` also counts
the masked tiles as dead, over all tiles). It is measured on every tile of the first ``--sparsity-heads`` (4) heads of
batch item 0, after the calibration (:func:`calibrate_local`), which aims within half a point of the target on a
sample of query tiles; the target is in ``target_density``.

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
import functools
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
from bench_common import LEARNABLE, OK, OOM_ERRORS, fmt, free_memory, optional_import  # noqa: E402
from bench_extras import fused_stats  # noqa: E402
from bench_methods import (  # noqa: E402
    Method,
    adasplash_limits,
    adasplash_method,
    adasplash_version,
    fused_forward_launcher,
    sdpa_method,
    sparse_attn_method,
)
from bench_report import write_csv  # noqa: E402
from bench_timing import Timing, measure, start_run  # noqa: E402

from sparse_attn import mappings  # noqa: E402

MODES = ("fwd", "fwd+bwd")
# The fused kernels' forward slack over twice the baseline in the project's tests (tests/helpers.py,
# "eps_attention_kernel"): the threshold is refined to the dtype's tolerance, not to the last bit.
KERNEL_SLACK = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
COLUMNS = ("group", "method", "backend", "alpha", "mode", "dtype", "batch", "heads", "seq_q", "seq_k", "head_dim",
           "causal", "score_mult", "target_density", "block_sparsity", "block_sparsity_with_mask", "status", "note",
           "ms", "ms_q20", "ms_q80", "runs", "tflops", "vs_flash", "vs_cudnn", "vs_adasplash_v2", "passes_mean",
           "passes_max", "visits_mean", "tiles_skipped", "density", "peak_mem_mib", "max_err", "flash_style_err",
           "check")
GROUPS = ("headline", "local", "adasplash")
# the tile of the block-sparsity measure: AdaSplash-2's 64 x 64 block mask
BLOCK = 64



def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny float32 shapes on the CPU (Triton interpreter)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu>/headline)")
    p.add_argument("--seqs", default=None, help="comma list (default 4096,16384)")
    p.add_argument("--head-dims", default=None, help="comma list (default 128)")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--local-seq", type=int, default=None, help="sequence length of the local cases (default 8192)")
    p.add_argument("--dead", default="0.6,0.9", help="block sparsities of the local cases (default 0.6,0.9)")
    p.add_argument("--groups", default="headline,local", help="comma list of headline, local, adasplash")
    p.add_argument("--sweep-seqs", default=None,
                   help="sequence lengths of the adasplash group (default 4096,8192,16384,32768)")
    p.add_argument("--block-sparsity", default=None,
                   help="block sparsities of the adasplash group's local inputs (default 0.5,0.58,0.64,0.7,0.85)")
    p.add_argument("--sparsity-heads", type=int, default=4,
                   help="heads of batch item 0 the realized block sparsity is measured on (default 4)")
    p.add_argument("--no-adasplash", action="store_true", help="leave the AdaSplash rows out")
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
    args.sweep_seqs = [int(x) for x in (args.sweep_seqs or ("128" if smoke else "4096,8192,16384,32768")).split(",")]
    args.block_sparsity = [float(x) for x in (args.block_sparsity or ("0.3" if smoke else "0.5,0.58,0.64,0.7,0.85"))
                           .split(",") if x.strip()]
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    for g in args.groups:
        if g not in GROUPS:
            p.error(f"--groups takes {', '.join(GROUPS)}; got {g!r}")
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
    if "adasplash" in args.groups:
        for seq in args.sweep_seqs:
            for hd in args.head_dims:
                for target in [None, *args.block_sparsity]:
                    cases.append(Case("adasplash", max(1, args.tokens // seq), max(1, args.hidden // hd), seq, seq, hd,
                                      True, args.dtype, target_density=target, alpha="1.5"))
    return cases


@functools.cache
def adasplash_module():
    """``(module, "")``, or ``(None, why)`` when ``adasplash`` does not import."""
    module, why = optional_import("adasplash")
    return module, f"adasplash not importable: {why}"[:200] if module is None else ""


def peer_methods(case: Case, calls) -> list[Method]:
    """AdaSplash's explicit calls ``(variant, alpha)`` on ``case``: ``[adasplash_v2 at 1.5, adasplash_v1 at ...]``."""
    module, why = adasplash_module()
    return [adasplash_method(module, variant, alpha, why) for variant, alpha in calls]


def methods_of(case: Case, peers: bool = True) -> list[Method]:
    """The timed methods of a case: ours, then (``peers``) AdaSplash's, then SDPA's."""
    sdpa = [sdpa_method("flash"), sdpa_method("cudnn")]
    if case.group == "adasplash":
        fused, calls, sdpa = [sparse_attn_method("1.5")], [("v2", "1.5"), ("v1", "1.5")], sdpa[::-1]
    elif case.group == "headline":
        fused = [sparse_attn_method(a) for a in ("1", "1.5", "2", LEARNABLE)]
        calls = [("v2", "1.5"), ("v1", "1.5"), ("v1", "2")]
    else:
        fused, calls = [sparse_attn_method(case.alpha)], [("v2", case.alpha), ("v1", case.alpha)]
    return fused + (peer_methods(case, calls) if peers else []) + sdpa


def runnable_peer(case: Case, method: Method) -> bool:
    """Whether an AdaSplash method imports and can run ``case`` (its kernels are then built in the warm-up)."""
    variant = method.method.removeprefix("adasplash_")
    return adasplash_module()[0] is not None and not adasplash_limits(
        variant, method.alpha, case.causal, case.seq_q, case.seq_k, case.head_dim)


def add_positions(inputs: Inputs, strength: float) -> Inputs:
    """Make the scores of ``inputs`` also hold ``strength * cos(pi (i - j) / N)`` (largest on the diagonal, falling
    with ``|i - j|``): dimensions 0 and 1 of q and k become ``sqrt(strength * sqrt(D)) (cos, sin)(pi i / N)``, rounded
    to the inputs' dtype (in place; returns ``inputs``)."""
    with torch.no_grad():
        for t in (inputs.q, inputs.k):
            t[..., :2] = positions(t.shape[-2], t.shape[-1], strength).to(device=t.device, dtype=t.dtype)
    return inputs


def positions(n: int, d: int, strength: float) -> torch.Tensor:
    """``sqrt(strength * sqrt(d)) (cos, sin)(pi i / n)`` for ``i < n``, float64 ``(n, 2)``."""
    angle = math.pi * torch.arange(n, dtype=torch.float64) / n
    return torch.stack([angle.cos(), angle.sin()], -1) * math.sqrt(strength * math.sqrt(d))


def local_inputs(case: Case, device: str, strength: float, seed: int = 0) -> Inputs:
    """Random inputs of ``case`` with the positional term of :func:`add_positions` at ``strength``."""
    return add_positions(make_inputs(case, device, seed), strength)


def block_sparsity(q: torch.Tensor, k: torch.Tensor, alpha: float, causal: bool, q_blocks=None, block: int = BLOCK,
                   max_elems: int = 1 << 25) -> dict:
    """Realized block sparsity of alpha-entmax attention over the heads of ``q``, ``k`` (``(H, N, D)``, one batch
    item), from the float64 weights.

    Each head's (query, key) plane is cut into ``block`` x ``block`` tiles (the last ones partial). A tile is in the
    causal region when it holds an unmasked pair (causal: key ``j <= i + Nk - Nq``; every tile otherwise), dead when
    every weight ``p_ij`` of the exact alpha-entmax of the float64 scores ``q k^T / sqrt(D)`` is zero in it. Returns
    ``block_sparsity`` = dead / causal-region tiles (the masked tiles in neither count) and
    ``block_sparsity_with_mask`` = (dead + masked) / all tiles. ``q_blocks``: the query tiles to count (default all;
    the calibration's sample). Scores are built ``max_elems`` at a time (query tiles x the keys they may see)."""
    heads, n_q, d = q.shape
    n_k = k.shape[1]
    off = n_k - n_q
    n_qb, n_kb = -(-n_q // block), -(-n_k // block)
    q_blocks = list(range(n_qb)) if q_blocks is None else list(q_blocks)
    per_chunk = max(1, max_elems // max(1, block * n_k))
    dead = region = 0
    with torch.no_grad():
        for h in range(heads):
            q64, k64 = q[h].double(), k[h].double()
            for c in range(0, len(q_blocks), per_chunk):
                qbs = q_blocks[c:c + per_chunk]
                rows = torch.cat([torch.arange(b * block, min(n_q, (b + 1) * block), device=q.device) for b in qbs])
                last = max(rows.max().item() + off, -1) if causal else n_k - 1
                n_keys = min(n_k, last + 1)
                if n_keys <= 0:
                    continue
                s = (q64[rows] @ k64[:n_keys].T) * d ** -0.5
                if causal:
                    s = s.masked_fill(torch.arange(n_keys, device=q.device)[None, :] > rows[:, None] + off, -math.inf)
                live = mappings.entmax(s, alpha=alpha, dim=-1) > 0
                keys_pad = -(-n_keys // block) * block
                live = torch.nn.functional.pad(live, (0, keys_pad - n_keys))
                # (query tile, key tile) liveness: any live pair among the tile's rows and keys
                key_tiles = live.reshape(len(rows), -1, block).any(-1)
                starts = [0, *torch.tensor([min(n_q, (b + 1) * block) - b * block for b in qbs]).cumsum(0).tolist()]
                tiles = torch.stack([key_tiles[a:z].any(0) for a, z in zip(starts[:-1], starts[1:])])
                last_key = torch.tensor([min(n_q, (b + 1) * block) - 1 + off if causal else n_k - 1 for b in qbs],
                                        device=q.device)
                in_region = torch.arange(keys_pad // block, device=q.device)[None, :] * block <= last_key[:, None]
                dead += int((in_region & ~tiles).sum())
                region += int(in_region.sum())
    total = heads * len(q_blocks) * n_kb
    return {"block_sparsity": dead / region if region else float("nan"),
            "block_sparsity_with_mask": (dead + total - region) / total if total else float("nan")}


def calibrate_local(case: Case, inputs: Inputs, heads: int = 2, sample_blocks: int = 32, tol: float = 0.004,
                    steps: int = 16) -> float:
    """The strength of :func:`add_positions` that gives ``inputs`` (random inputs of ``case``) the block sparsity
    ``case.target_density`` at ``case.alpha``.

    Measured by :func:`block_sparsity` (float64, exact) on the actual inputs the strength makes (dimensions 0 and 1
    rounded to the inputs' dtype), restricted to the first ``heads`` heads of batch item 0 and ``sample_blocks``
    query tiles spread evenly from the first to the last (all when fewer); regula falsi in log strength stops once
    that sample is within ``tol`` of the target (about 6 to 10 evaluations), or returns the end of the range that
    comes nearest to an unreachable target. Cost per evaluation: the float64 scores and exact entmax of the sample
    (2 heads x 32 query tiles = 4096 rows, each with the keys it may see)."""
    q0 = inputs.q.detach()[0, :heads].clone()
    k0 = inputs.k.detach()[0, :heads].clone()
    n_qb = -(-q0.shape[1] // BLOCK)
    m = min(n_qb, sample_blocks)
    picks = sorted({round(i * (n_qb - 1) / max(1, m - 1)) for i in range(m)})

    def sparsity(log_strength: float) -> float:
        pos = positions(q0.shape[1], q0.shape[2], math.exp(log_strength)).to(device=q0.device, dtype=q0.dtype)
        q0[..., :2] = pos
        k0[..., :2] = pos
        return block_sparsity(q0, k0, float(case.alpha), case.causal, q_blocks=picks)["block_sparsity"]

    # regula falsi (Illinois) in log strength between 0.01 (random heads) and 1000 (beyond 85% at N >= 2048; larger
    # scores only add float32 rounding to every kernel's scores)
    target = case.target_density
    a, b = math.log(0.01), math.log(1e3)
    fa, fb = sparsity(a) - target, sparsity(b) - target
    if fa >= 0 or fb <= 0:
        return round(math.exp(a if fa >= 0 else b), 6)
    side, c = 0, a
    for _ in range(steps):
        c = (a * fb - b * fa) / (fb - fa)
        fc = sparsity(c) - target
        if abs(fc) <= tol:
            break
        if (fc > 0) == (fb > 0):
            b, fb = c, fc
            fa, side = (fa / 2 if side == -1 else fa), -1
        else:
            a, fa = c, fc
            fb, side = (fb / 2 if side == 1 else fb), 1
    return round(math.exp(c), 6)


def inputs_of(case: Case, device: str) -> Inputs:
    """The inputs of ``case``: random, plus the positional term at ``case.score_mult`` for the local scores (the
    local and adasplash groups' cases with a target; the strength does not change which kernels are built)."""
    if case.group == "local" or (case.group == "adasplash" and case.target_density is not None):
        return local_inputs(case, device, case.score_mult)
    return make_inputs(case, device)


# ---------------------------------------------------------------------------------------------- checks and stats
def alpha_of(method: Method, inputs: Inputs):
    if method.method == "sdpa":
        return 1.0
    if method.fused_alpha is None:
        return float(method.alpha)
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


def build_key(case: Case, method: Method) -> tuple:
    """What decides the kernels a (case, method) builds: its shape, dtype, mask and method (not its inputs' values)."""
    return (case.batch, case.heads, case.seq_q, case.seq_k, case.head_dim, case.causal, case.dtype, method.method,
            method.alpha)


def warm_pairs(cases: list[Case], peers: bool = True) -> list[tuple[int, int]]:
    """``(case index, method index)`` of each distinct build (:func:`build_key`) of ``sparse_attn`` and of the
    AdaSplash calls that can run (SDPA's kernels are prebuilt)."""
    seen, pairs = set(), []
    for ci, case in enumerate(cases):
        for mi, method in enumerate(methods_of(case, peers)):
            if method.method != "sparse_attn" and not (method.method.startswith("adasplash_")
                                                       and runnable_peer(case, method)):
                continue
            if build_key(case, method) not in seen:
                seen.add(build_key(case, method))
                pairs.append((ci, mi))
    return pairs


def run_case_once(case: Case, method: Method, inputs: Inputs, fwd) -> None:
    """Every launch a timed row of this (case, method) makes, untimed: the forward, forward + backward, and the
    statistics' forward (AdaSplash: its autotuning, which compiles every config it tries)."""
    grads = [inputs.q, inputs.k, inputs.v] + method.extra_grads(inputs)
    method.build(inputs)().backward(inputs.dout)
    for t in grads:
        t.grad = None
    if method.method == "sparse_attn":
        fused_stats(fwd, method, inputs)


def warm_up(args, cases: list[Case], device: str, argv: list[str]) -> list[str]:
    """Build every kernel of the run in ``args.jobs`` processes sharing the Triton cache; returns log lines: the
    warm-up's, then the kernels its processes loaded from the cache and compiled (``triton_cache.summary_line``)."""
    pairs = warm_pairs(cases, not args.no_adasplash)
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
    case, method = cases[ci], methods_of(cases[ci], not args.no_adasplash)[mi]
    if os.environ.get(triton_cache.LOG_ENV):
        triton_cache.log_compiles_to(os.environ[triton_cache.LOG_ENV])
    fwd, _ = fused_forward_launcher()
    run_case_once(case, method, inputs_of(case, device), fwd)
    if device == "cuda":
        torch.cuda.synchronize()
    return 0


def add_ratios(rows: list[dict]) -> None:
    def key(r):
        return (r["group"], r["seq_q"], r["head_dim"], r["causal"], r["score_mult"], r["target_density"], r["mode"])

    base = {(key(r), r["backend"] if r["method"] == "sdpa" else r["method"]): r["ms"] for r in rows
            if r["method"] in ("sdpa", "adasplash_v2") and r["status"] == OK}
    for r in rows:
        if r["status"] != OK:
            continue
        r["tflops"] = dense_flops(r["batch"], r["heads"], r["seq_q"], r["seq_k"], r["head_dim"], r["causal"],
                                  r["mode"]) / (r["ms"] * 1e-3) / 1e12
        for name, by in (("vs_flash", "flash"), ("vs_cudnn", "cudnn"), ("vs_adasplash_v2", "adasplash_v2")):
            b = base.get((key(r), by))
            r[name] = r["ms"] / b if b else None


def write_markdown(path: Path, stamp: dict, notes: list[str], rows: list[dict]) -> None:
    lines = ["# Headline: fused entmax attention vs SDPA flash / cuDNN", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in stamp.items()] + [f"- note: {n}" for n in notes] + [""]
    lines += ["Times are medians (ms) of at least 10 runs; `× flash` / `× cuDNN` / `× ada2` = time / SDPA's (or "
              "AdaSplash-2's) time on the same inputs and mode (above 1 = slower). TFLOP/s are dense-equivalent "
              "(`4 B H N² D`, halved when causal, x3.5 for fwd+bwd). `block sp.`: the block sparsity aimed at and "
              "the one realized (64 x 64 tiles whose float64 weights are all zero, over the tiles of the causal "
              "region). `dead tiles`: our forward's own tiles found dead. `check`: `ok` when the timed output's "
              "error against float64 is at most twice a FlashAttention-style pipeline's (+1 ulp), `ok (tol)` within "
              "the tests' kernel slack above that (bf16 2e-2, the threshold being refined to the dtype's tolerance), "
              "else `FAIL`.", ""]
    head = ["group", "N", "D", "causal", "block sp. target", "block sp. realized", "method", "α", "mode", "ms",
            "TFLOP/s", "× flash", "× cuDNN", "× ada2", "passes", "visits", "dead tiles", "density", "peak MiB",
            "max err", "FA-style err", "check", "status"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        method = {"sdpa": f"sdpa[{r['backend']}]", "sparse_attn": "sparse_attn"}.get(
            r["method"], f"{r['method']} {r['backend']}")
        cells = [r["group"], r["seq_q"], r["head_dim"], r["causal"], fmt(r.get("target_density")),
                 fmt(r.get("block_sparsity")), method, r["alpha"], r["mode"], fmt(r.get("ms")), fmt(r.get("tflops")),
                 fmt(r.get("vs_flash")), fmt(r.get("vs_cudnn")), fmt(r.get("vs_adasplash_v2")),
                 fmt(r.get("passes_mean")), fmt(r.get("visits_mean")),
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
                  + (f" sp {r['block_sparsity']:.2f}" if r.get("block_sparsity") is not None else "")
                  + ("" if r["method"] == "sparse_attn" else f" {r['method']}") + f" α={r['alpha']}"
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
        # a warm-up process: the local scores' strength does not change which kernels are built
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
    if not args.no_adasplash:
        module, why = adasplash_module()
        notes.append(why or f"adasplash {adasplash_version(module)}: adasplash_v1 (niter=10) and adasplash_v2 "
                     "(niter=1) called explicitly, with their own autotuning")
    print(triton_cache.shipped_cache_line(cache_dir()), flush=True)
    print(f"headline: {len(cases)} cases, Triton cache {cache_dir()} holds {n_built()} kernels", flush=True)
    lines = warm_up(args, cases, device, argv)
    print("\n".join(lines), flush=True)
    if args.warm_only:
        return None
    notes.extend(lines)
    built_before_timing = n_built()
    cubins_before = cubins()

    timing = HeadlineTiming(device, warmup_ms=10.0, rep_ms=50.0, cpu_warmup=0, cpu_reps=1, slow_ms=float("inf"))
    timing.min_runs = args.min_runs
    rows: list[dict] = []

    def flush():
        add_ratios(rows)
        write_csv(out / "headline.csv", stamp, notes, rows, COLUMNS)
        write_markdown(out / "headline.md", stamp, notes, rows)

    for case in cases:
        sparsity: dict = {}
        if case.group in ("local", "adasplash"):
            begin = time.monotonic()
            inputs = make_inputs(case, device)
            if case.target_density is not None:
                case = replace(case, score_mult=calibrate_local(case, inputs))
                add_positions(inputs, case.score_mult)
            calibrated = time.monotonic()
            q_s, k_s = (t.detach()[0, :args.sparsity_heads] for t in (inputs.q, inputs.k))
            sparsity = block_sparsity(q_s, k_s, float(case.alpha), case.causal)
            line = (f"[{case.group}] N={case.seq_q} D={case.head_dim} causal={case.causal} block sparsity: target "
                    f"{fmt(case.target_density)}, realized {sparsity['block_sparsity']:.4f} (with the masked tiles "
                    f"{sparsity['block_sparsity_with_mask']:.4f}; heads 0-{q_s.shape[0] - 1} of batch item 0), "
                    f"strength {case.score_mult:g}; calibrated in {calibrated - begin:.1f} s, measured in "
                    f"{time.monotonic() - calibrated:.1f} s")
            if case.target_density is not None and abs(sparsity["block_sparsity"] - case.target_density) > 0.03:
                line += " (more than 3 points from the target)"
            print(line, flush=True)
        else:
            inputs = inputs_of(case, device)
        for method in methods_of(case, not args.no_adasplash):
            base = {**case.fields(), **sparsity, "method": method.method, "backend": method.backend,
                    "alpha": method.alpha}
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
                      f"{'sparsity=' + str(case.target_density) + ' ' if case.target_density else ''}"
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
