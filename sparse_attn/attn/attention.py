"""Public entmax attention: ``entmax_attention(q, k, v, alpha, ...)``.

Shaped like :func:`torch.nn.functional.scaled_dot_product_attention`, with the attention
weights given by alpha-entmax of the scores instead of softmax (``alpha = 1`` is softmax,
``alpha = 2`` sparsemax). CUDA tensors run the fused Triton kernels (``backend="triton"``),
other tensors the materialized reference (``backend="reference"``). The arguments are
validated once by :func:`sparse_attn.attn.attn_inputs.prepare_attention`.
"""

from __future__ import annotations

import torch

from sparse_attn._validation import check_bool, checks_enabled, set_checks
from sparse_attn.attn._cpu_chunked import chunked_attention, chunked_fits
from sparse_attn.attn.attn_inputs import AttentionStats, AttnSpec, check_alpha_not_mask, prepare_attention
from sparse_attn.attn.reference import reference_forward
from sparse_attn.attn.routes import refusal_message, refused

__all__ = ["entmax_attention", "AttentionStats", "set_checks", "checks_enabled"]


def run_attention(inputs: AttnSpec, return_stats: bool | None = None):
    """Run prepared inputs on their backend; returns ``out`` or ``(out, AttentionStats)`` (``return_stats`` None: the
    spec's ``need_stats``)."""
    return_stats = inputs.need_stats if return_stats is None else return_stats
    if inputs.backend == "reference":
        why = refused("reference", inputs.used())
        if why:
            raise ValueError(refusal_message("reference", why, "no route of this version runs it"))
        if inputs.q.device.type == "meta":
            from sparse_attn.attn._attn_autograd import meta_attention

            return meta_attention(inputs, return_stats)
        if chunked_fits(inputs) and not refused("chunked", inputs.used()):
            out, stats = chunked_attention(inputs, with_stats=return_stats)
            return (out, stats) if return_stats else out
        res = reference_forward(inputs, with_stats=return_stats)
        return (res.out, res.stats) if return_stats else res.out
    from sparse_attn.attn._attn_autograd import fused_entmax_attention

    return fused_entmax_attention(inputs, return_stats)


def run_layer_attention(inputs: AttnSpec, dense: bool, sink=None):
    """The attention of a layer (module or integration) on prepared inputs.

    Args:
        inputs: from :func:`sparse_attn.attn.attn_inputs.prepare_attention`.
        dense: materialize the weights (the reference, whatever ``inputs.backend``).
        sink: None or a :class:`sparse_attn.stats.HeadStatsSink` the call reports to.

    Returns:
        ``(out, weights)``: ``weights`` ``(B, Hq, Nq, Nk)`` as multiplied with ``v`` (after
        dropout) when ``dense``, else None.
    """
    if dense and inputs.q.device.type == "meta":  # shapes only: the weights as an empty meta tensor
        res = run_attention(inputs, return_stats=sink is not None)
        out, stats = res if sink is not None else (res, None)
        weights = inputs.q.new_empty(inputs.score_shape)
        if sink is not None:
            sink(stats.nnz, stats.n_valid, inputs.alpha, weights)
        return out, weights
    if dense:
        res = reference_forward(inputs, with_weights=True, with_stats=sink is not None)
        if sink is not None:
            sink(res.stats.nnz, res.stats.n_valid, inputs.alpha, res.weights)
        return res.out, res.applied
    if sink is None:
        return run_attention(inputs, return_stats=False), None
    out, stats = run_attention(inputs, return_stats=True)
    sink(stats.nnz, stats.n_valid, inputs.alpha, None)
    return out, None


def entmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: float | torch.Tensor = 1.5,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_stats: bool = False,
    backend: str = "auto",
    window_size: tuple[int, int] | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    block_mask=None,
    deterministic: bool = True,
):
    """Attention whose weights are alpha-entmax of the scores, computed tile by tile.

    ``out_i = sum_j p_ij v_j`` with ``p_i = alpha-entmax(s_i)``, ``s_ij = scale * q_i . k_j + bias_ij``
    (masked pairs ``-inf``). ``alpha = 1`` is softmax, ``alpha = 2`` sparsemax; for alpha > 1 the
    weights are ``[(alpha - 1) s_ij - tau_i]_+^(1/(alpha-1))``, exactly zero below the threshold.
    The variants (``window_size``, ``alibi_slopes``, ``sinks``, ``softcap``, ``Dv != D``) follow
    flash-attn's semantics. The fused kernels implement them all, with the sinks' gradient, but give no gradient
    for ALiBi slopes (slopes that require grad raise ``ValueError`` there: ``attn_inputs.unfused_variants``).
    Decoding steps on the fused path (1 to 16 queries against more keys, nothing requiring grad, no
    dropout or packed sequences; any of the variants) run the split-K decode kernels
    (:func:`sparse_attn.decode.decode_fits`, docs/decode.md); everything else the general fused forward.

    Args:
        q: ``(B, Hq, Nq, D)`` queries; any strides (a ``(B, N, H, D)`` tensor ``.transpose(1, 2)``
            works without a copy). float16, bfloat16, float32 (float64 on the reference backend).
        k, v: ``(B, Hk, Nk, D)`` keys and ``(B, Hk, Nk, Dv)`` values, same dtype and device as
            ``q``. ``Dv`` may differ from ``D`` (e.g. DeepSeek-V3's attention; ``16 <= Dv <= 256`` on the kernels).
        alpha: float in [1, 2], or a tensor of shape ``(Hq,)`` (one alpha per q head, mixed freely;
            differentiable) or ``()``. Default 1.5. A tensor's values are checked when it is on
            the CPU or with :func:`sparse_attn.set_checks` on; otherwise (CUDA) a head whose alpha
            is outside [1, 2] or NaN gives NaN outputs.
        attn_mask: boolean (True = may attend) or additive float mask (e.g. ALiBi), broadcastable
            to ``(B, Hq, Nq, Nk)``; a float mask that requires grad gets a gradient. NaN or
            ``+inf`` entries make their rows NaN on every backend (no exception, no host read); ``-inf``
            entries exclude their keys.
        is_causal: causal masking, bottom-right aligned when ``Nq != Nk`` (as flash-attn): query
            ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``. May be combined with ``attn_mask``.
        scale: score scale, default ``1 / sqrt(D)``.
        dropout_p: drop probability applied to the weights after the entmax; kept weights are
            scaled by ``1 / (1 - dropout_p)`` as in SDPA. The seed is drawn from torch's RNG.
        enable_gqa: allow ``Hk < Hq`` (grouped-query / multi-query attention, ``Hq % Hk == 0``).
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` cumulative lengths of packed
            variable-length sequences; then ``q`` is ``(1, Hq, total_q, D)``, ``k``/``v``
            ``(1, Hk, total_k, D)``, and sequence ``s`` attends only within itself.
        max_seqlen_q, max_seqlen_k: with ``cu_seqlens``, the longest query / key sequence (an upper
            bound is fine), as in flash-attn's varlen API. When None they are computed from
            ``cu_seqlens``, which reads it back to the host (one synchronization on CUDA): pass
            them to keep CUDA calls free of host syncs.
        return_stats: also return :class:`AttentionStats` (per-row support size, threshold and
            number of valid keys, each ``(B, Hq, Nq)``) without materializing the weights.
        backend: ``"auto"`` (Triton for CUDA fp16/bf16/fp32 tensors with ``16 <= D <= 256``, the
            reference otherwise), ``"triton"`` or ``"reference"``. Problems without any query,
            key, head or batch entry run on the reference. A variant the fused kernels lack raises
            ``ValueError`` on ``"triton"`` and where ``"auto"`` picks them (never a silent dense fallback).
        window_size: ``(left, right)`` sliding window, as flash-attn: query ``i`` sees key ``j`` iff
            ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (per sequence with varlen), ``-1`` =
            unbounded on that side; intersected with ``is_causal`` and ``attn_mask``. Default None
            (= ``(-1, -1)``). Mistral's ``sliding_window=W`` with causal masking is ``(W - 1, 0)``.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` (varlen: ``(nseq, Hq)``) floating tensor on ``q``'s device:
            the bias ``-slope * |i + Nk - Nq - j|`` is added to the scaled scores (after ``softcap``),
            as flash-attn. Computed in float32 (float64 for float64 inputs). Default None.
        sinks: ``(Hq,)`` floating tensor, one learned sink logit per head (gpt-oss's ``s_aux``),
            differentiable. Every row is normalized over its keys plus a virtual key of score
            ``sinks[h]`` (not scaled, capped or masked) and zero value: at alpha = 1
            ``p_ij = exp(s_ij) / (exp(sinks[h]) + sum_k exp(s_ik))``; for alpha > 1 the entmax threshold
            includes the sink's term. The sink takes weight, so the weights over the real keys sum to
            ``1 - p_sink`` and the output shrinks; a row with no valid key still gives zeros.
            ``-inf`` turns a head's sink off, NaN or ``+inf`` makes the head's rows NaN. Default None.
        softcap: logit soft-capping (Gemma-2): finite scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before masks and biases are added. None or 0 = off
            (default); otherwise a finite positive Python number.
        block_mask: block-sparse mask: a :class:`sparse_attn.BlockSparseMask` ``(mask, (bq, bk))`` with ``mask``
            boolean ``(B or 1, Hq or 1, ceil(Nq / bq), ceil(Nk / bk))`` (varlen: ``(nseq or 1, Hq or 1,
            ceil(max_seqlen_q / bq), ceil(max_seqlen_k / bk))``, per sequence): key ``j`` is visible to query ``i``
            iff block ``(i // bq, j // bk)`` is True and every other mask allows it. Or torch's
            ``flex_attention.BlockMask`` (``create_block_mask(mask_mod, ...)``), with FlexAttention's semantics: a
            pair of a full block is kept, a pair of a partial block where ``mask_mod(b, h, q_idx, kv_idx)`` is True
            (``b`` the batch entry or packed sequence, ``h`` the query head, positions sequence-local). The
            ``mask_mod`` is evaluated once per mask object over the partial blocks' pairs (``torch.vmap``, as
            ``create_block_mask`` does; one bit per pair, cached with the mask); one that cannot be evaluated so
            raises ``ValueError`` naming it. Default None.
        deterministic: True (default): gradients are bitwise reproducible from run to run. False allows the fused
            backward to accumulate dQ with atomics inside its dK/dV kernel (five tensor-core products per visited
            tile instead of seven); its gradients then match float64 within the same tolerance but may differ
            between runs in the last float32 bits. Other routes are deterministic either way.

    Returns:
        ``out`` of shape ``(B, Hq, Nq, Dv)`` in the input dtype, or ``(out, stats)``.
        Rows with no key to attend to give zeros (and zero gradients).
    """
    check_bool("return_stats", return_stats)
    check_alpha_not_mask(alpha, q)
    spec = prepare_attention(
        q, k, v, alpha, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
        enable_gqa=enable_gqa, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend, window_size=window_size,
        alibi_slopes=alibi_slopes, sinks=sinks, softcap=softcap, need_stats=return_stats, block_mask=block_mask,
        deterministic=deterministic,
    )
    return run_attention(spec)
