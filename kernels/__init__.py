"""Triton kernels of sparse_attn (installed as ``sparse_attn.kernels``).

Nothing here imports ``torch.nn`` or the reference implementation.
"""
