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

from sparse_attn.attn_inputs import AttentionInputs, AttentionStats
from sparse_attn.decode import decode_attention, decode_fits
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


@torch.library.custom_op("sparse_attn::entmax_attn_fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, bias: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, scale: float, is_causal: bool,
    window: list[int], alibi_slopes: Tensor | None, softcap: float | None, sinks: Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, seed: int, alpha_class: str, need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused forward; the last output is ``out_u`` (shape ``(0,)`` unless ``_needs_out_u``)."""
    res = entmax_attn_fwd(
        q, k, v, alpha, scale, bias=bias, is_causal=is_causal, window_size=window, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=dropout_p, seed=seed, alpha_class=None if alpha_class == "auto" else alpha_class,
        need_out_u=_needs_out_u(need_grad, alpha_class, q.dtype),
    )
    out_u = q.new_empty(0, dtype=torch.float32) if res.out_u is None else res.out_u
    return res.out, res.tau, res.lsum, res.nnz, res.n_valid, res.live, res.n_passes, res.tile_visits, out_u


def _needs_out_u(need_grad: bool, alpha_class: str, dtype: torch.dtype) -> bool:
    """The backward's float32 ``out_u`` is computed when gradients are needed, unless every head is softmax with
    float32 inputs (then it is the output itself)."""
    return need_grad and (alpha_class != "softmax" or dtype != torch.float32)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, alpha, bias, cu_seqlens_q, cu_seqlens_k, scale, is_causal, window, alibi_slopes, softcap, sinks,
              max_seqlen_q, max_seqlen_k, dropout_p, seed, alpha_class, need_grad):
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
    need_dalpha: bool, need_dbias: bool, alpha_class: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused backward; the last output is d sinks (shape ``(0,)`` without sinks)."""
    block_m, block_n = fwd_block_sizes(q.shape[-1])
    dq, dk, dv, dalpha, dbias, *dsinks = entmax_attn_bwd(
        do, q, k, v, out, tau, lsum, alpha, scale, bias=bias, is_causal=is_causal, window_size=window,
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
              need_dbias, alpha_class):
    dbias_shape = bias.shape if need_dbias else (0,)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        alpha.new_empty((alpha.shape[0],) if need_dalpha else (0,)),
        q.new_empty(dbias_shape, dtype=torch.float32),
        q.new_empty(0, dtype=torch.float32) if sinks is None else torch.empty_like(sinks),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, bias, cu_q, cu_k, scale, is_causal, window, slopes, softcap, sinks = inputs[:13]
    max_q, max_k, dropout_p, seed, alpha_class = inputs[13:18]
    out, tau, lsum, _, _, live, _, _, out_u = output
    ctx.save_for_backward(q, k, v, out, out_u, tau, lsum, alpha, bias, cu_q, cu_k, live, slopes, sinks)
    ctx.args = (scale, is_causal, window, softcap, max_q, max_k, dropout_p, seed, alpha_class)


def _backward(ctx, d_out, *_unused):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "entmax_attention's fused backward is not differentiable: double backward "
            "(create_graph=True) is not supported; use backend='reference' for higher-order gradients"
        )
    q, k, v, out, out_u, tau, lsum, alpha, bias, cu_q, cu_k, live, slopes, sinks = ctx.saved_tensors
    scale, is_causal, window, softcap, max_q, max_k, dropout_p, seed, alpha_class = ctx.args
    need_dalpha = ctx.needs_input_grad[3]
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dalpha, dbias, dsinks = _bwd_op(
        d_out.contiguous(), q, k, v, out, out_u, tau, lsum, alpha, bias, cu_q, cu_k, live, scale,
        is_causal, window, slopes, softcap, sinks, max_q, max_k, dropout_p, seed, need_dalpha, need_dbias, alpha_class,
    )
    need_dsinks = sinks is not None and ctx.needs_input_grad[12]
    return (
        dq, dk, dv, dalpha if need_dalpha else None, dbias if need_dbias else None,
        None, None, None, None, None, None, None, dsinks if need_dsinks else None,
        None, None, None, None, None, None,
    )


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
    leaves = (inputs.q, inputs.k, inputs.v, inputs.alpha, inputs.mask, inputs.sinks)
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
    out, tau, lsum, nnz, n_valid, _, _, _, _ = _fwd_op(
        inputs.q, inputs.k, inputs.v, inputs.alpha, inputs.mask, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
        inputs.scale, inputs.is_causal, list(inputs.window_size or (-1, -1)), inputs.alibi_slopes, inputs.softcap,
        inputs.sinks, inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.dropout_p, seed, _alpha_class(inputs), need_grad,
    )
    if return_stats:
        return out, AttentionStats(nnz=nnz, tau=tau.detach(), n_valid=n_valid)
    return out
