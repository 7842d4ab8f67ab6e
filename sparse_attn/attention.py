"""Public entmax attention: ``entmax_attention(q, k, v, alpha, ...)``.

Shaped like :func:`torch.nn.functional.scaled_dot_product_attention`, with the attention
weights given by alpha-entmax of the scores instead of softmax (``alpha = 1`` is softmax,
``alpha = 2`` sparsemax). CUDA tensors run the fused Triton kernels (``backend="triton"``),
other tensors the materialized reference (``backend="reference"``).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from sparse_attn.kernels._common import interpreting
from sparse_attn.reference import AttentionStats, entmax_attention_reference

__all__ = ["entmax_attention", "AttentionStats"]

_BACKENDS = ("auto", "triton", "reference")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = _KERNEL_DTYPES + (torch.float64,)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _check_qkv(q, k, v, enable_gqa: bool, varlen: bool):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, kv_heads, seq_k, head_dim), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    h_q, h_k = q.shape[1], k.shape[1]
    if h_k == 0 or h_q % h_k != 0:
        raise ValueError(f"the number of q heads ({h_q}) must be a multiple of the number of k/v heads ({h_k})")
    if h_q != h_k and not enable_gqa:
        raise ValueError(
            f"q has {h_q} heads and k/v have {h_k}: pass enable_gqa=True for grouped-query or multi-query attention"
        )
    if varlen and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the packed tensors must have batch size 1, got q of shape {tuple(q.shape)}")


def _check_alpha(alpha, n_heads: int, device):
    """Return alpha as given (float) or as a validated tensor of shape () or (n_heads,)."""
    if isinstance(alpha, torch.Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"alpha must be a float or a floating-point tensor, got a tensor of dtype {alpha.dtype}")
        if alpha.dim() > 1 or (alpha.dim() == 1 and alpha.shape[0] not in (1, n_heads)):
            raise ValueError(f"alpha must be a float or a tensor of shape () or ({n_heads},) (one per q head), got shape {tuple(alpha.shape)}")
        if alpha.device != device and alpha.device.type != "cpu":
            raise ValueError(f"alpha must be on the device of q ({device}), got {alpha.device}")
        if torch.compiler.is_compiling():
            return alpha
        vals = alpha.detach()
        if not bool(((vals >= 1) & (vals <= 2)).all()):  # one host sync; NaN fails both comparisons
            raise ValueError(f"alpha must be finite and in [1, 2], got {vals.flatten().tolist()}")
        return alpha
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"alpha must be a float or a tensor, got {type(alpha).__name__}")
    if torch.compiler.is_compiling():
        return alpha
    if not math.isfinite(alpha) or not 1.0 <= alpha <= 2.0:
        raise ValueError(f"alpha must be finite and in [1, 2], got {alpha}")
    return float(alpha)


def _check_mask(attn_mask, shape, device):
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be boolean (True = attend) or floating (additive), got {attn_mask.dtype}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask must be on the device of q ({device}), got {attn_mask.device}")
    if attn_mask.is_floating_point() and not torch.compiler.is_compiling():
        if bool((torch.isnan(attn_mask) | (attn_mask == float("inf"))).any()):
            raise ValueError("a float attn_mask must be finite or -inf (masked), got NaN or +inf entries")
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, shape) != torch.Size(shape):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask must be broadcastable to (batch, heads, seq_q, seq_k) = {tuple(shape)}, got {tuple(attn_mask.shape)}") from None


def _check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int, device):
    if cu_q is None:
        return
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            got = f"{cu.dtype} tensor of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise TypeError(f"{name} must be a 1-d int32 or int64 tensor, got {got}")
        if cu.device != device:
            raise ValueError(f"{name} must be on the device of q ({device}), got {cu.device}")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold at least two offsets (nseq + 1), got {cu.numel()}")
        if torch.compiler.is_compiling():
            continue
        vals = cu.tolist()
        if vals[0] != 0 or vals[-1] != total or any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"{name} must start at 0, be non-decreasing and end at the packed length {total}, got {vals}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got {cu_q.numel() - 1} and {cu_k.numel() - 1}")


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        fits = q.dtype in _KERNEL_DTYPES and MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM
        return "triton" if q.is_cuda and fits else "reference"
    if backend == "triton":
        if not q.is_cuda and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import, for testing), "
                f"got tensors on {q.device}; use backend='auto' or 'reference'"
            )
        if q.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"the triton backend takes float16, bfloat16 or float32 inputs, got {q.dtype}")
        if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"the triton backend takes head_dim in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {q.shape[-1]}")
    return backend


def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: float | torch.Tensor = 1.5,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_stats: bool = False,
    backend: str = "auto",
):
    """Attention whose weights are alpha-entmax of the scores, computed tile by tile.

    ``out_i = sum_j p_ij v_j`` with ``p_i = alpha-entmax(s_i)``, ``s_ij = scale * q_i . k_j + bias_ij``
    (masked pairs ``-inf``). ``alpha = 1`` is softmax, ``alpha = 2`` sparsemax; for alpha > 1 the
    weights are ``[(alpha - 1) s_ij - tau_i]_+^(1/(alpha-1))``, exactly zero below the threshold.

    Args:
        q: ``(B, Hq, Nq, D)`` queries; any strides (a ``(B, N, H, D)`` tensor ``.transpose(1, 2)``
            works without a copy). float16, bfloat16, float32 (float64 on the reference backend).
        k, v: ``(B, Hk, Nk, D)`` keys and values, same dtype and device as ``q``.
        alpha: float in [1, 2], or a tensor of shape ``(Hq,)`` (one alpha per q head, mixed freely;
            differentiable) or ``()``. Default 1.5.
        attn_mask: boolean (True = may attend) or additive float mask (e.g. ALiBi), broadcastable
            to ``(B, Hq, Nq, Nk)``; a float mask that requires grad gets a gradient.
        is_causal: causal masking, bottom-right aligned when ``Nq != Nk`` (as flash-attn): query
            ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``. May be combined with ``attn_mask``.
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: drop probability applied to the weights after the entmax; kept weights are
            scaled by ``1 / (1 - dropout_p)`` as in SDPA. The seed is drawn from torch's RNG.
        enable_gqa: allow ``Hk < Hq`` (grouped-query / multi-query attention, ``Hq % Hk == 0``).
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` cumulative lengths of packed
            variable-length sequences; then ``q`` is ``(1, Hq, total_q, D)``, ``k``/``v``
            ``(1, Hk, total_k, D)``, and sequence ``s`` attends only within itself.
        return_stats: also return :class:`AttentionStats` (per-row support size, threshold and
            number of valid keys, each ``(B, Hq, Nq)``) without materializing the weights.
        backend: ``"auto"`` (Triton for CUDA fp16/bf16/fp32 tensors with ``16 <= D <= 256``, the
            reference otherwise), ``"triton"`` or ``"reference"``.

    Returns:
        ``out`` of shape ``(B, Hq, Nq, D)`` in the input dtype, or ``(out, stats)``.
        Rows with no key to attend to give zeros (and zero gradients).
    """
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa), ("return_stats", return_stats)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    _check_qkv(q, k, v, enable_gqa, varlen=cu_seqlens_q is not None)
    alpha = _check_alpha(alpha, q.shape[1], q.device)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    _check_mask(attn_mask, shape, q.device)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], q.device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real)):
        raise TypeError(f"scale must be None or a Python number, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    backend = _resolve_backend(backend, q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "reference":
        return entmax_attention_reference(
            q, k, v, alpha, attn_mask=attn_mask, is_causal=is_causal, scale=float(scale),
            dropout_p=float(dropout_p), enable_gqa=enable_gqa, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, return_stats=return_stats,
        )
    from sparse_attn._attn_autograd import fused_entmax_attention

    return fused_entmax_attention(
        q, k, v, alpha, attn_mask=attn_mask, is_causal=is_causal, scale=float(scale),
        dropout_p=float(dropout_p), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        return_stats=return_stats,
    )
