"""Attention-mask conventions, in one place.

The attention functions take one mask per call, either

* a **keep mask**: boolean, ``True`` = the query may attend to the key, or
* a **bias**: floating, added to the scaled scores; ``-inf`` excludes a key (weight exactly 0),

broadcastable to the scores ``(B, H, Nq, Nk)`` and kept at its own shape (never expanded to
``(B, H, Nq, Nk)``). ``torch.nn.MultiheadAttention`` uses the opposite boolean convention
(``True`` = *not* allowed) and a separate ``key_padding_mask`` ``(N, S)``; the helpers below
convert between the two and combine masks. Causal masks are bottom-right aligned (as
flash-attn): query ``i`` of ``n_q`` sees key ``j`` of ``n_k`` iff ``j <= i + n_k - n_q``. Sliding windows
(:func:`window_keep`) and ALiBi biases (:func:`alibi_bias`) use the same bottom-right alignment.

Used by :func:`sparse_attn.entmax_attention` (fused path), the reference, the modules and the
Hugging Face integration.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "causal_keep",
    "window_keep",
    "alibi_bias",
    "keep_to_bias",
    "combine_masks",
    "from_mha_mask",
    "key_padding_to_mask",
    "check_mask",
]

_NEG_INF = float("-inf")


def causal_keep(n_q: int, n_k: int, device=None, bottom_right: bool = True) -> Tensor:
    """Boolean ``(n_q, n_k)`` causal keep mask: row i sees key j iff ``j <= i + n_k - n_q`` (bottom-right
    aligned, flash-attn's convention; the default) or iff ``j <= i`` (``bottom_right=False``: top-left
    aligned, ``nn.Transformer.generate_square_subsequent_mask``'s convention)."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + (n_k - n_q if bottom_right else 0)


def window_keep(n_q: int, n_k: int, window_size: tuple[int, int], device=None) -> Tensor:
    """Boolean ``(n_q, n_k)`` sliding-window keep mask, flash-attn's ``window_size=(left, right)``.

    Query ``i`` sees key ``j`` iff ``i + n_k - n_q - left <= j <= i + n_k - n_q + right`` (bottom-right
    aligned, inclusive); ``-1`` leaves that side unbounded. ``(-1, 0)`` is the causal mask.
    """
    left, right = window_size
    diag = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    cols = torch.arange(n_k, device=device)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep = keep & (cols >= diag - left)
    if right >= 0:
        keep = keep & (cols <= diag + right)
    return keep


def alibi_bias(slopes: Tensor, n_q: int, n_k: int) -> Tensor:
    """ALiBi additive bias ``-slope * |i + n_k - n_q - j|`` (flash-attn's ``alibi_slopes``, bottom-right aligned).

    Args:
        slopes: ``(H,)`` or ``(B, H)`` floating tensor, one slope per head (and batch entry).
        n_q, n_k: number of queries and keys.

    Returns:
        ``(1, H, n_q, n_k)`` or ``(B, H, n_q, n_k)`` in the dtype and on the device of ``slopes``.
    """
    diag = torch.arange(n_q, device=slopes.device)[:, None] + (n_k - n_q)
    dist = (torch.arange(n_k, device=slopes.device)[None, :] - diag).abs().to(slopes.dtype)
    per_head = slopes if slopes.dim() == 2 else slopes[None]
    return -per_head[:, :, None, None] * dist


def keep_to_bias(keep: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Boolean keep mask to an additive bias of the same shape: 0 where kept, ``-inf`` elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, _NEG_INF)


def combine_masks(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Intersect two masks (keep or bias convention); the result has their broadcast shape.

    Two keep masks give their logical and, two biases their sum, a bias and a keep mask the bias
    with ``-inf`` where the keep mask is False. None stands for "no mask".
    """
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        return torch.where(b, a, torch.full((), _NEG_INF, dtype=a.dtype, device=a.device))
    return a + b


def from_mha_mask(mask: Tensor, n_extra: int = 0) -> Tensor:
    """An ``nn.MultiheadAttention`` mask (bool True = *not* allowed, or float additive) in the
    keep/bias convention, with ``n_extra`` always-visible key columns appended on the right
    (``add_bias_kv`` / ``add_zero_attn``)."""
    if mask.dtype == torch.bool:
        keep = ~mask
        return torch.nn.functional.pad(keep, (0, n_extra), value=True) if n_extra else keep
    return torch.nn.functional.pad(mask, (0, n_extra), value=0.0) if n_extra else mask


def key_padding_to_mask(key_padding_mask: Tensor, n_extra: int = 0) -> Tensor:
    """An ``nn.MultiheadAttention`` ``key_padding_mask`` ``(N, S)`` as a keep/bias mask ``(N, 1, 1, S + n_extra)``."""
    return from_mha_mask(key_padding_mask, n_extra)[:, None, None, :]


def check_mask(name: str, mask, device, shape=None, keep_means: str = "True = attend") -> None:
    """Check the type, dtype, device and (when ``shape`` is given) broadcast shape of a mask.

    Args:
        name: the argument's name, used in the messages.
        mask: None or a tensor.
        device: the device it must be on (that of the queries).
        shape: the 4-d score shape it must broadcast to without growing it, or None.
        keep_means: what True means in this argument's convention (for the message).
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be boolean ({keep_means}) or floating (additive), got {mask.dtype}")
    if mask.device != torch.device(device):
        raise ValueError(f"{name} must be on the device of the queries ({device}), got {mask.device}")
    if shape is None:
        return
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} must be broadcastable to (batch, heads, seq_q, seq_k) = {tuple(shape)}, got {tuple(mask.shape)}"
        )


