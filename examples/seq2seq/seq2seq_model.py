"""The model of the sparse Transformer example: an encoder-decoder Transformer whose every attention is
an :class:`sparse_attn.modules.EntmaxMultiheadAttention` (softmax, fixed 1.5-entmax or learnable
per-head alpha), and the helpers that build, load and inspect it."""

from __future__ import annotations

import numpy as np
import torch
from seq2seq_task import VARIANTS, Config
from torch import nn

from sparse_attn.modules import EntmaxMultiheadAttention

BLOCKS = ("encoder self", "decoder self", "context")


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
        return {"learnable": True, "alpha_min": 1.0, "alpha_max": 2.0, "alpha_init": init}
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


class _Layer(nn.Module):
    """Pre-norm Transformer layer: self-attention, optional context attention, feed-forward."""

    def __init__(self, d_model: int, heads: int, d_ff: int, dropout: float, cross: bool, attn_kwargs_fn):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = EntmaxMultiheadAttention(d_model, heads, dropout=dropout, batch_first=True,
                                                  **attn_kwargs_fn())
        self.cross_attn = None
        if cross:
            self.norm2 = nn.LayerNorm(d_model)
            self.cross_attn = EntmaxMultiheadAttention(d_model, heads, dropout=dropout, batch_first=True,
                                                       **attn_kwargs_fn())
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

        def kw():
            return variant_attention_kwargs(cfg.variant, cfg.heads, gen)

        self.src_embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.vocab + 1, cfg.d_model)
        self.src_pos = nn.Parameter(torch.randn(cfg.length, cfg.d_model) * 0.1)
        self.tgt_pos = nn.Parameter(torch.randn(cfg.length, cfg.d_model) * 0.1)
        self.encoder = nn.ModuleList(_Layer(cfg.d_model, cfg.heads, cfg.d_ff, cfg.dropout, False, kw)
                                     for _ in range(cfg.layers))
        self.decoder = nn.ModuleList(_Layer(cfg.d_model, cfg.heads, cfg.d_ff, cfg.dropout, True, kw)
                                     for _ in range(cfg.layers))
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


def by_block(names, values, axis: int = 0) -> dict:
    """Group per-module entries (along ``axis``) by attention block: ``{block: array}`` in layer order."""
    values = np.asarray(values, dtype=float)
    out = {}
    for block in BLOCKS:
        idx = [i for i, n in enumerate(names) if block_of(n) == block]
        if idx:
            out[block] = np.take(values, idx, axis=axis)
    return out


