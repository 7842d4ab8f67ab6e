"""sparse_attn: Triton kernels for adaptively sparse (alpha-entmax) attention."""

from sparse_attn._version import __version__

__all__ = ["__version__"]
