"""Train a small adaptively sparse Transformer on a synthetic sequence-to-sequence task.

A small reproduction of the analysis in Correia et al. (2019), "Adaptively Sparse Transformers"
(``correia2019-adaptively-sparse-transformers.txt``): an encoder-decoder Transformer whose
three attention blocks (encoder self-attention, decoder self-attention, context attention) are
:class:`sparse_attn.modules.EntmaxMultiheadAttention`, trained in three variants

* ``softmax``  -- alpha = 1 in every head (the baseline),
* ``entmax15`` -- fixed alpha = 1.5 in every head,
* ``adaptive`` -- one learnable alpha per head, ``alpha = 1 + sigmoid(a)`` with ``a ~ N(0, 1)``
  drawn at random as in the paper; the logits ``a`` train with a 10x learning rate
  (``--alpha-lr-mult``) so that a run of a few hundred steps shows the trajectories the paper
  saw over many thousand,

on a task that needs no download: reverse (default) or sort a random string of digits. Both
need sharp, position- or content-specific context attention, so sparse heads have something
to find.

Every variant writes ``<out>/<variant>/checkpoint.pt``; the run writes its reports to ``<out>``:
``metrics.json`` / ``metrics.csv`` (validation loss, token and sequence accuracy per variant),
``head_stats.csv`` (alpha, density per head), ``alpha_trajectories.csv`` and the figures
``fig2_alpha_trajectories.png`` ... ``fig6_head_diversity.png`` (the paper's Figs. 2-6),
``training_loss.png`` and ``summary.txt`` (also printed).
Layers and heads are counted from 0 everywhere (as in the module names ``decoder.1.cross_attn``
and in :meth:`sparse_attn.stats.HeadStatsRecorder.table`); ``metrics.json`` is strict JSON, with
null where a value is undefined (the JS diversity of length-1 sequences, which has no row with
two keys).

Usage::

    python examples/train_sparse_transformer.py --variant all --out runs/demo
    python examples/train_sparse_transformer.py --variant adaptive --steps 2000 --d-model 128

On a CUDA machine the attention runs the fused Triton kernels; on CPU the materialized
reference path.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sparse_attn.modules import EntmaxMultiheadAttention
from sparse_attn.stats import record_head_stats

VARIANTS = ("softmax", "entmax15", "adaptive")
TASKS = ("reverse", "sort")
BLOCKS = ("encoder self", "decoder self", "context")
FIGURES = (
    "fig2_alpha_trajectories.png",
    "fig3_alpha_distribution.png",
    "fig4_density_histograms.png",
    "fig5_head_density.png",
    "fig6_head_diversity.png",
    "training_loss.png",
)


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


def variant_attention_kwargs(variant: str, heads: int, generator: torch.Generator) -> dict:
    """Keyword arguments of :class:`EntmaxMultiheadAttention` for one variant.

    The adaptive variant draws its initial alphas at random, ``alpha = 1 + sigmoid(a)`` with
    ``a ~ N(0, 1)`` per head (Correia et al. 2019, Sec. 4), from ``generator``.
    """
    if variant == "softmax":
        return {"alpha": 1.0}
    if variant == "entmax15":
        return {"alpha": 1.5}
    if variant == "adaptive":
        init = 1.0 + torch.sigmoid(torch.randn(heads, generator=generator))
        return {"learnable_alpha": True, "alpha_min": 1.0, "alpha_max": 2.0, "alpha_init": init}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


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


class _Layer(nn.Module):
    """Pre-norm Transformer layer: self-attention, optional context attention, feed-forward."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, cross: bool, attn_kwargs_fn):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = EntmaxMultiheadAttention(d_model, heads, dropout=dropout, batch_first=True, **attn_kwargs_fn())
        self.cross_attn = None
        if cross:
            self.norm2 = nn.LayerNorm(d_model)
            self.cross_attn = EntmaxMultiheadAttention(d_model, heads, dropout=dropout, batch_first=True, **attn_kwargs_fn())
        self.norm3 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, memory=None, causal_mask=None, need_weights=False):
        """x ``(B, T, d_model)``, memory ``(B, S, d_model)`` or None, causal_mask bool ``(T, T)`` (True = masked).

        Returns ``(x, [weights of each attention])``; weights ``(B, heads, T, T_or_S)`` or None.
        """
        weights = []
        h = self.norm1(x)
        a, w = self.self_attn(h, h, h, attn_mask=causal_mask, is_causal=causal_mask is not None,
                              need_weights=need_weights, average_attn_weights=False)
        x = x + self.drop(a)
        weights.append(w)
        if self.cross_attn is not None:
            h = self.norm2(x)
            a, w = self.cross_attn(h, memory, memory, need_weights=need_weights, average_attn_weights=False)
            x = x + self.drop(a)
            weights.append(w)
        x = x + self.drop(self.ff(self.norm3(x)))
        return x, weights


class SparseSeq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer whose every attention is an :class:`EntmaxMultiheadAttention`.

    Args:
        cfg: :class:`Config` (vocab, length, d_model, heads, layers, d_ff, dropout, variant, seed).

    ``forward(src, tgt_in)`` takes int64 ``(B, S)`` source and ``(B, T)`` decoder-input tokens
    and returns logits ``(B, T, vocab)`` float32. With ``need_weights=True`` it also returns a
    dict ``{module name: attention weights (B, heads, T_or_S, S_or_T)}``.
    """

    def __init__(self, cfg: Config):
        super().__init__()
        gen = torch.Generator().manual_seed(cfg.seed + 7919)
        kw = lambda: variant_attention_kwargs(cfg.variant, cfg.heads, gen)  # noqa: E731
        self.src_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.vocab + 1, cfg.d_model)
        self.src_pos = nn.Parameter(torch.randn(cfg.length, cfg.d_model) * 0.1)
        self.tgt_pos = nn.Parameter(torch.randn(cfg.length, cfg.d_model) * 0.1)
        self.encoder = nn.ModuleList(_Layer(cfg.d_model, cfg.heads, cfg.d_ff, cfg.dropout, False, kw) for _ in range(cfg.layers))
        self.decoder = nn.ModuleList(_Layer(cfg.d_model, cfg.heads, cfg.d_ff, cfg.dropout, True, kw) for _ in range(cfg.layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model)
        self.dec_norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, src, tgt_in, need_weights: bool = False):
        x = self.src_embed(src) + self.src_pos[: src.shape[1]]
        names = []
        weights = []
        for i, layer in enumerate(self.encoder):
            x, w = layer(x, need_weights=need_weights)
            names.append(f"encoder.{i}.self_attn")
            weights += w
        memory = self.enc_norm(x)
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)
        y = self.tgt_embed(tgt_in) + self.tgt_pos[:t]
        for i, layer in enumerate(self.decoder):
            y, w = layer(y, memory, causal_mask=causal, need_weights=need_weights)
            names += [f"decoder.{i}.self_attn", f"decoder.{i}.cross_attn"]
            weights += w
        logits = self.head(self.dec_norm(y))
        if need_weights:
            return logits, dict(zip(names, weights))
        return logits

    def attention_modules(self):
        """``[(name, block, layer index, module)]`` for every attention, encoder first."""
        out = []
        for name, mod in self.named_modules():
            if isinstance(mod, EntmaxMultiheadAttention):
                out.append((name, block_of(name), int(name.split(".")[1]), mod))
        return out

    @torch.no_grad()
    def greedy_decode(self, src):
        """Greedy decoding of int64 ``src`` ``(B, S)``; returns int64 ``(B, S)`` predictions."""
        vocab = self.head.out_features
        tgt_in = torch.full((src.shape[0], 1), vocab, dtype=torch.long, device=src.device)
        for _ in range(src.shape[1]):
            nxt = self(src, tgt_in)[:, -1].argmax(-1, keepdim=True)
            tgt_in = torch.cat([tgt_in, nxt], dim=1)
        return tgt_in[:, 1:]


def block_of(name: str) -> str:
    """Attention block of a module name: ``encoder self``, ``decoder self`` or ``context``."""
    if "cross_attn" in name:
        return "context"
    return "encoder self" if name.startswith("encoder") else "decoder self"


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; other names are checked and passed through."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device must be 'auto', 'cpu' or an available CUDA device, got {device!r} but CUDA is not available")
    return torch.device(device)


def build_model(cfg: Config) -> SparseSeq2SeqTransformer:
    """A freshly initialised model for ``cfg`` (seeded by ``cfg.seed``) on ``cfg.device``."""
    torch.manual_seed(cfg.seed)
    return SparseSeq2SeqTransformer(cfg).to(cfg.device)


def load_checkpoint(path, device: str = "cpu"):
    """Load ``path`` written by :func:`train_variant`; returns ``(model in eval mode, Config, metrics)``."""
    ckpt = torch.load(path, map_location=device, weights_only=False)
    cfg = Config(**{**ckpt["config"], "device": device})
    model = SparseSeq2SeqTransformer(cfg).to(device)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model, cfg, ckpt.get("metrics", {})


def current_alphas(model: SparseSeq2SeqTransformer) -> np.ndarray:
    """float64 ``(n_attention_modules, heads)`` array of the current alpha of every head."""
    return np.stack([m.alpha.detach().float().cpu().numpy() for _, _, _, m in model.attention_modules()])


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


def validation_batches(cfg: Config, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The validation set of ``cfg`` (seed ``cfg.seed + 1_000_003``) as ``(src, tgt_in, tgt_out)`` batches of
    at most 256 examples, int64 ``(B, cfg.length)`` each, on ``device`` (default ``"cpu"``)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    return [tuple(t.to(device) for t in make_batch(cfg.task, min(256, cfg.val_size - i), cfg.length, cfg.vocab, gen))
            for i in range(0, cfg.val_size, 256)]


def train_variant(cfg: Config, out_dir: Path, progress: bool = True) -> RunResult:
    """Train one variant, evaluate it and save ``out_dir/<variant>/checkpoint.pt``."""
    device = torch.device(cfg.device)
    model = build_model(cfg)
    model.train()
    alpha_params = [p for name, p in model.named_parameters() if name.endswith("alpha_logit")]
    other = [p for name, p in model.named_parameters() if not name.endswith("alpha_logit")]
    groups = [{"params": other, "lr_mult": 1.0}] + ([{"params": alpha_params, "lr_mult": cfg.alpha_lr_mult}] if alpha_params else [])
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
        src, tgt_in, tgt_out = (t.to(device) for t in make_batch(cfg.task, cfg.batch_size, cfg.length, cfg.vocab, train_gen))
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
    res.metrics.update(train_loss_first=float(np.mean(res.losses[:10])), train_loss_last=float(np.mean(res.losses[-10:])),
                       steps=cfg.steps, train_seconds=res.seconds)
    ckpt_dir = out_dir / cfg.variant
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    res.checkpoint = str(ckpt_dir / "checkpoint.pt")
    torch.save({"config": asdict(cfg), "state_dict": model.state_dict(), "metrics": res.metrics}, res.checkpoint)
    return res


def by_block(names, values, axis: int = 0) -> dict:
    """Group per-module entries (along ``axis``) by attention block: ``{block: array}`` in layer order."""
    values = np.asarray(values, dtype=float)
    out = {}
    for block in BLOCKS:
        idx = [i for i, n in enumerate(names) if block_of(n) == block]
        if idx:
            out[block] = np.take(values, idx, axis=axis)
    return out


def _head_rows(res: RunResult):
    h = res.metrics["heads"]
    for block, dens in by_block(h["names"], h["density"]).items():
        alphas = by_block(h["names"], h["alpha"])[block]
        divs = by_block(h["names"], h["diversity"])[block]
        for layer in range(dens.shape[0]):
            for head in range(dens.shape[1]):
                yield {"variant": res.variant, "block": block, "layer": layer, "head": head,
                       "alpha": round(float(alphas[layer, head]), 6), "density": round(float(dens[layer, head]), 6),
                       "layer_js_diversity": round(float(divs[layer]), 6)}


def _write_csv(path: Path, rows: list[dict]):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _block_means(res: RunResult, key: str) -> dict:
    h = res.metrics["heads"]
    vals = by_block(h["names"], h[key])
    return {b: float(np.mean(v)) for b, v in vals.items()}


def summary_text(cfg: Config, results: list[RunResult], out_dir: Path) -> str:
    """The short text summary printed at the end of a run (also ``summary.txt``)."""
    backend = "fused Triton kernels" if cfg.device.startswith("cuda") else "reference path"
    lines = [
        f"sparse_attn demo: {cfg.task} {cfg.length} digits, encoder-decoder Transformer "
        f"{cfg.layers}+{cfg.layers} layers x {cfg.heads} heads, d_model {cfg.d_model}, "
        f"{cfg.steps} steps x batch {cfg.batch_size}, seed {cfg.seed}, {cfg.device} ({backend})",
        "",
        f"{'variant':<9} {'val loss':>8} {'tok acc':>8} {'seq acc':>8}   "
        f"{'density enc/dec/ctx':<20} {'mean alpha enc/dec/ctx':<23} {'JS enc/dec/ctx':<17} {'train s':>7}",
    ]
    for r in results:
        m = r.metrics
        dens, alph, js = (_block_means(r, k) for k in ("density", "alpha", "diversity"))
        fmt = lambda d: "/".join(f"{d[b]:.2f}" for b in BLOCKS)  # noqa: E731
        lines.append(f"{r.variant:<9} {m['val_loss']:>8.4f} {m['token_acc']:>8.3f} {m['seq_acc']:>8.3f}   "
                     f"{fmt(dens):<20} {fmt(alph):<23} {fmt(js):<17} {r.seconds:>7.1f}")
    for r in results:
        if r.variant != "adaptive":
            continue
        first, last = np.asarray(r.alpha_history[0]), np.asarray(r.alpha_history[-1])
        h = r.metrics["heads"]
        dens, alph = np.asarray(h["density"]), np.asarray(h["alpha"])
        lo, hi = np.unravel_index(dens.argmin(), dens.shape), np.unravel_index(dens.argmax(), dens.shape)
        desc = lambda ij: f"{h['names'][ij[0]]} head {ij[1]} (alpha {alph[ij]:.2f}, density {dens[ij]:.2f})"  # noqa: E731
        lines += [
            "",
            f"adaptive: alpha moved from init mean {first.mean():.2f} (range {first.min():.2f}-{first.max():.2f}) "
            f"to {last.mean():.2f} (range {last.min():.2f}-{last.max():.2f}); mean |change| {np.abs(last - first).mean():.2f}",
            f"          sparsest head {desc(lo)}",
            f"          densest head  {desc(hi)}",
        ]
    lines += ["", "density = mean fraction of attendable keys with nonzero weight (softmax: 1); "
              "JS = Jensen-Shannon head diversity (Correia et al. 2019, eq. 11)",
              f"reports and figures in {out_dir}/"]
    return "\n".join(lines)


def _nan_to_none(obj):
    """``obj`` (nested dicts, lists, tuples, scalars) with every non-finite float replaced by None (JSON null)."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_reports(cfg: Config, results: list[RunResult], out_dir: Path, figures: bool = True) -> str:
    """Write metrics.json/.csv, head_stats.csv, alpha_trajectories.csv, the figures and summary.txt.

    Returns the summary text.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = {r.variant: {k: v for k, v in r.metrics.items() if k != "heads"} | {"checkpoint": r.checkpoint}
               for r in results}
    with open(out_dir / "metrics.json", "w") as f:
        json.dump(_nan_to_none({"config": asdict(cfg) | {"variant": [r.variant for r in results]}, "variants": metrics,
                                "heads": {r.variant: r.metrics["heads"] for r in results}}), f, indent=1, allow_nan=False)
    _write_csv(out_dir / "metrics.csv", [{"variant": v} | {k: m[k] for k in
               ("val_loss", "token_acc", "seq_acc", "train_loss_first", "train_loss_last", "steps", "train_seconds")}
               for v, m in metrics.items()])
    _write_csv(out_dir / "head_stats.csv", [row for r in results for row in _head_rows(r)])
    traj = []
    for r in results:
        for step, alphas in zip(r.alpha_steps, r.alpha_history):
            for name, row in zip(r.module_names, alphas):
                for head, a in enumerate(row):
                    traj.append({"variant": r.variant, "step": step, "block": block_of(name),
                                 "layer": int(name.split(".")[1]), "head": head, "alpha": round(a, 6)})
    _write_csv(out_dir / "alpha_trajectories.csv", traj)
    if figures:
        plot_figures(results, out_dir)
    text = summary_text(cfg, results, out_dir)
    (out_dir / "summary.txt").write_text(text + "\n")
    return text


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_figures(results: list[RunResult], out_dir: Path) -> list[Path]:
    """Write the analogues of Correia et al. (2019) Figs. 2-6 and the loss curves; returns the paths.

    Skipped, with a message, when matplotlib (extra ``plot``) is not installed.
    """
    try:
        plt = _pyplot()
    except ImportError:
        print("matplotlib not installed (pip install 'sparse_attn[plot]'): figures skipped", file=sys.stderr)
        return []
    runs = {r.variant: r for r in results}
    colors = {"softmax": "#4c72b0", "entmax15": "#dd8452", "adaptive": "#55a868"}
    paths = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)

    adaptive = runs.get("adaptive")
    if adaptive is not None:
        hist = np.asarray(adaptive.alpha_history)
        steps = np.asarray(adaptive.alpha_steps)
        per_block = by_block(adaptive.module_names, np.moveaxis(hist, 0, 1))
        fig, axes = plt.subplots(1, len(per_block), figsize=(4.2 * len(per_block), 3.6), sharey=True, squeeze=False)
        for ax, (block, arr) in zip(axes[0], per_block.items()):
            cmap = plt.get_cmap("tab10")
            for layer in range(arr.shape[0]):
                for head in range(arr.shape[2]):
                    ax.plot(steps, arr[layer, :, head], color=cmap(head % 10), lw=1.4,
                            ls=("-", "--", ":", "-.")[layer % 4], label=f"L{layer} H{head}")
            ax.set_title(f"{block} attention")
            ax.set_xlabel("training step")
            ax.set_ylim(1.0, 2.0)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("alpha")
        axes[0][-1].legend(fontsize=7, ncol=2, loc="best")
        fig.suptitle("Fig. 2 analogue: alpha trajectories per head (adaptive)")
        save(fig, FIGURES[0])

        fig, axes = plt.subplots(1, len(per_block), figsize=(4.2 * len(per_block), 3.4), sharey=True, squeeze=False)
        bins = np.linspace(1.0, 2.0, 11)
        for ax, (block, arr) in zip(axes[0], per_block.items()):
            ax.hist(arr[:, 0].ravel(), bins=bins, histtype="step", lw=1.5, color="grey", label="initial (random)")
            ax.hist(arr[:, -1].ravel(), bins=bins, alpha=0.7, color=colors["adaptive"], label="learned")
            ax.set_title(f"{block} attention")
            ax.set_xlabel("alpha")
        axes[0][0].set_ylabel("number of heads")
        axes[0][0].legend(fontsize=8)
        fig.suptitle("Fig. 3 analogue: distribution of learned alpha per attention block")
        save(fig, FIGURES[1])

    sparse = [r for r in results if r.variant != "softmax"]
    if sparse:
        fig, axes = plt.subplots(1, len(BLOCKS), figsize=(12.6, 3.4), sharey=True)
        bins = np.linspace(0.0, 1.0, 21)
        for ax, block in zip(axes, BLOCKS):
            for r in sparse:
                h = r.metrics["heads"]
                vals = by_block(h["names"], h["sentence_density"], axis=1)[block]
                ax.hist(vals.ravel(), bins=bins, alpha=0.55, color=colors[r.variant], label=r.variant)
            ax.set_title(f"{block} attention")
            ax.set_xlabel("density (fraction of keys with nonzero weight)")
        axes[0].set_ylabel("heads x validation sentences")
        axes[0].legend(fontsize=8)
        fig.suptitle("Fig. 4 analogue: head density histograms per block (softmax: all at 1)")
        save(fig, FIGURES[2])

        fig, axes = plt.subplots(len(sparse), len(BLOCKS), figsize=(12.6, 3.0 * len(sparse)), sharey=True, squeeze=False)
        for row, r in zip(axes, sparse):
            h = r.metrics["heads"]
            for ax, block in zip(row, BLOCKS):
                dens = np.sort(by_block(h["names"], h["density"])[block], axis=1)
                layers = np.arange(dens.shape[0])
                for head in range(dens.shape[1]):
                    ax.plot(layers, dens[:, head], marker="o", color=colors[r.variant], alpha=0.35 + 0.65 * head / max(1, dens.shape[1] - 1))
                ax.set_title(f"{r.variant}: {block}", fontsize=10)
                ax.set_xticks(layers)
                ax.set_ylim(0, 1.05)
                ax.grid(alpha=0.3)
            row[0].set_ylabel("head density (sorted)")
        for ax in axes[-1]:
            ax.set_xlabel("layer")
        fig.suptitle("Fig. 5 analogue: density of each head per layer")
        save(fig, FIGURES[3])

    fig, axes = plt.subplots(1, len(BLOCKS), figsize=(12.6, 3.4), sharey=True)
    for ax, block in zip(axes, BLOCKS):
        for r in results:
            h = r.metrics["heads"]
            js = by_block(h["names"], h["diversity"])[block]
            ax.plot(np.arange(len(js)), js, marker="o", color=colors[r.variant], label=r.variant)
        ax.set_title(f"{block} attention")
        ax.set_xlabel("layer")
        ax.set_xticks(np.arange(len(js)))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Jensen-Shannon head diversity")
    axes[0].legend(fontsize=8)
    fig.suptitle("Fig. 6 analogue: head diversity per layer")
    save(fig, FIGURES[4])

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in results:
        loss = np.asarray(r.losses)
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(smooth)) + k, smooth, color=colors[r.variant], label=r.variant)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, FIGURES[5])
    return paths


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--variant", choices=VARIANTS + ("all",), default="all", help="attention variant to train")
    p.add_argument("--task", choices=TASKS, default=d.task, help="synthetic task")
    p.add_argument("--length", type=_positive_int, default=d.length, help="sequence length (digits)")
    p.add_argument("--vocab", type=_positive_int, default=d.vocab, help="number of distinct digits")
    p.add_argument("--d-model", type=_positive_int, default=d.d_model, help="model width")
    p.add_argument("--heads", type=_positive_int, default=d.heads, help="attention heads per block")
    p.add_argument("--layers", type=_positive_int, default=d.layers, help="encoder layers (= decoder layers)")
    p.add_argument("--d-ff", type=_positive_int, default=d.d_ff, help="feed-forward width")
    p.add_argument("--dropout", type=float, default=d.dropout, help="dropout (attention weights and residuals)")
    p.add_argument("--steps", type=_positive_int, default=d.steps, help="training steps per variant")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="training batch size")
    p.add_argument("--lr", type=float, default=d.lr, help="peak Adam learning rate")
    p.add_argument("--alpha-lr-mult", type=float, default=d.alpha_lr_mult, help="learning-rate multiplier of the alpha logits")
    p.add_argument("--warmup", type=_positive_int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--val-size", type=_positive_int, default=d.val_size, help="validation examples")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (data, weights, initial alphas)")
    p.add_argument("--log-every", type=_positive_int, default=d.log_every, help="record alphas every N steps")
    p.add_argument("--device", default="auto", help="'auto' (CUDA when available), 'cpu' or 'cuda[:i]'")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="CPU threads for torch (this model's matrices are too small to gain from more)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-figures", action="store_true", help="reports without figures")
    return p


def main(argv=None) -> list[RunResult]:
    """Command line entry point; returns the :class:`RunResult` of every variant trained."""
    args = build_parser().parse_args(argv)
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if not 0.0 <= args.dropout < 1.0:
        raise SystemExit(f"--dropout must be in [0, 1), got {args.dropout}")
    device = str(resolve_device(args.device))
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = []
        for variant in variants:
            cfg = Config(variant=variant, task=args.task, length=args.length, vocab=args.vocab, d_model=args.d_model,
                         heads=args.heads, layers=args.layers, d_ff=args.d_ff, dropout=args.dropout, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, alpha_lr_mult=args.alpha_lr_mult, warmup=args.warmup,
                         val_size=args.val_size, seed=args.seed, log_every=args.log_every, device=device)
            results.append(train_variant(cfg, args.out, progress=not args.no_progress))
        print(write_reports(cfg, results, args.out, figures=not args.no_figures))
    finally:
        torch.set_num_threads(previous_threads)
    return results


if __name__ == "__main__":
    main()
