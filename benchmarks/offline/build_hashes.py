"""Every forward launch (fused, the split forward's two stages, inference and training) and the backward kernels at
the pinned configs, built for sm_90 as a launch builds them, each with a hash of its SASS: two trees (or two triton
versions, or ``--no-tma``) compare build for build, and a refactor that should not change the code shows the same
hashes.

Usage: ``python benchmarks/offline/build_hashes.py [--d 64 128 256] [--bwd-d 128] [--no-tma]``. One line per build:
its name, ``sha`` (the first 10 hex digits of the SHA-1 of its SASS instructions, addresses left out), registers,
spill bytes, spill loads / stores inside loops, SASS instructions, TMA loads (UTMALDG), cp.async copies (LDGSTS)
warpgroup MMAs (HGMMA) and ``mma.sync`` (HMMA); columns as in ``sm90_build.py``, whose ``analyse`` computes the
hash.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_build  # noqa: E402
import torch  # noqa: E402

import sparse_attn.kernels.attn.entmax_attn_fwd as fwd  # noqa: E402

CLASSES = ("softmax", "entmax15", "sparsemax", "general")


def show(name: str, info: dict) -> None:
    print(f"{name:44s} sha={info['sha']} regs={info['regs']} spill={info['spill']} loop_ldst={info['loop_ldst']} "
          f"sass={info['sass']} tma={info['tma']} ldgsts={info['ldgsts']} hgmma={info['hgmma']} hmma={info['hmma']}",
          flush=True)


def forward_builds(head_dim: int, n: int):
    """``(name, info)`` of every forward launch of each alpha class (causal, bf16, no mask) at ``head_dim``."""
    for cls in CLASSES:
        for train in (False, True):
            for split in (False, True) if fwd.runs_split(cls, True) else (False,):
                q, k, v, _ = sm90_build._problem(head_dim, n, torch.bfloat16, False)
                alpha = torch.full((q.shape[1],), sm90_build.ALPHA_OF_CLASS[cls])
                # split=False with the pinned warps forced: the fused kernel itself, not its autotuner
                forced = {} if split else {"num_warps": fwd._pick_config(head_dim, False)[2]}
                kernel, launches = sm90_build.captured_launches(
                    fwd, "_entmax_attn_fwd_kernel", fwd.entmax_attn_fwd, q, k, v, alpha, head_dim ** -0.5,
                    is_causal=True, alpha_class=cls, need_out_u=train, split=split, **forced)
                for _, args, kwargs in launches:
                    name = (f"fwd d{head_dim} {cls}{' train' if train else ''}"
                            + (f" split-stage{kwargs['STAGE']}" if split else ""))
                    yield name, sm90_build.analyse(sm90_build.compile_like_launch(kernel, args, kwargs))


def backward_builds(head_dim: int, n: int):
    """``(name, info)`` of the backward kernels of ``sm90_build.BWD_MATRIX`` for 1.5-entmax and general alpha."""
    for cls in ("entmax15", "general"):
        for need_dalpha, mask, kernels, det in sm90_build.BWD_MATRIX:
            for info in sm90_build.bwd_cases(head_dim, need_dalpha=need_dalpha, mask=mask, kernels=kernels,
                                             alpha_class=cls, deterministic=det, n=n):
                yield f"bwd d{head_dim} {cls} {info['kernel']} da={need_dalpha} m={mask} det={det}", info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256], help="forward head dims")
    ap.add_argument("--bwd-d", type=int, nargs="*", default=[128], help="backward head dims (none: no backward)")
    ap.add_argument("--n", type=int, default=sm90_build.N_DEFAULT)
    ap.add_argument("--no-tma", action="store_true",
                    help="pointer loads everywhere instead of TMA descriptors (as with SPARSE_ATTN_TMA=0)")
    args = ap.parse_args(argv)
    sm90_build.TMA = not args.no_tma
    print(f"# build_hashes: triton {sm90_build.triton.__version__}, sm_90, bf16, N {args.n}, causal, "
          + ("pointer loads" if args.no_tma else "TMA where the launchers take it"), flush=True)
    for d in args.d:
        for name, info in forward_builds(d, args.n):
            show(name, info)
    for d in args.bwd_d:
        for name, info in backward_builds(d, args.n):
            show(name, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
