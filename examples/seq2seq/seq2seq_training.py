"""Training and evaluation of one variant of the sparse Transformer example."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from seq2seq_model import build_model, current_alphas
from seq2seq_task import Config, make_batch, validation_batches
from torch.nn import functional as F

from sparse_attn.stats import record_head_stats


@torch.no_grad()
def evaluate(model, cfg: Config, batches, head_stats: bool = False, hist_sentences: int = 128) -> dict:
    """Teacher-forced validation loss, token accuracy and sequence accuracy over ``batches``.

    With ``head_stats`` the pass runs under :func:`sparse_attn.stats.record_head_stats` (with
    JS diversity) and the result gets ``"heads"``: the recorder's layer names, density and alpha
    ``(n_layers, heads)``, diversity per layer, and ``"sentence_density"``
    ``(hist_sentences, n_layers, heads)``, the density of every head on each of the first
    ``hist_sentences`` validation sentences (for the density histograms).
    """
    model.eval()
    tot_loss = tot_tok = tot_seq = n = 0.0
    recorder = record_head_stats(model, diversity=True) if head_stats else None
    with recorder if recorder is not None else contextlib.nullcontext():
        for src, tgt_in, tgt_out in batches:
            logits = model(src, tgt_in)
            tot_loss += F.cross_entropy(logits.transpose(1, 2), tgt_out, reduction="sum").item()
            correct = logits.argmax(-1) == tgt_out
            tot_tok += correct.sum().item()
            tot_seq += correct.all(1).sum().item()
            n += src.shape[0]
    out = {
        "val_loss": tot_loss / (n * cfg.length),
        "token_acc": tot_tok / (n * cfg.length),
        "seq_acc": tot_seq / n,
    }
    if head_stats:
        names = list(recorder.layer_names)
        div = recorder.diversity()
        per_sentence = []
        src, tgt_in, _ = batches[0]
        with record_head_stats(model) as rec:
            for i in range(min(hist_sentences, src.shape[0])):
                rec.reset()
                model(src[i : i + 1], tgt_in[i : i + 1])
                per_sentence.append(rec.density().numpy())
        out["heads"] = {
            "names": names,
            "density": recorder.density().tolist(),
            "alpha": recorder.alphas().tolist(),
            "diversity": [div[name] for name in names],
            "sentence_density": np.stack(per_sentence).round(5).tolist(),
        }
    model.train()
    return out


def _lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up then cosine decay to 10% of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class RunResult:
    """What one variant's training produced (see :func:`train_variant`)."""

    variant: str
    metrics: dict
    losses: list = field(default_factory=list)
    alpha_steps: list = field(default_factory=list)
    alpha_history: list = field(default_factory=list)
    module_names: list = field(default_factory=list)
    seconds: float = 0.0
    checkpoint: str = ""


def train_variant(cfg: Config, out_dir: Path, progress: bool = True) -> RunResult:
    """Train one variant, evaluate it and save ``out_dir/<variant>/checkpoint.pt``."""
    device = torch.device(cfg.device)
    model = build_model(cfg)
    model.train()
    alpha_params = [p for name, p in model.named_parameters() if name.endswith("alpha_logit")]
    other = [p for name, p in model.named_parameters() if not name.endswith("alpha_logit")]
    groups = [{"params": other, "lr_mult": 1.0}]
    if alpha_params:
        groups.append({"params": alpha_params, "lr_mult": cfg.alpha_lr_mult})
    opt = torch.optim.Adam(groups, lr=cfg.lr, betas=(0.9, 0.98))
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val = validation_batches(cfg, device)
    names = [name for name, _, _, _ in model.attention_modules()]
    res = RunResult(variant=cfg.variant, metrics={}, module_names=names)
    res.alpha_steps.append(0)
    res.alpha_history.append(current_alphas(model).tolist())
    steps = range(cfg.steps)
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            print("tqdm not installed (pip install tqdm): no progress bar", file=sys.stderr)
        else:
            bar = tqdm(steps, desc=f"{cfg.variant:>8}", unit="step", dynamic_ncols=True, file=sys.stderr)
            steps = bar
    running = None
    start = time.perf_counter()
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg) * group["lr_mult"]
        batch = make_batch(cfg.task, cfg.batch_size, cfg.length, cfg.vocab, train_gen)
        src, tgt_in, tgt_out = (t.to(device) for t in batch)
        loss = F.cross_entropy(model(src, tgt_in).transpose(1, 2), tgt_out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        res.losses.append(value)
        running = value if running is None else 0.95 * running + 0.05 * value
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            res.alpha_steps.append(step + 1)
            res.alpha_history.append(current_alphas(model).tolist())
            if bar is not None:
                bar.set_postfix(loss=f"{running:.3f}")
    res.seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    res.metrics = evaluate(model, cfg, val, head_stats=True)
    res.metrics.update(train_loss_first=float(np.mean(res.losses[:10])),
                       train_loss_last=float(np.mean(res.losses[-10:])), steps=cfg.steps, train_seconds=res.seconds)
    ckpt_dir = out_dir / cfg.variant
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    res.checkpoint = str(ckpt_dir / "checkpoint.pt")
    torch.save({"config": asdict(cfg), "state_dict": model.state_dict(), "metrics": res.metrics}, res.checkpoint)
    return res


