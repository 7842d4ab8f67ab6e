"""The host side of the kernels: everything a launcher computes before a launch, from Python values and tensors
to kernel arguments. The alpha class plan (``ALPHA_CLASSES`` and the rules that pick a class), the interpreter
switches and build choices, the structural mask ``MASK`` (:func:`mask_spec`), the score modifications ``SCORE``
(:func:`score_spec`) and their tensors ``MODS`` (:func:`mods_args`), the arguments every attention kernel takes
(:func:`attention_args`), the launch geometry (:func:`tile_plan`) and the reduction of a mask's gradient to its
broadcast shape (:func:`dbias_mode`, :func:`sum_to_mask`). ``_common.py`` and ``_masking.py`` hold the device code
that reads these arguments.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import dropout_mask_kernel

# ALPHA_CLASS values of the attention kernels, one compiled path each: softmax (alpha = 1), sparsemax (alpha = 2),
# 1.5-entmax and any other alpha. "mixed" alpha (classes unknown on the host) launches all four, each over every head,
# and a program whose head is of another class has nothing to do (HEAD_FILTER, ``_common.alpha_class_id``).
ALPHA_CLASSES = {"softmax": 0, "sparsemax": 1, "entmax15": 2, "general": 3}
CLASS_NAMES = {cls: name for name, cls in ALPHA_CLASSES.items()}
# the threshold arithmetic of each ALPHA_CLASS, the compile-time ``POW`` of the forward and decode kernels (and the key
# of their point tables, ``_threshold.FWD_POINTS`` / ``DECODE_POINTS``): 1 for alpha = 2, 2 for alpha = 1.5, 0 for any
# other alpha; softmax (no threshold: its passes never read ``POW``) takes 0
CLASS_POW = {0: 0, 1: 1, 2: 2, 3: 0}


def computed_alpha(alpha: float, dtype: torch.dtype = torch.float32) -> float:
    """``alpha`` as a computation in ``dtype`` holds it: rounded to float32, or kept in float64 when ``dtype`` is
    float64 (the kernels and every float32 / float16 / bfloat16 computation hold alpha in float32).

    Every path decides its alpha class from this value, so a Python alpha such as ``1 + 1e-9`` (1.0 in float32) is
    the softmax class rather than a general alpha whose ``alpha - 1`` rounds to 0. The general arithmetic is exact in
    kind for every float32 alpha above 1 (the smallest, ``1 + 2**-23``, included); entmax tends to softmax as
    ``alpha -> 1`` with weights off by ``O((alpha - 1) * s**2)`` (``s``: the scores' spread), below float32's
    resolution wherever rounding makes alpha exactly 1.
    """
    alpha = float(alpha)
    if torch.compiler.is_compiling():
        # torch.compile makes a float argument symbolic (dynamic=True, or after a call with another value), which the
        # host's decisions cannot read (struct.pack recursed without end): frexp makes dynamo specialize it, a guard
        # on its value, so each alpha compiles its own graph as a constant alpha does
        alpha = math.ldexp(*math.frexp(alpha))
    if dtype == torch.float64:
        return alpha
    held = struct.unpack("f", struct.pack("f", alpha))[0]  # on the host: no tensor, nothing read back
    # beyond float32's range (no alpha of an attention call) it rounds to inf, which gave NaN rows: held as 2**100,
    # where the map is argmax to float32 resolution and the solver's arithmetic stays finite
    return held if math.isfinite(held) else 2.0**100


def alpha_class_of(alpha_values) -> str:
    """The compile-time alpha class for known per-head alpha values (a sequence of floats in [1, 2]), each taken as
    the kernels hold it (:func:`computed_alpha`)."""
    vals = {computed_alpha(a) for a in alpha_values}
    if vals == {1.0}:
        return "softmax"
    if vals == {2.0}:
        return "sparsemax"
    if vals == {1.5}:
        return "entmax15"
    if vals and all(1.0 < a < 2.0 and a != 1.5 for a in vals):
        return "general"
    return "mixed"


def resolve_alpha_class(alpha, alpha_class: str | None) -> str:
    """``alpha_class`` when given, else from the values of a Python number or a CPU tensor (no device sync), else
    ``"mixed"``."""
    if alpha_class is not None:
        return alpha_class
    if not isinstance(alpha, torch.Tensor):
        return alpha_class_of([alpha])
    return alpha_class_of(alpha.tolist()) if alpha.device.type == "cpu" else "mixed"


def class_launches(alpha_class: str) -> list:
    """``(ALPHA_CLASS, HEAD_FILTER)`` of the launches one call makes: one, or all four filtered ones when mixed."""
    if alpha_class == "mixed":
        return [(c, True) for c in ALPHA_CLASSES.values()]
    return [(ALPHA_CLASSES[alpha_class], False)]


def classes_present(alpha, alpha_class: str) -> tuple:
    """The ``ALPHA_CLASS`` values one call launches, ascending: those of :func:`class_launches`, or for a mixed alpha
    held in a CPU tensor the classes of its values (a head outside [1, 2] or NaN: the general class, 3, as on the
    device, ``_common.alpha_class_id``)."""
    if alpha_class == "mixed" and isinstance(alpha, torch.Tensor) and alpha.device.type == "cpu":
        return tuple(sorted({ALPHA_CLASSES[alpha_class_of([a])] if 1 <= a <= 2 else 3 for a in alpha.tolist()}))
    return tuple(c for c, _ in class_launches(alpha_class))


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pinned_launch() -> bool:
    """True when the attention kernels launch their one pinned config instead of ``triton.autotune``: under the
    interpreter, or with ``SPARSE_ATTN_PINNED=1`` (a first GPU run: one build per kernel, no tuning runs)."""
    return interpreting() or os.environ.get("SPARSE_ATTN_PINNED", "0") == "1"


class _LaunchContext:
    """:func:`device_guard`'s context: ``torch.cuda.device`` of a CUDA device, and Triton's scratch allocator for
    the descriptors made in a kernel while the launches run (:func:`_install_scratch_allocator`)."""

    __slots__ = ("device", "_cuda", "_token")

    def __init__(self, device):
        self.device, self._cuda, self._token = device, None, None

    def __enter__(self):
        if self.device.type == "cuda":
            self._cuda = torch.cuda.device(self.device)
            self._cuda.__enter__()
            self._token = _install_scratch_allocator()
        return self

    def __exit__(self, *exc):
        if self._token is not None:
            _scratch_allocator_var().reset(self._token)
            self._token = None
        if self._cuda is not None:
            self._cuda.__exit__(*exc)
            self._cuda = None
        return False


def device_guard(device) -> _LaunchContext:
    """The context a launch on ``device`` runs in: Triton launches on the current CUDA device, so a tensor on another
    GPU (a model split over devices) makes its device current for the launch (as flash-attn's device guard does), and
    kernels that make TMA descriptors get their global scratch from it (:func:`_install_scratch_allocator`, undone on
    exit); a no-op for CPU tensors (the interpreter)."""
    return _LaunchContext(device)


def launches_on(tensor_of):
    """Decorator of a launcher: run it under :func:`device_guard` of ``tensor_of(*args, **kwargs)``'s device."""

    def wrap(launcher):
        @functools.wraps(launcher)
        def run(*args, **kwargs):
            with device_guard(tensor_of(*args, **kwargs).device):
                return launcher(*args, **kwargs)

        return run

    return wrap


def tma_device(device) -> bool:
    """Whether the kernels may stream tiles with TMA tensor descriptors on ``device``: a CUDA device of compute
    capability 9.x (Hopper's tensor memory accelerator; the builds measured are sm_90's, so later GPUs keep pointer
    loads), unless ``SPARSE_ATTN_TMA=0`` turns them off (every kernel then takes its pointer loads: the same values
    loaded, results within rounding)."""
    return (device.type == "cuda" and os.environ.get("SPARSE_ATTN_TMA", "1") != "0"
            and torch.cuda.get_device_capability(device)[0] == 9)


def tma_rows(t: torch.Tensor) -> bool:
    """Whether TMA can stream row tiles of ``t`` ``(B, H, N, D)``: a contiguous last dim, a 16-byte aligned base and
    16-byte multiples as the other strides and the row length (the descriptor's rules), rows that do not overlap (a
    row stride of at least ``D``: not a broadcast along the sequence)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.shape[-1] * size % 16 == 0
            and t.stride(-2) >= t.shape[-1] and all(st * size % 16 == 0 for st in t.stride()[:-1]))


# bytes of Triton's global scratch per descriptor a program makes in a kernel (a CUtensorMap), and the scratch a
# launch may take whatever its output's size
TMA_DESCRIPTOR_BYTES = 128
TMA_SCRATCH_FREE = 8 << 20


def tma_scratch_fits(grid: tuple, descriptors: int, like: torch.Tensor) -> bool:
    """Whether the scratch of ``descriptors`` TMA descriptors per program over ``grid`` (every program makes its own)
    stays within :data:`TMA_SCRATCH_FREE` or the bytes of ``like`` (the launch's output): always for dense batches;
    not for many packed sequences of very different lengths, whose grid spans every sequence at the longest one's
    tiles (1000 sequences up to 32k keys, 32 heads: 4 GiB of scratch for 64-row tiles)."""
    scratch = grid[0] * grid[1] * grid[2] * descriptors * TMA_DESCRIPTOR_BYTES
    return scratch <= max(TMA_SCRATCH_FREE, like.numel() * like.element_size())


def _scratch_allocator_var():
    """Triton's context variable holding the scratch allocator (``triton.runtime._allocation._allocator``)."""
    from triton.runtime import _allocation

    return _allocation._allocator


def _install_scratch_allocator():
    """Descriptors made in a kernel (``tl.make_tensor_descriptor``) live in a global scratch buffer Triton asks an
    allocator for at launch. When the caller has set none, set :func:`_scratch_on_current_device` (the launch's
    device) and return the token that puts the caller's state back; None when the caller's allocator stays, and under
    the interpreter, which needs none. A Triton without that private context variable gets the allocator through
    ``triton.set_allocator`` for good (it cannot tell a caller's own)."""
    if interpreting():
        return None
    try:
        from triton.runtime import _allocation

        var, null = _scratch_allocator_var(), _allocation.NullAllocator
    except (ImportError, AttributeError):
        triton.set_allocator(_scratch_on_current_device)
        return None
    if not isinstance(var.get(), null):
        return None
    return var.set(_scratch_on_current_device)


def _scratch_on_current_device(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch of one launch: ``size`` bytes on the current CUDA device, starting at a multiple of
    ``alignment`` (a view into a block ``alignment`` bytes longer)."""
    alignment = max(int(alignment), 1)
    block = torch.empty(size + alignment, dtype=torch.int8, device="cuda")
    start = -block.data_ptr() % alignment
    return block[start:start + size]


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the attention ``tl.dot``s: fp32 inputs keep fp32 accuracy on tensor cores
    (3xTF32); fp16/bf16 ignore the setting; the interpreter computes in the input dtype whatever it says."""
    if interpreting():
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def head_dim_block(head_dim: int) -> int:
    """``BLOCK_D``: the head dim padded to a power of two >= 16 (``tl.dot`` needs >= 16 on a GPU)."""
    return max(16, triton.next_power_of_2(head_dim))


def launch_configs():
    """GPU configs a ``triton.autotune`` of an attention kernel may try: warps and pipeline stages only (the tiles
    are the launcher's); each launch keeps three of them (``prune_to_pinned``)."""
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)]


def prune_to_pinned(pinned, by_args: bool = False):
    """``early_config_prune`` for ``launch_configs()``: ``pinned(head_dim) -> (num_warps, num_stages)`` (with
    ``by_args``: ``pinned(args)``, the launch's arguments by name) of a launch first, then one more pipeline stage,
    then the other warp count (measured alternatives: docs/kernels.md)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        warps, stages = pinned(args if by_args else args["HEAD_DIM"])
        keep = [(warps, stages), (warps, stages + 1), ({4: 8, 8: 4}[warps], stages)]
        return [c for w_s in keep for c in configs if (c.num_warps, c.num_stages) == w_s]
    return prune


# window sides at least this wide are unbounded for any sequence the kernels index with int32
_UNBOUNDED_SIDE = 2**30


class MaskSpec(NamedTuple):
    """The ``MASK`` kernel argument, read by name in the kernels (``_masking.visible``, ``key_tile_range``, ...):
    three compile-time flags and the window's sides as run-time ints (one build serves every window width)."""

    causal: tl.constexpr  # keys after the query's diagonal are hidden
    has_left: tl.constexpr  # a left window side: keys more than ``left`` before the diagonal are hidden
    has_right: tl.constexpr  # a right window side: keys more than ``right`` after the diagonal are hidden
    left: int  # 0 without a left side
    right: int  # 0 without a right side


class ScoreSpec(NamedTuple):
    """The ``SCORE`` kernel argument, read by name in the kernels: how scores are modified before masks."""

    has_softcap: tl.constexpr  # ``softcap * tanh(s / softcap)``
    softcap: float  # a run-time float, 1.0 when off
    has_alibi: tl.constexpr  # ALiBi slopes read by ``_masking.alibi_slope``
    has_sinks: tl.constexpr  # a per-head sink logit per row (``_masking.sink_logit``)
    blocks: tl.constexpr  # the block mask's mode, :func:`blocks_mode` (0: none)
    # no modification but the soft cap needs a per-score step (the structural mask aside): a tile inside the
    # structural mask takes the scores as they are (the backward's interior tiles, ``_bwd_tiles._tile``)
    plain: tl.constexpr = tl.constexpr(True)


class ModsArgs(NamedTuple):
    """The ``MODS`` kernel argument (:func:`mods_args`): the score modifications' tensors and strides, read by name in
    ``_masking.program_mods``. ``bits`` and ``n_words`` (a block mask with partial blocks, :func:`block_args`) are
    None otherwise: the kernel then takes no more arguments than without them."""

    bias: object  # the additive / boolean mask (``like`` for none), broadcast by zero strides
    stride_bias_b: int
    stride_bias_h: int
    stride_bias_m: int
    stride_bias_n: int
    alibi: object  # the ALiBi slopes
    stride_alibi_b: int
    stride_alibi_h: int
    sinks: object  # the per-head sink logits
    blocks: object  # the block mask's grid
    stride_block_b: int
    stride_block_h: int
    stride_block_m: int
    stride_block_n: int
    block_q: int
    block_k: int
    bits: object = None  # the element masks of its partial blocks
    n_words: int | None = None


def mask_spec(is_causal: bool, window_size: tuple | None = None) -> MaskSpec:
    """The ``MASK`` kernel argument (:class:`MaskSpec`).

    ``window_size``: ``(left, right)`` ints >= -1 (``-1`` = unbounded on that side) or None for no window.
    """
    left, right = (-1, -1) if window_size is None else (int(w) for w in window_size)
    has_left, has_right = 0 <= left < _UNBOUNDED_SIDE, 0 <= right < _UNBOUNDED_SIDE
    return MaskSpec(tl.constexpr(bool(is_causal)), tl.constexpr(has_left), tl.constexpr(has_right),
                    left if has_left else 0, right if has_right else 0)


def score_spec(softcap: float | None, has_alibi: bool, has_sinks: bool = False, has_blocks: int = 0) -> ScoreSpec:
    """The ``SCORE`` kernel argument (:class:`ScoreSpec`): ``softcap * tanh(s / softcap)`` and ALiBi slopes;
    whether each row has a per-head sink logit, a virtual key with zero value that joins the row's normalization;
    and whether a block-sparse mask hides whole blocks of keys (``_masking.block_visible``).
    ``has_blocks`` (``SCORE.blocks``, :func:`blocks_mode`): 0 no block mask. A block mask whose blocks are all full
    or hidden (a boolean grid): 1 when its blocks are unions of the launch's tiles (the tile loops skip hidden tiles
    and every tile they visit is whole in one kept block: no per-score check); 2 otherwise (the tile skip and the
    per-score check, ``_masking.block_visible``). A block mask with partial blocks (an int32 grid of block states
    and their element masks as bits, ``_masking.block_state``): 3 when aligned as in mode 1 (one state read per
    tile; only a tile in a partial block tests its scores' bits, ``_masking.partial_tile``); 4 otherwise (the
    per-score states, and the bits of the scores in partial blocks when the tile meets one,
    ``_masking.partial_scores``)."""
    return ScoreSpec(tl.constexpr(softcap is not None), float(softcap) if softcap is not None else 1.0,
                     tl.constexpr(bool(has_alibi)), tl.constexpr(bool(has_sinks)), tl.constexpr(int(has_blocks)),
                     tl.constexpr(not has_alibi and int(has_blocks) <= 1))


def attention_args(spec, seed: int, tiles: tuple | None = None) -> dict:
    """The keyword arguments every attention kernel (forward, dQ, dK/dV, d bias) takes, named as in
    CONTRIBUTING.md ("Naming in kernels/"), from an ``AttnSpec`` (``kernels/_spec.py``; the fused ops' spec, or
    ``kernel_spec`` of a direct launcher call) and the dropout ``seed``. The spec's ``mask`` (an additive float mask,
    or a boolean / uint8 keep mask read as is: ``BIAS_KIND`` 1 or 2) is broadcast to ``(B, Hq, Nq, Nk)`` by zero
    strides; ``is_causal`` and ``window_size`` become the structural mask ``MASK`` (:func:`mask_spec`); ``softcap``
    and ``alibi_slopes`` (float32 ``(Hq,)`` or ``(B or nseq, Hq)``) the score modifications ``SCORE`` and ``ALIBI``
    (:func:`score_spec`); ``sinks`` (``(Hq,)``, read as float32) the per-head sink logits ``SINKS``; the block mask
    (:func:`spec_block_mask`) the block grid and, with partial blocks, their bits (:func:`block_args`); ``tiles``: the
    ``(block_m, block_n)`` of a launch whose tile loops decide the block mask per tile (:func:`blocks_mode`)."""
    q, k, v = spec.q, spec.k, spec.v
    block_mask = spec_block_mask(spec)
    is_varlen = spec.cu_seqlens_q is not None
    head_dim = q.shape[3]
    return dict(
        Q=q, K=k, V=v, ALPHA=alpha_arg(spec.alpha, q.shape[1], q.device),
        **mods_args(spec.mask, (*q.shape[:3], k.shape[2]), spec.alibi_slopes, spec.sinks, q, block_mask),
        CU_SEQLENS_Q=spec.cu_seqlens_q if is_varlen else q, CU_SEQLENS_K=spec.cu_seqlens_k if is_varlen else q,
        **stride_args("stride_q", q, "bhmd"), **stride_args("stride_k", k, "bhnd"),
        **stride_args("stride_v", v, "bhnd"),
        n_heads=q.shape[1], kv_group=q.shape[1] // k.shape[1], total_q=q.shape[2], total_k=k.shape[2],
        scale=float(spec.scale), dropout_p=float(spec.dropout_p), seed=int(seed) & 0x7FFFFFFF,
        MASK=mask_spec(spec.is_causal, spec.window_size),
        SCORE=score_spec(spec.softcap, spec.alibi_slopes is not None, spec.sinks is not None,
                         blocks_mode(block_mask, tiles)),
        HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
        HEAD_DIM_V=v.shape[3], BLOCK_DV=head_dim_block(v.shape[3]), IS_VARLEN=is_varlen,
        HAS_DROPOUT=float(spec.dropout_p) > 0.0, UPCAST=interpreting(), DOT_PRECISION=dot_precision(q.dtype),
    )


def spec_block_mask(spec) -> tuple | None:
    """A spec's block mask as :func:`block_parts` reads it: ``(grid, (bq, bk))``, ``(states, (bq, bk), bits)`` with
    partial blocks, or None."""
    if spec.block_mask is None:
        return None
    return (spec.block_mask, spec.block_size) if spec.block_bits is None else (spec.block_mask, spec.block_size,
                                                                                spec.block_bits)


def blocks_mode(block_mask, tiles: tuple | None) -> int:
    """``SCORE.blocks`` (:func:`score_spec`) for a block mask (:func:`block_parts`) and the launch's ``tiles``
    ``(block_m, block_n)``: 0 without a block mask. Every tile lies in one block when ``bq``, ``bk`` are multiples of
    the tiles: then 1 without partial blocks (the tile loops' skip decides alone, the per-score check would only cost,
    and at head dim 128 spill), 3 with them (one state read per tile, bits only in partial tiles). Otherwise, or when
    ``tiles`` is None (a kernel that visits tiles the forward's skip did not decide), 2 without partial blocks and 4
    with them (per-score states)."""
    if block_mask is None:
        return 0
    _, (block_q, block_k), bits = block_parts(block_mask)
    aligned = tiles is not None and block_q % tiles[0] == 0 and block_k % tiles[1] == 0
    return (1 if aligned else 2) + (0 if bits is None else 2)


def block_parts(block_mask) -> tuple:
    """``(grid, (block_q, block_k), bits)`` of a launcher's ``block_mask``: a ``(grid, (block_q, block_k))`` pair (a
    boolean grid, ``bits`` None) or a ``(states, (block_q, block_k), bits)`` triple (``bits`` None or the int32 words
    of the partial blocks, :func:`block_args`)."""
    grid, size, *rest = block_mask
    return grid, size, rest[0] if rest else None


def mods_args(bias, shape: tuple, alibi_slopes, sinks, like, block_mask=None) -> dict:
    """``BIAS_KIND`` and ``MODS``, the tensors of the score modifications as one kernel argument (a
    :class:`ModsArgs`, read by name in ``_masking.program_mods`` only) from :func:`bias_args`, :func:`alibi_args`,
    :func:`sinks_arg` and :func:`block_args`. A new per-program score input is a new field here and in
    ``_masking.ProgramMods``; the kernels pass ``MODS`` on unread."""
    b = bias_args(bias, shape, like)
    a = alibi_args(alibi_slopes, like)
    mods = ModsArgs(b["BIAS"], b["stride_bias_b"], b["stride_bias_h"], b["stride_bias_m"], b["stride_bias_n"],
                    a["ALIBI"], a["stride_alibi_b"], a["stride_alibi_h"], sinks_arg(sinks, like),
                    *block_args(block_mask, like))
    return dict(BIAS_KIND=b["BIAS_KIND"], MODS=mods)


def block_args(block_mask, like) -> tuple:
    """``(BLOCKS, stride_block_b, stride_block_h, stride_block_m, stride_block_n, block_q, block_k)``, and ``(BITS,
    n_words)`` after them with partial blocks: a block mask (:func:`block_parts`) indexed by sequence and q head,
    stride 0 along its broadcast dims. A boolean grid ``(B or nseq or 1, Hq or 1, q blocks, k blocks)`` is read as
    uint8; with partial blocks the grid holds int32 states (0 hidden, 1 full, ``2 + i`` partial block ``i``) and
    ``BITS`` the int32 words ``(n_partial, block_q, n_words)`` of their element masks (``n_words = ceil(block_k /
    32)``; bit ``c % 32`` of word ``c // 32`` of row ``r`` keeps the block's row ``r``, key ``c``). ``like`` and zeros
    (block sizes 1) for none."""
    if block_mask is None:
        return (like, 0, 0, 0, 0, 1, 1)
    mask, (block_q, block_k), bits = block_parts(block_mask)
    if bits is None:
        mask, partial = mask.to(device=like.device, dtype=torch.bool).view(torch.uint8), ()
    else:
        mask = mask.to(device=like.device, dtype=torch.int32)
        partial = (bits.to(device=like.device, dtype=torch.int32).contiguous(), bits.shape[2])
    strides = [0 if n == 1 else st for n, st in zip(mask.shape, mask.stride(), strict=True)]
    return (mask, *strides, int(block_q), int(block_k), *partial)


def bias_args(bias, shape: tuple, like) -> dict:
    """``BIAS``, ``BIAS_KIND`` (0 none, 1 an additive float mask, 2 a boolean / uint8 keep mask read as uint8) and
    ``stride_bias_b/h/m/n``: the mask broadcast to the 4-d ``shape`` by zero strides (``like`` stands in for a
    missing one)."""
    if bias is None:
        return dict(BIAS=like, BIAS_KIND=0, **bias_stride_args(None))
    kind = 2 if bias.dtype in (torch.bool, torch.uint8) else 1
    if bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    full = bias.expand(*shape)
    return dict(BIAS=full, BIAS_KIND=kind, **bias_stride_args(full))


def sinks_arg(sinks, like) -> torch.Tensor:
    """The ``SINKS`` kernel argument: the per-head sink logits as contiguous float32 on ``like``'s device (``like``
    stands in for none)."""
    return like if sinks is None else sinks.detach().to(device=like.device, dtype=torch.float32).contiguous()


def alibi_args(alibi_slopes, like) -> dict:
    """``ALIBI`` and ``stride_alibi_b/h``: the slopes ``(Hq,)`` (batch stride 0) or ``(B or nseq, Hq)``."""
    if alibi_slopes is None:
        return dict(ALIBI=like, stride_alibi_b=0, stride_alibi_h=0)
    slopes = alibi_slopes.to(device=like.device, dtype=torch.float32)
    if slopes.dim() == 1:
        return dict(ALIBI=slopes, stride_alibi_b=0, stride_alibi_h=slopes.stride(0))
    return dict(ALIBI=slopes, stride_alibi_b=slopes.stride(0), stride_alibi_h=slopes.stride(1))


def alpha_arg(alpha, n_heads: int, device) -> torch.Tensor:
    """The ``ALPHA`` kernel argument: float32 ``(Hq,)`` on ``device`` (a Python number is broadcast)."""
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.full((n_heads,), float(alpha), dtype=torch.float32, device=device)
    assert alpha.shape == (n_heads,), f"alpha: expected shape ({n_heads},), got {tuple(alpha.shape)}"
    return alpha.detach().to(device=device, dtype=torch.float32).contiguous()


def stride_args(prefix: str, t: torch.Tensor, dims: str) -> dict:
    """Kernel keyword arguments ``{prefix + dim: stride}``, e.g. ``stride_args("stride_q", q, "bhmd")``."""
    return {prefix + d: st for d, st in zip(dims, t.stride(), strict=True)}


def bias_stride_args(bias: torch.Tensor | None) -> dict:
    """``stride_bias_b/h/m/n`` of a 4-d bias (broadcast dims have stride 0); all 0 without a bias."""
    if bias is None:
        return dict.fromkeys(("stride_bias_b", "stride_bias_h", "stride_bias_m", "stride_bias_n"), 0)
    return stride_args("stride_bias_", bias, "bhmn")


# CUDA caps launch-grid axes 1 and 2 at 65535 programs; the attention grids are
# (tiles, heads, batch entries or sequences), so heads and batch are each limited to this.
MAX_GRID_YZ = 65535


class TilePlan(NamedTuple):
    """Launch geometry of one attention call: grid axis 2 (batch entries, or packed sequences), the
    tile sizes, the query / key tiles of the longest sequence (grid axis 0) and the liveness words
    per query tile (one bit per key tile, docs/design.md)."""

    n_seq: int
    block_m: int
    block_n: int
    n_q_tiles: int
    n_k_tiles: int
    n_words: int


def tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_m: int, block_n: int) -> TilePlan:
    """The :class:`TilePlan` of ``q (B, Hq, Nq, D)``, ``k (B, Hk, Nk, D)`` (packed when ``cu_seqlens_q`` is
    given; the longest sequences are computed from the offsets unless given).

    Raises ``ValueError`` for more than 65535 heads or batch entries (sequences): CUDA caps grid axes
    1 and 2 at 65535 (their product is not limited).
    """
    n_seq = q.shape[0]
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[2], k.shape[2]
    else:
        n_seq = cu_seqlens_q.numel() - 1
        max_seqlen_q = _max_seqlen(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = _max_seqlen(cu_seqlens_k) if max_seqlen_k is None else max_seqlen_k
    if q.shape[1] > MAX_GRID_YZ or n_seq > MAX_GRID_YZ:
        raise ValueError(f"q: expected at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries (sequences), "
                         f"got {q.shape[1]} heads and {n_seq}")
    assert all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n)), f"block_m, block_n: got {block_m}, {block_n}"
    n_k_tiles = triton.cdiv(max_seqlen_k, block_n)
    return TilePlan(n_seq, block_m, block_n, triton.cdiv(max_seqlen_q, block_m), n_k_tiles, triton.cdiv(n_k_tiles, 32))


def _max_seqlen(cu_seqlens) -> int:
    """Longest sequence of packed offsets ``cu_seqlens`` (int ``(nseq + 1,)``); 0 without sequences."""
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def key_blocks_spanned(mask: tuple, seqlen_q: int, seqlen_k: int, block_n: int) -> int:
    """Most key blocks of ``block_n`` keys that ``_masking.key_block_range`` gives the rows of one sequence of
    ``seqlen_q`` rows and at most ``seqlen_k`` keys under ``mask`` (:func:`mask_spec`): all blocks, or with a left
    window the ``seqlen_q + left`` keys before the sequence end (over one more block when unaligned)."""
    n_blocks = triton.cdiv(seqlen_k, block_n)
    if mask.has_left:
        n_blocks = min(n_blocks, triton.cdiv(seqlen_q + mask.left, block_n) + 1)
    return n_blocks


def mask_shape4(bias) -> tuple:
    """The mask's shape left-padded with ones to 4 dims."""
    return (1,) * (4 - bias.ndim) + tuple(bias.shape)


def dbias_mode(bias, full) -> str:
    """How the bias gradient is accumulated without a ``(B, Hq, Nq, Nk)`` buffer unless the mask has that size.

    ``"rows"``: mask broadcast along keys, per-row sums of dS from the dQ kernel (``(B, Hq, Nq)``);
    ``"cols"``: broadcast along queries, per-key sums from the dK/dV kernel (``(B, Hq, Nk)``);
    ``"dense"``: a full ``(B, Hq, Nq, Nk)`` mask (or none), dS written by the dQ kernel;
    ``"blocks"``: broadcast over batch and/or heads only, the dbias kernel sums into the mask's shape.
    """
    if bias is None:
        return "dense"
    shape4 = mask_shape4(bias)
    if shape4[3] == 1:
        return "rows"
    if shape4[2] == 1:
        return "cols"
    if shape4[0] == full[0] and shape4[1] == full[1]:
        return "dense"
    return "blocks"


def sum_to_mask(grad, bias):
    """Sum a 4-d gradient over the dims the mask broadcasts along; shaped like ``bias`` (or 4-d if None)."""
    if bias is None:
        return grad
    shape4 = mask_shape4(bias)
    dims = [d for d in range(4) if shape4[d] == 1 and grad.shape[d] != 1]
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(bias.shape)


def dropout_keep_mask(seed: int, batch_heads: int, n_rows: int, n_cols: int, dropout_p: float, device) -> torch.Tensor:
    """Materialize the keep-mask the attention kernels draw, shape ``(batch_heads, n_rows, n_cols)``.

    For tests and the reference path only (it is O(N^2)); ``batch_heads`` indexes
    ``b * num_heads + h`` exactly as the kernels do.
    """
    out = torch.empty((batch_heads, n_rows, n_cols), dtype=torch.int8, device=device)
    block_m = 16
    grid = (triton.cdiv(n_rows, block_m), batch_heads)
    with device_guard(out.device):
        dropout_mask_kernel[grid](OUT=out, seed=seed, dropout_p=dropout_p, n_rows=n_rows, n_cols=n_cols,
                                  BLOCK_M=block_m, BLOCK_N=32)
    return out.bool()
