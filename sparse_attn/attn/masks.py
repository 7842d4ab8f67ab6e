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

Block-sparse masks (:class:`BlockSparseMask`, or torch's ``flex_attention.BlockMask`` converted by
:func:`block_mask_from_torch`) keep or drop whole ``(bq, bk)`` blocks of the scores; :func:`check_block_mask`
validates one and :func:`block_keep` expands it to the keep mask it stands for (the reference's oracle).

Used by :func:`sparse_attn.entmax_attention` (fused path), the reference, the modules and the
Hugging Face integration.
"""

from __future__ import annotations

from math import ceil
from numbers import Integral
from typing import NamedTuple

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
    "BlockSparseMask",
    "block_mask_from_torch",
    "check_block_mask",
    "block_keep",
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




class BlockSparseMask(NamedTuple):
    """A block-sparse keep mask: key ``j`` is visible to row ``i`` only if ``mask[..., i // bq, j // bk]`` is True.

    mask:       boolean ``(B or 1, H or 1, ceil(Nq / bq), ceil(Nk / bk))`` (``H`` the query heads); with packed
                sequences ``(nseq or 1, H or 1, ceil(max_seqlen_q / bq), ceil(max_seqlen_k / bk))`` in the coordinates
                of each sequence (row and key 0 = the sequence's first).
    block_size: ``(bq, bk)`` positive ints.

    Intersected with every other mask of the call (``attn_mask``, causal, window); rows left with no key give zeros.
    """

    mask: Tensor
    block_size: tuple[int, int]


def block_mask_from_torch(block_mask) -> BlockSparseMask:
    """torch's ``flex_attention.BlockMask`` as a :class:`BlockSparseMask`: a block is kept when it is listed among
    the partial (``kv_num_blocks`` / ``kv_indices``) or the full (``full_kv_num_blocks`` / ``full_kv_indices``) ones.

    Memory: the ``(B, H, q blocks, kv blocks)`` grid only. Raises ``ValueError`` for a mask built with a
    ``mask_mod`` other than ``noop_mask``: its partial blocks hold an element mask that only the ``mask_mod``
    knows and the kernels cannot evaluate.
    """
    from torch.nn.attention.flex_attention import noop_mask

    if block_mask.mask_mod is not noop_mask:
        name = getattr(block_mask.mask_mod, "__name__", type(block_mask.mask_mod).__name__)
        raise ValueError(
            f"block_mask: a torch BlockMask must be built with mask_mod=noop_mask (its partial blocks would need the "
            f"mask_mod evaluated per element, which the kernels cannot run), got mask_mod {name}; give the element "
            f"mask as attn_mask / is_causal / window_size and build the BlockMask with noop_mask "
            f"(create_block_mask(noop_mask, ...) or BlockMask.from_kv_blocks(..., mask_mod=None))")
    bq, bk = (block_mask.BLOCK_SIZE,) * 2 if isinstance(block_mask.BLOCK_SIZE, int) else block_mask.BLOCK_SIZE
    n_q, n_k = block_mask.seq_lengths
    n_qb, n_kb = ceil(n_q / bq), ceil(n_k / bk)
    lead = block_mask.kv_num_blocks.shape[:2]
    grid = torch.zeros((*lead, n_qb, n_kb + 1), dtype=torch.int32, device=block_mask.kv_num_blocks.device)
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            continue
        num, idx = num[:, :, :n_qb].long(), idx[:, :, :n_qb].long()
        listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        # unlisted slots go to the spare column n_kb, dropped below
        grid.scatter_add_(3, torch.where(listed, idx.clamp(0, n_kb), n_kb), listed.to(torch.int32))
    return BlockSparseMask(grid[..., :n_kb] > 0, (int(bq), int(bk)))


def check_block_mask(name: str, block_mask, device, n_rows: int, n_heads: int, n_q: int, n_k: int,
                     rows_name: str = "batch") -> BlockSparseMask | None:
    """Validate a block mask (a :class:`BlockSparseMask`, a ``(mask, (bq, bk))`` pair or torch's ``BlockMask``)
    for ``n_rows`` batch entries (or packed sequences, ``rows_name``), ``n_heads`` query heads, ``n_q`` queries and
    ``n_k`` keys (the longest sequences with varlen). Returns it as a :class:`BlockSparseMask` (None for None);
    raises ``TypeError`` / ``ValueError`` naming ``name``."""
    if block_mask is None:
        return None
    if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "kv_num_blocks"):
        block_mask = block_mask_from_torch(block_mask)
    if not (isinstance(block_mask, tuple) and len(block_mask) == 2):
        raise TypeError(f"{name} must be None, a sparse_attn.BlockSparseMask(mask, block_size) or a torch "
                        f"flex_attention.BlockMask, got {type(block_mask).__name__}")
    mask, size = block_mask
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"a tensor of dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name}: the mask must be a boolean tensor (True = keep the block), got {got}")
    if isinstance(size, Integral) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, Integral) and not isinstance(s, bool) and s > 0 for s in size)):
        raise ValueError(f"{name}: block_size must be a positive int or a pair of positive ints (bq, bk), "
                         f"got {size!r}")
    bq, bk = (int(s) for s in size)
    if mask.device != torch.device(device):
        raise ValueError(f"{name} must be on the device of the queries ({device}), got {mask.device}")
    grid = (ceil(n_q / bq), ceil(n_k / bk))
    if (mask.dim() != 4 or mask.shape[0] not in (1, n_rows) or mask.shape[1] not in (1, n_heads)
            or tuple(mask.shape[2:]) != grid):
        raise ValueError(
            f"{name}: the mask must have shape ({rows_name} or 1, heads or 1, ceil(seq_q / bq), ceil(seq_k / bk)) = "
            f"({n_rows} or 1, {n_heads} or 1, {grid[0]}, {grid[1]}) for block_size ({bq}, {bk}), "
            f"got {tuple(mask.shape)}")
    return BlockSparseMask(mask, (bq, bk))


def block_keep(block_mask: BlockSparseMask, n_q: int, n_k: int, seq: int | None = None) -> Tensor:
    """The boolean keep mask ``(B or 1, H or 1, n_q, n_k)`` a block mask stands for (O(n_q n_k): the reference's).
    ``seq``: with packed sequences, the sequence whose entry is taken (then ``(1, H or 1, n_q, n_k)``)."""
    mask, (bq, bk) = block_mask
    if seq is not None:
        mask = mask[seq if mask.shape[0] > 1 else 0][None]
    rows = torch.arange(n_q, device=mask.device) // bq
    cols = torch.arange(n_k, device=mask.device) // bk
    return mask[:, :, rows[:, None], cols[None, :]]
