"""Tune the fused forward's launch config: time ``entmax_attn_fwd`` (and forward + backward) at candidate
``(block_m, block_n, num_warps, num_stages)`` per head dim, dtype, alpha class and causal flag.

Every candidate is forced past the autotuner (``entmax_attn_fwd(..., block_m=, block_n=, num_warps=,
num_stages=)``); the pinned config of ``_pick_config`` is always the first, and on a GPU one more row times the
default launch (``autotune``: pinned tiles, warps and stages autotuned). ``fwd`` is the training forward (it also
computes the backward's ``out_u``, like the ``fwd`` rows of ``bench_attention.py``); ``fwd+bwd`` adds
``entmax_attn_bwd`` on the forward's bitmap, whose key tiles are the forward's ``block_n`` and whose query tiles
are at most the forward's ``block_m`` (its own warps and stages stay autotuned). Each timed output (``out``, or
``dq``) is compared with the pinned config's: a relative difference above ``DIFF_TOL`` gives status ``mismatch``.

``--modes bwd,bwd-atomic`` sweeps the backward's configs instead: ``entmax_attn_bwd`` timed alone (``bwd-atomic``:
``deterministic=False``, the atomic dQ) after one forward at its pinned config; the pinned backward first, then
candidates (``BWD_CANDIDATES`` or ``--bwd-configs dq:128x64w8s3,dkdv:32x128w8s2``) that each replace one kernel's
pinned config (``entmax_attn_bwd(..., tiles=)``, launched with exactly its warps and stages). The outputs compared
are dQ, dK, dV together. A winner becomes a change of ``entmax_attn_bwd._pick_config``.

Writes into ``--out`` (default ``benchmarks/results/<gpu-name>/tune/``): ``tune.csv`` (one row per case, config
and mode, stamped like ``results.csv``) and ``tune.md`` (the stamp, every config against the pinned one per head
dim and dtype over all cases, the best config per case as "pinned ms -> best ms", then every row). Statuses:
``ok``, ``OOM``, ``out of resources`` (e.g. shared memory; the build needs more than the GPU has), ``compile
error``, ``error``, ``mismatch``, ``skipped`` (the time budget). ``--smoke`` runs tiny float32 shapes on CPU under
the Triton interpreter (the pinned interpreter config and one other block size) so CI runs the code path.
See benchmarks/README.md for the GPU command and how a winner becomes a change of ``_pick_config``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
# this folder, the timing harness (benchmarks/harness/: cases, methods, timing, reports) and benchmarks/offline/
# (sm90_build, which reads a build's registers)
sys.path[:0] = [str(HERE), str(HERE.parent / "harness"), str(HERE.parent / "offline")]

import torch  # noqa: E402
from bench_cases import Case, dense_flops, make_inputs  # noqa: E402
from bench_common import ERROR, OK, SKIPPED, fmt, free_memory, split_resumed  # noqa: E402
from bench_report import read_csv, stamp_lines, write_csv  # noqa: E402
from bench_timing import Timing, measure, start_run  # noqa: E402

from sparse_attn.kernels import _args  # noqa: E402
from sparse_attn.kernels.attn import entmax_attn_bwd as bwd  # noqa: E402
from sparse_attn.kernels.attn import entmax_attn_fwd as fwd  # noqa: E402

CLASS_ALPHA = {"entmax15": 1.5, "softmax": 1.0, "sparsemax": 2.0, "general": 1.25, "mixed": None}
# fwd, fwd+bwd: the forward's configs; bwd, bwd-atomic: the backward's (deterministic, and with the atomic dQ), timed
# alone after one forward at its pinned config
MODES = ("fwd", "fwd+bwd", "bwd", "bwd-atomic")
BWD_MODES = ("bwd", "bwd-atomic")
OUT_OF_RESOURCES, COMPILE_ERROR, MISMATCH = "out of resources", "compile error", "mismatch"
# largest relative difference (max |x - x_pinned| / max |x_pinned|) from the pinned config's output still "ok":
# tiles change the summation order and the threshold search's schedule, not the result beyond rounding
DIFF_TOL = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}
# (block_m, block_n, num_warps, num_stages) tried besides the pinned config, by padded head dim: the pinned tiles
# with other warps / stages first, then neighbouring tiles (at head dim 128 among them the former pin, 128 x 32 on
# 8 warps)
CANDIDATES = {
    64: ((128, 64, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2)),
    128: ((64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 128, 4, 2)),
    256: ((64, 32, 4, 2), (64, 32, 8, 3), (32, 32, 4, 2), (64, 64, 8, 2)),
}
SMOKE_CANDIDATES = ((64, 64, 4, 1),)
# backward candidates by padded head dim: (kernel, block_m, block_n, num_warps, num_stages), each replacing one
# kernel's pinned config (entmax_attn_bwd(..., tiles=)); query rows or keys a multiple of 64 per warpgroup keep every
# product on Hopper's warpgroup MMA; the offline sm_90 builds of these spill at most outside the loops for some classes
# (docs/backward.md): the timings decide
BWD_CANDIDATES = {
    64: (("dq", 128, 64, 8, 3), ("dq", 64, 64, 4, 2), ("dq", 128, 128, 8, 2), ("dkdv", 32, 128, 8, 3),
         ("dkdv", 64, 128, 8, 2), ("dkdv", 64, 64, 4, 2)),
    128: (("dq", 128, 64, 8, 3), ("dq", 64, 64, 4, 2), ("dq", 128, 32, 8, 2), ("dkdv", 32, 128, 8, 3),
          ("dkdv", 16, 128, 8, 2), ("dkdv", 32, 64, 4, 2)),
    256: (("dq", 64, 16, 4, 2), ("dq", 64, 32, 8, 2), ("dkdv", 16, 32, 4, 2), ("dkdv", 32, 32, 8, 2)),
}
SMOKE_BWD_CANDIDATES = (("dq", 32, 16, 4, 1), ("dkdv", 16, 32, 4, 1))
AUTOTUNE = "autotune"
PINNED_BWD = "pinned backward"

TUNE_COLUMNS = (
    "head_dim", "dtype", "alpha_class", "causal", "batch", "heads", "seq", "mode", "config", "block_m", "block_n",
    "num_warps", "num_stages", "pinned", "status", "note", "ms", "ms_q20", "ms_q80", "tflops", "speedup_vs_pinned",
    "peak_mem_mib", "regs", "spill_bytes", "smem_bytes", "rel_diff_vs_pinned",
)
TUNE_FLOAT_COLUMNS = ("block_m", "block_n", "num_warps", "num_stages", "ms", "ms_q20", "ms_q80", "tflops",
                      "speedup_vs_pinned", "peak_mem_mib", "regs", "spill_bytes", "smem_bytes", "rel_diff_vs_pinned")
TUNE_INT_COLUMNS = ("head_dim", "batch", "heads", "seq")
KEY_COLUMNS = ("head_dim", "dtype", "alpha_class", "causal", "seq", "mode", "config")


class Config(NamedTuple):
    """A launch config of the forward; ``block_m is None`` is the default launch (autotuned on a GPU)."""

    block_m: int | None
    block_n: int | None
    num_warps: int | None
    num_stages: int | None

    @property
    def label(self) -> str:
        if self.block_m is None:
            return AUTOTUNE
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"

    def launch_kwargs(self) -> dict:
        return {} if self.block_m is None else self._asdict()


class BwdConfig(NamedTuple):
    """A launch config ``tiles`` of one backward kernel (``"dq"``, ``"dkdv"``, ``"dbias"``), replacing its pinned
    one; ``kernel is None``: the pinned backward (its warps and stages autotuned on a GPU)."""

    kernel: str | None
    tiles: Config

    block_m = property(lambda self: self.tiles.block_m)
    block_n = property(lambda self: self.tiles.block_n)
    num_warps = property(lambda self: self.tiles.num_warps)
    num_stages = property(lambda self: self.tiles.num_stages)

    @property
    def label(self) -> str:
        return PINNED_BWD if self.kernel is None else f"{self.kernel} {self.tiles.label}"

    def launch_tiles(self) -> dict | None:
        """``entmax_attn_bwd``'s ``tiles``."""
        return None if self.kernel is None else {self.kernel: tuple(self.tiles)}


def parse_bwd_config(text: str) -> BwdConfig:
    """``"dkdv:32x128w8s2"`` -> ``BwdConfig("dkdv", 32, 128, 8, 2)``; ``ValueError`` naming the text otherwise."""
    m = re.fullmatch(r"(dq|dkdv|dbias):(\d+)x(\d+)\s*w(\d+)\s*s(\d+)", text.strip())
    if m is None:
        raise ValueError(f"--bwd-configs: expected entries like dkdv:32x128w8s2 (kernel: block_m x block_n, warps, "
                         f"stages), got {text!r}")
    return BwdConfig(m.group(1), Config(*map(int, m.groups()[1:])))


def bwd_candidate_configs(head_dim: int, extra: list[BwdConfig] | None, smoke: bool) -> list[BwdConfig]:
    """The pinned backward first, then one kernel's config replaced at a time (``extra`` replaces the table)."""
    if extra is None:
        table = SMOKE_BWD_CANDIDATES if smoke else BWD_CANDIDATES[min(256, max(64, _args.head_dim_block(head_dim)))]
        extra = [BwdConfig(c[0], Config(*c[1:])) for c in table]
    return list(dict.fromkeys([BwdConfig(None, Config(None, None, None, None))] + list(extra)))


def parse_config(text: str) -> Config:
    """``"128x64w8s2"`` (spaces allowed) -> ``Config(128, 64, 8, 2)``; ``ValueError`` naming the text otherwise."""
    m = re.fullmatch(r"(\d+)x(\d+)\s*w(\d+)\s*s(\d+)", text.strip())
    if m is None:
        raise ValueError(f"--configs: expected entries like 128x64w8s2 (block_m x block_n, warps, stages), "
                         f"got {text!r}")
    return Config(*map(int, m.groups()))


def pinned_config(head_dim: int) -> Config:
    return Config(*fwd._pick_config(head_dim, _args.interpreting()))


def candidate_configs(head_dim: int, extra: list[Config] | None, smoke: bool) -> list[Config]:
    """The pinned config first, then the candidates (``extra`` replaces the table), then the default launch on a
    GPU; no repeats."""
    pinned = pinned_config(head_dim)
    if extra is None:
        table = SMOKE_CANDIDATES if smoke else CANDIDATES[min(256, max(64, _args.head_dim_block(head_dim)))]
        extra = [Config(*c) for c in table]
    configs = [pinned] + [c for c in extra if c != pinned]
    if not _args.interpreting():
        configs.append(Config(None, None, None, None))
    return list(dict.fromkeys(configs))


class Problem(NamedTuple):
    """Inputs of one shape, layout ``(batch, heads, seq, head_dim)``, no autograd."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    mixed_alpha: torch.Tensor
    scale: float


def make_problem(case: Case, device: str) -> Problem:
    inputs = make_inputs(case, device)
    q, k, v = (t.detach() for t in (inputs.q, inputs.k, inputs.v))
    return Problem(q, k, v, inputs.dout, inputs.mixed_alpha, case.head_dim ** -0.5)


def alpha_of(problem: Problem, alpha_class: str) -> torch.Tensor:
    """Per-head float32 alpha on the inputs' device: the class's value, or ``linspace(1, 2, H)`` for mixed."""
    value = CLASS_ALPHA[alpha_class]
    if value is None:
        return problem.mixed_alpha
    return torch.full((problem.q.shape[1],), value, dtype=torch.float32, device=problem.q.device)


def fwd_kwargs(problem: Problem, alpha_class: str, causal: bool, config: Config) -> dict:
    """Keyword arguments of the timed ``entmax_attn_fwd`` call (the training forward, ``need_out_u``)."""
    return dict(q=problem.q, k=problem.k, v=problem.v, alpha=alpha_of(problem, alpha_class), scale=problem.scale,
                is_causal=causal, alpha_class=alpha_class, need_out_u=True, **config.launch_kwargs())


def timed_call(problem: Problem, alpha_class: str, causal: bool, config, mode: str):
    """A zero-argument call of the fused forward (returns ``out``), forward + backward (returns ``dq``) or, for a
    backward config, the backward alone after one untimed forward at the pinned config (returns ``dq, dk, dv``
    flattened into one tensor)."""
    if mode in BWD_MODES:
        return timed_bwd_call(problem, alpha_class, causal, config, mode)
    kwargs = fwd_kwargs(problem, alpha_class, causal, config)

    def call():
        res = fwd.entmax_attn_fwd(**kwargs)
        if mode == "fwd":
            return res.out
        return bwd.entmax_attn_bwd(problem.dout, problem.q, problem.k, problem.v, res.out, res.tau, res.lsum,
                                   kwargs["alpha"], problem.scale, is_causal=causal, live=res.live,
                                   block_m=res.block_m, block_n=res.block_n, out_u=res.out_u, tau_lo=res.tau_lo,
                                   alpha_class=alpha_class)[0]
    return call


def timed_bwd_call(problem: Problem, alpha_class: str, causal: bool, config: BwdConfig, mode: str):
    """``timed_call`` of a backward config (``bwd``: deterministic; ``bwd-atomic``: ``deterministic=False``)."""
    kwargs = fwd_kwargs(problem, alpha_class, causal, Config(None, None, None, None))
    res = fwd.entmax_attn_fwd(**kwargs)

    def call():
        grads = bwd.entmax_attn_bwd(problem.dout, problem.q, problem.k, problem.v, res.out, res.tau, res.lsum,
                                    kwargs["alpha"], problem.scale, is_causal=causal, live=res.live,
                                    block_m=res.block_m, block_n=res.block_n, out_u=res.out_u,
                                    alpha_class=alpha_class, deterministic=mode == "bwd",
                                    tiles=config.launch_tiles())
        return torch.cat([g.flatten() for g in grads[:3]])
    return call


def fwd_resources(kwargs: dict) -> dict:
    """``regs`` (per thread), ``spill_bytes`` (local memory per thread) and ``smem_bytes`` (shared memory per
    block) of the forward's GPU build for these launch arguments (a forced config), read from the compiled
    kernel; the largest over the launches of a mixed class. ``{}`` under the interpreter or for the default
    launch; ``{"note": ...}`` when they cannot be read."""
    if _args.interpreting() or kwargs.get("num_warps") is None:
        return {}
    try:
        from sm90_build import captured_launches

        kernel, launches = captured_launches(fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, **kwargs)
        stats = []
        for grid, args, launch_kwargs in launches:
            compiled = kernel.warmup(*args, grid=grid, **launch_kwargs)
            compiled._init_handles()
            stats.append((compiled.n_regs, compiled.n_spills, compiled.metadata.shared))
        regs, spills, smem = (max(s) for s in zip(*stats))
        return {"regs": regs, "spill_bytes": spills, "smem_bytes": smem}
    except Exception as exc:  # the numbers are extras: the timing stands without them
        return {"note": f"resources not read: {type(exc).__name__}: {str(exc).strip()[:80]}"}


def classify(result: dict) -> dict:
    """``measure``'s ``error`` split into ``out of resources`` and ``compile error`` by the exception's type."""
    if result["status"] == ERROR:
        kind = result["note"].split(":", 1)[0]
        if kind == "OutOfResources":
            result["status"] = OUT_OF_RESOURCES
        elif "Compil" in kind or "PTXAS" in kind:
            result["status"] = COMPILE_ERROR
    return result


def rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` in float64 (``inf`` for a non-finite ``x``)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    scale = ref.abs().max().item() or 1.0
    return (x - ref).abs().max().item() / scale


def row_key(row: dict) -> tuple:
    return tuple(fmt(row[c], 6) for c in KEY_COLUMNS)


def _bools(text: str) -> list[bool]:
    return [x.strip().lower() in ("1", "true", "yes") for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny float32 shapes (CPU + Triton interpreter without CUDA)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/<gpu>/tune/)")
    p.add_argument("--head-dims", default=None, help="comma list (default 128,64; 256 is supported)")
    p.add_argument("--dtypes", default=None, help="comma list of bf16, fp16, fp32 (default bf16; fp32 with --smoke)")
    p.add_argument("--classes", default=None,
                   help=f"alpha classes among {', '.join(CLASS_ALPHA)} (default entmax15,general; mixed with --smoke)")
    p.add_argument("--causal", default=None, help="comma list (default false,true)")
    p.add_argument("--seqs", default=None, help="comma list of sequence lengths (default 8192)")
    p.add_argument("--tokens", type=int, default=None, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="heads * head_dim (default 2048)")
    p.add_argument("--modes", default=None,
                   help="comma list of fwd, fwd+bwd (the forward's configs) or of bwd, bwd-atomic (the backward's "
                        "configs, deterministic and with the atomic dQ); default fwd; fwd,fwd+bwd with --smoke")
    p.add_argument("--configs", default=None,
                   help="candidates replacing the built-in table, e.g. 128x64w8s2,64x64w4s3 (the pinned config is "
                        "always tried first)")
    p.add_argument("--bwd-configs", default=None,
                   help="backward candidates replacing the built-in table (bwd modes), e.g. dq:128x64w8s3,"
                        "dkdv:32x128w8s2 (the pinned backward is always tried first)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up in ms (default 10)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench measuring time in ms (default 50)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new (config, seq) after this many seconds; rows left are 'skipped'")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="tune.csv of an earlier run: its rows (but 'skipped') are kept and not run again")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.head_dims = _ints(args.head_dims or ("32" if smoke else "128,64"))
    args.dtypes = _names(args.dtypes or ("fp32" if smoke else "bf16"))
    args.classes = _names(args.classes or ("mixed" if smoke else "entmax15,general"))
    args.causal = _bools(args.causal or ("true" if smoke else "false,true"))
    args.seqs = _ints(args.seqs or ("48" if smoke else "8192"))
    args.tokens = args.tokens or (48 if smoke else 16384)
    args.hidden = args.hidden or (64 if smoke else 2048)
    args.modes = _names(args.modes or ("fwd,fwd+bwd" if smoke else "fwd"))
    for name, values, allowed in (("dtypes", args.dtypes, DIFF_TOL), ("classes", args.classes, CLASS_ALPHA),
                                  ("modes", args.modes, MODES)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{name} takes {', '.join(allowed)}; got {bad}")
    bad = [d for d in args.head_dims if not 16 <= d <= 256]
    if bad:
        p.error(f"--head-dims takes head dims in [16, 256]; got {bad}")
    if any(m in BWD_MODES for m in args.modes) and not all(m in BWD_MODES for m in args.modes):
        p.error(f"--modes: {', '.join(BWD_MODES)} sweep the backward's configs, the others the forward's: one kind "
                f"per run; got {args.modes}")
    try:
        args.configs = None if args.configs is None else [parse_config(c) for c in args.configs.split(",") if c]
        args.bwd_configs = (None if args.bwd_configs is None
                            else [parse_bwd_config(c) for c in args.bwd_configs.split(",") if c])
    except ValueError as exc:
        p.error(str(exc))
    return args


def run(argv: list[str] | None = None) -> Path:
    """Run the sweep described by ``argv`` (see ``--help``); returns the output folder."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    start = time.monotonic()
    device, stamp, default_out = start_run("benchmarks/gpu/tune_tiles.py", argv, args.smoke, "tuning", "tune")
    out = args.out or default_out
    out.mkdir(parents=True, exist_ok=True)
    notes = ["fwd = training forward (need_out_u); fwd+bwd adds entmax_attn_bwd (its warps/stages autotuned); "
             "mixed alpha = linspace(1, 2, heads); general = 1.25"]
    if device == "cpu":
        notes.append("CPU smoke run: Triton interpreter, wall-clock timer, numbers mean nothing for speed")
    previous = {}
    if args.resume_from:
        previous = {row_key(r): r for r in read_tune_csv(args.resume_from) if r["status"] != SKIPPED}
        notes.append(f"{len(previous)} rows kept from {args.resume_from} (an earlier run, see its own stamp)")
    timing = Timing(device, args.warmup_ms, args.rep_ms)
    rows: list[dict] = []
    state = {"budget_hit": False}

    def flush():
        add_speedups(rows)
        write_csv(out / "tune.csv", stamp, notes, rows, TUNE_COLUMNS)
        write_markdown(out / "tune.md", stamp, notes, rows)

    def over_budget() -> bool:
        if args.budget_s is not None and not state["budget_hit"] and time.monotonic() - start > args.budget_s:
            state["budget_hit"] = True
            notes.append(f"incomplete: time budget of {args.budget_s:g} s reached; rows left are 'skipped'")
        return state["budget_hit"]

    sweep_bwd = args.modes[0] in BWD_MODES
    if sweep_bwd:
        notes.append("bwd modes: entmax_attn_bwd alone (bwd-atomic: deterministic=False) after one forward at its "
                     "pinned config; each config replaces one backward kernel's pinned config "
                     "(entmax_attn_bwd(..., tiles=)), launched with exactly its warps and stages")
    for head_dim in args.head_dims:
        if sweep_bwd:
            configs = bwd_candidate_configs(head_dim, args.bwd_configs, args.smoke)
        else:
            configs = candidate_configs(head_dim, args.configs, args.smoke)
        for dtype in args.dtypes:
            problems: dict[int, Problem] = {}
            for alpha_class in args.classes:
                for causal in args.causal:
                    sweep_case(args, device, timing, head_dim, dtype, alpha_class, causal, configs, problems,
                               previous, rows, over_budget, flush)
            problems.clear()
            free_memory(device)
    flush()
    print(f"wrote {out / 'tune.md'}, {out / 'tune.csv'}", flush=True)
    if state["budget_hit"]:
        print("INCOMPLETE: time budget reached; rerun with --resume-from " + str(out / "tune.csv"), flush=True)
    return out


def sweep_case(args, device, timing, head_dim, dtype, alpha_class, causal, configs, problems, previous, rows,
               over_budget, flush):
    """Every (config, seq, mode) of one (head dim, dtype, alpha class, causal) case, pinned config first; the files
    are rewritten after each (config, seq)."""
    refs: dict[tuple, torch.Tensor] = {}
    pinned = configs[0]
    for config in configs:
        for seq in args.seqs:
            case = Case("tune", max(1, args.tokens // seq), max(1, args.hidden // head_dim), seq, seq, head_dim,
                        causal, dtype)
            base = {"head_dim": head_dim, "dtype": dtype, "alpha_class": alpha_class, "causal": causal,
                    "batch": case.batch, "heads": case.heads, "seq": seq, "config": config.label,
                    "block_m": config.block_m, "block_n": config.block_n, "num_warps": config.num_warps,
                    "num_stages": config.num_stages, "pinned": config == pinned}
            todo, kept = split_resumed(base, args.modes, previous, row_key)
            rows.extend(kept)
            if not todo:
                continue
            if over_budget():
                rows.extend({**r, "status": SKIPPED, "note": "time budget reached"} for r in todo)
                continue
            if seq not in problems:
                problems[seq] = make_problem(case, device)
            problem = problems[seq]
            bwd_config = isinstance(config, BwdConfig)
            resources = {} if bwd_config else fwd_resources(fwd_kwargs(problem, alpha_class, causal, config))
            for row in todo:
                mode = row["mode"]
                call = timed_call(problem, alpha_class, causal, config, mode)
                result = classify(measure(call, "fwd", None, [], timing))
                if result["status"] == OK:
                    result.update(check_against_pinned(call, refs, (seq, mode), problem, alpha_class, causal, pinned,
                                                       mode, dtype))
                    result["tflops"] = dense_flops(case.batch, case.heads, seq, seq, head_dim, causal,
                                                   "bwd" if bwd_config else mode) / (result["ms"] * 1e-3) / 1e12
                    if config.block_m is None and not bwd_config:
                        picked = getattr(fwd._entmax_attn_fwd_autotuned, "best_config", None)
                        if picked is not None:
                            result["note"] = f"autotune picked w{picked.num_warps} s{picked.num_stages}"
                note = "; ".join(n for n in (result.get("note", ""), resources.get("note", "")) if n)
                rows.append({**row, **{k: v for k, v in resources.items() if k != "note"}, **result, "note": note})
                add_speedups(rows)
                print(progress_line(rows[-1]), flush=True)
            free_memory(device)
            flush()


def check_against_pinned(call, refs, key, problem, alpha_class, causal, pinned, mode, dtype) -> dict:
    """``rel_diff_vs_pinned`` of one more call's output, and status ``mismatch`` above ``DIFF_TOL``; only a note
    when the pinned config itself fails (its row says how)."""
    try:
        if key not in refs:
            refs[key] = timed_call(problem, alpha_class, causal, pinned, mode)()
        diff = rel_diff(call(), refs[key])
    except Exception as exc:  # the timing stands; the comparison is an extra
        return {"note": f"not compared with the pinned config: {type(exc).__name__}"}
    result = {"rel_diff_vs_pinned": diff}
    if not diff <= DIFF_TOL[dtype]:
        result.update(status=MISMATCH, note=f"output differs from the pinned config's by {diff:.3g} (relative)")
    return result


def add_speedups(rows: list[dict]):
    """``speedup_vs_pinned`` = pinned ms / ms of the same (head dim, dtype, class, causal, seq, mode)."""
    pinned = {_case_key(r): r["ms"] for r in rows if _is_pinned(r) and r["status"] == OK}
    for r in rows:
        base = pinned.get(_case_key(r))
        r["speedup_vs_pinned"] = base / r["ms"] if base and r["status"] in (OK, MISMATCH) and r["ms"] else None


def _case_key(row: dict) -> tuple:
    return tuple(fmt(row[c], 6) for c in KEY_COLUMNS[:-1])


def _is_pinned(row: dict) -> bool:
    return str(row["pinned"]) == "True"


def progress_line(row: dict) -> str:
    cells = [f"D={row['head_dim']}", row["dtype"], row["alpha_class"], "causal" if row["causal"] else "full",
             f"N={row['seq']}", row["mode"], row["config"], row["status"]]
    if row.get("ms") is not None:
        cells.append(f"{row['ms']:.4g} ms")
    if row.get("speedup_vs_pinned") is not None:
        cells.append(f"x{row['speedup_vs_pinned']:.3f} vs pinned")
    return "  ".join(cells) + (f"  ({row['note']})" if row.get("note") else "")


def read_tune_csv(path: Path) -> list[dict]:
    """Rows of a ``tune.csv`` written by :func:`run`, numbers parsed back."""
    return read_csv(path, TUNE_FLOAT_COLUMNS, TUNE_INT_COLUMNS)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def config_summary(rows: list[dict]) -> dict:
    """Per (head dim, dtype) and config, per mode: ``(geomean speedup, worst speedup, cases, cases not ok)`` over
    the cases where the pinned config ran; a config not ``ok`` on one of them is not a candidate for pinning."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["status"] == SKIPPED:
            continue
        group = out.setdefault((r["head_dim"], r["dtype"]), {}).setdefault(r["config"], {})
        speed, failed = group.setdefault(r["mode"], ([], []))
        if r["status"] == OK and r.get("speedup_vs_pinned"):
            speed.append(r["speedup_vs_pinned"])
        elif r["status"] != OK:
            failed.append(r["status"])
    return {key: {cfg: {mode: (_geomean(s) if s else None, min(s) if s else None, len(s), len(f))
                        for mode, (s, f) in modes.items()}
                  for cfg, modes in configs.items()}
            for key, configs in out.items()}


def winners(rows: list[dict]) -> list[dict]:
    """Per (head dim, dtype, class, causal, mode): the config with the best geomean speedup over the sequence
    lengths (``ok`` at every one the pinned config ran), with "pinned ms -> best ms" per sequence length."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["head_dim"], r["dtype"], r["alpha_class"], r["causal"], r["mode"])
        groups.setdefault(key, {}).setdefault(r["config"], {})[r["seq"]] = r
    table = []
    for key, by_config in groups.items():
        pinned = next((c for c, seqs in by_config.items() if any(_is_pinned(r) for r in seqs.values())), None)
        if pinned is None:
            continue
        seqs = sorted(s for s, r in by_config[pinned].items() if r["status"] == OK)
        if not seqs:
            continue
        best, best_gain = pinned, 1.0
        for cfg, runs in by_config.items():
            if all(s in runs and runs[s]["status"] == OK for s in seqs):
                gain = _geomean([runs[s]["speedup_vs_pinned"] for s in seqs])
                if gain > best_gain:
                    best, best_gain = cfg, gain
        auto = by_config.get(AUTOTUNE, {})
        table.append({
            "head_dim": key[0], "dtype": key[1], "alpha_class": key[2], "causal": key[3], "mode": key[4],
            "pinned": pinned, "best": best, "speedup": best_gain,
            "per_seq": [(s, by_config[pinned][s]["ms"], by_config[best][s]["ms"],
                         auto[s]["ms"] if s in auto and auto[s]["status"] == OK else None) for s in seqs],
        })
    return table


def write_markdown(path: Path, stamp: dict, notes: list[str], rows: list[dict]):
    """``tune.md``: stamp, configs against the pinned one per head dim and dtype, winners per case, every row."""
    lines = ["# Launch-config tuning of the fused kernels (benchmarks/gpu/tune_tiles.py)", "",
             *stamp_lines(stamp, notes),
             "", "## Configs against the pinned one (speedup = pinned ms / ms; geomean and worst over the cases)", "",
             "A config to pin must be `ok` in every case (the pinned tiles are per head dim, for every alpha class).",
             ""]
    for (head_dim, dtype), configs in config_summary(rows).items():
        modes = [m for m in MODES if any(m in c for c in configs.values())]
        header = ["config"] + [f"{m} {h}" for m in modes for h in ("geomean", "worst", "cases ok", "not ok")]
        lines += [f"### D = {head_dim}, {dtype}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        order = sorted(configs, key=lambda c: -(configs[c].get(modes[-1], (0,))[0] or 0))
        for cfg in order:
            cells = [cfg]
            for m in modes:
                gm, worst, n_ok, n_bad = configs[cfg].get(m, (None, None, 0, 0))
                cells += [fmt(gm, 4), fmt(worst, 4), str(n_ok), str(n_bad)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Best config per case (pinned ms -> best ms; autotune = the default launch)", "",
              "| D | dtype | class | causal | mode | pinned | best | speedup (geomean) | N: pinned ms -> best ms "
              "(autotune ms) |", "|" + "---|" * 9]
    for w in winners(rows):
        per_seq = "; ".join(f"{s}: {fmt(p, 4)} -> {fmt(b, 4)}" + (f" ({fmt(a, 4)})" if a is not None else "")
                            for s, p, b, a in w["per_seq"])
        lines.append(f"| {w['head_dim']} | {w['dtype']} | {w['alpha_class']} | {w['causal']} | {w['mode']} | "
                     f"{w['pinned']} | {w['best']} | {fmt(w['speedup'], 4)} | {per_seq} |")
    header = ["D", "dtype", "class", "causal", "N", "mode", "config", "status", "ms (q20–q80)", "TFLOP/s",
              "× pinned", "regs", "spill B", "smem B", "rel diff", "note"]
    lines += ["", "## Every row", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ms = "" if r.get("ms") is None else f"{fmt(r['ms'])} ({fmt(r['ms_q20'])}–{fmt(r['ms_q80'])})"
        cells = [r["head_dim"], r["dtype"], r["alpha_class"], r["causal"], r["seq"], r["mode"], r["config"],
                 r["status"], ms, fmt(r.get("tflops")), fmt(r.get("speedup_vs_pinned"), 4), fmt(r.get("regs")),
                 fmt(r.get("spill_bytes")), fmt(r.get("smem_bytes")), fmt(r.get("rel_diff_vs_pinned"), 2),
                 r.get("note", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
