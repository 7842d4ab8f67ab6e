"""The decode kernels as a custom op, and the decode route of the fused path (below :mod:`sparse_attn.decode`).

``sparse_attn::entmax_decode`` wraps the launcher of ``kernels/attn/entmax_decode.py`` (forward only, with a fake
implementation for ``torch.compile``); it takes the spec as the fused ops do, field by field (``kernels/_spec.py``:
``flatten_spec`` / ``unflatten_spec``), its ``cache_seqlens`` the keys each sequence holds, and the threshold hint;
:func:`decode_fits` / :func:`decode_attention` are how
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
from sparse_attn.kernels._spec import flatten_spec, op_schema, unflatten_spec

__all__ = ["decode_attention", "decode_fits", "decode_unsupported"]


def _decode_impl(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode kernels as a custom op (forward only) on a flattened spec and ``tau_hint`` (float32 broadcastable
    to ``(B, Hq, Nq)`` or None, ``entmax_decode``'s): ``(out, tau, nnz, n_valid)``."""
    spec, (tau_hint,) = unflatten_spec(args)
    res = _launch(spec, True, False, tau_hint)
    return res.out, res.tau, res.nnz, res.n_valid


_DECODE_SCHEMA = f"({op_schema({'tau_hint': 'Tensor?'})}) -> (Tensor, Tensor, Tensor, Tensor)"
_decode_op = torch.library.custom_op("sparse_attn::entmax_decode", _decode_impl, mutates_args=(), schema=_DECODE_SCHEMA)


def _launch(spec: AttnSpec, stats: bool, reuse: bool, tau_hint=None):
    """The launcher on a spec whose ``k`` / ``v`` are a KV cache holding ``spec.cache_seqlens`` keys per sequence,
    for the op (``stats`` and not ``reuse``: every output fresh, the scratch allocated, which under
    ``torch.compile``'s CUDA graphs belongs to the graph's pool) or for an eager call that needs no op
    (:func:`_run_decode_op`: the scratch reused, the statistics computed into it unless ``stats``)."""
    from sparse_attn.kernels.attn import entmax_decode as kernels

    # the spec reaches the launcher whole (its fields are the launcher's arguments; ALPHA is made float32 there)
    return kernels.launch_decode(spec, counters=False, stats=stats, reuse_scratch=reuse, tau_hint=tau_hint)


@_decode_op.register_fake
def _decode_fake(*args):
    spec, _ = unflatten_spec(args)
    rows = spec.q.shape[:3]
    return (spec.q.new_empty((*rows, spec.head_dim_v)), spec.q.new_empty(rows, dtype=torch.float32),
            spec.q.new_empty(rows, dtype=torch.int32), spec.q.new_empty(rows, dtype=torch.int32))


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
    spec = spec.swapped(cache_seqlens=seqlens)
    if _direct(spec.q, spec.k, spec.v, seqlens, spec.mask, spec.block_table, spec.alibi_slopes, spec.sinks,
               spec.block_mask, spec.block_bits, tau_hint):
        res = _launch(spec, return_stats, True, tau_hint)
        out, tau, nnz, n_valid = res.out, res.tau, res.nnz, res.n_valid
    else:
        out, tau, nnz, n_valid = _decode_op(*flatten_spec(spec, tau_hint))
    return (out, AttentionStats(nnz, tau, n_valid)) if return_stats else out
