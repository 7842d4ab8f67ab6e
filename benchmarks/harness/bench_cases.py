"""What the attention benchmark measures: the groups of cases, their shapes and alphas, their inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from bench_common import LEARNABLE, MIXED, MODE_FLOP_FACTOR

from sparse_attn import mappings

GROUP_TITLES = {
    "flash": "FlashAttention grid (batch x seq = const tokens)",
    "sparsity": "Sparsity sweep (scores scaled to set the support size)",
    "mixed": "Per-head mixed alpha (linspace(1, 2, H)); learnable = requires_grad",
}


@dataclass(frozen=True)
class Case:
    """One input shape. Layout ``(batch, heads, seq, head_dim)``; ``score_mult`` scales ``q``."""

    group: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    dtype: str
    score_mult: float = 1.0
    target_density: float | None = None
    alpha: str = ""

    def fields(self) -> dict:
        return {
            "group": self.group, "dtype": self.dtype, "batch": self.batch, "heads": self.heads,
            "seq_q": self.seq_q, "seq_k": self.seq_k, "head_dim": self.head_dim,
            "causal": self.causal, "score_mult": self.score_mult,
            "target_density": self.target_density,
        }


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    mixed_alpha: torch.Tensor
    learnable_alpha: torch.Tensor
    causal: bool


def dense_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool, mode: str) -> float:
    """Dense-equivalent FLOPs: ``4 B H Nq Nk D`` forward (halved when causal), x2.5 bwd, x3.5 fwd+bwd."""
    flops = 4.0 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def make_inputs(case: Case, device: str, seed: int = 0) -> Inputs:
    """Random Gaussian ``q, k, v, dout`` of the case (``q`` times ``score_mult``), all requiring grad."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch_dtype(case.dtype)

    def rand(n, mult=1.0):
        x = torch.randn(case.batch, case.heads, n, case.head_dim, generator=gen) * mult
        return x.to(device=device, dtype=dtype)

    q = rand(case.seq_q, case.score_mult).requires_grad_()
    k = rand(case.seq_k).requires_grad_()
    v = rand(case.seq_k).requires_grad_()
    dout = rand(case.seq_q)
    mixed = torch.linspace(1.0, 2.0, case.heads, device=device)
    return Inputs(q, k, v, dout, mixed, mixed.clone().requires_grad_(), case.causal)


def alpha_arg(alpha: str, inputs: Inputs):
    """The alpha argument for an ``alpha`` column value: the per-head tensor of ``mixed`` / ``learnable``, else a
    float."""
    if alpha == MIXED:
        return inputs.mixed_alpha
    if alpha == LEARNABLE:
        return inputs.learnable_alpha
    return float(alpha)


def alpha_label(value: float) -> str:
    return f"{value:g}"


def _case(group: str, args, seq: int, head_dim: int, causal: bool) -> Case:
    """A square case of ``group``: ``batch = tokens // seq``, ``heads = hidden // head_dim`` (at least 1 each)."""
    return Case(group, max(1, args.tokens // seq), max(1, args.hidden // head_dim), seq, seq, head_dim, causal,
                args.dtype)


def flash_grid(args) -> list[Case]:
    """FlashAttention's grid: ``batch = tokens // seq``, ``heads = hidden // head_dim``; shortest sequences first."""
    return [_case("flash", args, seq, head_dim, causal)
            for seq in args.seqs for head_dim in args.head_dims for causal in args.causal]


def calibrate_mult(inputs: Inputs, alpha: float, target: float, sample_rows: int = 64) -> float:
    """Multiplier of the scores giving mean support fraction ``target`` on a sample of rows (bisection in log)."""
    q, k = inputs.q.detach(), inputs.k.detach()
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        s = (q[:1, :, :sample_rows].float() @ k[:1].float().transpose(-2, -1)) * scale
        lo, hi = math.log(1e-4), math.log(1e4)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            dens = (mappings.entmax(s * math.exp(mid), alpha=alpha, dim=-1) > 0).float().mean().item()
            if dens > target:
                lo = mid
            else:
                hi = mid
    return math.exp(0.5 * (lo + hi))


def sparsity_grid(args, device: str) -> list[Case]:
    """Cases of the sparsity sweep: per alpha and target density, the calibrated score multiplier."""
    cases = []
    seq = args.sweep_seq
    base = _case("sparsity", args, seq, args.sweep_head_dim, False)
    probe = make_inputs(base, device)
    for alpha in args.sweep_alphas:
        if alpha == 1.0:
            continue
        for target in args.sweep_targets:
            frac = target / seq if target >= 1 else target
            mult = calibrate_mult(probe, alpha, frac)
            cases.append(replace(base, score_mult=round(mult, 6), target_density=frac, alpha=alpha_label(alpha)))
    return cases


def mixed_grid(args) -> list[Case]:
    """Cases of the mixed-alpha group: one sequence length, each head dim and causal value."""
    return [_case("mixed", args, args.mixed_seq, head_dim, causal)
            for head_dim in args.mixed_head_dims for causal in args.mixed_causal]


def all_cases(args, device: str) -> list[Case]:
    """The cases of ``args.groups``, group by group in the order given."""
    builders = {"flash": flash_grid, "sparsity": lambda a: sparsity_grid(a, device), "mixed": mixed_grid}
    return [case for group in args.groups for case in builders[group](args)]
