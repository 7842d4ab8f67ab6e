"""The decode kernels as a custom op, and the decode route of the fused path (below :mod:`sparse_attn.decode`).

``sparse_attn::entmax_decode`` wraps the launcher of ``kernels/attn/entmax_decode.py`` (forward only, with a fake
implementation for ``torch.compile``); :func:`decode_fits` / :func:`decode_attention` are how
:func:`sparse_attn.entmax_attention` sends a decoding step to it (``sparse_attn.attn._attn_autograd``), and
:func:`_run_decode_op` how both reach the kernels: through the op, or straight to the launcher for eager calls that
need no op (:func:`_direct`). Design and measurements: docs/decode.md.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from sparse_attn.attn._kv_cache import MAX_DECODE_QUERIES
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec
from sparse_attn.attn.routes import refused
from sparse_attn.kernels._args import alpha_class_of

__all__ = ["decode_attention", "decode_fits", "decode_unsupported"]


@torch.library.custom_op("sparse_attn::entmax_decode", mutates_args=())
def _decode_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, alpha: Tensor, alpha_value: float | None,
    scale: float, block_table: Tensor | None, bias: Tensor | None, is_causal: bool, max_seqlen_k: int | None,
    num_splits: int | None, window_size: list[int] | None, alibi_slopes: Tensor | None, softcap: float | None,
    sinks: Tensor | None, block_mask: Tensor | None = None, block_size: list[int] | None = None,
    block_bits: Tensor | None = None, tau_hint: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode kernels as a custom op (forward only): ``(out, tau, nnz, n_valid)``; ``alpha`` float32 ``(Hq,)``,
    ``alpha_value`` the Python number it holds when it was given as one (one compile-time alpha class);
    ``block_mask``, ``block_size``, ``block_bits``: the spec's block grid, its ``(bq, bk)`` and its partial blocks'
    bits (None without them); ``tau_hint`` float32 broadcastable to ``(B, Hq, Nq)`` or None (``entmax_decode``'s)."""
    res = _launch(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                  max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask, block_size,
                  block_bits, True, False, tau_hint)
    return res.out, res.tau, res.nnz, res.n_valid


def _launch(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
            max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask, block_size, block_bits,
            stats, reuse, tau_hint=None):
    """The launcher on the op's arguments, for the op (``stats`` and not ``reuse``: every output fresh, the scratch
    allocated, which under ``torch.compile``'s CUDA graphs belongs to the graph's pool) or for an eager call that
    needs no op (:func:`_run_decode_op`: the scratch reused, the statistics computed into it unless ``stats``)."""
    from sparse_attn.kernels.attn import entmax_decode as kernels

    return kernels.entmax_decode_fwd(
        q, k_cache, v_cache, cache_seqlens, alpha, scale, block_table=block_table, bias=bias, is_causal=is_causal,
        window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, max_seqlen_k=max_seqlen_k,
        num_splits=num_splits,
        block_mask=None if block_mask is None else (block_mask, tuple(block_size), block_bits),
        alpha_class=None if alpha_value is None else alpha_class_of([alpha_value]), counters=False,
        stats=stats, reuse_scratch=reuse, tau_hint=tau_hint)


@_decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, alpha, alpha_value, scale, block_table, bias, is_causal,
                 max_seqlen_k, num_splits, window_size, alibi_slopes, softcap, sinks, block_mask=None, block_size=None,
                 block_bits=None, tau_hint=None):
    rows = q.shape[:3]
    return (q.new_empty((*rows, v_cache.shape[-1])), q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.int32), q.new_empty(rows, dtype=torch.int32))


def _window_arg(window_size) -> list[int] | None:
    """``window_size`` as the custom op takes it (a list of ints, or None)."""
    return None if window_size is None else [int(w) for w in window_size]


def decode_unsupported(inputs: AttnSpec) -> list[str]:
    """What keeps a fused-path call off the decode kernels, as phrases (empty: they can run it).

    The variants the ``"decode"`` route does not list in :data:`sparse_attn.attn.routes.SUPPORTED`: the decode kernels
    implement masks (boolean or float), bottom-right causal masking, GQA/MQA, per-head alpha and every attention
    variant the fused path takes (sliding window, ALiBi, sinks, soft cap, ``Dv != D``, a block mask), forward only.
    What the fused path refuses (:func:`sparse_attn.attn.attn_inputs.unfused_variants`: slopes that require grad, value
    head dims outside [16, 256]) never reaches here.
    """
    return refused("decode", inputs.used())


def decode_fits(inputs: AttnSpec) -> bool:
    """Whether the fused path runs ``inputs`` on the split-K decode kernels instead of the general forward.

    A decoding step: ``1 <= Nq <= MAX_DECODE_QUERIES`` queries per sequence against more keys than queries (a KV
    cache; ``Nk > Nq``), on the triton backend, with nothing from :func:`decode_unsupported`.
    """
    n_q, n_k = inputs.q.shape[2], inputs.k.shape[2]
    return (inputs.backend == "triton" and 1 <= n_q <= MAX_DECODE_QUERIES and n_k > n_q
            and not decode_unsupported(inputs))


def decode_attention(inputs: AttnSpec, return_stats: bool | None = None):
    """Run prepared inputs for which :func:`decode_fits` holds on the decode kernels: ``k``, ``v`` are a contiguous
    cache of ``Nk`` keys for every sequence. Returns ``out`` ``(B, Hq, Nq, Dv)`` or ``(out, AttentionStats)``
    (``return_stats`` None: the spec's ``need_stats``)."""
    return _run_decode_op(inputs, _whole_cache(inputs.q.shape[0], inputs.q.device),
                          inputs.need_stats if return_stats is None else return_stats)


_WHOLE: dict = {}


def _whole_cache(batch: int, device: torch.device) -> Tensor:
    """Lengths that say "every key of the cache": int32 ``(B,)`` of int32's largest value, which the kernels clamp to
    ``max_seqlen_k`` (the cache's ``Nk``). One tensor per (batch size, device), made outside CUDA graph captures
    and compiled traces (within them: a new one, part of the graph)."""
    if torch.compiler.is_compiling():
        return torch.full((batch,), 2**31 - 1, dtype=torch.int32, device=device)
    lengths = _WHOLE.get((batch, device))
    if lengths is None:
        lengths = torch.full((batch,), 2**31 - 1, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _WHOLE[(batch, device)] = lengths
    return lengths


def _direct(*tensors) -> bool:
    """Whether an eager call may run the launcher without the custom op: plain tensors (or parameters) off the meta
    device, nothing tracing (``torch.compile``, ``torch.jit.trace``) and no dispatch mode (fake tensors, counters,
    ...) that must see the op. The op adds only its dispatch: the launcher and its results are the same."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or (type(t) in (Tensor, torch.nn.Parameter) and t.device.type != "meta") for t in tensors)


def _run_decode_op(spec: AttnSpec, seqlens: Tensor, return_stats: bool, tau_hint: Tensor | None = None):
    """The decode kernels on a spec whose ``k`` / ``v`` are a KV cache holding ``seqlens`` keys per sequence: ``out``
    or ``(out, AttentionStats)``; through the custom op, or straight to the launcher where :func:`_direct` allows.
    ``tau_hint``: ``entmax_decode``'s, checked."""
    args = (spec.q, spec.k, spec.v, seqlens, spec.alpha.detach().float().contiguous(), spec.alpha_value, spec.scale,
            spec.block_table, spec.mask, spec.is_causal, spec.max_seqlen_k, spec.num_splits,
            _window_arg(spec.window_size), spec.alibi_slopes, spec.softcap, spec.sinks, spec.block_mask,
            None if spec.block_size is None else [int(n) for n in spec.block_size], spec.block_bits, tau_hint)
    if _direct(spec.q, spec.k, spec.v, seqlens, spec.mask, spec.block_table, spec.alibi_slopes, spec.sinks,
               spec.block_mask, spec.block_bits, tau_hint):
        res = _launch(*args[:-1], return_stats, True, tau_hint)
        out, tau, nnz, n_valid = res.out, res.tau, res.nnz, res.n_valid
    else:
        out, tau, nnz, n_valid = _decode_op(*args)
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out
