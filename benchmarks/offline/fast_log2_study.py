"""Numerics of the hardware ``lg2`` (``_common.fast_log2``: ``lg2.approx.ftz.f32``) in the fused forward, on the CPU.

The interpreter cannot run inline PTX, so ``_threshold.fast_log2`` is replaced by an emulation at the PTX error
bound taken at its worst: ``log2 x + s * 2**-22 * max(1, |log2 x|)`` with ``s = +1``, ``-1`` or a hash of the bits
of ``x`` (modes ``+``, ``-``, ``hash``; ``exact`` = ``tl.log2``). Per head (alpha 1.01 / 1.05 / 1.25 / 1.75, general
class), score distribution (``benchmarks/offline/passes.py``'s ``flat`` / ``std1`` / ``std3`` / ``local``) and
causality it prints the max output error against the float64 reference, its ratio to the ``exact`` run's, the largest
tau change, the mean passes and the largest float64 weight in a key tile the kernel marked dead (the certificate: at
most 1e-6).

* ``--part sums``: the threshold's point sums (grid and candidate passes), float32 inputs and bf16-rounded inputs
  run in float32 with the dtype's tolerance (as ``benchmarks/offline/passes.py``).
* ``--part weights``: the value pass's 16-bit weights (``_threshold.weights(FAST)``), real bf16 / fp16 tensors.

Usage: ``python benchmarks/offline/fast_log2_study.py [--part sums weights]`` (about 15 min per part on 2 cores).
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from passes import make_inputs  # noqa: E402 (benchmarks/offline/passes.py, next to this script)

from sparse_attn.kernels.attn import _threshold  # noqa: E402
from sparse_attn.kernels.attn.entmax_attn_fwd import default_tolerance, entmax_attn_fwd  # noqa: E402
from sparse_attn.reference import entmax_attention_reference  # noqa: E402

ALPHAS = [1.01, 1.05, 1.25, 1.75]
N, D, BLOCK = 256, 64, 64
ERR = 2.384185791015625e-07  # 2**-22


@triton.jit
def _lg2_plus(x):
    y = tl.log2(x)
    return y + ERR * tl.maximum(tl.abs(y), 1.0)


@triton.jit
def _lg2_minus(x):
    y = tl.log2(x)
    return y - ERR * tl.maximum(tl.abs(y), 1.0)


@triton.jit
def _lg2_hash(x):
    y = tl.log2(x)
    b = x.to(tl.int32, bitcast=True)
    s = (((b >> 3) ^ (b >> 11) ^ (b >> 17)) & 1).to(tl.float32) * 2.0 - 1.0
    return y + s * ERR * tl.maximum(tl.abs(y), 1.0)


MODES = {"exact": None, "+": _lg2_plus, "-": _lg2_minus, "hash": _lg2_hash}


def run(part: str):
    dtypes = (torch.float32, torch.bfloat16) if part == "sums" else (torch.bfloat16, torch.float16)
    worst = {}
    orig = _threshold.fast_log2
    for dtype in dtypes:
        for dist in ("flat", "std1", "std3", "local"):
            for causal in (False, True):
                q, k, v = (t.to(dtype) for t in make_inputs(dist, N, D, len(ALPHAS), 0))
                if part == "sums":
                    q, k, v = q.float(), k.float(), v.float()
                refs = [entmax_attention_reference(q[:, h:h + 1].double(), k[:, h:h + 1].double(),
                                                   v[:, h:h + 1].double(), a, is_causal=causal, scale=D ** -0.5,
                                                   return_weights=True) for h, a in enumerate(ALPHAS)]
                base = None
                for mode, fn in MODES.items():
                    _threshold.fast_log2 = orig if fn is None else fn
                    try:
                        res = entmax_attn_fwd(q, k, v, torch.tensor(ALPHAS), D ** -0.5, is_causal=causal,
                                              tol=default_tolerance(dtype), block_m=BLOCK, block_n=BLOCK,
                                              alpha_class="general")
                    finally:
                        _threshold.fast_log2 = orig
                    out = res.out.to(dtype).double()
                    base = base or (out, res.tau)
                    for h, a in enumerate(ALPHAS):
                        o64, w64 = refs[h][0][0, 0], refs[h][1][0, 0]
                        err = (out[0, h] - o64).abs().max().item()
                        ratio = err / max((base[0][0, h] - o64).abs().max().item(), 1e-30)
                        bits = (res.live[0, h].long().unsqueeze(-1) >> torch.arange(32)) & 1
                        live = bits.flatten(-2)[:, : N // BLOCK].bool()
                        tile_max = w64.reshape(N // BLOCK, BLOCK, N // BLOCK, BLOCK).amax(dim=(1, 3))
                        cert = tile_max[~live].max().item() if (~live).any() else 0.0
                        dtau = (res.tau[0, h] - base[1][0, h]).abs().max().item()
                        passes = res.n_passes[0, h].float().mean().item()
                        print(f"{str(dtype)[6:]:8s} {dist:6s} causal={int(causal)} alpha={a:<5} {mode:5s} "
                              f"err {err:.2e} ratio {ratio:.3f} dtau {dtau:.1e} passes {passes:.2f} cert {cert:.1e}",
                              flush=True)
                        w = worst.setdefault((str(dtype)[6:], a, mode == "exact"), [0.0, 0.0, 0.0, 0.0, 0.0])
                        for i, x in enumerate((err, ratio, dtau, cert, passes)):
                            w[i] = max(w[i], x)
    print("\nworst over distributions x causal (x sign modes): dtype, alpha, exact log2? -> "
          "max err / ratio to exact / |dtau| / dead-tile weight / mean passes")
    for key in sorted(worst):
        print(key, " / ".join(f"{x:.3g}" for x in worst[key]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", default=["sums", "weights"], choices=["sums", "weights"])
    for part in ap.parse_args(argv).part:
        run(part)


if __name__ == "__main__":
    main()
