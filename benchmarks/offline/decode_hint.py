"""Passes of a decoding step with and without the previous step's threshold as a hint (``entmax_decode(tau_hint=)``),
counted on the Triton interpreter (``TRITON_INTERPRET=1``, set here) or on a GPU.

A generation loop is simulated per (dtype, alpha, drift): ``B`` sequences with ``Hk`` kv heads and ``Hq / Hk = 4`` q
heads each, one query per step against a random cache of ``N`` keys that grows by one key per step; the queries drift
as an AR(1) process, ``q_t = rho q_{t-1} + sqrt(1 - rho^2) e_t`` (``rho = 1``: the same query every step, only the
cache changes; ``rho = 0``: an unrelated query). Each step runs three times on the same inputs: without a hint, with
the previous step's ``tau`` (``good``), and with a ``stale`` hint (the ``tau`` of ``--stale`` steps before, or of
the first step when there are fewer) or
``garbage`` (the previous ``tau`` plus noise of standard deviation 1, and NaN / inf entries). Columns: mean passes per
row tile (score and value pass included), the candidate passes' stored-score blocks per step and kv head, and the
largest difference of the outputs and thresholds from the run without a hint; ``median step of tau``: the median
``|tau_t - tau_{t-1}|`` over rows and steps (the run without a hint).

    python benchmarks/offline/decode_hint.py --n 4096 --steps 6 --markdown
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from sparse_attn.kernels.attn.entmax_decode import entmax_decode_fwd  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def simulate(n, steps, rho, alpha, dtype, hint_step, stale, batch, n_kv, d, block_n, seed, device):
    """Rows of per-step counters for one drift; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    group = 4
    cap = n + steps
    k = torch.randn(batch, n_kv, cap, d, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, n_kv, cap, d, generator=gen).to(dtype).to(device)
    q = torch.randn(batch, n_kv * group, 1, d, generator=gen)
    taus, rows = [], []
    for t in range(steps):
        if t:
            q = rho * q + (1 - rho * rho) ** 0.5 * torch.randn(q.shape, generator=gen)
        lens = torch.full((batch,), n + t, dtype=torch.int32, device=device)
        qd = q.to(dtype).to(device)

        def run(hint, qd=qd, lens=lens):
            return entmax_decode_fwd(qd, k, v, lens, alpha, d ** -0.5, num_splits=4, block_n=block_n,
                                     tau_hint=hint, hint_step=hint_step)

        base = run(None)
        taus.append(base.tau)
        if t == 0:
            continue
        hints = {"good": taus[-2], "stale": taus[max(len(taus) - 1 - stale, 0)]}
        noisy = taus[-2] + torch.randn(taus[-2].shape, generator=gen).to(device)
        noisy.view(-1)[::3] = float("nan")
        noisy.view(-1)[1::3] = float("inf")
        hints["garbage"] = noisy
        row = {"none": base, "dtau": (base.tau - taus[-2]).abs()}
        for name, h in hints.items():
            row[name] = run(h)
        rows.append(row)
    return rows


def summarize(rows):
    """Per kind: mean passes, candidate blocks per (step, kv head) and the largest output / tau differences."""
    out = {"dtau": torch.cat([r["dtau"][torch.isfinite(r["dtau"])] for r in rows]).median().item()}
    for kind in ("none", "good", "stale", "garbage"):
        passes = torch.stack([r[kind].n_passes.float().mean() for r in rows]).mean().item()
        cand = torch.stack([r[kind].blocks_read[..., 1:-2].sum().float() / r[kind].n_passes[0].numel()
                            for r in rows]).mean().item()
        d_out = max((r[kind].out.float() - r["none"].out.float()).abs().max().item() for r in rows)
        finite = [torch.isfinite(r["none"].tau) for r in rows]
        d_tau = max((r[kind].tau - r["none"].tau)[f].abs().max().item() for r, f in zip(rows, finite, strict=True))
        out[kind] = (passes, cand, d_out, d_tau)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rho", type=float, nargs="+", default=[1.0, 0.999, 0.99, 0.9])
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.5, 1.25, 2.0])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--hint-step", type=float, default=None)
    ap.add_argument("--stale", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    head = ("| dtype | alpha | rho | median step of tau | passes none | good | stale | garbage | cand blocks none "
            "| good | stale | garbage | max out diff (good) | max tau diff (good) |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for dt in args.dtype:
        for alpha in args.alpha:
            for rho in args.rho:
                rows = simulate(args.n, args.steps + 1, rho, alpha, DTYPES[dt], args.hint_step, args.stale,
                                args.batch, args.kv_heads, args.d, args.block_n, args.seed, device)
                s = summarize(rows)
                kinds = ("none", "good", "stale", "garbage")
                print(f"| {dt} | {alpha} | {rho} | {s['dtau']:.1e} | "
                      + " | ".join(f"{s[k][0]:.2f}" for k in kinds) + " | "
                      + " | ".join(f"{s[k][1]:.1f}" for k in kinds)
                      + f" | {s['good'][2]:.1e} | {s['good'][3]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
