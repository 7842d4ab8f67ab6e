"""sparse_attn: Triton kernels for adaptively sparse (alpha-entmax) attention.

Layout everywhere: ``(batch, heads, seq, head_dim)``.
"""

from sparse_attn._version import __version__
from sparse_attn.attention import AttentionStats, checks_enabled, entmax_attention, set_checks
from sparse_attn.constrained import FertilityAttention, FertilityPredictor, FertilityState, csoftmax, csparsemax
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
from sparse_attn.masks import BlockSparseMask
from sparse_attn.modules import EntmaxAlpha, EntmaxMultiheadAttention, swap_attention
from sparse_attn.sdpa import attach_entmax_sdpa, entmax_sdpa, swap_sdpa_attention
from sparse_attn.stats import HeadStatsRecorder, record_head_stats
from sparse_attn.structured import (
    Fusedmax,
    Oscarmax,
    fusedmax,
    gamma_sparsemax,
    oscar_prox,
    oscarmax,
    sq_pnorm_max,
    tv_prox,
)

__all__ = [
    "__version__",
    "entmax_attention",
    "BlockSparseMask",
    "AttentionStats",
    "set_checks",
    "checks_enabled",
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
    "EntmaxMultiheadAttention",
    "EntmaxAlpha",
    "swap_attention",
    "swap_sdpa_attention",
    "attach_entmax_sdpa",
    "entmax_sdpa",
    "record_head_stats",
    "HeadStatsRecorder",
    "fusedmax",
    "oscarmax",
    "sq_pnorm_max",
    "gamma_sparsemax",
    "tv_prox",
    "oscar_prox",
    "Fusedmax",
    "Oscarmax",
    "csoftmax",
    "csparsemax",
    "FertilityAttention",
    "FertilityPredictor",
    "FertilityState",
]

# attn_implementation="entmax" in Hugging Face transformers: registered now if transformers' modeling_utils is
# loaded, else right after it loads (an import hook; transformers is not imported here).
from sparse_attn.integrations import register_hf_when_imported as _register_hf_when_imported  # noqa: E402

_register_hf_when_imported()
