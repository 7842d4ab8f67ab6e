"""Does Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``) reach an sm_90 build?

A minimal FlashAttention-style forward loop (online softmax, ``Q K^T`` and ``P V`` on the tensor cores), written twice:
with pointer loads and with tensor descriptors (TMA). Each is built offline with and without ``warp_specialize`` for
sm_90 (the H100 / H200) and, as a control that the flag does something in this Triton, for sm_100, the way
``sm90_build.compile_like_launch`` builds the package's kernels. Prints per build the registers, spills, SASS
instruction count, asynchronous copies (LDGSTS, UTMALDG), HGMMA count and shared memory (sm_90), and the
warp-specialize ops left in the TTGIR (sm_100). Identical sm_90 lines with and without the flag mean the compiler
ignored it there. No GPU needed::

    python benchmarks/offline/warp_spec_probe.py        # triton 3.6: PYTHONPATH=. with the 3.6 venv
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sm90_build  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


@triton.jit
def _loop_pointers(Q, K, V, OUT, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, WS: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + dims[None, :])
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        cols = start + tl.arange(0, BN)
        s = tl.dot(q, tl.load(K + cols[None, :] * D + dims[:, None]))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        corr = tl.exp2(m - m_new)
        l_sum = l_sum * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p.to(tl.bfloat16), tl.load(V + cols[:, None] * D + dims[None, :]))
        m = m_new
    tl.store(OUT + rows[:, None] * D + dims[None, :], (acc / l_sum[:, None]).to(tl.bfloat16))


@triton.jit
def _loop_descriptors(Q, K, V, OUT, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, WS: tl.constexpr):
    q_desc = tl.make_tensor_descriptor(Q, [N, D], [D, 1], [BM, D])
    k_desc = tl.make_tensor_descriptor(K, [N, D], [D, 1], [BN, D])
    v_desc = tl.make_tensor_descriptor(V, [N, D], [D, 1], [BN, D])
    o_desc = tl.make_tensor_descriptor(OUT, [N, D], [D, 1], [BM, D])
    q = q_desc.load([tl.program_id(0) * BM, 0])
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        s = tl.dot(q, k_desc.load([start, 0]).T)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        corr = tl.exp2(m - m_new)
        l_sum = l_sum * corr + tl.sum(p, 1)
        acc = acc * corr[:, None] + tl.dot(p.to(tl.bfloat16), v_desc.load([start, 0]))
        m = m_new
    o_desc.store([tl.program_id(0) * BM, 0], (acc / l_sum[:, None]).to(tl.bfloat16))


def main() -> int:
    n, d = 4096, 128
    q, k, v, o = (torch.empty(n, d, dtype=torch.bfloat16) for _ in range(4))
    launch = dict(BM=128, BN=64, D=d, num_warps=8, num_stages=2)
    print(f"# warp_spec_probe: triton {triton.__version__}, bf16, N {n}, head dim {d}, 128 x 64 tiles, 8 warps, "
          "2 stages")
    for name, kernel in (("pointers", _loop_pointers), ("tensor descriptors", _loop_descriptors)):
        for ws in (False, True):
            a = sm90_build.analyse(sm90_build.compile_like_launch(kernel, (q, k, v, o, n), dict(launch, WS=ws)))
            print(f"sm_90  {name:18s} warp_specialize={ws!s:5s}: regs {a['regs']} spill {a['spill']} sass {a['sass']} "
                  f"ldgsts {a['ldgsts']} tma {a['tma']} hgmma {a['hgmma']} smem {a['smem']}")
    sm90 = sm90_build.TARGET
    sm90_build.TARGET = GPUTarget("cuda", 100, 32)
    try:
        for ws in (False, True):
            ttgir = sm90_build.compile_like_launch(_loop_descriptors, (q, k, v, o, n), dict(launch, WS=ws)).asm["ttgir"]
            print(f"sm_100 tensor descriptors warp_specialize={ws!s:5s}: warp_specialize ops in the TTGIR "
                  f"{ttgir.count('ttg.warp_specialize')}")
    finally:
        sm90_build.TARGET = sm90
    return 0


if __name__ == "__main__":
    sys.exit(main())
