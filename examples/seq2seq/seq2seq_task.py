"""The synthetic task of the sparse Transformer example: reverse or sort a random string of digits,
and the configuration a model and its task are rebuilt from (saved in every checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

VARIANTS = ("softmax", "entmax15", "adaptive")
TASKS = ("reverse", "sort")


@dataclass
class Config:
    """Everything needed to rebuild a model and its task (saved in the checkpoint)."""

    variant: str = "adaptive"
    task: str = "reverse"
    length: int = 10
    vocab: int = 10
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 128
    dropout: float = 0.0
    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    alpha_lr_mult: float = 10.0
    warmup: int = 50
    val_size: int = 512
    seed: int = 0
    log_every: int = 10
    device: str = "cpu"


def make_batch(task: str, n: int, length: int, vocab: int, generator: torch.Generator):
    """Draw ``n`` examples of ``task``.

    Returns ``(src, tgt_in, tgt_out)``, int64 tensors of shape ``(n, length)``: the input digits,
    the decoder input (BOS token ``vocab`` then the target shifted right) and the target.
    """
    src = torch.randint(0, vocab, (n, length), generator=generator)
    if task == "reverse":
        tgt = src.flip(1)
    elif task == "sort":
        tgt = src.sort(dim=1).values
    else:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    bos = torch.full((n, 1), vocab, dtype=torch.long)
    return src, torch.cat([bos, tgt[:, :-1]], dim=1), tgt


def validation_batches(cfg: Config, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The validation set of ``cfg`` (seed ``cfg.seed + 1_000_003``) as ``(src, tgt_in, tgt_out)`` batches of
    at most 256 examples, int64 ``(B, cfg.length)`` each, on ``device`` (default ``"cpu"``)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    return [tuple(t.to(device) for t in make_batch(cfg.task, min(256, cfg.val_size - i), cfg.length, cfg.vocab, gen))
            for i in range(0, cfg.val_size, 256)]

