"""sparse_attn: Triton kernels for adaptively sparse (alpha-entmax) attention.

Layout everywhere: ``(batch, heads, seq, head_dim)``.
"""

from sparse_attn._version import __version__
from sparse_attn.attn.attention import AttentionStats, checks_enabled, entmax_attention, set_checks
from sparse_attn.attn.masks import BlockSparseMask
from sparse_attn.models.modules import EntmaxAlpha, EntmaxMultiheadAttention, swap_attention
from sparse_attn.models.sdpa import attach_entmax_sdpa, entmax_sdpa, swap_sdpa_attention
from sparse_attn.models.stats import HeadStatsRecorder, record_head_stats
from sparse_attn.rows.constrained import FertilityAttention, FertilityPredictor, FertilityState, csoftmax, csparsemax
from sparse_attn.rows.losses import (
    Entmax15Loss,
    EntmaxBisectLoss,
    SparsemaxLoss,
    entmax15_loss,
    entmax_bisect_loss,
    sparsemax_loss,
)
from sparse_attn.rows.mappings import (
    Entmax,
    Entmax15,
    EntmaxBisect,
    Sparsemax,
    entmax,
    entmax15,
    entmax_bisect,
    sparsemax,
)
from sparse_attn.rows.structured import (
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

# The module paths of the flat layout keep importing the same module objects: the public short names
# (sparse_attn.mappings, sparse_attn.decode, ...) as they are, the private ones with a DeprecationWarning
# (sparse_attn/_old_paths.py).
from sparse_attn._old_paths import install as _install_old_paths  # noqa: E402

_install_old_paths()
