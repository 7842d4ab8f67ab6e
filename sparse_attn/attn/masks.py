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

import contextlib
import weakref
from math import ceil
from numbers import Integral
from typing import NamedTuple

import torch
from torch import Tensor

from sparse_attn._validation import values_checkable

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
    """A block-sparse keep mask: key ``j`` is visible to row ``i`` only if its block ``(i // bq, j // bk)`` is kept
    and, in a partial block, the pair's bit is set.

    mask:       boolean ``(B or 1, H or 1, ceil(Nq / bq), ceil(Nk / bk))`` (``H`` the query heads): the kept blocks,
                every pair of which is visible; with packed sequences ``(nseq or 1, H or 1, ceil(max_seqlen_q / bq),
                ceil(max_seqlen_k / bk))`` in the coordinates of each sequence (row and key 0 = the sequence's first).
                With ``bits``: int32 block states of that shape, 0 hidden, 1 full (every pair visible), ``2 + i``
                partial block ``i`` (the pairs whose bit in ``bits[i]`` is set).
    block_size: ``(bq, bk)`` positive ints.
    bits:       None, or int32 ``(n_partial, bq, ceil(bk / 32))``: bit ``c % 32`` of ``bits[i, r, c // 32]`` keeps row
                ``r``, key ``c`` of partial block ``i`` (counted from the block's first row and key).
                :func:`block_mask_from_torch` builds it from a ``BlockMask``'s ``mask_mod``.

    Intersected with every other mask of the call (``attn_mask``, causal, window); rows left with no key give zeros.
    """

    mask: Tensor
    block_size: tuple[int, int]
    bits: Tensor | None = None


_FROM_TORCH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""torch ``BlockMask`` -> ``{(n_rows, n_heads): BlockSparseMask}``: each mask object's conversion, computed once."""

_EVAL_CHUNK = 1 << 22
"""Pairs of partial blocks whose ``mask_mod`` values are computed at once (bounds the evaluation's memory)."""


def block_mask_from_torch(block_mask, n_rows: int | None = None, n_heads: int | None = None) -> BlockSparseMask:
    """torch's ``flex_attention.BlockMask`` as a :class:`BlockSparseMask`, with FlexAttention's semantics: a pair is
    kept when its block is listed among the full blocks (``full_kv_num_blocks`` / ``full_kv_indices``), or among the
    partial ones (``kv_num_blocks`` / ``kv_indices``) and ``mask_mod(b, h, q_idx, kv_idx)`` is True.

    The ``mask_mod`` is evaluated once, on the host side, over the pairs of the partial blocks only (``torch.vmap``
    over index tensors, as ``create_block_mask`` evaluates it; ``b`` the batch entry or packed sequence, ``h`` the
    query head, ``q_idx`` / ``kv_idx`` sequence-local), and stored as bits (:class:`BlockSparseMask`'s ``bits``);
    a partial block whose pairs all turn out kept (or all hidden) becomes a full (hidden) block, and a mask with no
    partial block left is a boolean grid. Where the block grid broadcasts over batch entries or heads (``B`` or ``H``
    of 1) and the call has ``n_rows`` batch entries (sequences) / ``n_heads`` heads (default: the mask's own), the
    ``mask_mod`` is evaluated at each of them and the bits are kept per entry only when they differ. The result is
    cached with the mask object (per ``n_rows``, ``n_heads``): build a new ``BlockMask`` when what its ``mask_mod``
    reads changes. ``noop_mask`` keeps every listed block whole (no evaluation).

    Memory: the ``(B, H, q blocks, kv blocks)`` grid and one bit per pair of a partial block. Raises ``ValueError``
    naming the ``mask_mod`` when it cannot be evaluated that way (Python control flow on its arguments, ``.item()``,
    a result that is not a boolean tensor).
    """
    key = (n_rows, n_heads)
    cached = _FROM_TORCH.get(block_mask, {})
    if key not in cached:
        cached[key] = _from_torch(block_mask, n_rows or 1, n_heads or 1)
        _FROM_TORCH[block_mask] = cached
    return cached[key]


def _from_torch(block_mask, n_rows: int, n_heads: int) -> BlockSparseMask:
    from torch.nn.attention.flex_attention import noop_mask

    bq, bk = (block_mask.BLOCK_SIZE,) * 2 if isinstance(block_mask.BLOCK_SIZE, int) else block_mask.BLOCK_SIZE
    size = (int(bq), int(bk))
    n_q, n_k = block_mask.seq_lengths
    n_qb, n_kb = ceil(n_q / bq), ceil(n_k / bk)
    partial = _listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n_qb, n_kb)
    full = _listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_qb, n_kb)
    full = torch.zeros_like(partial) if full is None else full.expand_as(partial)
    if block_mask.mask_mod is None or block_mask.mask_mod is noop_mask:
        return BlockSparseMask(partial | full, size)
    return _partial_bits(block_mask.mask_mod, full, partial & ~full, size, (n_q, n_k), n_rows, n_heads)


def _listed_blocks(num, idx, n_qb: int, n_kb: int) -> Tensor | None:
    """The boolean ``(B, H, n_qb, n_kb)`` grid of the blocks a ``BlockMask``'s ``(num, indices)`` pair lists."""
    if num is None:
        return None
    num, idx = num[:, :, :n_qb].long(), idx[:, :, :n_qb].long()
    grid = torch.zeros((*num.shape[:2], n_qb, n_kb + 1), dtype=torch.int32, device=num.device)
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    # unlisted slots go to the spare column n_kb, dropped below
    grid.scatter_add_(3, torch.where(listed, idx.clamp(0, n_kb), n_kb), listed.to(torch.int32))
    return grid[..., :n_kb] > 0


def _partial_bits(mask_mod, full: Tensor, partial: Tensor, size: tuple, lengths: tuple, n_rows: int,
                  n_heads: int) -> BlockSparseMask:
    """The :class:`BlockSparseMask` of full blocks ``full`` and partial blocks ``partial`` (boolean grids) whose pairs
    ``mask_mod`` keeps (sequences of ``lengths = (n_q, n_k)``)."""
    (bq, bk), (n_q, n_k) = size, lengths
    where = partial.nonzero()  # (P, 4): batch, head, q block, kv block
    if where.shape[0] == 0:
        return BlockSparseMask(full, size)
    dev = partial.device
    rows = where[:, 2:3] * bq + torch.arange(bq, device=dev)  # (P, bq)
    cols = where[:, 3:4] * bk + torch.arange(bk, device=dev)  # (P, bk)
    valid = (rows < n_q)[:, :, None] & (cols < n_k)[:, None, :]  # pairs inside the sequences
    outer = (partial.shape[0] == 1 and n_rows > 1, partial.shape[1] == 1 and n_heads > 1)
    fn = _vmapped(mask_mod, *outer)
    b_arg = torch.arange(n_rows, device=dev) if outer[0] else where[:, 0]
    h_arg = torch.arange(n_heads, device=dev) if outer[1] else where[:, 1]
    per_chunk = max(1, _EVAL_CHUNK // (bq * bk * (n_rows if outer[0] else 1) * (n_heads if outer[1] else 1)))
    parts = []
    for lo in range(0, where.shape[0], per_chunk):
        sl = slice(lo, lo + per_chunk)
        parts.append(_evaluate(fn, mask_mod, b_arg if outer[0] else b_arg[sl], h_arg if outer[1] else h_arg[sl],
                               rows[sl].clamp(max=n_q - 1), cols[sl].clamp(max=n_k - 1), outer))
    # the bits are kept per batch entry / head only where the mask_mod's values differ between them
    per = [o and any(_varies(t, dim) for t in parts) for dim, o in enumerate(outer)]
    keep = torch.cat([t[:None if per[0] else 1, :None if per[1] else 1] for t in parts], dim=2) & valid
    kept_any = keep.flatten(-2).any(-1)  # (NB, NH, P)
    kept_all = (keep | ~valid).flatten(-2).all(-1)
    is_partial = kept_any & ~kept_all
    shape = (n_rows if per[0] else full.shape[0], n_heads if per[1] else full.shape[1], *full.shape[2:])
    n_b, n_h = keep.shape[:2]
    tb = torch.arange(n_b, device=dev)[:, None, None] if per[0] else where[:, 0]
    th = torch.arange(n_h, device=dev)[None, :, None] if per[1] else where[:, 1]
    rank = is_partial.flatten().cumsum(0).view(is_partial.shape) + 1
    state = torch.where(kept_all, 1, torch.where(is_partial, rank, 0)).to(torch.int32)
    grid = full.to(torch.int32).expand(shape).clone()
    grid.index_put_(tuple(i.expand(state.shape) for i in (tb, th, where[:, 2], where[:, 3])), state)
    if not bool(is_partial.any()):
        return BlockSparseMask(grid != 0, size)
    return BlockSparseMask(grid, size, _pack_bits(keep[is_partial]))


def _vmapped(mask_mod, outer_b: bool, outer_h: bool):
    """``mask_mod`` mapped over ``(P, bq)`` rows and ``(P, bk)`` keys of ``P`` blocks, with one batch index and one
    head index per block, or (``outer_b`` / ``outer_h``) every batch entry / head in front."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(None if outer_b else 0, None if outer_h else 0, 0, 0))
    if outer_h:
        fn = torch.vmap(fn, in_dims=(None, 0, None, None))
    if outer_b:
        fn = torch.vmap(fn, in_dims=(0, None, None, None))
    return fn


def _evaluate(fn, mask_mod, b: Tensor, h: Tensor, rows: Tensor, cols: Tensor, outer: tuple) -> Tensor:
    """``fn`` (:func:`_vmapped`) at these indices as a boolean ``(NB, NH, P, bq, bk)`` tensor (``NB``, ``NH`` 1 unless
    ``outer``); ``ValueError`` naming ``mask_mod`` when it cannot be evaluated so."""
    try:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    except ImportError:  # pragma: no cover - torch versions without it index tensors under vmap directly
        TransformGetItemToIndex = contextlib.nullcontext
    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    try:
        with TransformGetItemToIndex():
            out = fn(b, h, rows, cols)
    except Exception as exc:
        raise ValueError(
            f"block_mask: the BlockMask's mask_mod {name} cannot be evaluated vectorized over its partial blocks "
            f"(torch.vmap over index tensors, as create_block_mask evaluates it): {type(exc).__name__}: {exc}"
        ) from exc
    want = (*((b.shape[0],) if outer[0] else ()), *((h.shape[0],) if outer[1] else ()), *rows.shape, cols.shape[1])
    if not isinstance(out, Tensor) or out.dtype != torch.bool or tuple(out.shape) != want:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"block_mask: the BlockMask's mask_mod {name} must return a boolean tensor, one value per "
                         f"(b, h, q_idx, kv_idx), got {got}")
    if not outer[1]:
        out = out.unsqueeze(-4)
    return out if outer[0] else out.unsqueeze(0)


def _varies(values: Tensor, dim: int) -> bool:
    """Whether ``values`` differ along ``dim`` (an expanded, stride-0 dim never does)."""
    if values.shape[dim] == 1 or values.stride(dim) == 0:
        return False
    return not bool((values == values.narrow(dim, 0, 1)).all())


def _pack_bits(keep: Tensor) -> Tensor:
    """Boolean ``(n, bq, bk)`` element masks as int32 words ``(n, bq, ceil(bk / 32))``: bit ``c % 32`` of word
    ``c // 32`` holds key ``c``."""
    n, bq, bk = keep.shape
    n_words = ceil(bk / 32)
    weights = torch.ones(32, dtype=torch.int64, device=keep.device) << torch.arange(32, device=keep.device)
    words, step = [], max(1, _EVAL_CHUNK // (bq * n_words * 32))
    for lo in range(0, n, step):
        chunk = torch.nn.functional.pad(keep[lo:lo + step], (0, n_words * 32 - bk))
        w = (chunk.view(-1, bq, n_words, 32).to(torch.int64) * weights).sum(-1)
        words.append(torch.where(w >= 2**31, w - 2**32, w).to(torch.int32))
    return torch.cat(words)


def check_block_mask(name: str, block_mask, device, n_rows: int, n_heads: int, n_q: int, n_k: int,
                     rows_name: str = "batch") -> BlockSparseMask | None:
    """Validate a block mask (a :class:`BlockSparseMask`, a ``(mask, (bq, bk))`` pair or torch's ``BlockMask``)
    for ``n_rows`` batch entries (or packed sequences, ``rows_name``), ``n_heads`` query heads, ``n_q`` queries and
    ``n_k`` keys (the longest sequences with varlen). Returns it as a :class:`BlockSparseMask` (None for None; a torch
    ``BlockMask`` converted by :func:`block_mask_from_torch`, whose ``seq_lengths`` must then cover ``n_q``, ``n_k``
    unless its ``mask_mod`` is ``noop_mask``); raises ``TypeError`` / ``ValueError`` naming ``name``."""
    if block_mask is None:
        return None
    if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "kv_num_blocks"):
        from torch.nn.attention.flex_attention import noop_mask

        lengths = tuple(block_mask.seq_lengths)
        if block_mask.mask_mod not in (None, noop_mask) and (n_q > lengths[0] or n_k > lengths[1]):
            raise ValueError(f"{name}: the BlockMask was built for seq_lengths {lengths}, shorter than the call's "
                             f"(seq_q, seq_k) = ({n_q}, {n_k}): its mask_mod is evaluated at the call's positions; "
                             f"build it with Q_LEN >= {n_q} and KV_LEN >= {n_k}")
        block_mask = block_mask_from_torch(block_mask, n_rows, n_heads)
    if not (isinstance(block_mask, tuple) and len(block_mask) in (2, 3)):
        raise TypeError(f"{name} must be None, a sparse_attn.BlockSparseMask(mask, block_size) or a torch "
                        f"flex_attention.BlockMask, got {type(block_mask).__name__}")
    mask, size, bits = (*block_mask, None)[:3]
    if bits is None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool):
        got = f"a tensor of dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name}: the mask must be a boolean tensor (True = keep the block), got {got}")
    if isinstance(size, Integral) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, (tuple, list)) and len(size) == 2
            and all(isinstance(s, Integral) and not isinstance(s, bool) and 0 < s < 2**31 for s in size)):
        raise ValueError(f"{name}: block_size must be a positive int or a pair of positive ints (bq, bk), below "
                         f"2**31, got {size!r}")
    bq, bk = (int(s) for s in size)
    if bits is not None:
        _check_bits(name, mask, bits, bq, bk)
    if mask.device != torch.device(device):
        raise ValueError(f"{name} must be on the device of the queries ({device}), got {mask.device}")
    grid = (ceil(n_q / bq), ceil(n_k / bk))
    if (mask.dim() != 4 or mask.shape[0] not in (1, n_rows) or mask.shape[1] not in (1, n_heads)
            or tuple(mask.shape[2:]) != grid):
        raise ValueError(
            f"{name}: the mask must have shape ({rows_name} or 1, heads or 1, ceil(seq_q / bq), ceil(seq_k / bk)) = "
            f"({n_rows} or 1, {n_heads} or 1, {grid[0]}, {grid[1]}) for block_size ({bq}, {bk}), "
            f"got {tuple(mask.shape)}")
    if bits is not None and bits.shape[0] == 0:
        return BlockSparseMask(mask != 0, (bq, bk))
    return BlockSparseMask(mask, (bq, bk), bits)


def _check_bits(name: str, mask, bits, bq: int, bk: int) -> None:
    """The block states ``mask`` and element bits ``bits`` of a :class:`BlockSparseMask` with partial blocks: types,
    shapes, devices, and (when readable without a device sync) the states' range."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.int32:
        got = f"a tensor of dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name}: with bits, the mask must be an int32 tensor of block states (0 hidden, 1 full, "
                        f"2 + i partial block i), got {got}")
    want = f"(partial blocks, {bq}, {ceil(bk / 32)})"
    if not isinstance(bits, Tensor) or bits.dtype != torch.int32:
        got = f"a tensor of dtype {bits.dtype}" if isinstance(bits, Tensor) else type(bits).__name__
        raise TypeError(f"{name}: bits must be None or an int32 tensor {want}, got {got}")
    if bits.dim() != 3 or tuple(bits.shape[1:]) != (bq, ceil(bk / 32)):
        raise ValueError(f"{name}: bits must have shape {want} for block_size ({bq}, {bk}), got {tuple(bits.shape)}")
    if bits.device != mask.device:
        raise ValueError(f"{name}: bits must be on the mask's device ({mask.device}), got {bits.device}")
    if values_checkable(mask) and mask.numel() and not (0 <= int(mask.min()) and int(mask.max()) <= bits.shape[0] + 1):
        raise ValueError(f"{name}: block states must lie in [0, {bits.shape[0] + 1}] (0 hidden, 1 full, 2 + i "
                         f"partial block i of {bits.shape[0]}), got values in [{int(mask.min())}, {int(mask.max())}]")


def block_keep(block_mask: BlockSparseMask, n_q: int, n_k: int, seq: int | None = None) -> Tensor:
    """The boolean keep mask ``(B or 1, H or 1, n_q, n_k)`` a block mask stands for (O(n_q n_k): the reference's):
    pairs of full blocks, and of partial blocks where their bit is set.
    ``seq``: with packed sequences, the sequence whose entry is taken (then ``(1, H or 1, n_q, n_k)``)."""
    mask, (bq, bk), bits = (*block_mask, None)[:3]
    if seq is not None:
        mask = mask[seq if mask.shape[0] > 1 else 0][None]
    q_idx = torch.arange(n_q, device=mask.device)
    k_idx = torch.arange(n_k, device=mask.device)
    state = mask[:, :, (q_idx // bq)[:, None], (k_idx // bk)[None, :]]
    if bits is None:
        return state
    r, c = (q_idx % bq)[:, None], (k_idx % bk)[None, :]
    word = bits[(state.long() - 2).clamp(min=0), r, c // 32]
    return (state == 1) | ((state >= 2) & (((word >> (c % 32)) & 1) != 0))
