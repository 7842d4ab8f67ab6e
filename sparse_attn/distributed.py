"""Entmax attention over a sequence split across processes: all-gather K/V and Ulysses (torch.distributed).

Both schemes take the local shards of one long sequence, layout ``(batch, heads, seq_local,
head_dim)``, on every rank of a process group, and give every rank the attention output of its
own query rows, equal (up to rounding) to what one process would compute on the whole sequence:

* :func:`context_parallel_attention` all-gathers K and V across the group (one collective for
  both), runs each local query chunk against the gathered keys, and reduce-scatters dK and dV in
  the backward. The entmax threshold of a row needs all of the row's keys, which every rank then
  holds, so the threshold search stays local.
* :func:`ulysses_attention` (DeepSpeed-Ulysses) turns sequence shards into head shards with one
  all-to-all (each rank then holds the whole sequence for ``H / P`` heads), runs any attention
  call on them, and turns the output back with the inverse all-to-all (the adjoint pair gives the
  backward).

Sharding: the sequence of length ``N`` is cut into ``2P`` chunks of ``N / (2P)`` positions and
rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` (``load_balance=True``, the default: every rank
gets the same causal work), or into ``P`` chunks with rank ``r`` holding chunk ``r``
(``load_balance=False``). :func:`shard_sequence`, :func:`unshard_sequence`,
:func:`shard_positions` (global positions of the local rows, for positional encodings) and
:func:`pad_for_context_parallel` (uneven lengths) follow the same layout, and
:class:`ContextParallelMultiheadAttention` is :class:`sparse_attn.EntmaxMultiheadAttention` on
sequence shards. Causal attention is bottom-right aligned, so a query chunk holding global
positions ``[s, e)`` attends with exact causal semantics to the gathered keys sliced to
``[0, e)`` (a view): see :func:`_attend_query_chunk`, the one place where a kernel-level query
offset would go. Design notes, memory and the choice between the schemes: ``docs/scaling.md``.

Parameters (a per-head ``alpha``, projections) are replicated; each rank's backward leaves in
their ``.grad`` the contribution of its own tokens, and the gradient of the whole sequence is the
sum over the group: reduce them as data-parallel gradients (DDP or FSDP2 over the group, whose
averaging matches a loss that is the mean over each rank's local tokens), or all-reduce them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from sparse_attn._validation import check_bool, check_int, values_checkable
from sparse_attn.attention import entmax_attention
from sparse_attn.attn_inputs import AttentionStats, check_head_alpha, prepare_attention
from sparse_attn.masks import check_mask
from sparse_attn.modules import EntmaxMultiheadAttention
from sparse_attn.stats import head_stats_sink

__all__ = [
    "context_parallel_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "pad_for_context_parallel",
    "gather_head_density",
    "ContextParallelMultiheadAttention",
    "enable_context_parallel",
    "SCHEMES",
]

SCHEMES = ("allgather", "ulysses")

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
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _seq_dim(x, dim)
    _chunk_size(x.shape[dim], lay, f"x.shape[{dim}]")
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


def _check_local(q, k, v, key_padding_mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_local, head_dim), got {tuple(t.shape)}")
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, Tensor) or not (
            key_padding_mask.dtype == torch.bool or key_padding_mask.is_floating_point()):
        got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
        raise TypeError(f"key_padding_mask must be a boolean (True = real key) or float (additive) tensor, got {got}")
    if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"key_padding_mask must have shape (batch, seq_local) = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != k.device:
        raise ValueError(f"key_padding_mask must be on the device of k ({k.device}), got {key_padding_mask.device}")


def _gather_key_mask(key_padding_mask, lay: _Layout):
    """The local ``(B, N_local)`` key mask (bool keep or float additive), gathered to ``(B, 1, 1, N)``, or None."""
    if key_padding_mask is None:
        return None
    if key_padding_mask.dtype == torch.bool:
        return _all_gather_seq([key_padding_mask.to(torch.uint8)], 1, lay)[0].bool()[:, None, None, :]
    return _GatherSequence.apply(lay, 1, key_padding_mask)[0][:, None, None, :]


def _cat_results(results, return_stats: bool):
    if not return_stats:
        return torch.cat(results, dim=2)
    outs, stats = zip(*results)
    return torch.cat(outs, dim=2), AttentionStats(*(torch.cat(f, dim=2) for f in zip(*stats)))


def _attend_query_chunk(q_chunk: Tensor, k_all: Tensor, v_all: Tensor, end: int, mask, **kw):
    """Causal attention of the query rows at global positions ``[end - n, end)`` to all keys.

    With bottom-right aligned causal masking, these rows see exactly the keys ``[0, end)``, so
    the gathered keys are sliced (a view, no copy). A kernel-level query offset would replace
    this slicing: this function is the one place to change.
    """
    mask = None if mask is None else mask[..., :end]
    return entmax_attention(q_chunk, k_all[:, :, :end], v_all[:, :, :end], attn_mask=mask, is_causal=True, **kw)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    group=None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_stats: bool = False,
    backend: str = "auto",
    load_balance: bool = True,
):
    """:func:`sparse_attn.entmax_attention` of a sequence sharded over a process group, by all-gathering K/V.

    Every rank passes its shards (same shapes on every rank) and gets the output of its own query
    rows. K and V are all-gathered (one collective) into global order; each local query chunk
    attends to them, with causal masking sliced to the keys up to the chunk's end; the backward
    reduce-scatters dK and dV (one collective). Memory per rank: the gathered K/V of the whole
    sequence, ``B * Hk * N * (D + Dv)`` elements, plus its gradient in the backward.

    Args:
        q: ``(B, Hq, N_local, D)`` this rank's query rows (see :func:`shard_sequence`).
        k, v: ``(B, Hk, N_local_k, D)`` and ``(B, Hk, N_local_k, Dv)`` this rank's keys and values,
            sharded like ``q`` (``N_local_k == N_local`` when ``is_causal``).
        alpha: float in [1, 2] or a ``(Hq,)`` / ``()`` tensor, the same on every rank (replicated).
            Its gradient on each rank is the contribution of the local rows: sum it over the group
            (DDP / FSDP2 do, see the module docstring). Default 1.5.
        group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        is_causal: causal attention over the global positions.
        key_padding_mask: ``(B, N_local_k)``, this rank's shard of a mask over the keys: bool, True =
            a real key (e.g. :func:`pad_for_context_parallel`'s ``keep``), or float, added to the
            scores (``-inf`` = excluded; differentiable).
        scale, dropout_p, enable_gqa, backend: as :func:`sparse_attn.entmax_attention`. Dropout
            masks are drawn on each rank (they differ from a single process's).
        return_stats: also return :class:`sparse_attn.AttentionStats` of the local rows, each
            ``(B, Hq, N_local)``; :func:`gather_head_density` aggregates densities over ranks.
        load_balance: the sharding layout (chunks ``r`` and ``2P - 1 - r``, or chunk ``r``). Default True.

    Returns:
        ``out`` ``(B, Hq, N_local, Dv)`` (this rank's rows), or ``(out, stats)``.
    """
    lay = _layout(group, load_balance)
    _check_local(q, k, v, key_padding_mask)
    check_bool("return_stats", return_stats)
    prepare_attention(q, k, v, alpha, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                      enable_gqa=enable_gqa, backend=backend)
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"is_causal needs q and k sharded from one sequence (the same seq_local), "
                         f"got {q.shape[2]} and {k.shape[2]}")
    c = _chunk_size(q.shape[2], lay, "q.shape[2] (seq_local)")
    _chunk_size(k.shape[2], lay, "k.shape[2] (seq_local)")
    if k.shape[-1] == v.shape[-1]:
        k_all, v_all = _GatherSequence.apply(lay, 2, k, v)
    else:
        (k_all,), (v_all,) = _GatherSequence.apply(lay, 2, k), _GatherSequence.apply(lay, 2, v)
    mask = _gather_key_mask(key_padding_mask, lay)
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa, return_stats=return_stats, backend=backend)
    if not is_causal:
        return entmax_attention(q, k_all, v_all, alpha, attn_mask=mask, **kw)
    results = [_attend_query_chunk(q[:, :, s * c:(s + 1) * c], k_all, v_all, (g + 1) * c, mask, alpha=alpha, **kw)
               for s, g in enumerate(lay.chunks(lay.rank))]
    return _cat_results(results, return_stats)


def _ulysses_kv_heads(h_q: int, h_k: int, p: int) -> int:
    """How many times each kv head is repeated before the all-to-all (1: kv heads are sharded)."""
    if h_q % p:
        raise ValueError(f"ulysses_attention needs the number of q heads ({h_q}) to be a multiple of the group "
                         f"size ({p}); use context_parallel_attention (all-gather K/V) instead")
    if h_k % p == 0:
        return 1
    if p % h_k == 0:
        return p // h_k
    raise ValueError(f"ulysses_attention needs the number of k/v heads ({h_k}) to be a multiple or a divisor of "
                     f"the group size ({p})")


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    group=None,
    attn_fn=None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    enable_gqa: bool = False,
    return_stats: bool = False,
    load_balance: bool = True,
    **kwargs,
):
    """Any attention call on a sequence sharded over a process group, by all-to-all to head shards (Ulysses).

    Each rank passes its sequence shards; one all-to-all gives it the whole sequence for its
    ``Hq / P`` heads (``alpha`` sliced to them), ``attn_fn`` runs there, and the inverse
    all-to-all returns this rank's rows for all heads. The backward is the adjoint all-to-all of
    each. Needs ``Hq % P == 0``; kv heads are sharded when ``Hk % P == 0`` and otherwise, when
    ``P % Hk == 0`` (e.g. multi-query attention), each kv head is repeated ``P / Hk`` times first
    (more all-to-all volume for K/V, gradients summed back). Memory per rank: q, k, v and the
    output of the whole sequence for ``H / P`` heads.

    Args:
        q: ``(B, Hq, N_local, D)``; k, v: ``(B, Hk, N_local_k, D)`` / ``(B, Hk, N_local_k, Dv)``, sharded
            alike (see :func:`shard_sequence`; ``N_local_k == N_local`` when ``is_causal``).
        alpha: float, or a ``(Hq,)`` / ``()`` tensor replicated on every rank (each rank's gradient
            holds its heads' entries; sum it over the group). Default 1.5.
        group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        attn_fn: the attention, called as ``attn_fn(q, k, v, alpha, is_causal=..., **options)`` on
            ``(B, Hq / P, N, D)`` head shards, where the options are ``attn_mask`` (``(B, 1, 1, N)``,
            only with a key padding mask), ``enable_gqa=True`` and
            ``return_stats=True`` (only when asked) and ``**kwargs``. Default
            :func:`sparse_attn.entmax_attention`.
        is_causal: causal attention over the global positions.
        key_padding_mask: ``(B, N_local)``, this rank's shard of a key mask, as in
            :func:`context_parallel_attention` (bool True = real key, or float additive).
        enable_gqa: allow ``Hk < Hq``.
        return_stats: also return ``attn_fn``'s :class:`sparse_attn.AttentionStats`, brought back to
            this rank's rows for all heads, ``(B, Hq, N_local)`` each.
        load_balance: the sharding layout of the inputs. Default True.
        **kwargs: passed to ``attn_fn`` (e.g. ``scale``, ``dropout_p``, ``backend``).

    Returns:
        ``out`` ``(B, Hq, N_local, Dv)``, or ``(out, stats)``.
    """
    lay = _layout(group, load_balance)
    _check_local(q, k, v, key_padding_mask)
    check_bool("return_stats", return_stats)
    check_bool("enable_gqa", enable_gqa)
    for name in ("attn_mask", "cu_seqlens_q", "cu_seqlens_k"):
        if name in kwargs:
            raise ValueError(f"{name} is not supported by ulysses_attention: pass key_padding_mask (and is_causal)")
    if attn_fn is None:
        attn_fn = entmax_attention
        prepare_attention(q, k, v, alpha, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)
    elif not callable(attn_fn):
        raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
    if is_causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"is_causal needs q and k sharded from one sequence (the same seq_local), "
                         f"got {q.shape[2]} and {k.shape[2]}")
    _chunk_size(q.shape[2], lay, "q.shape[2] (seq_local)")
    _chunk_size(k.shape[2], lay, "k.shape[2] (seq_local)")
    h_q, h_k = q.shape[1], k.shape[1]
    if h_k != h_q and not enable_gqa:
        raise ValueError(f"q has {h_q} heads and k/v have {h_k}: pass enable_gqa=True")
    check_head_alpha("alpha", alpha, h_q)
    repeat = _ulysses_kv_heads(h_q, h_k, lay.world)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if q.shape[-1] == v.shape[-1]:
        q_h, k_h, v_h = _AllToAll.apply(lay, True, q, k, v)
    else:
        (q_h, k_h), (v_h,) = _AllToAll.apply(lay, True, q, k), _AllToAll.apply(lay, True, v)
    h = h_q // lay.world
    if isinstance(alpha, Tensor) and alpha.numel() > 1:
        alpha = alpha.reshape(-1)[lay.rank * h:(lay.rank + 1) * h]
    options = dict(kwargs)
    mask = _gather_key_mask(key_padding_mask, lay)
    if mask is not None:
        options["attn_mask"] = mask
    if enable_gqa:
        options["enable_gqa"] = True
    if return_stats:
        options["return_stats"] = True
    res = attn_fn(q_h, k_h, v_h, alpha, is_causal=is_causal, **options)
    out_h, stats = res if return_stats else (res, None)
    (out,) = _AllToAll.apply(lay, False, out_h)
    if not return_stats:
        return out
    with torch.no_grad():
        stats = AttentionStats(*(_heads_to_seq([f.unsqueeze(-1)], lay)[0].squeeze(-1) for f in stats))
    return out, stats


def gather_head_density(stats: AttentionStats, group=None, row_mask: Tensor | None = None) -> Tensor:
    """Mean density per head over the rows of every rank: ``nnz / n_valid`` averaged over rows with ``n_valid > 0``.

    Args:
        stats: this rank's :class:`sparse_attn.AttentionStats` (``(B, H, N_local)`` each), e.g. from
            :func:`context_parallel_attention` or :func:`ulysses_attention` with ``return_stats=True``.
        group: the process group (None, a ``ProcessGroup`` or a 1-d ``DeviceMesh``).
        row_mask: optional bool ``(B, N_local)``, True for the query rows to count (e.g. leave the
            padded rows out).

    Returns:
        float64 ``(H,)`` on the stats' device, the same on every rank; NaN for a head with no row.
    """
    lay = _layout(group, False)
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be an AttentionStats, got {type(stats).__name__}")
    valid = stats.n_valid > 0
    if row_mask is not None:
        if not isinstance(row_mask, Tensor) or row_mask.dtype != torch.bool or row_mask.shape != (
                valid.shape[0], valid.shape[2]):
            got = f"{row_mask.dtype} {tuple(row_mask.shape)}" if isinstance(row_mask, Tensor) else row_mask
            raise ValueError(f"row_mask must be a boolean tensor of shape {(valid.shape[0], valid.shape[2])}, "
                             f"got {got}")
        valid = valid & row_mask[:, None, :]
    frac = torch.where(valid, stats.nnz.double() / stats.n_valid.clamp_min(1).double(), 0.0)
    totals = torch.stack([frac.sum((0, 2)), valid.sum((0, 2)).double()])
    dist.all_reduce(totals, group=lay.group)
    return totals[0] / totals[1]


class ContextParallelMultiheadAttention(EntmaxMultiheadAttention):
    """:class:`sparse_attn.EntmaxMultiheadAttention` whose inputs are sequence shards of a process group.

    Same constructor (plus the keyword arguments below), parameters and state dict as
    :class:`sparse_attn.EntmaxMultiheadAttention`, so a single-process checkpoint loads as is; the
    forward takes this rank's shard of the sequence (query and key/value sharded alike, see
    :func:`shard_sequence` with ``dim=1`` for ``batch_first`` input) and returns this rank's rows.
    Parameters are replicated: reduce their gradients over the group (DDP / FSDP2 over it).

    Args:
        process_group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        scheme: ``"allgather"`` (:func:`context_parallel_attention`, default) or ``"ulysses"``
            (:func:`ulysses_attention`, needs ``num_heads % P == 0``).
        load_balance: the sharding layout. Default True.

    Forward: as ``nn.MultiheadAttention.forward`` with these limits (others raise
    ``ValueError``): batched input; ``need_weights=False``; no ``attn_mask`` (use
    ``is_causal=True`` for causal attention over the global positions); ``key_padding_mask``
    ``(N, S_local)`` as in ``nn.MultiheadAttention`` (bool True = padding, or float additive);
    no ``add_bias_kv`` / ``add_zero_attn``. A
    :func:`sparse_attn.record_head_stats` recorder gets the statistics of every rank's rows, so
    its densities are those of the whole sequence (head diversity needs dense weights and is not
    available).
    """

    def __init__(self, embed_dim: int, num_heads: int, *args, process_group=None, scheme: str = "allgather",
                 load_balance: bool = True, **kwargs):
        super().__init__(embed_dim, num_heads, *args, **kwargs)
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        check_bool("load_balance", load_balance)
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported with context parallelism")
        self.process_group = process_group
        self.scheme = scheme
        self.load_balance = load_balance

    @classmethod
    def from_entmax(cls, mha: EntmaxMultiheadAttention, **kwargs) -> ContextParallelMultiheadAttention:
        """A context-parallel copy of ``mha`` (configuration, alpha, weights and ``requires_grad``).

        Args:
            mha: the :class:`sparse_attn.EntmaxMultiheadAttention` (kept unchanged).
            **kwargs: ``process_group``, ``scheme``, ``load_balance``.
        """
        if not isinstance(mha, EntmaxMultiheadAttention):
            raise TypeError(f"mha must be an EntmaxMultiheadAttention, got {type(mha).__name__}")
        if mha.learnable_alpha:
            mid = (mha.alpha_min + mha.alpha_max) / 2
            alpha_kw = dict(learnable=True, alpha=mid, alpha_min=mha.alpha_min, alpha_max=mha.alpha_max)
        else:
            alpha_kw = dict(alpha=mha._alpha_arg())
        return cls.from_mha(mha, backend=mha.backend, **alpha_kw, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme}, load_balance={self.load_balance}"

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, None]:
        """Attend over the whole sequence from this rank's shard; ``(out, None)``, ``out`` shaped like ``query``."""
        self._check_inputs(query, key, value)
        if need_weights:
            raise ValueError("need_weights=True is not supported with context parallelism: pass need_weights=False")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with context parallelism: pass is_causal=True (causal over "
                             "the global positions) and key_padding_mask")
        check_bool("is_causal", is_causal)
        if query.dim() != 3:
            raise ValueError(f"query, key and value must be batched (3-d) with context parallelism, "
                             f"got shape {tuple(query.shape)}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        n, l_q = query.shape[:2]
        keep = None
        if key_padding_mask is not None:
            check_mask("key_padding_mask", key_padding_mask, query.device, keep_means="True = padding")
            keep = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
        q, k, v = self._project(query, key, value, query is key and key is value)
        heads = (self.num_heads, self.head_dim)
        q, k, v = (t.unflatten(-1, heads).transpose(1, 2) for t in (q, k, v))
        sink = head_stats_sink(self)
        if sink is not None and sink.wants_weights:
            raise ValueError("head diversity needs dense weights, which context parallelism does not materialize: "
                             "record with record_head_stats(model, diversity=False)")
        kw = dict(group=self.process_group, is_causal=is_causal, key_padding_mask=keep, return_stats=sink is not None,
                  dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                  load_balance=self.load_balance)
        if self.scheme == "allgather":
            res = context_parallel_attention(q, k, v, self._alpha_arg(), **kw)
        else:
            res = ulysses_attention(q, k, v, self._alpha_arg(), **kw)
        out = res[0] if sink is not None else res
        if sink is not None:
            with torch.no_grad():
                nnz, n_valid = (unshard_sequence(f, self.process_group, load_balance=self.load_balance)
                                for f in (res[1].nnz, res[1].n_valid))
            sink(nnz, n_valid, self.alpha, None)
        out = self.out_proj(out.transpose(1, 2).reshape(n, l_q, self.embed_dim))
        return (out if self.batch_first else out.transpose(0, 1)), None


def enable_context_parallel(model: torch.nn.Module, group=None, *, scheme: str = "allgather",
                            load_balance: bool = True) -> list[str]:
    """Replace every :class:`sparse_attn.EntmaxMultiheadAttention` of ``model`` by its context-parallel copy, in place.

    Run it before building the optimizer (parameters are new objects) and before wrapping the
    model with DDP / FSDP2. The rest of the model must work on sequence shards (token-wise layers
    do; positional encodings need :func:`shard_positions`).

    Args:
        model: the model (e.g. after :func:`sparse_attn.swap_attention`).
        group, scheme, load_balance: as :class:`ContextParallelMultiheadAttention`.

    Returns:
        The qualified names of the replaced modules.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, EntmaxMultiheadAttention):
        raise ValueError("model is itself an EntmaxMultiheadAttention: "
                         "use ContextParallelMultiheadAttention.from_entmax(model)")
    _layout(group, load_balance)
    new_of, names = {}, []
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            if type(child) is not EntmaxMultiheadAttention:
                continue
            if id(child) not in new_of:
                new_of[id(child)] = ContextParallelMultiheadAttention.from_entmax(
                    child, process_group=group, scheme=scheme, load_balance=load_balance)
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
            setattr(parent, child_name, new_of[id(child)])
    return names
