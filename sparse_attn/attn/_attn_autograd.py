"""Autograd wiring of the fused kernels as ``torch.library`` custom ops.

``sparse_attn::entmax_attn_fwd`` and ``sparse_attn::entmax_attn_bwd`` wrap the Triton launchers;
their fake implementations give output shapes, so ``torch.compile(fullgraph=True)`` traces
through them, and ``register_autograd`` connects the handwritten backward. The forward computes the
backward's ``out_u`` (docs/backward.md) only when an input requires a gradient and grad mode is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from sparse_attn.attn._decode_op import decode_attention, decode_fits
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec
from sparse_attn.attn.routes import refusal_message, refused
from sparse_attn.kernels._spec import DECLS, DIFFERENTIABLE, flatten_spec, op_schema, unflatten_spec
from sparse_attn.kernels._spec import FIELDS as SPEC_FIELDS
from sparse_attn.kernels.attn.entmax_attn_bwd import launch_bwd
from sparse_attn.kernels.attn.entmax_attn_fwd import fwd_block_sizes, launch_fwd


def _live_shape(spec: AttnSpec):
    block_m, block_n = fwd_block_sizes(spec.head_dim)
    n_qt = -(-spec.max_seqlen_q // block_m)
    n_kt = -(-spec.max_seqlen_k // block_n)
    n_words = -(-n_kt // 32)
    return (spec.n_seqs, spec.n_heads, n_qt, n_words), (spec.n_seqs, spec.n_heads, n_qt)


FWD_FIELDS = SPEC_FIELDS + ("seed",)
"""The forward op's arguments by name, in its positional order: the spec's fields (their schema types declared in
``kernels/_spec.py``, ``DECLS``), then the dropout seed."""
_TENSOR_FIELDS = tuple(name for name, decl in DECLS.items() if decl.op_type.startswith("Tensor"))
_SPEC_SCHEMA = op_schema({"seed": "SymInt"})  # SymInt: under torch.compile the seed is drawn in the graph
_FWD_OUTPUTS = ("out", "tau", "tau_lo", "lsum", "nnz", "n_valid", "live", "n_passes", "tile_visits", "out_u")
_BWD_EXTRA = ("do", "out", "out_u", "tau", "tau_lo", "lsum", "live", "need_dalpha", "need_dmask")
"""The backward op's arguments before the spec's (the forward's results it reads, and which gradients)."""
_BWD_OUTPUTS = ("q", "k", "v", "alpha", "mask", "sinks")
"""The fields the backward op returns gradients for (a subset of :data:`DIFFERENTIABLE`), in its output order."""


def spec_to_op_args(spec: AttnSpec, seed: int) -> tuple:
    """Flatten a spec (and the dropout seed) into the fused ops' positional arguments (:data:`FWD_FIELDS` order,
    ``kernels/_spec.py``'s ``flatten_spec``, as the decode op); :func:`spec_from_op_args` is the inverse."""
    return flatten_spec(spec, seed)


def spec_from_op_args(args) -> tuple[AttnSpec, int]:
    """The spec and the dropout seed back from the fused ops' positional arguments (the inverse of
    :func:`spec_to_op_args`)."""
    fwd_op_named(args)  # one argument per field and the seed
    spec, (seed,) = unflatten_spec(args)
    return spec, seed


def fwd_op_named(args) -> dict:
    """The forward op's positional arguments (or ``ctx.needs_input_grad``) by field name."""
    return dict(zip(FWD_FIELDS, args, strict=True))


def _needs_out_u(spec: AttnSpec) -> bool:
    """The backward's float32 ``out_u`` is computed when gradients are needed, unless every head is softmax with
    float32 inputs (then it is the output itself)."""
    return spec.need_grad and (spec.alpha_class != "softmax" or spec.q.dtype != torch.float32)


def _fwd_impl(*args) -> tuple[Tensor, ...]:
    """The fused forward on a flattened spec; the last output is ``out_u`` (shape ``(0,)`` unless ``_needs_out_u``)."""
    spec, seed = spec_from_op_args(args)
    res = launch_fwd(spec, seed, need_out_u=_needs_out_u(spec))
    out_u = spec.q.new_empty(0, dtype=torch.float32) if res.out_u is None else res.out_u
    return (res.out, res.tau, res.tau_lo, res.lsum, res.nnz, res.n_valid, res.live, res.n_passes, res.tile_visits,
            out_u)


_fwd_op = torch.library.custom_op("sparse_attn::entmax_attn_fwd", _fwd_impl, mutates_args=(),
                                  schema=f"({_SPEC_SCHEMA}) -> ({', '.join(['Tensor'] * len(_FWD_OUTPUTS))})")


@_fwd_op.register_fake
def _fwd_fake(*args):
    spec, _ = spec_from_op_args(args)
    q = spec.q
    rows = q.shape[:3]
    out_shape = (*rows, spec.head_dim_v)
    live_shape, tile_shape = _live_shape(spec)
    return (
        torch.empty(out_shape, dtype=q.dtype, device=q.device),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.int32),
        q.new_empty(rows, dtype=torch.int32),
        q.new_empty(live_shape, dtype=torch.int32),
        q.new_empty(tile_shape, dtype=torch.int32),
        q.new_empty(tile_shape, dtype=torch.int32),
        q.new_empty(out_shape if _needs_out_u(spec) else (0,), dtype=torch.float32),
    )


def _bwd_impl(*args) -> tuple[Tensor, ...]:
    """The fused backward: :data:`_BWD_EXTRA`, then a flattened spec; gradients in :data:`_BWD_OUTPUTS` order (an
    empty tensor for one not asked for, and for d sinks without sinks)."""
    extra = dict(zip(_BWD_EXTRA, args))
    spec, seed = spec_from_op_args(args[len(_BWD_EXTRA):])
    out, out_u = extra["out"], extra["out_u"]
    block_m, block_n = fwd_block_sizes(spec.head_dim)
    # the spec reaches the launcher whole: every kernel argument is built from it (kernels/_args.attention_args)
    dq, dk, dv, dalpha, dmask, *dsinks = launch_bwd(
        spec, seed, extra["do"], out, extra["tau"], extra["lsum"], tau_lo=extra["tau_lo"], live=extra["live"],
        block_m=block_m, block_n=block_n, need_dalpha=extra["need_dalpha"], need_dbias=extra["need_dmask"],
        out_u=out_u if out_u.shape == out.shape else None, deterministic=spec.deterministic,
    )
    if dalpha is None:
        dalpha = spec.alpha.new_zeros(0)
    if dmask is None:
        dmask = spec.q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dalpha, dmask, dsinks[0] if dsinks else spec.q.new_zeros(0, dtype=torch.float32)


_bwd_op = torch.library.custom_op(
    "sparse_attn::entmax_attn_bwd", _bwd_impl, mutates_args=(),
    schema=f"(Tensor do, Tensor out, Tensor out_u, Tensor tau, Tensor tau_lo, Tensor lsum, Tensor live, "
           f"bool need_dalpha, bool need_dmask, {_SPEC_SCHEMA}) -> ({', '.join(['Tensor'] * len(_BWD_OUTPUTS))})")


@_bwd_op.register_fake
def _bwd_fake(*args):
    extra = dict(zip(_BWD_EXTRA, args))
    spec, _ = spec_from_op_args(args[len(_BWD_EXTRA):])
    q, alpha = spec.q, spec.alpha
    return (
        torch.empty_like(q), torch.empty_like(spec.k), torch.empty_like(spec.v),
        alpha.new_empty((alpha.shape[0],) if extra["need_dalpha"] else (0,)),
        q.new_empty(spec.mask.shape if extra["need_dmask"] else (0,), dtype=torch.float32),
        q.new_empty(0, dtype=torch.float32) if spec.sinks is None else torch.empty_like(spec.sinks),
    )


def _setup_context(ctx, inputs, output):
    a = fwd_op_named(inputs)
    res = dict(zip(_FWD_OUTPUTS, output, strict=True))
    ctx.save_for_backward(*(a[name] for name in _TENSOR_FIELDS), res["out"], res["out_u"], res["tau"], res["tau_lo"],
                          res["lsum"], res["live"])
    ctx.args = {name: a[name] for name in FWD_FIELDS if name not in _TENSOR_FIELDS}


def _backward(ctx, d_out, *_unused):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "entmax_attention's fused backward is not differentiable: double backward "
            "(create_graph=True) is not supported; use backend='reference' for higher-order gradients"
        )
    *saved, out, out_u, tau, tau_lo, lsum, live = ctx.saved_tensors
    a = {**dict(zip(_TENSOR_FIELDS, saved, strict=True)), **ctx.args}
    spec, seed = spec_from_op_args(tuple(a[name] for name in FWD_FIELDS))
    need = {name: wants and a[name] is not None for name, wants in fwd_op_named(ctx.needs_input_grad).items()}
    grads = dict(zip(_BWD_OUTPUTS, _bwd_op(d_out.contiguous(), out, out_u, tau, tau_lo, lsum, live, need["alpha"],
                                           need["mask"], *spec_to_op_args(spec, seed))))
    return tuple(grads.get(name) if name in DIFFERENTIABLE and need[name] else None for name in FWD_FIELDS)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def sdpa_refuses(inputs: AttnSpec, return_stats: bool | None = None) -> list[str]:
    """Why PyTorch's ``scaled_dot_product_attention`` cannot compute ``inputs`` with our semantics (empty: it can),
    whatever the device: the variants the ``"sdpa"`` route does not list (:data:`sparse_attn.attn.routes.SUPPORTED`), a
    head not at alpha = 1 (a Python number), statistics, causal rows left without keys (``Nq > Nk``; bottom-right
    alignment goes through ``causal_lower_right``). ``return_stats`` None: the spec's ``need_stats``."""
    why = refused("sdpa", inputs.used())
    if inputs.alpha_value != 1.0:
        why.append("alpha other than a Python 1")
    if inputs.need_stats if return_stats is None else return_stats:
        why.append("return_stats")
    if inputs.is_causal and inputs.q.shape[2] > inputs.k.shape[2]:
        why.append("causal with more queries than keys")
    return why


def _sdpa_fits(inputs: AttnSpec, return_stats: bool) -> bool:
    """Softmax heads the fused path hands to SDPA: CUDA tensors and nothing from :func:`sdpa_refuses`."""
    return inputs.q.is_cuda and not sdpa_refuses(inputs, return_stats)


def _sdpa(inputs: AttnSpec) -> Tensor:
    """Softmax attention through ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN / efficient)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    mask, causal = None, inputs.is_causal
    if causal and q.shape[2] != k.shape[2]:
        mask, causal = causal_lower_right(q.shape[2], k.shape[2]), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=inputs.dropout_p, is_causal=causal,
                                          scale=inputs.scale, enable_gqa=q.shape[1] != k.shape[1])


def meta_attention(inputs: AttnSpec, return_stats: bool):
    """Shape inference on meta tensors: the forward op's fake implementation gives every output's shape and dtype
    (nothing is computed or read back, whatever alpha is), and its registered autograd the gradients' shapes."""
    res = dict(zip(_FWD_OUTPUTS, _fwd_op(*spec_to_op_args(inputs, 0))))
    if return_stats:
        tau = res["tau"].detach().to(torch.float64 if inputs.q.dtype == torch.float64 else torch.float32)
        return res["out"], AttentionStats(nnz=res["nnz"], tau=tau, n_valid=res["n_valid"])
    return res["out"]


def fused_entmax_attention(inputs: AttnSpec, return_stats: bool | None = None):
    """Run the fused kernels on prepared inputs (see :func:`sparse_attn.entmax_attention`).

    Softmax heads (alpha = 1 for all heads) without statistics go to PyTorch's SDPA when it has our semantics
    (:func:`_sdpa_fits`); decoding steps (a few queries against a KV cache, no gradient) to the split-K decode
    kernels (:func:`sparse_attn.decode.decode_fits`); otherwise the Triton forward runs with the alpha class known
    on the host.
    """
    return_stats = inputs.need_stats if return_stats is None else return_stats
    if _sdpa_fits(inputs, return_stats):
        return _sdpa(inputs)
    if decode_fits(inputs):
        return decode_attention(inputs, return_stats)
    why = refused("fused", inputs.used())
    if why:
        raise ValueError(refusal_message("fused", why, "pass backend='reference'"))
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if inputs.dropout_p > 0 else 0
    res = dict(zip(_FWD_OUTPUTS, _fwd_op(*spec_to_op_args(inputs, seed))))
    out, tau, nnz, n_valid = res["out"], res["tau"], res["nnz"], res["n_valid"]
    if return_stats:
        return out, AttentionStats(nnz=nnz, tau=tau.detach(), n_valid=n_valid)
    return out
