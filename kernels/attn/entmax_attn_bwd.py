"""Fused backward of alpha-entmax attention: dQ, dK, dV, d alpha per head and d bias.

Layout ``(batch, heads, seq, head_dim)``. The weights are recomputed tile by tile from the
forward's per-row statistics (``tau`` in the z-scale, ``lsum``); see ``docs/design.md`` for the
conventions and ``docs/backward.md`` for the derivation. With ``U = p^(2-alpha)`` on the support:

    dP = dO V^T (times the replayed dropout factor)   delta_i = sum_j U_ij dP_ij / sum_j U_ij = dO_i . out_u_i
    dS = U (dP - delta)    dQ = scale dS K    dK = scale dS^T Q    dV = P^T dO    d bias = dS

``out_u = sum_j U_ij v_j / sum_j U_ij`` (float32) comes from the forward's value pass (``need_out_u``; the unrounded
output at alpha = 1), so ``delta`` is an O(N D) product per row and no kernel sweeps K only for it.
Three kernels; by default no atomics, so every gradient is bitwise reproducible:

* ``_entmax_attn_bwd_dq_kernel``, one program per (query tile, q head, batch): ``delta``, then one sweep over
  the live key tiles accumulating dQ and the d alpha row sums and writing dS (or its row sums) when asked.
* ``_entmax_attn_bwd_dkdv_kernel``, one program per (key tile, kv head, batch): loops over the q
  heads of its group and their live query tiles, so dK/dV of GQA are summed in a fixed order. Its products take the
  keys as the MMA's M (``s^T = K Q^T``, ``dP^T = V dO^T``, then ``dV += P^T dO``, ``dK += dS^T Q``).
  With ``deterministic=False`` it also adds ``dQ`` (and the d alpha row sums) with atomics, and the dQ kernel only
  computes ``delta`` before it and d alpha after it: five products per tile instead of seven.
* ``_entmax_attn_bwd_dbias_kernel`` (only for a mask broadcast over batch/heads but not over
  queries or keys): one program per mask block sums dS over the broadcast (batch, head) pairs.

Each kernel has its own tiles (``_pick_config``: 64 or 128 query rows / keys per program, so that every product runs
on Hopper's warpgroup MMA), unions of the forward's tiles or parts of them; the liveness bitmap of the forward's
tiles is read for both (``_bwd_tiles._live_bits``). Every loop walks a compacted list of its live tiles built from
the liveness bits in registers (``_masking.bit_rank``, ``live_tile``), with no branch per tile, so its loads are
pipelined (the dQ kernel's with TMA descriptors on sm_90); the per-score mask is computed on boundary tiles only
(``_masking.tile_inside``). The alpha class is a compile-time constant as in the forward (``_args.ALPHA_CLASSES``;
device alpha: one filtered launch per class): alpha = 1 uses ``exp2``, alpha = 1.5 and alpha = 2 use no
transcendental function per score, other values one ``log2(1 + w)`` (``_common.log2_1p``: a series, or one
``lg2.approx``) and one ``exp2``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple

import torch
import triton

from .. import _args
from .._spec import kernel_spec
from ._bwd_kernels import _entmax_attn_bwd_dbias_kernel, _entmax_attn_bwd_dkdv_kernel, _entmax_attn_bwd_dq_kernel

_DEFAULT_BLOCK = 64


class BwdTiles(NamedTuple):
    """The pinned launch config of one backward kernel: its query tiles (``block_m`` rows), key tiles (``block_n``
    keys), warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _pick_config(head_dim: int, interpret: bool, need_dalpha: bool = False, dense_dbias: bool = False,
                 deterministic: bool = True, alpha_class: str = "mixed", elem_size: int = 2) -> dict:
    """``{kernel: BwdTiles}`` for ``"dq"``, ``"dkdv"``, ``"dbias"``: each backward kernel's own tiles and pinned
    launch config for this head dim and call. The tiles are powers of two, independent of the forward's (the
    bitmap's): a backward tile lies in one forward tile or is a union of whole ones (``_bwd_tiles._live_bits``).

    On a GPU these are the configs of the offline sm_90 builds (docs/backward.md), the first ``triton.autotune`` tries:
    every product on Hopper's warpgroup MMA up to head dim 128 (64 rows per warpgroup: the dQ and d bias kernels own
    64 or 128 query rows, the dK/dV kernel 128 keys, the M of all its products, ``_keys_as_m``), and no spill inside
    a loop for any alpha class. The row sums of d alpha (``need_dalpha``) and the stored dS tiles of a dense mask
    gradient (``dense_dbias``) need registers in the kernel that sweeps them: the dQ kernel, or without determinism
    the dK/dV kernel, which then also adds dQ; that kernel takes narrower tiles, as does the atomic dQ's dK/dV kernel
    at head dim 128 for the general alpha class (``alpha_class``: the launch's, ``"mixed"`` for a filtered launch of
    every class). The interpreter runs its own small tiles, chosen to exercise both relations to the forward's 32 x 32
    tiles.

    Float32 inputs (``elem_size`` 4) take narrow tiles on one pipeline stage: the 16-bit tiles need 328-492 KiB of
    shared memory at head dim 128 (sm_90 has 227 KiB; sm_90 builds, docs/backward.md "Float32 inputs"), these at most
    224 KiB at every head dim, with or without d alpha, a mask gradient or determinism."""
    if interpret:
        return dict(dq=BwdTiles(64, 16, 4, 1), dkdv=BwdTiles(16, 64, 4, 1), dbias=BwdTiles(16, 64, 4, 1))
    head_dim_block = _args.head_dim_block(head_dim)
    if elem_size > 2:
        if head_dim_block <= 128:
            return dict(dq=BwdTiles(64, 16, 4, 1), dkdv=BwdTiles(16, 32, 4, 1), dbias=BwdTiles(32, 16, 4, 1))
        return dict(dq=BwdTiles(32, 32, 4, 1), dkdv=BwdTiles(16, 32, 4, 1), dbias=BwdTiles(32, 32, 4, 1))
    dq_dalpha, dq_dense = (need_dalpha, dense_dbias) if deterministic else (False, False)
    if head_dim_block <= 64:
        dq = BwdTiles(128, 32 if dq_dalpha or dq_dense else 64, 8, 2)
        dkdv = BwdTiles(16 if not deterministic and need_dalpha and dense_dbias else 32, 128, 8, 2)
        return dict(dq=dq, dkdv=dkdv, dbias=BwdTiles(64, 32, 4, 2))
    if head_dim_block <= 128:
        if dq_dalpha and dq_dense:
            dq = BwdTiles(64, 16, 4, 2)
        else:
            dq = BwdTiles(128, 32 if dq_dalpha or dq_dense else 64, 8, 2)
        # the atomic dQ's extra product and its d alpha sums (or the general class's weights) leave no registers for
        # 32 query rows a step
        narrow = not deterministic and (need_dalpha or alpha_class in ("general", "mixed"))
        dkdv = BwdTiles(16 if narrow else 32, 128, 8, 2)
        return dict(dq=dq, dkdv=dkdv, dbias=BwdTiles(64, 32, 4, 2))
    dq = BwdTiles(64, 16 if dq_dalpha or dq_dense else 32, 4, 2)
    return dict(dq=dq, dkdv=BwdTiles(16, 32, 8, 2), dbias=BwdTiles(64, 32, 8, 2))


def _keys_as_m(head_dim: int, head_dim_v: int) -> bool:
    """Whether the dK/dV kernel takes its products with the keys as the MMA's M (``KEYS_M``): up to head dim 128. Above,
    a warpgroup's 64 keys would hold 2 x 64 x 256 float32 accumulators (256 registers a thread), and eight warps on 64
    keys repeat the score products on both warpgroups (sm_90 builds, docs/backward.md): the query rows are the M."""
    return _args.head_dim_block(max(head_dim, head_dim_v)) <= 128


def _call_flags(args: dict) -> tuple:
    """``(need_dalpha, dense_dbias, deterministic, alpha_class, elem_size)`` of ``_pick_config`` from one kernel
    launch's arguments: as far as they choose that kernel's tiles (the dQ kernel's sweep, or without determinism the
    dK/dV kernel, accumulates the d alpha sums and stores the dense dS tiles; a filtered launch is ``"mixed"``; the
    inputs' element size)."""
    deterministic = args.get("PHASE", 0) == 0 and not args.get("NEED_DQ", False)
    alpha_class = "mixed" if args.get("HEAD_FILTER", True) else _args.CLASS_NAMES[args["ALPHA_CLASS"]]
    return (bool(args.get("NEED_DALPHA", False)), bool(args.get("NEED_DBIAS", False)), deterministic, alpha_class,
            args["Q"].element_size())


def _pinned(kernel: str):
    """``args -> (num_warps, num_stages)`` of ``kernel``'s pinned GPU config for a launch's arguments
    (``_args.prune_to_pinned``)."""
    def pinned(args):
        tiles = _pick_config(args["HEAD_DIM"], False, *_call_flags(args))[kernel]
        return tiles.num_warps, tiles.num_stages
    return pinned


_TUNE_KEY = ["HEAD_DIM", "HEAD_DIM_V", "BLOCK_M", "BLOCK_N", "ALPHA_CLASS", "HEAD_FILTER", "BIAS_KIND", "MASK",
             "IS_VARLEN", "HAS_LIVE", "LIVE_BLOCK_M", "LIVE_BLOCK_N", "HAS_DROPOUT", "DOT_PRECISION", "USE_TMA"]
# on a GPU each kernel is autotuned per head dim, tile, alpha class, feature flags and precision; the interpreter
# runs the pinned config (autotuning several fails there)
_entmax_attn_bwd_dq_autotuned = triton.autotune(
    configs=_args.launch_configs(), key=_TUNE_KEY + ["PHASE", "NEED_DALPHA", "NEED_DBIAS", "NEED_DBIAS_ROWS"],
    prune_configs_by={"early_config_prune": _args.prune_to_pinned(_pinned("dq"), by_args=True)},
)(_entmax_attn_bwd_dq_kernel)
# the dK/dV kernel adds into DK, DV with HEAD_FILTER (and into DQ, ROW_SUMS, DBIAS_ROWS without determinism), the
# dbias kernel into DBIAS: every autotuning run restores them
_entmax_attn_bwd_dkdv_autotuned = triton.autotune(
    configs=_args.launch_configs(),
    key=_TUNE_KEY + ["NEED_DBIAS_COLS", "NEED_DQ", "NEED_DALPHA", "NEED_DBIAS", "NEED_DBIAS_ROWS", "KEYS_M"],
    restore_value=["DK", "DV", "DQ", "ROW_SUMS", "DBIAS_ROWS"],
    prune_configs_by={"early_config_prune": _args.prune_to_pinned(_pinned("dkdv"), by_args=True)},
)(_entmax_attn_bwd_dkdv_kernel)
_entmax_attn_bwd_dbias_autotuned = triton.autotune(
    configs=_args.launch_configs(), key=_TUNE_KEY, restore_value=["DBIAS"],
    prune_configs_by={"early_config_prune": _args.prune_to_pinned(_pinned("dbias"), by_args=True)},
)(_entmax_attn_bwd_dbias_kernel)


def _launch(name: str, grid: tuple, args: dict, alpha_class: str, forced: BwdTiles | None = None) -> None:
    """Launch kernel ``name`` (``"dq"``, ``"dkdv"``, ``"dbias"``) once per alpha class (``_args.class_launches``):
    autotuned on a GPU, pinned under the interpreter or with ``SPARSE_ATTN_PINNED=1``, or with the warps and stages
    of a ``forced`` config (its tiles are in ``args``)."""
    for cls, head_filter in _args.class_launches(alpha_class):
        launch = dict(args, ALPHA_CLASS=cls, HEAD_FILTER=head_filter)
        if forced is not None or _args.pinned_launch():
            tiles = forced or _pick_config(args["HEAD_DIM"], _args.interpreting(), *_call_flags(launch))[name]
            globals()[f"_entmax_attn_bwd_{name}_kernel"][grid](**launch, num_warps=tiles.num_warps,
                                                               num_stages=tiles.num_stages)
        else:
            globals()[f"_entmax_attn_bwd_{name}_autotuned"][grid](**launch)


def _check_args(do, q, k, v, out, out_u, tau, tau_lo, lsum, bias, cu_seqlens_q, cu_seqlens_k, live, block_m,
                block_n):
    """Cheap consistency asserts; ``sparse_attn.entmax_attention`` validates user input before this."""
    assert q.ndim == 4 and q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"q: got {q.dtype} {q.shape}"
    assert all(t.dtype == q.dtype and t.device == q.device for t in (k, v, do, out)), "k, v, do, out: q's dtype"
    out_shape = (*q.shape[:3], v.shape[3])
    assert do.shape == out_shape and out.shape == out_shape, f"do, out: expected shape {out_shape}"
    assert out_u is None or (out_u.shape == out_shape and out_u.dtype in (torch.float32, q.dtype)), (
        "out_u: expected the output's shape, float32 (or q's dtype)")
    assert v.shape[:3] == k.shape[:3] and k.ndim == 4 and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3], (
        "k, v: shape")
    assert 16 <= v.shape[3] <= 256, f"v: head dim must be in [16, 256], got {v.shape[3]}"
    assert k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0, f"k: kv heads must divide {q.shape[1]}, got {k.shape[1]}"
    assert all(t.shape == q.shape[:3] and t.dtype == torch.float32 for t in (tau, lsum)), "tau, lsum: (B, Hq, Nq) fp32"
    assert tau_lo is None or (tau_lo.shape == tau.shape and tau_lo.dtype == torch.float32), "tau_lo: like tau"
    assert 16 <= q.shape[3] <= 256, f"q: head dim must be in [16, 256], got {q.shape[3]}"
    assert bias is None or bias.is_floating_point() or bias.dtype in (torch.bool, torch.uint8), "bias: float or bool"
    assert (cu_seqlens_q is None) == (cu_seqlens_k is None), "cu_seqlens_q, cu_seqlens_k: expected both or neither"
    assert cu_seqlens_q is None or (q.shape[0] == 1 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32), (
        "cu_seqlens_q, cu_seqlens_k: expected int32 offsets and batch 1")
    assert live is None or (block_m is not None and block_n is not None), "block_m, block_n: required with live"


# the kernels whose loops load their tiles with TMA descriptors on sm_90 (``USE_TMA``): the dQ kernel (its K / V
# tiles). The dK/dV and d bias kernels can (the same code, tested under the interpreter), but their sm_90 builds
# spill inside the loop with TMA (the descriptors and barriers cost registers) and not without (docs/backward.md)
_TMA_KERNELS = ("dq",)


def _live_args(live, like) -> dict:
    """``LIVE`` and its ``stride_live_b/h/m`` kernel arguments (``like`` and 0 without a bitmap)."""
    live = like if live is None else live.contiguous()
    strides = live.stride()[:3] if live is not like else (0, 0, 0)
    return dict(LIVE=live, stride_live_b=strides[0], stride_live_h=strides[1], stride_live_m=strides[2])


def _zero_grads(q, k, v, bias, need_dalpha, need_dbias):
    """The gradients of a problem without rows or keys: all zero."""
    zeros32 = dict(dtype=torch.float32, device=q.device)
    dalpha = torch.zeros(q.shape[1], **zeros32) if need_dalpha else None
    dbias_shape = (*q.shape[:3], k.shape[2]) if bias is None else bias.shape
    dbias = torch.zeros(dbias_shape, **zeros32) if need_dbias else None
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dalpha, dbias


# what the kernels write: gradients, per-row delta, weight factors (``_bwd_tiles._row_factors``) and d alpha
# partials, and the d bias accumulation
# mode (``_args.dbias_mode``, None when not needed) with its buffers; without determinism the float32 dQ the
# dK/dV kernel adds into and its six d alpha row sums per row
_Buffers = namedtuple("_Buffers", "dq dk dv delta row_factors dalpha_rows mode dbias dbias_rows dbias_cols dq32 "
                                   "row_sums")


def _buffers(q, k, v, bias, is_varlen, need_dalpha, need_dbias, deterministic) -> _Buffers:
    """Allocate what the kernels write; d bias buffers, and the buffers atomics add into, are zeroed float32
    (``delta`` stands in where unused)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if is_varlen:
        # rows and keys outside every sequence are never visited
        for g in (dq, dk, dv):
            g.zero_()
    full = (*q.shape[:3], k.shape[2])
    delta = torch.empty(full[:3], dtype=torch.float32, device=q.device)
    mode = _args.dbias_mode(bias, full) if need_dbias else None
    zeros32 = dict(dtype=torch.float32, device=q.device)
    return _Buffers(
        dq, dk, dv, delta, torch.empty((*full[:3], 3), dtype=torch.float32, device=q.device),
        torch.zeros_like(delta) if need_dalpha else delta, mode,
        torch.zeros(full, **zeros32) if mode == "dense" else delta,
        torch.zeros(full[:3], **zeros32) if mode == "rows" else delta,
        torch.zeros((*full[:2], full[3]), **zeros32) if mode == "cols" else delta,
        dq if deterministic else torch.zeros(q.shape, **zeros32),
        torch.zeros((*full[:3], 6), **zeros32) if need_dalpha and not deterministic else delta,
    )


def _common_args(spec, seed, do, tau, tau_lo, delta, row_factors, live, live_tiles: tuple, tiles: BwdTiles,
                 use_tma: bool) -> dict:
    """Keyword arguments of one backward kernel with its ``tiles`` (``TAU`` is the pair ``(tau, tau_lo)``, zeros
    without ``tau_lo``); ``live_tiles``: the bitmap's (the forward's)
    ``(block_m, block_n)``; ``use_tma``: stream the loops' tiles with TMA descriptors (``USE_TMA``). A block mask is
    decided by the tile loops alone (``SCORE.blocks`` 1) only when its blocks are unions of both the forward's tiles
    (the bitmap) and the kernel's."""
    whole = None if live is None else (max(live_tiles[0], tiles.block_m), max(live_tiles[1], tiles.block_n))
    args = _args.attention_args(spec, seed, whole)
    return dict(
        args, DO=do, TAU=(tau.contiguous(), torch.zeros_like(tau) if tau_lo is None else tau_lo.contiguous()),
        DELTA=delta, ROW_FACTORS=row_factors,
        **_args.stride_args("stride_do", do, "bhmd"), **_live_args(live, spec.q), HAS_LIVE=live is not None,
        LIVE_BLOCK_M=live_tiles[0], LIVE_BLOCK_N=live_tiles[1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        USE_TMA=use_tma,
    )


def entmax_attn_bwd(
    do, q, k, v, out, tau, lsum, alpha, scale, bias=None, is_causal=False, cu_seqlens_q=None,
    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, seed=0,
    live=None, block_m=None, block_n=None, need_dalpha=False, need_dbias=False, *, out_u=None, alpha_class=None,
    window_size=None, alibi_slopes=None, softcap=None, sinks=None, block_mask=None, deterministic=True, tiles=None,
    tau_lo=None,
):
    """Gradients of alpha-entmax attention from the forward's per-row statistics.

    Arguments are validated by the caller (``sparse_attn.entmax_attention``); here only cheap
    asserts and the launch-grid limit.

    Args:
        do: ``(B, Hq, Nq, D)`` gradient of the output, same dtype as ``q``; any strides.
        q: ``(B, Hq, Nq, D)`` queries, float16 / bfloat16 / float32; any strides. ``16 <= D <= 256``.
        k, v: ``(B, Hk, Nk, D)`` keys and values, dtype of ``q``; ``Hq % Hk == 0`` (GQA/MQA).
        out: ``(B, Hq, Nq, D)`` forward output (``delta = dO . O`` when ``out_u`` is None: softmax only).
        tau, lsum: float32 ``(B, Hq, Nq)`` forward statistics (``docs/design.md``): for
            alpha > 1, ``p = [(alpha-1) s - tau]_+^(1/(alpha-1)) / lsum``; for alpha = 1,
            ``p = exp(s - tau)``. ``lsum == 0`` marks a row with no valid key (zero gradients).
            The forward's value pass sums its weights at exactly the saved ``tau``, so ``lsum`` normalizes them.
        alpha: float32 ``(Hq,)`` per-head alpha in ``[1, 2]`` (a Python float is broadcast).
        scale: float, scores are ``scale * q . k + bias``.
        bias: optional float tensor broadcastable (zero strides allowed) to ``(B, Hq, Nq, Nk)``;
            ``-inf`` marks masked pairs. Default None.
        is_causal: bottom-right aligned causal mask (``kernels/_masking.py``). Default False.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` for variable length (then ``B == 1``
            and ``Nq``/``Nk`` are the packed totals). Default None.
        max_seqlen_q, max_seqlen_k: longest sequences (computed from ``cu_seqlens`` when None).
        dropout_p, seed: dropout of the forward, replayed with ``kernels._common.dropout_keep``.
        live: optional int32 ``(B or nseq, Hq, cdiv(max_seqlen_q, block_m), words)`` tile
            liveness bits of the forward; dead tiles are skipped. Requires ``block_m``/``block_n``.
        block_m, block_n: the forward's tile sizes (powers of two >= 16; default 64), which index ``live``; the
            backward's kernels have tiles of their own (``_pick_config``), inside the forward's or unions of them.
        need_dalpha: also return the alpha gradient. Default False.
        need_dbias: also return the bias gradient. Default False.
        out_u: ``(B, Hq, Nq, D)`` float32 (or ``q.dtype``), the forward's ``sum_j U_ij v_j / sum_j U_ij``
            (``entmax_attn_fwd(..., need_out_u=True).out_u``), from which ``delta = dO . out_u``; may be None
            when every head is softmax (then ``out`` serves, rounded to ``q.dtype``). Default None.
        alpha_class: compile-time alpha class as in ``entmax_attn_fwd`` (``"softmax"``, ``"sparsemax"``,
            ``"entmax15"``, ``"general"`` or ``"mixed"``: one filtered launch of each kernel per class); default from
            the values of a Python float or a CPU tensor (no device sync), else ``"mixed"``.
        window_size, alibi_slopes, softcap: the forward's sliding window, ALiBi slopes and soft cap
            (``entmax_attn_fwd``), or None.
        sinks: the forward's ``(Hq,)`` per-head sink logits (``entmax_attn_fwd``), or None. Default None.
        block_mask: the forward's ``(mask, (bq, bk))`` block mask, or None (key tiles it hides are dead in ``live``).
        deterministic: True (default): no atomics, every gradient bitwise reproducible (the dQ kernel sweeps the
            keys: seven products per live tile). False: the dK/dV kernel adds dQ (float32) with atomics, five
            products per live tile, results reproducible to float32 rounding only (docs/backward.md).
        tiles: ``{kernel: (block_m, block_n, num_warps, num_stages)}`` replacing the pinned config of ``"dq"``,
            ``"dkdv"`` or ``"dbias"`` (launch-config tuning, ``benchmarks/gpu/tune_tiles.py``): tiles powers of two
            >= 16, 4 or 8 warps; such a kernel is launched with exactly these warps and stages, not autotuned. Default
            None.
        tau_lo: float32 ``(B, Hq, Nq)``, the forward's ``tau_lo`` (the rounding residual of ``tau``): the scores are
            taken relative to ``tau + tau_lo`` (docs/kernels.md, "Shift invariance"). None: zeros (``tau`` exact),
            which loses the weights of rows whose scores are large (a huge additive mask constant). Default None.

    Returns:
        ``(dq, dk, dv, dalpha, dbias)``: ``dq`` like ``q``, ``dk``/``dv`` like ``k``/``v``
        (summed over the q heads of each kv group), ``dalpha`` float32 ``(Hq,)`` summed over
        batch and rows or None, ``dbias`` float32 in the shape of ``bias`` (``dS`` summed over the
        dims ``bias`` broadcasts along; ``(B, Hq, Nq, Nk)`` when ``bias`` is None) or None. Extra
        memory for it is O(B Hq (Nq + Nk)) plus the mask's own size: key- or query-broadcast masks
        use per-row / per-key sums from the two kernels, masks broadcast only over batch/heads
        ``_entmax_attn_bwd_dbias_kernel``. With ``sinks`` a sixth entry follows: ``dsinks``, ``(Hq,)`` in the dtype
        of ``sinks`` (float32 per-row gradients summed over batch and rows).

    Raises:
        ValueError: more than 65535 heads or batch entries (sequences) (``_args.tile_plan``).
    """
    spec = kernel_spec(q, k, v, alpha, scale, bias=bias, is_causal=is_causal, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       dropout_p=dropout_p, alpha_class=alpha_class, window_size=window_size,
                       alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, block_mask=block_mask)
    return launch_bwd(spec, seed, do, out, tau, lsum, out_u=out_u, tau_lo=tau_lo, live=live, block_m=block_m,
                      block_n=block_n, need_dalpha=need_dalpha, need_dbias=need_dbias, deterministic=deterministic,
                      tiles=tiles)


@_args.launches_on(lambda spec, *args, **kwargs: spec.q)
def launch_bwd(spec, seed, do, out, tau, lsum, *, out_u=None, tau_lo=None, live=None, block_m=None, block_n=None,
               need_dalpha=False, need_dbias=False, deterministic=True, tiles=None):
    """:func:`entmax_attn_bwd` of an ``AttnSpec`` (``kernels/_spec.py``: the fused op's spec, or ``kernel_spec`` of the
    launcher's keywords), with the forward's dropout ``seed``, outputs and statistics and the options of
    :func:`entmax_attn_bwd`."""
    q, k, v, alpha, bias, sinks = spec.q, spec.k, spec.v, spec.alpha, spec.mask, spec.sinks
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = (spec.cu_seqlens_q, spec.cu_seqlens_k, spec.max_seqlen_q,
                                                              spec.max_seqlen_k)
    _check_args(do, q, k, v, out, out_u, tau, tau_lo, lsum, bias, cu_seqlens_q, cu_seqlens_k, live, block_m, block_n)
    n_heads = q.shape[1]
    assert sinks is None or sinks.shape == (n_heads,), f"sinks: expected shape ({n_heads},)"
    if q.shape[0] * n_heads * q.shape[2] == 0 or k.shape[2] == 0:
        grads = _zero_grads(q, k, v, bias, need_dalpha, need_dbias)
        return grads if sinks is None else (*grads, torch.zeros_like(sinks))
    dense = need_dbias and _args.dbias_mode(bias, (*q.shape[:3], k.shape[2])) == "dense"
    alpha_class = _args.resolve_alpha_class(alpha, spec.alpha_class)
    config = _pick_config(q.shape[3], _args.interpreting(), bool(need_dalpha), dense, deterministic, alpha_class,
                          q.element_size())
    forced = {name: BwdTiles(*t) for name, t in (tiles or {}).items()}
    assert set(forced) <= set(config), f"tiles: expected kernels among {sorted(config)}, got {sorted(forced)}"
    assert all(b >= 16 and b & (b - 1) == 0 for t in forced.values() for b in t[:2]) and all(
        t.num_warps in (4, 8) and t.num_stages >= 1 for t in forced.values()), f"tiles: got {tiles}"
    config.update(forced)
    # the bitmap's tiles are the forward's (block_m x block_n); each kernel's tiles lie in them or are unions of them
    live_tiles = tuple(_DEFAULT_BLOCK if b is None else int(b) for b in (block_m, block_n))
    live_plan = _args.tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *live_tiles)
    live_shape = (live_plan.n_seq, n_heads, live_plan.n_q_tiles, live_plan.n_words)
    assert live is None or (live.shape == live_shape and live.dtype == torch.int32), f"live: expected {live_shape}"
    assert out_u is not None or alpha_class == "softmax", (
        "out_u: required unless every head has alpha = 1 (entmax_attn_fwd(..., need_out_u=True).out_u)")
    plans = {name: _args.tile_plan(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, t.block_m,
                                      t.block_n) for name, t in config.items()}
    buf = _buffers(q, k, v, bias, cu_seqlens_q is not None, need_dalpha, need_dbias, deterministic)
    if alpha_class == "mixed" and n_heads > k.shape[1] and k.dtype != torch.float32:
        # each class launch of the dK/dV kernel adds the group's heads of its class: partial sums in float32
        buf = buf._replace(dk=torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                           dv=torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    elif alpha_class == "mixed":
        # one class per dK/dV row (no GQA), or float32 already: the launches add into zeros exactly
        buf.dk.zero_()
        buf.dv.zero_()

    # the dQ kernel's K / V tiles by TMA where the device and layout allow (_TMA_KERNELS) and their scratch (two
    # descriptors per program) is no larger than dQ
    dq_grid = (plans["dq"].n_q_tiles, n_heads, plans["dq"].n_seq)
    use_tma = (_args.tma_device(q.device) and all(_args.tma_rows(t) for t in (q, k, v, do))
               and _args.tma_scratch_fits(dq_grid, 2, buf.dq))

    def kernel_args(name):
        return _common_args(spec, seed, do, tau, tau_lo, buf.delta, buf.row_factors, live, live_tiles, config[name],
                            use_tma and name in _TMA_KERNELS)

    out_u = out if out_u is None else out_u
    # rows outside every packed sequence are never visited
    dsinks_rows = None if sinks is None else torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    # deterministic: the dQ kernel sweeps the keys (PHASE 0); otherwise the dK/dV kernel computes dQ and the row sums,
    # between the dQ kernel's delta (PHASE 1) and its d alpha from those sums (PHASE 2)
    dq_args = dict(
        kernel_args("dq"), LSUM=lsum.contiguous(), OUT_U=out_u, DQ=buf.dq, DALPHA=buf.dalpha_rows, DBIAS=buf.dbias,
        DSINKS=buf.delta if dsinks_rows is None else dsinks_rows, DBIAS_ROWS=buf.dbias_rows, ROW_SUMS=buf.row_sums,
        **_args.stride_args("stride_ou", out_u, "bhmd"), **_args.stride_args("stride_dq", buf.dq, "bhmd"),
        NEED_DALPHA=bool(need_dalpha), NEED_DBIAS=deterministic and buf.mode == "dense",
        NEED_DBIAS_ROWS=deterministic and buf.mode == "rows",
    )
    _launch("dq", dq_grid, dict(dq_args, PHASE=0 if deterministic else 1), alpha_class, forced.get("dq"))
    plan = plans["dkdv"]
    _launch("dkdv", (plan.n_k_tiles, k.shape[1], plan.n_seq), dict(
        kernel_args("dkdv"), DK=buf.dk, DV=buf.dv, DBIAS_COLS=buf.dbias_cols, DQ=buf.dq32, ROW_SUMS=buf.row_sums,
        DBIAS=buf.dbias, DBIAS_ROWS=buf.dbias_rows, **_args.stride_args("stride_dk", buf.dk, "bhnd"),
        **_args.stride_args("stride_dv", buf.dv, "bhnd"), **_args.stride_args("stride_dq", buf.dq32, "bhmd"),
        NEED_DBIAS_COLS=buf.mode == "cols", NEED_DQ=not deterministic,
        NEED_DALPHA=bool(need_dalpha) and not deterministic, NEED_DBIAS=not deterministic and buf.mode == "dense",
        NEED_DBIAS_ROWS=not deterministic and buf.mode == "rows", KEYS_M=_keys_as_m(q.shape[3], v.shape[3]),
    ), alpha_class, forced.get("dkdv"))
    if not deterministic:
        if need_dalpha:
            _launch("dq", dq_grid, dict(dq_args, PHASE=2), alpha_class, forced.get("dq"))
        buf = buf._replace(dq=buf.dq32.to(q.dtype))
    dalpha = buf.dalpha_rows.double().sum(dim=(0, 2)).float() if need_dalpha else None
    buf = buf._replace(dk=buf.dk.to(k.dtype), dv=buf.dv.to(v.dtype))  # no copy unless float32 partials
    dbias = None if buf.mode is None else _dbias(buf, bias, cu_seqlens_q, plans, n_heads, kernel_args("dbias"),
                                                 alpha_class, forced.get("dbias"))
    if sinks is None:
        return buf.dq, buf.dk, buf.dv, dalpha, dbias
    return buf.dq, buf.dk, buf.dv, dalpha, dbias, dsinks_rows.double().sum(dim=(0, 2)).to(sinks.dtype)


def _dbias(buf, bias, cu_seqlens_q, plans, n_heads, common, alpha_class, forced=None):
    """d bias in the shape of ``bias`` from the kernels' buffers (and the dbias kernel for batch/head broadcasts)."""
    if buf.mode == "blocks":
        dbias = _dbias_blocks(_args.mask_shape4(bias), cu_seqlens_q is not None, plans["dbias"], n_heads, common,
                              alpha_class, forced)
    else:
        dbias = {"rows": buf.dbias_rows[..., None], "cols": buf.dbias_cols[:, :, None]}.get(buf.mode, buf.dbias)
    return _args.sum_to_mask(dbias, bias)


def _dbias_blocks(bias_shape, is_varlen, plan, n_heads, common, alpha_class, forced=None):
    """d bias of a mask broadcast over batch and/or heads only, in the mask's 4-d shape (dbias kernel)."""
    dbias = torch.zeros(bias_shape, dtype=torch.float32, device=common["Q"].device)
    full_b, full_h = bias_shape[0] != 1 or is_varlen, bias_shape[1] != 1
    _launch("dbias", (plan.n_q_tiles, n_heads if full_h else 1, plan.n_seq if full_b else 1), dict(
        common, DBIAS=dbias, stride_dbias_b=0 if is_varlen else dbias.stride(0), stride_dbias_h=dbias.stride(1),
        n_b_loop=1 if full_b else plan.n_seq, n_h_loop=1 if full_h else n_heads,
    ), alpha_class, forced)
    return dbias
