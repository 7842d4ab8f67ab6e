"""Sharding a sequence over a context-parallel group: the positions a rank holds, its shard of a whole tensor, the
whole tensor back from the shards, and padding to a shardable length (public through
:mod:`sparse_attn.distributed`, whose docstring describes the layouts)."""

from __future__ import annotations

import torch
from torch import Tensor

from sparse_attn._validation import check_int, values_checkable
from sparse_attn.models._cp_layout import _all_gather_seq, _chunk_size, _GatherSequence, _Layout, _layout, _ranks_agree


def shard_positions(seq_len: int, world_size: int, rank: int, *, load_balance: bool = True) -> Tensor:
    """Global positions of the rows rank ``rank`` holds, int64 ``(seq_len / world_size,)``.

    Feed them to positional encodings (RoPE, learned positions) of the local shard. Needs no
    process group (a data loader can shard with ``x.index_select(dim, positions)``).

    Args:
        seq_len: the (padded) global sequence length, a multiple of ``2 * world_size``
            (``world_size`` without load balancing).
        world_size, rank: the context-parallel group's size and this process's rank in it.
        load_balance: the sharding layout (see the module docstring). Default True.
    """
    lay = _layout(None, load_balance, world_size, rank)
    check_int("seq_len", seq_len)
    if seq_len < 0 or seq_len % lay.n_chunks:
        raise ValueError(f"seq_len must be a multiple of {lay.n_chunks} (world_size={world_size}"
                         f"{' x 2 chunks, load_balance=True' if load_balance else ''}), got {seq_len}")
    c = seq_len // lay.n_chunks
    return torch.cat([torch.arange(g * c, (g + 1) * c) for g in lay.chunks(rank)])


def shard_sequence(x: Tensor, group=None, *, dim: int = 2, load_balance: bool = True) -> Tensor:
    """This rank's shard of a tensor every rank holds whole (e.g. a batch from the data loader).

    Args:
        x: any tensor; ``x.shape[dim]`` (the sequence) must be a multiple of ``2P`` (``P`` without
            load balancing), ``P`` the group size.
        group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        dim: the sequence dimension. Default 2 (``(B, H, N, D)``); 1 for ``(B, N, E)``.
        load_balance: chunks ``r`` and ``2P - 1 - r`` (True, default) or chunk ``r`` (False).

    Returns:
        A new tensor with ``x.shape[dim] / P`` rows along ``dim``, differentiable.
    """
    lay = _layout(group, load_balance)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _seq_dim(x, dim)
    n = x.shape[dim]
    if n % lay.n_chunks:
        raise ValueError(
            f"x.shape[{dim}] (the sequence, {n}) must be a multiple of {lay.n_chunks} to shard it over {lay.world} "
            f"ranks{' with load_balance=True' if load_balance else ''}; pad it with pad_for_context_parallel"
        )
    c = n // lay.n_chunks
    return torch.cat([x.narrow(dim, g * c, c) for g in lay.chunks(lay.rank)], dim=dim)


def unshard_sequence(x: Tensor, group=None, *, dim: int = 2, load_balance: bool = True) -> Tensor:
    """All-gather the shards of :func:`shard_sequence` back into the whole tensor, on every rank.

    Differentiable: the backward is the adjoint of the all-gather, the sum over ranks of the
    gradients w.r.t. the whole tensor, sliced to the local shard (if every rank computes the same
    loss on the whole tensor, the local gradient is ``P`` times that of one process).

    Args:
        x: this rank's shard; every rank's has the same shape and dtype.
        group, dim, load_balance: as :func:`shard_sequence`.
    """
    lay = _layout(group, load_balance)
    args = [("x", x, None), ("dim", dim, None), ("load_balance", load_balance, None)]
    with _ranks_agree(lay, "unshard_sequence", args):
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = _seq_dim(x, dim)
        _chunk_size(x.shape[dim], lay, f"x.shape[{dim}]")
    return _unshard(x, dim, lay)


def _unshard(x: Tensor, dim: int, lay: _Layout) -> Tensor:
    if x.dtype == torch.bool:
        return _all_gather_seq([x.to(torch.uint8)], dim, lay)[0].bool()
    return _GatherSequence.apply(lay, dim, x)[0]


def _seq_dim(x: Tensor, dim) -> int:
    check_int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d tensor, got {dim}")
    return dim % x.dim()


def pad_for_context_parallel(x: Tensor, world_size: int, *, dim: int = 2, lengths: Tensor | None = None,
                             load_balance: bool = True, value: float = 0.0) -> tuple[Tensor, Tensor]:
    """Pad the sequence dimension up to a multiple of ``2 * world_size`` and return which keys are real.

    Args:
        x: a batch, batch dimension 0, sequence dimension ``dim`` (e.g. ``(B, N, E)`` with ``dim=1``).
        world_size: the context-parallel group size ``P``.
        dim: the sequence dimension. Default 2.
        lengths: int ``(B,)`` valid length of each sequence (uneven lengths); default ``N`` for all.
        load_balance: pad to ``2P`` (True, default) or ``P`` chunks.
        value: the padding value. Default 0.

    Returns:
        ``(x_padded, keep)``: ``keep`` bool ``(B, N_padded)``, True for real positions, the
        ``key_padding_mask`` of :func:`context_parallel_attention` (before sharding it).
    """
    lay = _layout(None, load_balance, world_size, 0)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _seq_dim(x, dim)
    if dim == 0:
        raise ValueError("dim must not be 0: dimension 0 is the batch")
    n = x.shape[dim]
    if lengths is None:
        lengths = torch.full((x.shape[0],), n, dtype=torch.int64, device=x.device)
    elif not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or tuple(lengths.shape) != (x.shape[0],):
        got = f"{lengths.dtype} tensor of shape {tuple(lengths.shape)}" if isinstance(lengths, Tensor) else lengths
        raise ValueError(f"lengths must be an integer tensor of shape ({x.shape[0]},), got {got}")
    elif values_checkable(lengths) and bool(((lengths < 0) | (lengths > n)).any()):
        raise ValueError(f"lengths must lie in [0, {n}] (the unpadded length), got {lengths.tolist()}")
    n_pad = -n % lay.n_chunks
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, n_pad]
    x_padded = torch.nn.functional.pad(x, pad, value=value) if n_pad else x
    keep = torch.arange(n + n_pad, device=x.device)[None, :] < lengths.to(x.device)[:, None]
    return x_padded, keep
