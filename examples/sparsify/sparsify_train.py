"""Adapt an entmax student to its softmax teacher by distillation, with fixed or learnable alpha per head.

The student starts from the teacher's weights. Each step draws ``batch_size`` windows of real text,
runs the teacher (no gradient) and the student, and minimizes

    token_weight * |s - t|^2 / |t|^2  (last hidden states, summed over the batch)
    + embedding_weight * mean(1 - cos(pool(s), pool(t)))  (sentence embeddings)
    + sparsity_weight * mean over heads of (alpha_max - alpha) / (alpha_max - alpha_min)

over every weight except the input embeddings, which stay frozen. The last term only matters for a
learnable alpha: distillation to a softmax teacher alone pulls every alpha back to 1 (the teacher's
own attention), so some pressure towards sparsity is what lets each head find how sparse it can be
at a given cost; ``sparsity_weight`` sets the exchange rate. Dropout stays off (eval mode), so a
step is deterministic given the seed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from sparsify_model import model_alphas, pooled
from torch import Tensor, nn

import sparse_attn.integrations.hf as entmax_hf

ALPHA_MIN, ALPHA_MAX = 1.0, 2.0


@dataclass
class TrainConfig:
    """Settings of one adaptation run (see the module docstring for the loss)."""

    learnable: bool = True
    alpha: float = 1.05
    steps: int = 60
    batch_size: int = 8
    lr: float = 5e-5
    alpha_lr: float = 0.1
    token_weight: float = 1.0
    embedding_weight: float = 1.0
    sparsity_weight: float = 1.0
    log_every: int = 5
    seed: int = 0


@dataclass
class TrainResult:
    """What one adaptation run recorded: alpha ``(n_layers, n_heads)`` at each logged step, losses per step."""

    name: str
    config: TrainConfig
    alpha_steps: list[int] = field(default_factory=list)
    alpha_history: list[np.ndarray] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    distill_losses: list[float] = field(default_factory=list)
    sparsity_terms: list[float] = field(default_factory=list)
    seconds: float = 0.0


def attach_alphas(model: nn.Module, cfg: TrainConfig) -> None:
    """Give every attention module of ``model`` its per-head alpha, learnable or fixed at ``cfg.alpha``."""
    if cfg.learnable:
        if not ALPHA_MIN < cfg.alpha < ALPHA_MAX:
            raise ValueError(f"a learnable alpha must start strictly inside ({ALPHA_MIN}, {ALPHA_MAX}), "
                             f"got {cfg.alpha}")
        entmax_hf.attach_entmax_alpha(model, alpha=cfg.alpha, learnable=True, alpha_min=ALPHA_MIN, alpha_max=ALPHA_MAX)
    else:
        entmax_hf.attach_entmax_alpha(model, alpha=cfg.alpha, learnable=False)


def distillation_loss(student_hidden: Tensor, teacher_hidden: Tensor, cfg: TrainConfig) -> Tensor:
    """Token-state and sentence-embedding distillation loss (see the module docstring)."""
    tok = (student_hidden - teacher_hidden).square().sum() / teacher_hidden.square().sum()
    emb = (1 - (pooled(student_hidden) * pooled(teacher_hidden)).sum(-1)).mean()
    return cfg.token_weight * tok + cfg.embedding_weight * emb


def _sparsity_term(model: nn.Module) -> Tensor:
    alphas = [m.entmax_alpha() for _, m in entmax_hf.attention_modules(model)]
    return ((ALPHA_MAX - torch.cat(alphas)) / (ALPHA_MAX - ALPHA_MIN)).mean()


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print("tqdm not installed (pip install 'sparse_attn[plot]'): no progress bar", file=sys.stderr)
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


def distill(student: nn.Module, teacher: nn.Module, windows: Tensor, cfg: TrainConfig, name: str,
            device: torch.device, progress: bool = True) -> TrainResult:
    """Train ``student`` (alphas already attached) towards ``teacher`` on ``windows`` ``(n, seq_len)`` int64.

    Returns:
        :class:`TrainResult` with the alpha of every head every ``cfg.log_every`` steps (and at the end).
    """
    if windows.dim() != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty (n, seq_len) tensor of token ids, "
                         f"got shape {tuple(windows.shape)}")
    student.eval()
    teacher.eval()
    student.get_input_embeddings().weight.requires_grad_(False)
    alpha_params = [p for n, p in student.named_parameters() if n.endswith("entmax_alpha.alpha_logit")]
    alpha_ids = {id(p) for p in alpha_params}
    others = [p for p in student.parameters() if p.requires_grad and id(p) not in alpha_ids]
    groups = [{"params": others, "lr": cfg.lr}]
    if alpha_params:
        groups.append({"params": alpha_params, "lr": cfg.alpha_lr})
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    result = TrainResult(name=name, config=cfg)
    bar = _progress(cfg.steps, progress, name)
    start = time.perf_counter()

    def log(step: int) -> None:
        result.alpha_steps.append(step)
        result.alpha_history.append(model_alphas(student).numpy())

    log(0)
    for step in range(1, cfg.steps + 1):
        ids = windows[torch.randint(0, windows.shape[0], (cfg.batch_size,), generator=gen)].to(device)
        with torch.no_grad():
            target = teacher(input_ids=ids).last_hidden_state
        hidden = student(input_ids=ids).last_hidden_state
        distill_loss = distillation_loss(hidden, target, cfg)
        sparsity = _sparsity_term(student) if alpha_params else None
        loss = distill_loss + cfg.sparsity_weight * sparsity if sparsity is not None else distill_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(loss.item())
        result.distill_losses.append(distill_loss.item())
        if sparsity is not None:
            result.sparsity_terms.append(sparsity.item())
        if step % cfg.log_every == 0 or step == cfg.steps:
            log(step)
        if bar is not None:
            bar.set_postfix(loss=f"{result.losses[-1]:.4f}", alpha=f"{result.alpha_history[-1].mean():.3f}",
                            refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - start
    student.eval()
    return result
