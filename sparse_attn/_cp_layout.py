"""Layout and collectives of the context-parallel schemes (:mod:`sparse_attn.distributed`).

:class:`_Layout` says which global chunks a rank holds (load-balanced causal sharding or one chunk per
rank); the helpers move sequence shards to global order and back with one all-gather / reduce-scatter
(:class:`_GatherSequence`, all-gather-K/V) or turn sequence shards into head shards with one all-to-all
(:class:`_AllToAll`, Ulysses). Each autograd Function's backward is the adjoint collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from sparse_attn._validation import check_bool, check_int

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class _Layout:
    """Which sequence chunks each rank of ``group`` holds (see the module docstring)."""

    group: object
    world: int
    rank: int
    load_balance: bool

    @property
    def per_rank(self) -> int:
        return 2 if self.load_balance else 1

    @property
    def n_chunks(self) -> int:
        return self.world * self.per_rank

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk indices held by ``rank``, in local order."""
        return (rank, 2 * self.world - 1 - rank) if self.load_balance else (rank,)

    def pieces(self) -> list[tuple[int, int]]:
        """``(rank, local slot)`` of every global chunk, in global order."""
        owner = {g: (r, s) for r in range(self.world) for s, g in enumerate(self.chunks(r))}
        return [owner[g] for g in range(self.n_chunks)]


def _layout(group, load_balance: bool, world_size: int | None = None, rank: int | None = None) -> _Layout:
    check_bool("load_balance", load_balance)
    if world_size is not None:
        for name, val in (("world_size", world_size), ("rank", rank)):
            check_int(name, val)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, "
                             f"world_size={world_size}")
        return _Layout(None, world_size, rank, load_balance)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first "
                           "(shard_positions and pad_for_context_parallel need no process group)")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group must be a process group or a 1-d DeviceMesh (e.g. mesh['cp']), "
                             f"got a {group.ndim}-d DeviceMesh")
        group = group.get_group()
    elif group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (the default group), a ProcessGroup or a 1-d DeviceMesh, "
                        f"got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group does not contain this process")
    return _Layout(group, dist.get_world_size(group), rank, load_balance)


def _chunk_size(n_local: int, lay: _Layout, what: str) -> int:
    if n_local % lay.per_rank:
        raise ValueError(
            f"{what} must be a multiple of {lay.per_rank} with load_balance=True (each rank holds two "
            f"chunks of the sequence), got {n_local}; pad the sequence with pad_for_context_parallel"
        )
    return n_local // lay.per_rank


def _to_global(stacked: Tensor, dim: int, lay: _Layout) -> Tensor:
    """``(P, *local)`` rank shards stacked -> the tensor in global order along ``dim`` (one copy)."""
    c = stacked.shape[dim + 1] // lay.per_rank
    return torch.cat([stacked[r].narrow(dim, s * c, c) for r, s in lay.pieces()], dim=dim)


def _fill_rank_major(dst: Tensor, x: Tensor, dim: int, lay: _Layout) -> None:
    """Write ``x`` (global order along ``dim``) into ``dst`` ``(P, *local)``: ``dst[r]`` is rank r's shard."""
    c = dst.shape[dim + 1] // lay.per_rank
    for r in range(lay.world):
        for s, g in enumerate(lay.chunks(r)):
            dst[r].narrow(dim, s * c, c).copy_(x.narrow(dim, g * c, c))


def _offsets(shapes) -> list[tuple[int, int]]:
    out, off = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append((off, n))
        off += n
    return out


def _packed_views(buf: Tensor, shapes) -> list[Tensor]:
    """Views ``(P, *shape)`` of the column blocks of a ``(P, total)`` buffer, one per shape."""
    return [buf[:, off:off + n].view(buf.shape[0], *shape) for (off, n), shape in zip(_offsets(shapes), shapes)]


def _all_gather_seq(tensors, dim: int, lay: _Layout) -> list[Tensor]:
    """All-gather sequence shards (one collective; tensors share a dtype) into global order."""
    shapes = [t.shape for t in tensors]
    send = torch.cat([t.reshape(-1) for t in tensors])
    recv = send.new_empty(lay.world * send.numel())
    _all_gather(recv, send, group=lay.group)
    recv = recv.view(lay.world, -1)
    return [_to_global(piece, dim, lay) for piece in _packed_views(recv, shapes)]


def _reduce_scatter_seq(grads, local_shapes, dim: int, lay: _Layout) -> list[Tensor]:
    """Adjoint of :func:`_all_gather_seq`: sum the full-sequence tensors over ranks, keep the local shard."""
    send = grads[0].new_empty(lay.world, sum(n for _, n in _offsets(local_shapes)))
    for piece, g in zip(_packed_views(send, local_shapes), grads):
        _fill_rank_major(piece, g, dim, lay)
    recv = send.new_empty(send.shape[1])
    _reduce_scatter(recv, send.view(-1), group=lay.group)
    return [recv[off:off + n].view(shape) for (off, n), shape in zip(_offsets(local_shapes), local_shapes)]


def _seq_to_heads(tensors, lay: _Layout) -> list[Tensor]:
    """All-to-all ``(B, H, N_local, D)`` sequence shards -> ``(B, H / P, N, D)`` head shards (one collective)."""
    p = lay.world
    shapes = [(t.shape[0], t.shape[1] // p, t.shape[2], t.shape[3]) for t in tensors]
    send = tensors[0].new_empty(p, sum(n for _, n in _offsets(shapes)))
    for piece, t in zip(_packed_views(send, shapes), tensors):
        piece.copy_(t.unflatten(1, (p, -1)).movedim(1, 0))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=lay.group)
    return [_to_global(piece, 2, lay) for piece in _packed_views(recv, shapes)]


def _heads_to_seq(tensors, lay: _Layout) -> list[Tensor]:
    """Inverse (and adjoint) of :func:`_seq_to_heads`: ``(B, H / P, N, D)`` -> ``(B, H, N_local, D)``."""
    p = lay.world
    shapes = [(t.shape[0], t.shape[1], t.shape[2] // p, t.shape[3]) for t in tensors]
    send = tensors[0].new_empty(p, sum(n for _, n in _offsets(shapes)))
    for piece, t in zip(_packed_views(send, shapes), tensors):
        _fill_rank_major(piece, t, 2, lay)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1), group=lay.group)
    return [piece.movedim(0, 1).flatten(1, 2) for piece in _packed_views(recv, shapes)]


class _GatherSequence(torch.autograd.Function):
    """All-gather of sequence shards along ``dim``; backward: reduce-scatter of the gradients."""

    @staticmethod
    def forward(ctx, lay: _Layout, dim: int, *tensors):
        ctx.lay, ctx.dim, ctx.shapes = lay, dim, [t.shape for t in tensors]
        return tuple(_all_gather_seq(tensors, dim, lay))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_reduce_scatter_seq(grads, ctx.shapes, ctx.dim, ctx.lay))


class _AllToAll(torch.autograd.Function):
    """Sequence shards to head shards (``to_heads``) or back; the backward runs the other direction."""

    @staticmethod
    def forward(ctx, lay: _Layout, to_heads: bool, *tensors):
        ctx.lay, ctx.to_heads = lay, to_heads
        return tuple((_seq_to_heads if to_heads else _heads_to_seq)(tensors, lay))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(_heads_to_seq if ctx.to_heads else _seq_to_heads)(grads, ctx.lay))
