"""Autograd wiring of the fused kernels as ``torch.library`` custom ops.

``sparse_attn::entmax_attn_fwd`` and ``sparse_attn::entmax_attn_bwd`` wrap the Triton launchers;
their fake implementations give output shapes, so ``torch.compile(fullgraph=True)`` traces
through them, and ``register_autograd`` connects the handwritten backward. The forward computes the
backward's ``out_u`` (docs/backward.md) only when an input requires a gradient and grad mode is on.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from sparse_attn.attn_inputs import AttentionInputs, AttentionStats
from sparse_attn.decode import decode_attention, decode_fits
from sparse_attn.kernels._common import BlockWindow
from sparse_attn.kernels.entmax_attn_bwd import entmax_attn_bwd
from sparse_attn.kernels.entmax_attn_fwd import alpha_class_of, entmax_attn_fwd, fwd_block_sizes
from sparse_attn.routes import refusal_message, refused


def _live_shape(q: Tensor, k: Tensor, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int):
    block_m, block_n = fwd_block_sizes(q.shape[-1])
    n_seq = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    n_qt = -(-max_seqlen_q // block_m)
    n_kt = -(-max_seqlen_k // block_n)
    n_words = -(-n_kt // 32)
    return (n_seq, q.shape[1], n_qt, n_words), (n_seq, q.shape[1], n_qt)


def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, bias: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, scale: float, is_causal: bool,
    window: list[int], alibi_slopes: Tensor | None, softcap: float | None, sinks: Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, seed: int, alpha_class: str, need_grad: bool, block_mask: Tensor | None,
    block_size: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused forward; the last output is ``out_u`` (shape ``(0,)`` unless ``_needs_out_u``)."""
    res = entmax_attn_fwd(
        q, k, v, alpha, scale, bias=bias, is_causal=is_causal, window_size=_window(window, block_mask, block_size),
        alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=dropout_p, seed=seed, alpha_class=None if alpha_class == "auto" else alpha_class,
        need_out_u=_needs_out_u(need_grad, alpha_class, q.dtype),
    )
    out_u = q.new_empty(0, dtype=torch.float32) if res.out_u is None else res.out_u
    return res.out, res.tau, res.lsum, res.nnz, res.n_valid, res.live, res.n_passes, res.tile_visits, out_u


def _window(window: list[int], block_mask: Tensor | None, block_size: list[int]):
    """The launchers' ``window_size``, carrying the block mask when there is one (``_common.BlockWindow``)."""
    return window if block_mask is None else BlockWindow(window, (block_mask, tuple(block_size)))


_fwd_op = torch.library.custom_op("sparse_attn::entmax_attn_fwd", mutates_args=())(_fwd_impl)
FWD_FIELDS = tuple(inspect.signature(_fwd_impl).parameters)
"""The forward op's arguments by name, in its positional order (the op's schema is its signature)."""
DIFFERENTIABLE = ("q", "k", "v", "alpha", "bias", "sinks")
"""The forward op's arguments that receive a gradient (each only when it requires one)."""
_SAVED = ("q", "k", "v", "alpha", "bias", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks", "block_mask")
_FWD_OUTPUTS = ("out", "tau", "lsum", "nnz", "n_valid", "live", "n_passes", "tile_visits", "out_u")


def fwd_op_args(inputs: AttentionInputs, seed: int, alpha_class: str, need_grad: bool) -> tuple:
    """Flatten prepared inputs into the forward op's positional arguments (:data:`FWD_FIELDS` order)."""
    named = dict(q=inputs.q, k=inputs.k, v=inputs.v, alpha=inputs.alpha, bias=inputs.mask,
                 cu_seqlens_q=inputs.cu_seqlens_q, cu_seqlens_k=inputs.cu_seqlens_k, scale=inputs.scale,
                 is_causal=inputs.is_causal, window=list(inputs.window_size or (-1, -1)),
                 alibi_slopes=inputs.alibi_slopes, softcap=inputs.softcap, sinks=inputs.sinks,
                 max_seqlen_q=inputs.max_seqlen_q, max_seqlen_k=inputs.max_seqlen_k, dropout_p=inputs.dropout_p,
                 seed=seed, alpha_class=alpha_class, need_grad=need_grad,
                 block_mask=None if inputs.block_mask is None else inputs.block_mask.mask,
                 block_size=list(inputs.block_mask.block_size if inputs.block_mask is not None else (1, 1)))
    return tuple(named[name] for name in FWD_FIELDS)


def fwd_op_named(args) -> dict:
    """The forward op's positional arguments (or ``ctx.needs_input_grad``) by field name: the inverse of
    :func:`fwd_op_args`."""
    return dict(zip(FWD_FIELDS, args, strict=True))


def _needs_out_u(need_grad: bool, alpha_class: str, dtype: torch.dtype) -> bool:
    """The backward's float32 ``out_u`` is computed when gradients are needed, unless every head is softmax with
    float32 inputs (then it is the output itself)."""
    return need_grad and (alpha_class != "softmax" or dtype != torch.float32)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, alpha, bias, cu_seqlens_q, cu_seqlens_k, scale, is_causal, window, alibi_slopes, softcap, sinks,
              max_seqlen_q, max_seqlen_k, dropout_p, seed, alpha_class, need_grad, block_mask, block_size):
    rows = q.shape[:3]
    out_shape = (*rows, v.shape[3])
    live_shape, tile_shape = _live_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    return (
        torch.empty(out_shape, dtype=q.dtype, device=q.device),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.int32),
        q.new_empty(rows, dtype=torch.int32),
        q.new_empty(live_shape, dtype=torch.int32),
        q.new_empty(tile_shape, dtype=torch.int32),
        q.new_empty(tile_shape, dtype=torch.int32),
        q.new_empty(out_shape if _needs_out_u(need_grad, alpha_class, q.dtype) else (0,), dtype=torch.float32),
    )


@torch.library.custom_op("sparse_attn::entmax_attn_bwd", mutates_args=())
def _bwd_op(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, out_u: Tensor, tau: Tensor, lsum: Tensor,
    alpha: Tensor, bias: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    live: Tensor, scale: float, is_causal: bool, window: list[int], alibi_slopes: Tensor | None,
    softcap: float | None, sinks: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, seed: int,
    need_dalpha: bool, need_dbias: bool, alpha_class: str, block_mask: Tensor | None, block_size: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused backward; the last output is d sinks (shape ``(0,)`` without sinks)."""
    block_m, block_n = fwd_block_sizes(q.shape[-1])
    dq, dk, dv, dalpha, dbias, *dsinks = entmax_attn_bwd(
        do, q, k, v, out, tau, lsum, alpha, scale, bias=bias, is_causal=is_causal,
        window_size=_window(window, block_mask, block_size),
        alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, seed=seed, live=live,
        block_m=block_m, block_n=block_n, need_dalpha=need_dalpha, need_dbias=need_dbias,
        out_u=out_u if out_u.shape == out.shape else None, alpha_class=None if alpha_class == "auto" else alpha_class,
    )
    if dalpha is None:
        dalpha = alpha.new_zeros(0)
    if dbias is None:
        dbias = q.new_zeros(0, dtype=torch.float32)
    return dq, dk, dv, dalpha, dbias, dsinks[0] if dsinks else q.new_zeros(0, dtype=torch.float32)


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, out, out_u, tau, lsum, alpha, bias, cu_seqlens_q, cu_seqlens_k, live, scale, is_causal,
              window, alibi_slopes, softcap, sinks, max_seqlen_q, max_seqlen_k, dropout_p, seed, need_dalpha,
              need_dbias, alpha_class, block_mask, block_size):
    dbias_shape = bias.shape if need_dbias else (0,)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        alpha.new_empty((alpha.shape[0],) if need_dalpha else (0,)),
        q.new_empty(dbias_shape, dtype=torch.float32),
        q.new_empty(0, dtype=torch.float32) if sinks is None else torch.empty_like(sinks),
    )


def _setup_context(ctx, inputs, output):
    a = fwd_op_named(inputs)
    res = dict(zip(_FWD_OUTPUTS, output, strict=True))
    ctx.save_for_backward(*(a[name] for name in _SAVED), res["out"], res["out_u"], res["tau"], res["lsum"],
                          res["live"])
    ctx.args = {name: a[name] for name in FWD_FIELDS if name not in _SAVED}


def _backward(ctx, d_out, *_unused):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "entmax_attention's fused backward is not differentiable: double backward "
            "(create_graph=True) is not supported; use backend='reference' for higher-order gradients"
        )
    *saved, out, out_u, tau, lsum, live = ctx.saved_tensors
    a = {**dict(zip(_SAVED, saved, strict=True)), **ctx.args}
    need = {name: wants and a[name] is not None for name, wants in fwd_op_named(ctx.needs_input_grad).items()}
    shared = ("q", "k", "v", "alpha", "bias", "cu_seqlens_q", "cu_seqlens_k", "scale", "is_causal", "window",
              "alibi_slopes", "softcap", "sinks", "max_seqlen_q", "max_seqlen_k", "dropout_p", "seed", "alpha_class",
              "block_mask", "block_size")
    dq, dk, dv, dalpha, dbias, dsinks = _bwd_op(
        do=d_out.contiguous(), out=out, out_u=out_u, tau=tau, lsum=lsum, live=live, need_dalpha=need["alpha"],
        need_dbias=need["bias"], **{name: a[name] for name in shared},
    )
    grads = dict(q=dq, k=dk, v=dv, alpha=dalpha, bias=dbias, sinks=dsinks)
    return tuple(grads[name] if name in DIFFERENTIABLE and need[name] else None for name in FWD_FIELDS)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _alpha_class(inputs: AttentionInputs) -> str:
    """The forward's compile-time alpha class: exact for a Python alpha, from the values of a checked CPU tensor
    (no device sync), otherwise the run-time branch per head (which also turns unchecked out-of-range heads
    into NaN outputs)."""
    if inputs.alpha_value is not None:
        return alpha_class_of([inputs.alpha_value])
    if inputs.alpha_checked and inputs.alpha.device.type == "cpu":
        return "auto"
    return "mixed"


def sdpa_refuses(inputs: AttentionInputs, return_stats: bool) -> list[str]:
    """Why PyTorch's ``scaled_dot_product_attention`` cannot compute ``inputs`` with our semantics (empty: it can),
    whatever the device: the variants the ``"sdpa"`` route does not list (:data:`sparse_attn.routes.SUPPORTED`), a
    head not at alpha = 1 (a Python number), statistics, causal rows left without keys (``Nq > Nk``; bottom-right
    alignment goes through ``causal_lower_right``)."""
    why = refused("sdpa", inputs.used())
    if inputs.alpha_value != 1.0:
        why.append("alpha other than a Python 1")
    if return_stats:
        why.append("return_stats")
    if inputs.is_causal and inputs.q.shape[2] > inputs.k.shape[2]:
        why.append("causal with more queries than keys")
    return why


def _sdpa_fits(inputs: AttentionInputs, return_stats: bool) -> bool:
    """Softmax heads the fused path hands to SDPA: CUDA tensors and nothing from :func:`sdpa_refuses`."""
    return inputs.q.is_cuda and not sdpa_refuses(inputs, return_stats)


def _sdpa(inputs: AttentionInputs) -> Tensor:
    """Softmax attention through ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN / efficient)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    mask, causal = None, inputs.is_causal
    if causal and q.shape[2] != k.shape[2]:
        mask, causal = causal_lower_right(q.shape[2], k.shape[2]), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=inputs.dropout_p, is_causal=causal,
                                          scale=inputs.scale, enable_gqa=q.shape[1] != k.shape[1])


def fused_entmax_attention(inputs: AttentionInputs, return_stats: bool):
    """Run the fused kernels on prepared inputs (see :func:`sparse_attn.entmax_attention`).

    Softmax heads (alpha = 1 for all heads) without statistics go to PyTorch's SDPA when it has our semantics
    (:func:`_sdpa_fits`); decoding steps (a few queries against a KV cache, no gradient) to the split-K decode
    kernels (:func:`sparse_attn.decode.decode_fits`); otherwise the Triton forward runs with the alpha class known
    on the host.
    """
    if _sdpa_fits(inputs, return_stats):
        return _sdpa(inputs)
    if decode_fits(inputs):
        return decode_attention(inputs, return_stats)
    why = refused("fused", inputs.used())
    if why:
        raise ValueError(refusal_message("fused", why, "pass backend='reference'"))
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if inputs.dropout_p > 0 else 0
    args = fwd_op_named(fwd_op_args(inputs, seed, _alpha_class(inputs), need_grad=False))
    args["need_grad"] = torch.is_grad_enabled() and any(args[name] is not None and args[name].requires_grad
                                                        for name in DIFFERENTIABLE)
    res = dict(zip(_FWD_OUTPUTS, _fwd_op(*args.values())))
    out, tau, nnz, n_valid = res["out"], res["tau"], res["nnz"], res["n_valid"]
    if return_stats:
        return out, AttentionStats(nnz=nnz, tau=tau.detach(), n_valid=n_valid)
    return out
