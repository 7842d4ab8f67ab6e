"""The host side of a decode step (``kernels/attn/entmax_decode.py``): what its launches need besides the tensors,
worked out once per configuration, and the scratch memory its kernels share between launches.

* :func:`static_plan`: everything that depends only on the configuration (dtype, head dims, GQA rows, the variants,
  the alpha classes, the pass budget): tile sizes, the compile-time tuples (``MASK``, ``SCORE``, ``CACHE``), the
  launch chain of each alpha class. Cached by that configuration (a small LRU), so a step of a generation loop builds
  none of it again.
* :func:`sizes`: the per-call geometry (splits, key blocks spanned, grid), plain integer arithmetic.
* :func:`workspace`: the scratch tensors of one step (stored scores, live lists, per-split partial sums, the merged
  threshold state) carved from one buffer per (device, stream, thread), grown when a step needs more and reused
  otherwise: kernels on one stream run in order, so a step never sees another's scratch in use. Nothing is cached
  while a CUDA graph is being captured (the graph gets its own allocations, from its private pool) or while
  ``torch.compile`` traces. :func:`release_workspaces` frees this thread's buffers.

Outputs handed to the caller are never taken from here: they are allocated fresh by the launcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

from .. import _args
from .._args import CLASS_POW, mask_spec, score_spec
from ._decode_state import N_PART, N_STATE, _cache_spec
from ._threshold import DECODE_MAX_PASSES, DECODE_POINTS, default_tolerance

__all__ = ["StaticPlan", "Sizes", "static_plan", "sizes", "scratch_layout", "carve", "workspace", "tickets",
           "reset_tickets", "release_workspaces", "default_num_splits", "sm_count"]

# Nq * Hq / Hk rows per program at most; more rows take more row tiles (each reads the cache again)
MAX_BLOCK_M = 32
_MAX_PLANS = 64
_ALIGN = 256  # bytes: every scratch tensor starts at a multiple (the pointer specialization of a fresh allocation)
# the threshold hint (``entmax_decode(tau_hint=)``): points the score pass evaluates around it (``HINT_P``, a power of
# two; the hint itself among them) and their spacing in the z-scale by POW: wide where two points with no score
# between them give the exact root (alpha = 2, 1.5), narrower at other alpha, which need a bracket narrow in total
# weight (docs/decode.md, "Reusing the previous step's threshold")
HINT_POINTS = 8
HINT_STEP = {1: 1e-2, 2: 1e-2, 0: 3e-3}


class StaticPlan(NamedTuple):
    """What one configuration's launches take besides tensors and sizes (:func:`static_plan`)."""

    block_m: int
    block_n: int
    options: dict          # num_warps / num_stages (none under the interpreter)
    max_passes: int
    consts: dict           # kernel arguments that are the same for every call of the configuration
    chains: tuple          # per alpha class: (ALPHA_CLASS, POW, GRID_K, CAND_P, (PHASE, ...))


class Sizes(NamedTuple):
    """The geometry of one call (:func:`sizes`)."""

    n_row_tiles: int
    n_span: int
    n_splits: int
    blocks_per_split: int
    max_seqlen_k: int


_PLANS: OrderedDict = OrderedDict()
_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pick_config(head_dim: int, n_rows: int, interpret: bool) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)``: packed rows padded to a power of two >= 16 (``tl.dot``),
    at most ``MAX_BLOCK_M``; 64-key blocks up to head dim 128, 32 above (16 under the interpreter)."""
    block_m = min(MAX_BLOCK_M, max(16, 1 << max(n_rows - 1, 0).bit_length()))
    if interpret:
        return block_m, 16, 4, 1
    return block_m, 64 if _args.head_dim_block(head_dim) <= 128 else 32, 4, 2


def static_plan(dtype: torch.dtype, paged: bool, head_dim: int, head_dim_v: int, n_rows: int, is_causal: bool,
                window_size, softcap, has_alibi: bool, has_sinks: bool, has_blocks: int, classes: tuple,
                tol, max_passes, block_n, has_hint: bool = False) -> StaticPlan:
    """The launches' configuration (cached): ``classes`` the ``ALPHA_CLASS`` values launched (``FILTER`` when more
    than one), ``tol`` / ``max_passes`` / ``block_n`` None for the defaults, ``has_blocks`` the block mask's
    ``SCORE.blocks`` (``_args.blocks_mode``: 0, or 2 / 4 without / with partial blocks), ``has_hint`` a threshold
    hint given. Arguments as :func:`sparse_attn.kernels.attn.entmax_decode.entmax_decode_fwd`."""
    key = (dtype, paged, head_dim, head_dim_v, n_rows, is_causal, window_size, softcap, has_alibi, has_sinks,
           has_blocks, classes, tol, max_passes, block_n, has_hint)
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    interpret = _args.interpreting()
    block_m, default_n, num_warps, num_stages = _pick_config(head_dim, n_rows, interpret)
    block_n = default_n if block_n is None else block_n
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n: got {block_n}"
    max_passes = DECODE_MAX_PASSES[dtype] if max_passes is None else max_passes
    assert max_passes >= 2, f"max_passes: got {max_passes}"
    # per alpha class: the score pass (softmax: its only pass), then the value pass
    chains = tuple((cls, CLASS_POW[cls], *DECODE_POINTS[CLASS_POW[cls]], (0,) if cls == 0 else (0, 2))
                   for cls in classes)
    score = score_spec(softcap, has_alibi, has_sinks, has_blocks)
    consts = dict(tol=default_tolerance(dtype) if tol is None else float(tol), n_slots=max_passes + 1,
                  MASK=mask_spec(is_causal, window_size), SCORE=score, FILTER=len(classes) > 1, BLOCK_M=block_m,
                  BLOCK_N=block_n, CACHE=_cache_spec(paged, head_dim, head_dim_v, dtype), HAS_HINT=has_hint,
                  HINT_P=HINT_POINTS)
    plan = StaticPlan(block_m, block_n, {} if interpret else dict(num_warps=num_warps, num_stages=num_stages),
                      max_passes, consts, chains)
    _PLANS[key] = plan
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


def default_num_splits(batch: int, n_kv_heads: int, n_row_tiles: int, n_kblocks: int, device) -> int:
    """Key-range splits: enough programs to fill the GPU twice over, at least 4 key blocks per split, at most 32
    splits (each later launch merges every split's results); 4 at most under the interpreter."""
    if n_kblocks == 0:
        return 1
    if device.type == "cuda":
        want, cap = 2 * sm_count(device), 32
    else:
        want, cap = 4, 4
    splits = _cdiv(want, max(batch * n_kv_heads * n_row_tiles, 1))
    return max(1, min(splits, cap, _cdiv(n_kblocks, 4)))


def sizes(plan: StaticPlan, batch: int, n_kv_heads: int, n_rows: int, seqlen_q: int, capacity: int,
          max_seqlen_k, num_splits, device) -> Sizes:
    """The geometry of one call: row tiles, key blocks the splits share (``_args.key_blocks_spanned``), splits."""
    max_seqlen_k = capacity if max_seqlen_k is None else min(int(max_seqlen_k), capacity)
    n_row_tiles = _cdiv(n_rows, plan.block_m)
    mask, block_n = plan.consts["MASK"], plan.block_n
    n_span = _cdiv(max_seqlen_k, block_n)
    if mask.has_left:
        n_span = min(n_span, _cdiv(seqlen_q + mask.left, block_n) + 1)
    if num_splits is None:
        num_splits = default_num_splits(batch, n_kv_heads, n_row_tiles, n_span, device)
    blocks_per_split = max(_cdiv(n_span, max(int(num_splits), 1)), 1)
    return Sizes(n_row_tiles, n_span, max(_cdiv(n_span, blocks_per_split), 1), blocks_per_split, max_seqlen_k)


def scratch_layout(plan: StaticPlan, sz: Sizes, rows: tuple, n_kv_heads: int, head_dim_v: int, counters: bool,
                   stats: bool) -> tuple:
    """``(name, shape, dtype)`` of every scratch tensor of a step with ``rows = (B, Hq, Nq)``: the stored scores
    ``Z``, the live lists, the per-split partials, the grid sums (flat: each class chain cuts its own point count,
    :func:`carve`; the chains run one after the other and share them), the tiles' threshold state and, with a
    threshold hint, the splits' sums at its points, and the
    write-only stand-ins of the counters (without ``counters``) and of the statistics (without ``stats``)."""
    f32, i32 = torch.float32, torch.int32
    batch = rows[0]
    n_rows = rows[1] // max(n_kv_heads, 1) * rows[2]
    tiles = (batch, n_kv_heads, sz.n_row_tiles)
    per_split = (batch, n_kv_heads, sz.n_row_tiles * plan.block_m, sz.n_splits)
    grid_k = max((c[2] for c in plan.chains), default=1)
    layout = [("Z", (batch, n_kv_heads, n_rows, sz.n_span * plan.block_n), f32),
              ("LIST", (*tiles, sz.n_span), i32), ("LIVE_N", (*tiles, sz.n_splits), i32),
              ("PART_ROW", (*per_split, N_PART.value), f32), ("PART_ACC", (*per_split, head_dim_v), f32),
              ("GRID_ROW", (*per_split, N_PART.value), f32), ("GRID_PTS", (_numel(per_split) * 3 * grid_k,), f32),
              ("STATE", (*per_split[:3], N_STATE.value), f32)]
    if plan.consts["HAS_HINT"]:
        layout.append(("HINT_PTS", (*per_split, 3, plan.consts["HINT_P"]), f32))
    if not counters:
        layout += [("N_PASSES", (len(plan.chains), *tiles), i32),
                   ("BLOCKS_READ", (len(plan.chains), *tiles, sz.n_splits, plan.max_passes + 1), i32)]
    if not stats:
        layout += [("TAU", rows, f32), ("NNZ", rows, i32), ("N_VALID", rows, i32)]
    return tuple(layout)


def carve(flat: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The first ``prod(shape)`` elements of a flat scratch tensor as a contiguous tensor of ``shape``."""
    return flat[:_numel(shape)].view(shape)


class _Arena:
    """One thread's scratch buffer on one (device, stream), the views last cut from it, and its ticket counters."""

    __slots__ = ("buf", "layout", "views", "tickets")

    def __init__(self):
        self.buf, self.layout, self.views, self.tickets = None, None, None, None


_LOCAL = threading.local()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream_key(device: torch.device):
    if device.type != "cuda":
        return device, 0
    return device, torch.cuda.current_stream(device).cuda_stream


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _offsets(layout: tuple) -> tuple[list, int]:
    """Byte offsets of the layout's tensors in one buffer (each aligned to ``_ALIGN``), and its size."""
    offs, total = [], 0
    for _, shape, dtype in layout:
        offs.append(total)
        total += _cdiv(_numel(shape) * dtype.itemsize, _ALIGN) * _ALIGN
    return offs, total


def _arena(device: torch.device) -> _Arena:
    arenas = getattr(_LOCAL, "arenas", None)
    if arenas is None:
        arenas = _LOCAL.arenas = {}
    key = _stream_key(device)
    arena = arenas.get(key)
    if arena is None:
        arena = arenas[key] = _Arena()
    return arena


def tickets(n: int, device: torch.device, reuse: bool = True) -> torch.Tensor:
    """``n`` int32 ticket counters (one per row tile) for the last-arrival combines of the decode kernels: zero, and
    left zero by every launch that completes. This thread's counters for the current stream (grown, zeroed, when a
    step needs more), or fresh zeros without ``reuse``, while a CUDA graph is captured or ``torch.compile`` traces (the
    graph then resets them itself: a fill node)."""
    if not reuse or torch.compiler.is_compiling() or _capturing(device):
        return torch.zeros(n, dtype=torch.int32, device=device)
    arena = _arena(device)
    if arena.tickets is None or arena.tickets.numel() < n:
        arena.tickets = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return arena.tickets


def reset_tickets(device: torch.device) -> None:
    """Zero this thread's ticket counters for the current stream (after a launch that raised)."""
    arena = getattr(_LOCAL, "arenas", {}).get(_stream_key(device))
    if arena is not None and arena.tickets is not None:
        arena.tickets.zero_()


def workspace(layout: tuple, device: torch.device, reuse: bool = True) -> dict:
    """The scratch tensors of ``layout`` (:func:`scratch_layout`) by name: views of this thread's buffer for the
    current stream of ``device``, or fresh allocations without ``reuse``, while a CUDA graph is captured or
    ``torch.compile`` traces. Their contents are whatever an earlier step left (the kernels write every entry before
    reading it)."""
    if not reuse or torch.compiler.is_compiling() or _capturing(device):
        return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape, dtype in layout}
    arena = _arena(device)
    if arena.layout == layout and arena.views is not None:
        return arena.views
    offs, total = _offsets(layout)
    if arena.buf is None or arena.buf.numel() < total:
        grown = 0 if arena.buf is None else arena.buf.numel() + arena.buf.numel() // 4
        arena.buf = torch.empty(max(total, grown), dtype=torch.uint8, device=device)
    arena.views = {name: arena.buf[off:off + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
                   for (name, shape, dtype), off in zip(layout, offs, strict=True)}
    arena.layout = layout
    return arena.views


def release_workspaces() -> None:
    """Free this thread's decode scratch buffers (the next step allocates again)."""
    _LOCAL.arenas = {}
