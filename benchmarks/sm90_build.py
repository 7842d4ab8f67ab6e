"""Offline sm_90 (H100) builds of the attention kernels, without a GPU: registers, spills, shared memory,
asynchronous copies and the instruction mix.

Each kernel is compiled with the specialization a real launch gets: the arguments are built by the
launcher's own planning function from real (CPU) tensors, and Triton's JIT binder derives the
stride-1 constants and the 16-divisibility hints from them, as it would at launch. The cubin is then
read with the ptxas/cuobjdump bundled with Triton.

Usage: ``python benchmarks/sm90_build.py [--d 64 128 256] [--classes ...] [--markdown]``.
Columns: regs per thread, spill bytes (local memory), static shared memory, SASS instructions in
total, LDGSTS (cp.async) and UTMALDG (TMA) loads, LDG (plain global loads), HGMMA/HMMA (tensor-core
matrix instructions), MUFU (special-function unit ops: exp2, log2, rsqrt, rcp).
"""

from __future__ import annotations

import argparse
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

import sparse_attn.kernels.entmax_attn_fwd as fwd  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Capture:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def captured_launches(module, name: str, launcher, *args, **kwargs):
    """Run ``launcher`` with ``module.name`` replaced by a recorder; returns ``(kernel, [(grid, args, kwargs)])``."""
    kernel = getattr(module, name)
    cap = _Capture(kernel)
    setattr(module, name, cap)
    try:
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
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
    return dict(regs=field("REG"), spill=field("LOCAL"), smem=field("SHARED"), sass=len(ops),
                ldgsts=count("LDGSTS"), tma=count("UTMALDG"), ldg=count("LDG") - count("LDGSTS") - count("LDGDEPBAR"),
                mma=count("HGMMA") + count("HMMA"), mufu=count("MUFU"))


ALPHA_OF_CLASS = {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5, "general": 1.25, "mixed": 1.25}


def fwd_case(head_dim: int, alpha_class: str, causal: bool = True, dtype=torch.bfloat16, n: int = 1024):
    """Build the forward for one configuration as the launcher launches it; returns the analysis dict."""
    q, k, v = (torch.empty(1, 4, n, head_dim, dtype=dtype) for _ in range(3))
    alpha = torch.full((4,), ALPHA_OF_CLASS[alpha_class])
    extra = {"alpha_class": alpha_class} if "alpha_class" in fwd.entmax_attn_fwd.__code__.co_varnames else {}
    kernel, launches = captured_launches(fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, q, k, v, alpha,
                                         head_dim ** -0.5, is_causal=causal, **extra)
    (grid, args, kwargs), = launches
    info = analyse(compile_like_launch(kernel, args, kwargs))
    info.update(kernel="fwd", d=head_dim, alpha=alpha_class if extra else "all (run time)",
                block=f"{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']}", warps=kwargs.get("num_warps", 4),
                stages=kwargs.get("num_stages", 3))
    return info


COLUMNS = ("kernel", "d", "alpha", "block", "warps", "stages", "regs", "spill", "smem", "sass", "ldgsts", "tma",
           "ldg", "mma", "mufu")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--classes", nargs="+", default=list(ALPHA_OF_CLASS))
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
    for d in args.d:
        for cls in args.classes:
            info = fwd_case(d, cls)
            if args.markdown:
                print("| " + " | ".join(str(info[c]) for c in COLUMNS) + " |", flush=True)
            else:
                print("  ".join(f"{c}={info[c]}" for c in COLUMNS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
