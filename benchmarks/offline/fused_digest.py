"""Bitwise fingerprint of the fused attention kernels, to show that a refactor changed nothing.

Runs ``sparse_attn.entmax_attention(..., backend="triton")`` forward and backward (autograd) on a
fixed set of seeded random problems, plus the forward launcher itself for the statistics the
public function does not return (``lsum``, ``live``, ``n_passes``, ``tile_visits``) and, for causal problems, both
launchers at 16 x 16 tiles (several tiles per sequence, so the causal tile ranges matter), and
writes the sha256 of every result tensor (out, stats, dq, dk, dv, dalpha, dbias, ...) to a JSON
file. Two runs of the same kernels give identical files; compare a run before and after a change with ``--check``.

Without a GPU it sets ``TRITON_INTERPRET=1`` (before importing any kernel) and runs on CPU
tensors; a minute or two on one core.

    python benchmarks/offline/fused_digest.py --out /tmp/after.json [--check /tmp/before.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparse_attn import entmax_attention  # noqa: E402
from sparse_attn.kernels.attn.entmax_attn_bwd import entmax_attn_bwd  # noqa: E402
from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd  # noqa: E402

ALPHA4 = [1.0, 1.5, 2.0, 1.25]

# name -> problem. Shapes (batch b, q heads hq, kv heads hk, nq, nk, head dim d); `mask`: None,
# a float bias shape (with a few -inf entries, differentiable) or "bool" (a padding mask with
# fully masked rows); `varlen`: (cu_seqlens_q, cu_seqlens_k) with b = 1 and nq, nk the totals.
CASES = {
    "mixed_alpha_d32": dict(b=2, hq=4, hk=4, nq=40, nk=40, d=32),
    "causal_gqa_cross_d64": dict(b=1, hq=4, hk=2, nq=37, nk=53, d=64, causal=True),
    "causal_mqa_nq_gt_nk": dict(b=1, hq=4, hk=1, nq=45, nk=20, d=32, causal=True),
    "bias_full": dict(b=2, hq=4, hk=2, nq=33, nk=41, d=32, mask=(2, 4, 33, 41), causal=True),
    "bias_shared_2d": dict(b=2, hq=4, hk=4, nq=33, nk=41, d=32, mask=(1, 1, 33, 41)),
    "bias_heads_only": dict(b=2, hq=4, hk=4, nq=33, nk=41, d=32, mask=(1, 4, 33, 41), causal=True),
    "bias_keys": dict(b=2, hq=4, hk=2, nq=33, nk=41, d=32, mask=(2, 1, 1, 41)),
    "bias_rows": dict(b=2, hq=4, hk=4, nq=33, nk=41, d=32, mask=(2, 4, 33, 1)),
    "bool_mask": dict(b=2, hq=4, hk=4, nq=35, nk=35, d=32, mask="bool", causal=True),
    "varlen_causal_gqa": dict(b=1, hq=4, hk=2, nq=70, nk=80, d=32, causal=True,
                              varlen=([0, 5, 5, 47, 70], [0, 9, 20, 60, 80])),
    "varlen_dropout_bias": dict(b=1, hq=4, hk=4, nq=60, nk=66, d=32, dropout=0.2, mask=(1, 4, 1, 66),
                                varlen=([0, 25, 60], [0, 30, 66])),
    "dropout_causal": dict(b=2, hq=4, hk=2, nq=40, nk=48, d=32, dropout=0.3, causal=True),
    "fp16_d80_causal": dict(b=1, hq=4, hk=2, nq=41, nk=41, d=80, dtype=torch.float16, causal=True),
    "bf16_d64": dict(b=1, hq=4, hk=4, nq=36, nk=50, d=64, dtype=torch.bfloat16),
    "alpha_near_one_d32": dict(b=1, hq=4, hk=4, nq=40, nk=40, d=32, alpha=[1.01, 1.001, 1.1, 1.9]),
}


_FWD_FIELDS = ("out", "tau", "lsum", "nnz", "live", "n_passes", "tile_visits")

def digest(t) -> str | None:
    """sha256 of a tensor's dtype, shape and bytes (None stays None)."""
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mask(spec, c, gen, device):
    """The attention mask of a case: None, a bool padding mask or a float bias with -inf entries."""
    if spec is None:
        return None
    if spec == "bool":
        keep = torch.rand(c["b"], 1, c["nq"], c["nk"], generator=gen) > 0.3
        keep[..., 3, :] = False
        return keep.to(device)
    bias = 0.5 * torch.randn(*spec, generator=gen)
    bias.view(-1)[::11] = float("-inf")
    return bias.to(device).requires_grad_()


def run_case(c: dict, seed: int, device: str) -> dict:
    """Digests of one problem: public forward, stats and autograd gradients, then the launcher's extra outputs."""
    gen = torch.Generator().manual_seed(seed)
    dtype = c.get("dtype", torch.float32)
    b, hq, hk, nq, nk, d = (c[n] for n in ("b", "hq", "hk", "nq", "nk", "d"))
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype).to(device).requires_grad_()
               for h, n in ((hq, nq), (hk, nk), (hk, nk)))
    alpha = torch.tensor(c.get("alpha", ALPHA4), device=device).requires_grad_()
    mask = _mask(c.get("mask"), c, gen, device)
    cu_q = cu_k = None
    if "varlen" in c:
        cu_q, cu_k = (torch.tensor(x, dtype=torch.int32, device=device) for x in c["varlen"])
    kw = dict(attn_mask=mask, is_causal=c.get("causal", False), dropout_p=c.get("dropout", 0.0),
              enable_gqa=hq != hk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    do = torch.randn(b, hq, nq, d, generator=gen).to(dtype).to(device)
    torch.manual_seed(seed)  # the public function draws its dropout seed from torch's RNG
    out, stats = entmax_attention(q, k, v, alpha, backend="triton", return_stats=True, **kw)
    wrt = [q, k, v, alpha] + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad((out * do).sum(), wrt)
    res = dict(out=digest(out), tau=digest(stats.tau), nnz=digest(stats.nnz), n_valid=digest(stats.n_valid))
    res.update(zip(["dq", "dk", "dv", "dalpha", "dbias"], map(digest, grads)))

    bias = None
    if mask is not None:
        bias = mask.detach().float()
        if not mask.is_floating_point():
            bias = torch.zeros(mask.shape, device=device).masked_fill(~mask, float("-inf"))
    launch = dict(is_causal=kw["is_causal"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=kw["dropout_p"], seed=seed)
    q, k, v, alpha = (t.detach() for t in (q, k, v, alpha))
    full_bias = None if bias is None else bias.expand(b, hq, nq, nk)
    fwd = entmax_attn_fwd(q, k, v, alpha, d**-0.5, bias=full_bias, **launch)
    res.update({f"launcher_{f}": digest(getattr(fwd, f)) for f in _FWD_FIELDS})
    if kw["is_causal"]:
        # 16 x 16 tiles: several query and key tiles per sequence, so the causal tile ranges are exercised
        fwd = entmax_attn_fwd(q, k, v, alpha, d**-0.5, bias=full_bias, block_m=16, block_n=16, need_out_u=True,
                              **launch)
        bwd = entmax_attn_bwd(do, q, k, v, fwd.out, fwd.tau, fwd.lsum, alpha, d**-0.5, bias=bias, live=fwd.live,
                              tau_lo=fwd.tau_lo, block_m=16, block_n=16, need_dalpha=True, need_dbias=bias is not None,
                              out_u=fwd.out_u, **launch)
        res.update({f"tiles16_{f}": digest(getattr(fwd, f)) for f in _FWD_FIELDS})
        res.update({f"tiles16_{f}": digest(t) for f, t in zip(["dq", "dk", "dv", "dalpha", "dbias"], bwd)})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write the digests to")
    ap.add_argument("--check", help="a JSON file of an earlier run: exit 1 unless every digest is equal")
    ap.add_argument("--cases", nargs="*", help="run only these cases (default: all)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    names = args.cases or list(CASES)
    result = {name: run_case(CASES[name], list(CASES).index(name), device) for name in names}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    print(f"{len(result)} cases, {sum(len(r) for r in result.values())} digests -> {args.out}")
    if args.check:
        with open(args.check) as fh:
            want = json.load(fh)
        bad = [f"{n}.{f}" for n in result for f in result[n] if want.get(n, {}).get(f) != result[n][f]]
        print("identical to " + args.check if not bad else f"DIFFERENT from {args.check}: {', '.join(bad)}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
