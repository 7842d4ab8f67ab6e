"""Layout and collectives of the context-parallel schemes (:mod:`sparse_attn.distributed`).

:class:`_Layout` says which global chunks a rank holds (load-balanced causal sharding or one chunk per
rank); the helpers move sequence shards to global order and back with one all-gather / reduce-scatter
(:class:`_GatherSequence`, all-gather-K/V) or turn sequence shards into head shards with one all-to-all
(:class:`_AllToAll`, Ulysses). Each autograd Function's backward is the adjoint collective.

Before any of them, :func:`_ranks_agree` compares what every rank passed (shapes, dtypes, kinds and scalar values
of the arguments, as a fixed-size int64 row per rank, one small all-gather), so that mismatched shards raise the
same ``ValueError`` on every rank instead of hanging or aborting inside the backend.
"""

from __future__ import annotations

import struct
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral, Real

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


# The agreement check. Each argument is encoded as _WIDTH ints: kind, ndim (or length), _SLOTS shape entries (or
# tuple entries), dtype, requires_grad, value. A row is [local error, function, *arguments, zero padding], the same
# length for every function, so ranks that call different functions still meet in one all-gather of equal sizes.
_FUNCTIONS = ("context_parallel_attention", "ulysses_attention", "unshard_sequence", "gather_head_density")
_NONE, _TENSOR, _BOOL, _INT, _FLOAT, _STR, _TUPLE, _OTHER = range(8)
_SLOTS = 6
_WIDTH = _SLOTS + 5
_DTYPE, _GRAD, _VALUE = _SLOTS + 2, _SLOTS + 3, _SLOTS + 4
_MAX_ARGS = 20
_HEADER = 2
_ROW = _HEADER + _MAX_ARGS * _WIDTH
_STR_BYTES = 8 * (_WIDTH - 2)
_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_INT64 = range(-(2 ** 63), 2 ** 63)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _encode(x) -> list[int]:
    """``x`` as ``_WIDTH`` ints (see above); any object gives a row, so a rank with bad arguments still takes part."""
    row = [0] * _WIDTH
    if x is None:
        return row
    if isinstance(x, Tensor):
        shape = list(x.shape)
        if len(shape) > _SLOTS:
            tail = 1
            for d in shape[_SLOTS - 1:]:
                tail *= d
            shape = shape[:_SLOTS - 1] + [tail]
        row[0], row[1] = _TENSOR, x.dim()
        row[2:2 + len(shape)] = shape
        row[_DTYPE] = _DTYPE_CODE.get(x.dtype, -1)
        row[_GRAD] = int(x.requires_grad and torch.is_grad_enabled())
    elif isinstance(x, bool):
        row[0], row[_VALUE] = _BOOL, int(x)
    elif isinstance(x, Integral):
        row[0], row[_VALUE] = _INT, int(x) if int(x) in _INT64 else _crc(str(x))
    elif isinstance(x, Real):
        row[0], row[_VALUE] = _FLOAT, struct.unpack("<q", struct.pack("<d", float(x)))[0]
    elif isinstance(x, str):  # its first 72 bytes (64 and a checksum if longer)
        raw = x.encode()
        row[0], row[1] = _STR, len(raw)
        for i in range(_WIDTH - 2):
            row[2 + i] = int.from_bytes(raw[8 * i:8 * i + 8].ljust(8, b"\0"), "little", signed=True)
        if len(raw) > _STR_BYTES:
            row[-1] = zlib.crc32(raw)
    elif (isinstance(x, (tuple, list)) and len(x) <= _SLOTS
          and all(isinstance(e, Integral) and not isinstance(e, bool) and int(e) in _INT64 for e in x)):
        row[0], row[1] = _TUPLE, len(x)
        row[2:2 + len(x)] = [int(e) for e in x]
    else:
        row[0], row[_VALUE] = _OTHER, _crc(f"{type(x).__module__}.{type(x).__qualname__}")
    return row


def _describe(row: list[int]) -> str:
    """What :func:`_encode` saw, in words."""
    kind = row[0]
    if kind == _NONE:
        return "None"
    if kind == _TENSOR:
        shape = tuple(row[2:2 + row[1]]) if row[1] <= _SLOTS else f"({', '.join(map(str, row[2:1 + _SLOTS]))}, ...)"
        grad = " requiring grad" if row[_GRAD] else ""
        return f"a {_value(row, _DTYPE)} tensor of shape {shape}{grad}"
    if kind == _BOOL:
        return str(bool(row[_VALUE]))
    if kind == _INT:
        return str(row[_VALUE])
    if kind == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", row[_VALUE]))[0])
    if kind == _STR:
        n = _STR_BYTES if row[1] <= _STR_BYTES else _STR_BYTES - 8
        raw = b"".join(c.to_bytes(8, "little", signed=True) for c in row[2:]).rstrip(b"\0")[:n]
        return repr(raw.decode(errors="replace")) + ("..." if row[1] > n else "")
    if kind == _TUPLE:
        return str(tuple(row[2:2 + row[1]]))
    return "an object of another type"


def _field(name: str, labels, row0: list[int], row: list[int]) -> tuple[str, int]:
    """The name of the first part of argument ``name`` where ``row`` differs from ``row0``, and its position
    (-1: the whole argument, described by :func:`_describe`)."""
    pos = next(i for i, (a, b) in enumerate(zip(row0, row)) if a != b)
    if row0[0] != _TENSOR or row[0] != _TENSOR or pos == 0:
        return name, -1
    if pos == 1:
        return f"{name}.dim()", pos
    if pos < 2 + _SLOTS:
        i = pos - 2
        return f"{name}.shape[{i}]" + (f" ({labels[i]})" if labels and i < len(labels) else ""), pos
    return f"{name}.{'dtype' if pos == _DTYPE else 'requires_grad'}", pos


def _value(row: list[int], pos: int) -> str:
    if pos < 0:
        return _describe(row)
    if pos == _DTYPE:
        return str(_DTYPES[row[pos] - 1]).removeprefix("torch.") if row[pos] > 0 else "unknown dtype"
    if pos == _GRAD:
        return str(bool(row[pos]))
    return str(row[pos])


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _mismatch(fn: str, args, rows: list[list[int]]) -> str | None:
    """The message for rows that differ from rank 0's (None when all agree), the same on every rank."""
    funcs = [r[1] for r in rows]
    if len(set(funcs)) > 1:
        by = {}
        for rank, f in enumerate(funcs):
            by.setdefault(_FUNCTIONS[f] if 0 <= f < len(_FUNCTIONS) else f"function #{f}", []).append(rank)
        return ("the ranks of the group call different functions at the same point: "
                + ", ".join(f"{name} on {_ranks(r)}" for name, r in by.items()))
    parts = []
    for a, (name, _, labels) in enumerate(args):
        lo = _HEADER + a * _WIDTH
        cells = [r[lo:lo + _WIDTH] for r in rows]
        found = {}  # field -> (position, {value: ranks})
        for rank, cell in enumerate(cells[1:], start=1):
            if cell != cells[0]:
                field, pos = _field(name, labels, cells[0], cell)
                found.setdefault(field, (pos, {}))[1].setdefault(_value(cell, pos), []).append(rank)
        for field, (pos, got) in found.items():
            parts.append(f"{field}: expected {_value(cells[0], pos)} (as on rank 0), got "
                         + " and ".join(f"{v} on {_ranks(r)}" for v, r in got.items()))
    if not parts:
        return None
    return (f"{fn} needs the same argument shapes, dtypes and values on every rank of the group (each passes its "
            "shard of one sequence), and every rank stops here before any data moves; " + "; ".join(parts))


def _meta_device(pg, like) -> torch.device:
    """Where the rows go: the CPU when the group has a CPU backend (gloo; no GPU synchronization), else the device
    of the inputs (NCCL)."""
    try:
        pg._get_backend(torch.device("cpu"))
        return torch.device("cpu")
    except Exception:  # no CPU backend (e.g. an NCCL-only group), or an older torch without the query
        pass
    if isinstance(like, Tensor) and like.device.type != "cpu":
        return like.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _compare(lay: _Layout, fn: str, args, error: BaseException | None) -> None:
    """One all-gather of every rank's encoded arguments; raise the same ``ValueError`` on every rank when they differ,
    or, when some rank's own checks failed (``error``), that error there and a ``ValueError`` naming it elsewhere."""
    if lay.world == 1:
        return
    if len(args) > _MAX_ARGS:
        raise AssertionError(f"{fn}: {len(args)} arguments to compare, at most {_MAX_ARGS}")
    mine = [int(error is not None), _FUNCTIONS.index(fn)]
    for _, val, _ in args:
        mine += _encode(val)
    mine += [0] * (_ROW - len(mine))
    pg = lay.group if lay.group is not None else dist.group.WORLD
    send = torch.tensor(mine, dtype=torch.int64, device=_meta_device(pg, args[0][1]))
    recv = send.new_empty(lay.world * _ROW)
    _all_gather(recv, send, group=lay.group)
    table = recv.view(lay.world, _ROW).cpu()
    failed = table[:, 0].nonzero().flatten().tolist()
    if not failed and bool((table[:, 1:] == table[0, 1:]).all()):
        return
    message = _mismatch(fn, args, table.tolist())
    if message is not None:
        raise ValueError(message) from error
    if error is None:
        raise ValueError(f"{fn}: the arguments of {_ranks(failed)} of the group are invalid (the error is raised "
                         "there); every rank stops here before any data moves")


@contextmanager
def _ranks_agree(lay: _Layout, fn: str, args):
    """Run a function's own argument checks in the ``with`` block, then compare the ranks' arguments (one small
    all-gather, see :func:`_compare`) before any data collective, whether or not the checks passed.

    Args:
        lay: the group's layout.
        fn: the public function's name (in :data:`_FUNCTIONS`).
        args: ``(name, value, labels)`` triples, the same names in the same order on every rank; ``labels`` names
            a tensor's dimensions in messages (or None).
    """
    try:
        yield
    except Exception as err:
        _compare(lay, fn, args, err)
        raise
    _compare(lay, fn, args, None)
