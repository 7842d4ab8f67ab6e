"""sparse_attn: Triton kernels for adaptively sparse (alpha-entmax) attention.

Layout everywhere: ``(batch, heads, seq, head_dim)``.
"""

from sparse_attn._version import __version__
from sparse_attn.attention import AttentionStats, entmax_attention
from sparse_attn.losses import (
    Entmax15Loss,
    EntmaxBisectLoss,
    SparsemaxLoss,
    entmax15_loss,
    entmax_bisect_loss,
    sparsemax_loss,
)
from sparse_attn.mappings import (
    Entmax,
    Entmax15,
    EntmaxBisect,
    Sparsemax,
    entmax,
    entmax15,
    entmax_bisect,
    sparsemax,
)

__all__ = [
    "__version__",
    "entmax_attention",
    "AttentionStats",
    "entmax",
    "sparsemax",
    "entmax15",
    "entmax_bisect",
    "Entmax",
    "Sparsemax",
    "Entmax15",
    "EntmaxBisect",
    "sparsemax_loss",
    "entmax15_loss",
    "entmax_bisect_loss",
    "SparsemaxLoss",
    "Entmax15Loss",
    "EntmaxBisectLoss",
]
