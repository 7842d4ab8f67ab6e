"""Offline sm_90 (H100) builds of the attention kernels, without a GPU: registers, spills, shared memory,
asynchronous copies and the instruction mix.

Each kernel is compiled with the specialization a real launch gets: the arguments are built by the
launcher's own planning function from real (CPU) tensors, and Triton's JIT binder derives the
stride-1 constants and the 16-divisibility hints from them, as it would at launch. The cubin is then
read with the ptxas/cuobjdump bundled with Triton.

Usage: ``python benchmarks/offline/sm90_build.py [--d 64 128 256] [--classes ...] [--markdown]``.
Columns: regs per thread, spill bytes (stack + local memory per thread) and spill stores (STL), the spill loads
and stores inside a loop (``loop_ldst``: paid per iteration; those outside every loop are paid once per program), shared
memory (dynamic, bytes), SASS instructions in total, LDGSTS (cp.async) and UTMALDG (TMA) loads, LDG (plain
global loads), HGMMA (Hopper's warpgroup MMA, wgmma) and HMMA (the older per-warp ``mma.sync``) tensor-core
instructions, MUFU (special-function unit ops: exp2, log2,
rsqrt, rcp).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import sparse_attn.kernels.attn.entmax_attn_fwd as fwd  # noqa: E402
from sparse_attn.kernels import _args  # noqa: E402
from sparse_attn.kernels._args import tile_plan  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# the most shared memory one block may use on sm_90 (227 KiB; a launch above fails with "out of resource")
SM90_SMEM_BYTES = 232448
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Capture:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


# the launchers plan every recorded launch as for an sm_90 GPU: TMA descriptors in the kernels that take them there
# (``_args.tma_device`` says yes); False (``--no-tma``): pointer loads everywhere, as with ``SPARSE_ATTN_TMA=0``
TMA = True


def captured_launches(module, name: str, launcher, *args, **kwargs):
    """Run ``launcher`` with ``module.name`` replaced by a recorder (and TMA decided as :data:`TMA` says); returns
    ``(kernel, [(grid, args, kwargs)])``."""
    kernel = getattr(module, name)
    cap = _Capture(kernel)
    setattr(module, name, cap)
    try:
        with sm90_tma():
            launcher(*args, **kwargs)
    finally:
        setattr(module, name, kernel)
    return kernel, cap.launches


def compile_like_launch(kernel, args: tuple, kwargs: dict):
    """Compile ``kernel`` for sm_90 with the specialization the JIT would give these arguments."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, opts = binder(*args, **kwargs)
    parsed, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=parsed.__dict__)


def analyse(compiled) -> dict:
    """Resource usage and SASS instruction counts of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    def field(name):
        m = re.search(name + r":(\d+)", res)
        return int(m.group(1)) if m else 0
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    # the build's identity: its SASS instructions without their addresses (``build_hashes.py``)
    sha = hashlib.sha1("\n".join(re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)", sass)).encode()).hexdigest()[:10]
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
    return dict(regs=field("REG"), spill=field("STACK") + field("LOCAL"), stl=count("STL"),
                loop_ldst=_spills_in_loops(sass),
                smem=compiled.metadata.shared, sass=len(ops),
                ldgsts=count("LDGSTS"), tma=count("UTMALDG"), ldg=count("LDG") - count("LDGSTS") - count("LDGDEPBAR"),
                mma=count("HGMMA") + count("HMMA"), hgmma=count("HGMMA"), hmma=count("HMMA"), mufu=count("MUFU"),
                sha=sha)


def _spills_in_loops(sass: str) -> int:
    """Local-memory loads and stores (LDL / STL: the spill traffic) inside a loop: between a backward branch's
    target and the branch. Spills outside every loop are paid once per program; inside one, on every iteration."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;",
                                                    sass)]
    loops = [(int(t, 16), a) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/[^;]*?\bBRA\b[^;]*?0x([0-9a-f]+)\s*;", sass)]
    loops = [(t, int(a, 16)) for t, a in loops if t < int(a, 16)]
    return sum(1 for addr, op in ins if op.startswith(("LDL", "STL")) and any(t <= addr <= b for t, b in loops))


ALPHA_OF_CLASS = {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5, "general": 1.25}
# sequence length of the builds: long enough that the liveness map has several words (n_words > 1), as in a real
# launch; at 1024 keys (one word) the compiler drops the word loops and the builds need fewer registers
N_DEFAULT = 4096


@contextlib.contextmanager
def sm90_tma(on: bool | None = None):
    """Inside, the launchers decide TMA as on an sm_90 GPU (``on`` True: ``_args.tma_device`` says yes) or as without
    (False); None: as :data:`TMA` says."""
    saved = _args.tma_device
    _args.tma_device = lambda device: TMA if on is None else on
    try:
        yield
    finally:
        _args.tma_device = saved


def _problem(head_dim, n, dtype, varlen, heads=4, head_dim_v=None):
    """CPU tensors shaped like a real call (contiguous, 16-byte aligned; ``v`` of ``head_dim_v``, default
    ``head_dim``), and varlen offsets."""
    b = 1 if varlen else 2
    q, k = (torch.empty(b, heads, n, head_dim, dtype=dtype) for _ in range(2))
    v = torch.empty(b, heads, n, head_dim_v or head_dim, dtype=dtype)
    cu = torch.tensor([0, n // 3, n], dtype=torch.int32) if varlen else None
    return q, k, v, cu


# block masks of the builds (``--block-mask``): block sizes aligned with every launch's tiles or not, a boolean grid
# (every kept block full) or block states with the bits of partial blocks
BLOCK_MASKS = {"aligned": ((128, 128), False), "unaligned": ((96, 80), False), "partial": ((128, 128), True),
               "partial-unaligned": ((96, 80), True)}


def block_mask_arg(kind: str | None, n_seq: int, heads: int, n: int):
    """The launchers' ``block_mask`` argument of a :data:`BLOCK_MASKS` kind for ``n_seq`` sequences of ``n`` rows and
    keys and ``heads`` heads (its values do not matter to a build), or None."""
    if kind is None:
        return None
    (bq, bk), partial = BLOCK_MASKS[kind]
    shape = (n_seq, heads, -(-n // bq), -(-n // bk))
    if not partial:
        return torch.ones(shape, dtype=torch.bool), (bq, bk)
    return torch.ones(shape, dtype=torch.int32), (bq, bk), torch.zeros(16, bq, -(-bk // 32), dtype=torch.int32)


def fwd_case(head_dim: int, alpha_class: str, causal: bool = True, dtype=torch.bfloat16, n: int = N_DEFAULT,
             mask: str | None = None, dropout: bool = False, varlen: bool = False, need_out_u: bool = False,
             window_size=None, softcap: float | None = None, alibi: bool = False, sinks: bool = False,
             config: tuple | None = None, block_mask: str | None = None, block: tuple | None = None,
             split: bool = False, head_dim_v: int | None = None):
    """Build the forward for one configuration as the launcher launches it; returns the analysis dict.

    ``mask``: None, ``"float"`` (an additive ``(B, 1, Nq, Nk)`` bias) or ``"bool"`` (a keep mask);
    ``need_out_u``: the training forward, which also accumulates the backward's ``out_u``;
    ``window_size``: a sliding window ``(left, right)`` or None; ``softcap``, ``alibi``, ``sinks``: soft-capping,
    ALiBi slopes, per-head sinks; ``config``: ``(num_warps, num_stages)`` instead of the pinned one (an autotune
    candidate); ``block_mask``: a kind of :data:`BLOCK_MASKS` or None; ``block``: ``(block_m, block_n)`` instead of
    the pinned tiles; ``split``: the split forward's two stages (``kernels/attn/_fwd_split.py``, both built; the dict
    is the value kernel's), else the fused kernel, whatever the launcher's default for the class; ``head_dim_v``: the
    value head dim (default ``head_dim``).
    """
    q, k, v, cu = _problem(head_dim, n, dtype, varlen, head_dim_v=head_dim_v)
    variants = dict(window_size=window_size, softcap=softcap,
                    alibi_slopes=torch.empty(q.shape[1], dtype=torch.float32) if alibi else None)
    if block_mask is not None:
        variants["block_mask"] = block_mask_arg(block_mask, 2 if varlen else q.shape[0], q.shape[1], n)
    if sinks:
        variants["sinks"] = torch.zeros(q.shape[1], dtype=torch.float32)
    alpha = torch.full((q.shape[1],), ALPHA_OF_CLASS[alpha_class])
    bias = None if mask is None else torch.empty(q.shape[0], 1, n, n, dtype=torch.bool if mask == "bool" else dtype)
    extra = {"alpha_class": alpha_class} if "alpha_class" in fwd.entmax_attn_fwd.__code__.co_varnames else {}
    if need_out_u:
        extra["need_out_u"] = True
    if block is not None:
        extra.update(block_m=block[0], block_n=block[1])
    if "split" in fwd.entmax_attn_fwd.__code__.co_varnames:
        extra["split"] = split
    tuned = getattr(fwd, "_entmax_attn_fwd_autotuned", None)
    if split:  # the split's stages launch the kernel itself, with the pinned config (or the forced one)
        if config is not None:
            extra.update(num_warps=config[0], num_stages=config[1])
        kernel, launches = captured_launches(fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, q, k, v, alpha,
                                             head_dim ** -0.5, bias=bias, is_causal=causal, cu_seqlens_q=cu,
                                             cu_seqlens_k=cu, dropout_p=0.1 if dropout else 0.0,
                                             **variants, **extra)
        for _, args, kwargs in launches[:-1]:
            compile_like_launch(kernel, args, kwargs)
    elif tuned is not None:  # the autotuned kernel: record its launch, build it with the pinned config
        cap = _Capture(tuned)
        fwd._entmax_attn_fwd_autotuned = cap
        try:
            with sm90_tma():
                fwd.entmax_attn_fwd(q, k, v, alpha, head_dim ** -0.5, bias=bias, is_causal=causal, cu_seqlens_q=cu,
                                    cu_seqlens_k=cu, dropout_p=0.1 if dropout else 0.0, **variants, **extra)
        finally:
            fwd._entmax_attn_fwd_autotuned = tuned
        _, _, warps, stages = (fwd._pick_config(head_dim, False, q.element_size(), v.shape[3]) if config is None
                               else (None, None, *config))
        kernel, launches = fwd._entmax_attn_fwd_kernel, [(g, a, {**kw, "num_warps": warps, "num_stages": stages})
                                                         for g, a, kw in cap.launches]
    else:
        kernel, launches = captured_launches(fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, q, k, v, alpha,
                                             head_dim ** -0.5, bias=bias, is_causal=causal, cu_seqlens_q=cu,
                                             cu_seqlens_k=cu, dropout_p=0.1 if dropout else 0.0,
                                             **variants, **extra)
    grid, args, kwargs = launches[-1]
    info = analyse(compile_like_launch(kernel, args, kwargs))
    info.update(kernel=("fwd split" if split else "fwd") + ("+out_u" if need_out_u else "")
                + (f"[{block_mask}]" if block_mask else ""), d=head_dim,
                alpha=alpha_class if "alpha_class" in extra else "all (run time)",
                block=f"{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']}", warps=kwargs.get("num_warps", 4),
                stages=kwargs.get("num_stages", 3))
    return info


def bwd_cases(head_dim: int, need_dalpha: bool = True, mask: str | None = "blocks", causal: bool = True,
              dtype=torch.bfloat16, n: int = N_DEFAULT, dropout: bool = False, varlen: bool = False,
              kernels=("dq", "dkdv", "dbias"), window_size=None, softcap: float | None = None, alibi: bool = False,
              sinks: bool = False, config: tuple | None = None, alpha_class: str = "general",
              deterministic: bool = True, tma: bool | None = None, block_mask: str | None = None):
    """Build the backward kernels (those of ``kernels`` among ``"dq"``, ``"dkdv"``, ``"dbias"``) one launch of
    ``entmax_attn_bwd`` starts for the heads of one alpha class (``ALPHA_OF_CLASS``); one analysis dict per kernel.

    ``mask``: None, ``"bool"``, or the float-mask gradient mode: ``"dense"`` ``(B, H, N, N)``, ``"rows"``
    ``(B, H, N, 1)``, ``"cols"`` ``(B, 1, 1, N)``, ``"blocks"`` ``(1, H, N, N)``. ``config``: ``(num_warps,
    num_stages)`` for every kernel built instead of its pinned one (an autotune candidate). ``deterministic=False``:
    the backward that adds dQ with atomics in the dK/dV kernel. ``tma``: True, the launch an sm_90 GPU gets, whose
    loops stream their tiles with TMA descriptors (``_args.tma_device``, which says no for CPU tensors); False: the
    pointer loads of other devices; None: as :data:`TMA` says. ``block_mask``: a kind of :data:`BLOCK_MASKS` or None.
    """
    from sparse_attn.kernels.attn import entmax_attn_bwd as bwd

    q, k, v, cu = _problem(head_dim, n, dtype, varlen)
    bsz, heads = q.shape[:2]
    shapes = {"dense": (bsz, heads, n, n), "rows": (bsz, heads, n, 1), "cols": (bsz, 1, 1, n),
              "blocks": (1, heads, n, n), "bool": (bsz, 1, n, n)}
    bias = None if mask is None else torch.empty(shapes[mask], dtype=torch.bool if mask == "bool" else dtype)
    block_m, block_n = fwd.fwd_block_sizes(head_dim)
    plan = tile_plan(q, k, cu, cu, None, None, block_m, block_n)
    live = torch.empty(plan.n_seq, heads, plan.n_q_tiles, plan.n_words, dtype=torch.int32)
    stats = torch.empty(bsz, heads, n)
    names = ("dq", "dkdv", "dbias")
    # the launcher starts the autotuned kernels on a GPU: record those launches, build with the pinned configs
    tuned = {name: getattr(bwd, f"_entmax_attn_bwd_{name}_autotuned") for name in names}
    caps = {name: _Capture(kernel) for name, kernel in tuned.items()}
    for name, cap in caps.items():
        setattr(bwd, f"_entmax_attn_bwd_{name}_autotuned", cap)
    options = dict(is_causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.1 if dropout else 0.0, live=live,
                   block_m=block_m, block_n=block_n, need_dalpha=need_dalpha, need_dbias=mask not in (None, "bool"),
                   out_u=torch.empty_like(q), window_size=window_size, softcap=softcap,
                   alibi_slopes=torch.empty(heads, dtype=torch.float32) if alibi else None,
                   **({"sinks": torch.zeros(heads, dtype=torch.float32)} if sinks else {}),
                   **({"block_mask": block_mask_arg(block_mask, plan.n_seq, heads, n)} if block_mask else {}),
                   **({} if deterministic else {"deterministic": False}))
    try:
        with sm90_tma(tma):
            bwd.entmax_attn_bwd(torch.empty_like(q), q, k, v, torch.empty_like(q), stats, stats,
                                torch.full((heads,), ALPHA_OF_CLASS[alpha_class]), head_dim ** -0.5, bias=bias,
                                **options)
    finally:
        for name, kernel in tuned.items():
            setattr(bwd, f"_entmax_attn_bwd_{name}_autotuned", kernel)
    out = []
    for name, cap in caps.items():
        for _, args, kwargs in cap.launches if name in kernels else []:
            warps, stages = _pinned_launch_config(bwd, name, kwargs) if config is None else config
            kwargs = {**kwargs, "num_warps": warps, "num_stages": stages}
            info = analyse(compile_like_launch(getattr(bwd, f"_entmax_attn_bwd_{name}_kernel"), args, kwargs))
            # the dQ kernel's delta / d alpha launches (PHASE 1, 2) and the dK/dV kernel with the atomic dQ
            suffix = f"_phase{kwargs['PHASE']}" if kwargs.get("PHASE") else "+dq" if kwargs.get("NEED_DQ") else ""
            info.update(kernel=f"bwd_{name}{suffix}" + (f"[{block_mask}]" if block_mask else ""), d=head_dim,
                        alpha=f"{alpha_class} dalpha={int(need_dalpha)} mask={mask}",
                        block=f"{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']}", warps=kwargs.get("num_warps", 4),
                        stages=kwargs.get("num_stages", 3))
            out.append(info)
    return out


def _pinned_launch_config(bwd, name: str, kwargs: dict) -> tuple:
    """``(num_warps, num_stages)`` the backward launcher pins for a launch of kernel ``name`` with these arguments
    (by the launch's arguments; a launcher before the per-variant pins took the head dim)."""
    pinned = bwd._pinned(name)
    try:
        return pinned(kwargs)
    except TypeError:
        return pinned(kwargs["HEAD_DIM"])


# (need_dalpha, mask, kernels, deterministic) of ``--bwd``: each distinct backward build once (the dK/dV and dbias
# kernels do not depend on d alpha in the deterministic backward): without and with d alpha and with each way the mask
# gradient is accumulated (d bias tiles written by the dQ kernel, column sums in the dK/dV kernel, the dbias kernel for
# batch/head-broadcast masks); then the dK/dV kernel of the atomic dQ (``deterministic=False``), alone, with the d
# alpha row sums, and with those and the dense dS tiles it then stores
BWD_MATRIX = (
    (False, None, ("dq", "dkdv"), True),
    (True, None, ("dq",), True),
    (False, "dense", ("dq",), True),
    (True, "dense", ("dq",), True),
    (False, "cols", ("dkdv",), True),
    (False, "blocks", ("dbias",), True),
    (False, None, ("dkdv",), False),
    (True, None, ("dkdv",), False),
    (True, "dense", ("dkdv",), False),
)

COLUMNS = ("kernel", "d", "alpha", "block", "warps", "stages", "regs", "spill", "stl", "loop_ldst", "smem", "sass",
           "ldgsts", "tma", "ldg", "hgmma", "hmma", "mufu")


def candidates(head_dims, classes, n: int = N_DEFAULT):
    """Every launch config the autotuners may try, as they would launch it (not causal, bf16, length ``n``): the
    training forward (``need_out_u``) of each alpha class in ``classes``, and the general-alpha backward's dQ (with
    d alpha) and dK/dV kernels over their pruned config lists. Yields one analysis dict per build, with ``pinned``
    True for the config used without autotuning."""
    from sparse_attn.kernels import _args
    from sparse_attn.kernels.attn import entmax_attn_bwd as bwd

    def tried(pinned, d):  # the configs the autotuner of a launch at head dim d keeps
        return _args.prune_to_pinned(pinned)(_args.launch_configs(), {"HEAD_DIM": d})

    for d in head_dims:
        _, _, warps, stages = fwd._pick_config(d, False)
        for cls in classes:
            for cfg in tried(lambda head_dim: fwd._pick_config(head_dim, False)[2:], d):
                info = fwd_case(d, cls, causal=False, need_out_u=True, n=n, config=(cfg.num_warps, cfg.num_stages))
                yield dict(info, pinned=(cfg.num_warps, cfg.num_stages) == (warps, stages))
        for name in ("dq", "dkdv"):
            pinned = bwd._pick_config(d, False, True)[name][-2:]
            kept = _args.prune_to_pinned(bwd._pinned(name), by_args=True)(
                _args.launch_configs(), {"HEAD_DIM": d, "NEED_DALPHA": True, "Q": torch.empty(0, dtype=torch.bfloat16)})
            for cfg in kept:
                for info in bwd_cases(d, need_dalpha=True, mask=None, causal=False, n=n, kernels=(name,),
                                      config=(cfg.num_warps, cfg.num_stages)):
                    yield dict(info, alpha="general", pinned=(cfg.num_warps, cfg.num_stages) == pinned)


def check() -> int:
    """CI: the GPU builds the interpreter never exercises compile for sm_90: the forward's general-alpha class
    (the largest path) with a float mask, dropout, varlen, ALiBi, sinks and the backward's ``out_u``, its 1.5-entmax
    class with a boolean mask, a sliding window and soft-capping, the split forward's stages with the same features
    (sparsemax, 1.5-entmax at the head-dim-128 pin with its register cap); the three backward kernels with d alpha, a
    window, ALiBi, soft-capping, sinks and a mask gradient reduced by the d bias kernel."""
    infos = [
        fwd_case(80, "general", mask="float", dropout=True, varlen=True, need_out_u=True, alibi=True, sinks=True),
        fwd_case(64, "entmax15", mask="bool", causal=False, window_size=(255, 16), softcap=30.0),
        fwd_case(80, "sparsemax", mask="float", dropout=True, varlen=True, need_out_u=True, alibi=True, sinks=True,
                 split=True),
        fwd_case(128, "entmax15", mask="bool", window_size=(255, 16), softcap=30.0, split=True),
        *bwd_cases(80, need_dalpha=True, mask="blocks", dropout=True, window_size=(255, -1), softcap=30.0,
                   alibi=True, sinks=True),
        # float32 inputs, the largest shared memory of each kernel's pinned tiles (an H200 launch of the former
        # ones failed: docs/backward.md "Float32 inputs")
        fwd_case(256, "entmax15", dtype=torch.float32, n=1024),
        fwd_case(128, "entmax15", dtype=torch.float32, n=1024, head_dim_v=256),
        *bwd_cases(256, need_dalpha=False, mask=None, dtype=torch.float32, n=1024, kernels=("dq",),
                   alpha_class="entmax15"),
        *bwd_cases(256, need_dalpha=True, mask="blocks", dtype=torch.float32, n=1024, kernels=("dkdv",),
                   alpha_class="entmax15", deterministic=False),
    ]
    over = [f"{i['kernel']} d {i['d']} {i['alpha']}: {i['smem']} bytes" for i in infos if i["smem"] > SM90_SMEM_BYTES]
    if over:
        print(f"shared memory above sm_90's {SM90_SMEM_BYTES} bytes per block: " + "; ".join(over))
        return 1
    print("built")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--classes", nargs="+", default=list(ALPHA_OF_CLASS))
    ap.add_argument("--bwd", action="store_true",
                    help="also the backward kernels of every class (BWD_MATRIX: with and without d alpha and d bias)")
    ap.add_argument("--no-fwd", action="store_true", help="skip the forward builds (with --bwd: the backward only)")
    ap.add_argument("--no-tma", action="store_true",
                    help="pointer loads everywhere instead of TMA descriptors (as with SPARSE_ATTN_TMA=0)")
    ap.add_argument("--out-u", action="store_true", help="also the training forward (need_out_u) of every class")
    ap.add_argument("--candidates", action="store_true",
                    help="every config the autotuners may try (training forward per class, general-alpha backward)")
    ap.add_argument("--n", type=int, default=N_DEFAULT, help=f"sequence length of the builds (default {N_DEFAULT})")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--check", action="store_true", help="build one set of feature-complete kernels and exit")
    ap.add_argument("--block-mask", choices=list(BLOCK_MASKS), default=None,
                    help="every build with a block mask of this kind (BLOCK_MASKS)")
    args = ap.parse_args(argv)
    global TMA
    TMA = not args.no_tma
    if args.check:
        return check()

    def show(info):
        if args.markdown:
            print("| " + " | ".join(str(info[c]) for c in COLUMNS) + " |", flush=True)
        else:
            print("  ".join(f"{c}={info[c]}" for c in COLUMNS), flush=True)

    print(f"# triton {triton.__version__}, sm_90, bf16, N {args.n}"
          + (f", block mask {args.block_mask} {BLOCK_MASKS[args.block_mask]}" if args.block_mask else ""))
    if args.candidates:
        cols = ("kernel", "d", "alpha", "block", "warps", "stages", "pinned", "regs", "spill", "stl", "loop_ldst")
        if args.markdown:
            print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for info in candidates(args.d, args.classes, args.n):
            print(("| " + " | ".join(str(info[c]) for c in cols) + " |") if args.markdown
                  else "  ".join(f"{c}={info[c]}" for c in cols), flush=True)
        return 0
    if args.markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
    for d in args.d:
        for cls in [] if args.no_fwd else args.classes:
            show(fwd_case(d, cls, n=args.n, block_mask=args.block_mask))
            if args.out_u:
                show(fwd_case(d, cls, need_out_u=True, n=args.n, block_mask=args.block_mask))
        for cls in args.classes if args.bwd else []:
            for need_dalpha, mask, kernels, deterministic in BWD_MATRIX:
                for info in bwd_cases(d, need_dalpha=need_dalpha, mask=mask, kernels=kernels, n=args.n,
                                      alpha_class=cls, deterministic=deterministic, tma=TMA,
                                      block_mask=args.block_mask):
                    show(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
