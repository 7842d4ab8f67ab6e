"""Materialized reference for entmax attention: the oracle every kernel is tested against.

It builds the full ``(B, H, Nq, Nk)`` score matrix (soft-capped, plus masks, causal and sliding-window masks and
ALiBi biases; with per-head sinks one more column), applies the row-wise mapping
:func:`sparse_attn.mappings.entmax` and aggregates the values. It uses only PyTorch, supports
every option of :func:`sparse_attn.entmax_attention`, and is differentiable (inputs, ``alpha``,
float masks).

Numerics: scores, masks, weights and the value product are computed in float32 for float16,
bfloat16 and float32 inputs and in float64 for float64 inputs (or in ``compute_dtype``), with
autocast off; the output is cast back to the input dtype. Non-finite values follow the project's
policy: ``-inf`` scores (or masked keys) get weight 0; a row whose scores hold NaN or ``+inf``
(from ``q``, ``k`` or a float mask) is all NaN (its gradients too); a row with no key gives
zeros; a head whose alpha is outside [1, 2] or NaN (possible only when its values were not
checked) is all NaN. No host read is needed for any of this.

Its memory is O(N^2): it is for tests, CPU tensors and small problems. It traces under
``torch.compile(fullgraph=True)`` for any alpha (float, per-head or learnable tensor) except
with ``cu_seqlens_q``/``cu_seqlens_k``: the packed-sequence loop reads the offsets to the host
and runs eagerly only.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from sparse_attn._validation import check_bool
from sparse_attn.attn.attn_inputs import AttentionInputs, AttentionStats, check_alpha_not_mask, prepare_attention
from sparse_attn.attn.masks import alibi_bias, block_keep, causal_keep, check_mask, combine_masks, window_keep
from sparse_attn.rows.mappings import entmax

__all__ = ["entmax_attention_reference", "reference_forward", "ReferenceResult", "causal_keep"]

_NAN, _INF = float("nan"), float("inf")
_SAFE_ALPHA = 1.5


class ReferenceResult(NamedTuple):
    """What :func:`reference_forward` computed.

    out:     ``(B, Hq, Nq, Dv)`` in the input dtype.
    weights: ``(B, Hq, Nq, Nk)`` entmax weights before dropout, in the input dtype (None unless asked).
    applied: the weights multiplied with ``v`` (after dropout, scaled by ``1 / (1 - dropout_p)``),
             input dtype; the same tensor as ``weights`` without dropout (None unless asked).
    stats:   :class:`AttentionStats` (None unless asked).
    """

    out: Tensor
    weights: Tensor | None
    applied: Tensor | None
    stats: AttentionStats | None


def _row_threshold(scores: Tensor, p: Tensor, alpha) -> Tensor:
    """Recover the threshold tau of each row from finite-or--inf scores and their weights (see AttentionStats)."""
    valid = torch.isfinite(scores).any(-1)
    neg = torch.finfo(scores.dtype).min
    if not isinstance(alpha, Tensor):
        alpha = torch.tensor(alpha, dtype=scores.dtype, device=scores.device)
    alpha = alpha.detach().to(scores.dtype)
    a = alpha.squeeze(-1) if alpha.dim() == 4 else alpha
    finite = scores.masked_fill(~torch.isfinite(scores), neg)
    lse = torch.logsumexp(finite, dim=-1)
    zmax, idx = ((alpha - 1) * finite).max(dim=-1)
    pmax = p.gather(-1, idx.unsqueeze(-1)).squeeze(-1).to(scores.dtype)
    entmax_tau = zmax - pmax.clamp_min(torch.finfo(scores.dtype).tiny) ** (a - 1)
    tau = torch.where(a == 1, lse, entmax_tau)
    return torch.where(valid, tau, torch.full_like(tau, _INF))


def _stats(scores: Tensor, p: Tensor, alpha, n_valid: Tensor, bad: Tensor, n_keys: int) -> AttentionStats:
    """Per-row statistics of one dense block; ``scores`` finite or -inf, ``bad`` marks NaN rows.

    ``scores`` and ``p`` may hold a sink column after the ``n_keys`` real keys: the threshold is that
    of the whole row, the support size counts real keys only; a row with no valid key has ``tau = +inf`` (with a
    sink too, as on the kernels).
    """
    if scores.shape[-1] == 0:
        return AttentionStats(n_valid, torch.full(n_valid.shape, _INF, dtype=scores.dtype, device=scores.device),
                              n_valid)
    nnz = (p[..., :n_keys] > 0).sum(-1, dtype=torch.int32)
    if isinstance(alpha, Tensor):
        is_softmax = (alpha.squeeze(-1) if alpha.dim() == 4 else alpha) == 1
    else:
        is_softmax = torch.tensor(alpha == 1.0, device=scores.device)
    nnz = torch.where(is_softmax, n_valid, nnz)
    bad = bad.squeeze(-1)
    tau = _row_threshold(scores, p, alpha).masked_fill(n_valid == 0, _INF).masked_fill(bad, _NAN)
    return AttentionStats(nnz.masked_fill(bad, 0), tau, n_valid)


def modify_scores(s: Tensor, inputs) -> Tensor:
    """The score modifications applied to the scaled scores ``s = scale q k^T`` (every head of ``inputs``, the spec,
    along dim 1) before masks and biases: the soft cap. The one place the reference and the CPU path modify scores
    (the kernels' twin is ``kernels/_masking.score_mod``)."""
    return _soft_cap(s, inputs.softcap)


def _soft_cap(s: Tensor, softcap: float | None) -> Tensor:
    """``softcap * tanh(s / softcap)`` on finite scores; non-finite ones (-inf masked, NaN, +inf) unchanged.

    A cap of ``2**64`` or more is applied in float64: in float32 it may round to inf (``inf * tanh(0)``) and its
    backward multiplies by it (overflow)."""
    if softcap is None:
        return s
    finite = torch.isfinite(s)
    x = s.masked_fill(~finite, 0.0)
    capped = (softcap * torch.tanh(x.double() / softcap)).to(s.dtype) if softcap >= 2.0**64 else \
        softcap * torch.tanh(x / softcap)
    return torch.where(finite, capped, s)


def _attend(q, k, v, alpha, bad_head, bias, keep, inputs, ct, dropout_mask, generator, with_stats):
    """One dense block: q (B,H,Nq,D), k (B,H,Nk,D), v (B,H,Nk,Dv); bias/keep broadcastable to (B,H,Nq,Nk).

    Scores ``softcap(scale * q k^T) + bias``, ``-inf`` where ``keep`` is False; with ``inputs.sinks`` a
    sink column ``(H,)`` joins every row's normalization and is dropped from the weights.
    Returns ``(out, p, applied, stats)`` in the compute dtype ``ct``; ``p`` over the real keys.
    """
    s = modify_scores(torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * inputs.scale, inputs)
    if bias is not None:
        s = s + bias.to(ct)
    if keep is not None:
        s = s.masked_fill(~keep, -_INF)
    n_keys = s.shape[-1]
    if inputs.sinks is not None:
        s = torch.cat([s, inputs.sinks.to(ct).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    bad = (torch.isnan(s) | (s == _INF)).any(-1, keepdim=True)
    if bad_head is not None:
        bad = bad | bad_head
    s_in = s.masked_fill(bad, 0.0)
    a_in = alpha if bad_head is None else torch.where(bad_head, _SAFE_ALPHA, alpha)
    # no key at all: the (empty) weights still connect the zero output to the inputs
    p = s_in * 0 if s.shape[-1] == 0 else entmax(s_in, a_in, dim=-1)
    stats = None
    if with_stats:
        with torch.no_grad():
            n_valid = (s[..., :n_keys] != -_INF).sum(-1, dtype=torch.int32)
            stats = _stats(s_in, p, a_in, n_valid, bad, n_keys)
    # NaN rows (and heads): the value and the gradients of p there are NaN, elsewhere unchanged
    poison = torch.zeros(bad.shape, dtype=ct, device=s.device).masked_fill(bad, _NAN)
    p = p + poison * (s.masked_fill(s == -_INF, 0.0) + (alpha if isinstance(alpha, Tensor) else 0.0))
    p = p[..., :n_keys]
    applied = p
    if dropout_mask is not None:
        applied = p * dropout_mask.to(ct) / (1.0 - inputs.dropout_p)
    elif inputs.dropout_p > 0:
        # no generator=None: torch.rand refuses it with the symbolic sizes of torch.compile(dynamic=True)
        rng = {} if generator is None else {"generator": generator}
        drop_keep = torch.rand(p.shape, device=p.device, dtype=torch.float32, **rng) >= inputs.dropout_p
        applied = p * drop_keep.to(ct) / (1.0 - inputs.dropout_p)
    return torch.matmul(applied, v.to(ct)), p, applied, stats


def _block_masks(inputs: AttentionInputs, bias, keep, n_q: int, n_k: int, device, seq: int | None = None):
    """``(bias, keep)`` of one block with the structural masks added: causal, sliding window, block mask, ALiBi.

    ``seq``: the packed sequence (picks the row of ``(nseq, H)`` ALiBi slopes and the block mask's entry), None
    without varlen.
    """
    if inputs.is_causal:
        keep = combine_masks(keep, causal_keep(n_q, n_k, device))
    if inputs.window_size is not None:
        keep = combine_masks(keep, window_keep(n_q, n_k, inputs.window_size, device))
    if inputs.block_mask is not None:
        blocks = (inputs.block_mask, inputs.block_size, inputs.block_bits)
        keep = combine_masks(keep, block_keep(blocks, n_q, n_k, seq))
    slopes = inputs.alibi_slopes
    if slopes is not None:
        if seq is not None and slopes.dim() == 2:
            slopes = slopes[seq]
        bias = combine_masks(bias, alibi_bias(slopes, n_q, n_k))
    return bias, keep


def reference_forward(
    inputs: AttentionInputs,
    *,
    dropout_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    compute_dtype: torch.dtype | None = None,
    with_weights: bool = False,
    with_stats: bool = False,
) -> ReferenceResult:
    """The reference on prepared inputs (see :func:`entmax_attention_reference` for the arguments)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    ct = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    n_heads = q.shape[1]
    if k.shape[1] != n_heads:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    if inputs.alpha_value is not None:
        alpha, bad_head = inputs.alpha_value, None
    else:
        alpha = inputs.alpha.to(ct).reshape(1, n_heads, 1, 1)
        bad_head = None if inputs.alpha_checked else ~((alpha >= 1) & (alpha <= 2))
    mask = inputs.mask
    bias, keep = (mask, None) if mask is not None and mask.dtype != torch.bool else (None, mask)
    if bias is not None:
        # cast at the mask's own shape: its gradient is then summed over the broadcast dims in the compute dtype
        bias = bias.to(ct)
    full_shape = (q.shape[0], n_heads, q.shape[2], k.shape[2])
    if dropout_mask is not None:
        dropout_mask = dropout_mask.expand(full_shape)
    common = (alpha, bad_head)
    autocast_off = (torch.autocast(q.device.type, enabled=False) if q.device.type in ("cpu", "cuda")
                    else contextlib.nullcontext())
    with autocast_off:
        if inputs.cu_seqlens_q is None:
            bias, keep = _block_masks(inputs, bias, keep, q.shape[2], k.shape[2], q.device)
            out, p, applied, stats = _attend(q, k, v, *common, bias, keep, inputs, ct, dropout_mask, generator,
                                             with_stats)
        else:
            out, p, applied, stats = _attend_packed(inputs, q, k, v, common, bias, keep, ct, dropout_mask,
                                                    generator, with_weights, with_stats)
    dtype = inputs.q.dtype
    weights = applied_w = None
    if with_weights:
        weights = p.to(dtype)
        applied_w = weights if applied is p else applied.to(dtype)
    return ReferenceResult(out.to(dtype), weights, applied_w, stats)


def _attend_packed(inputs, q, k, v, common, bias, keep, ct, dropout_mask, generator, with_weights, with_stats):
    """The packed-sequence loop: each sequence attends within itself; masks use packed positions, causal
    masks, sliding windows and ALiBi the positions within the sequence."""
    bounds_q, bounds_k = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    full_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    outs, all_stats = [], []
    p_full = applied_full = None
    if with_weights:
        p_full = q.new_zeros(full_shape, dtype=ct)
        applied_full = q.new_zeros(full_shape, dtype=ct)
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        sl = (slice(None), slice(None), slice(q0, q1), slice(k0, k1))
        b = bias.expand(full_shape)[sl] if bias is not None else None
        kp = keep.expand(full_shape)[sl] if keep is not None else None
        b, kp = _block_masks(inputs, b, kp, q1 - q0, k1 - k0, q.device, seq=s)
        dm = dropout_mask[sl] if dropout_mask is not None else None
        o, p, applied, st = _attend(q[sl[:3]], k[:, :, k0:k1], v[:, :, k0:k1], *common, b, kp, inputs, ct, dm,
                                    generator, with_stats)
        outs.append(o)
        all_stats.append(st)
        if with_weights:
            p_full[sl] = p
            applied_full[sl] = applied
    out = torch.cat(outs, dim=2)
    stats = AttentionStats(*(torch.cat(t, dim=2) for t in zip(*all_stats))) if with_stats else None
    return out, p_full, applied_full, stats


def entmax_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    enable_gqa: bool = False,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_stats: bool = False,
    return_weights: bool = False,
    compute_dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
    window_size: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    block_mask=None,
):
    """Materialized entmax attention (the oracle). Arguments as :func:`sparse_attn.entmax_attention`.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hk, Nk, D)``; v: ``(B, Hk, Nk, Dv)`` with ``Hq % Hk == 0``
            (grouped heads are accepted whatever ``enable_gqa``); any float dtype.
        alpha: float or ``(Hq,)`` / ``()`` tensor in [1, 2] (differentiable).
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, Hq, Nq, Nk)``.
        dropout_mask: optional bool keep-mask broadcastable to ``(B, Hq, Nq, Nk)``; when given it
            replaces the random draw (used to replay the kernels' RNG in tests).
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` for packed sequences; then ``B == 1``
            and masks are indexed with global (packed) row/column positions.
        max_seqlen_q, max_seqlen_k: as :func:`sparse_attn.entmax_attention` (only checked here).
        return_stats: also return :class:`AttentionStats`. Default False.
        return_weights: also return the ``(B, Hq, Nq, Nk)`` entmax weights (before dropout), in
            the input dtype. Default False.
        compute_dtype: ``torch.float32`` or ``torch.float64``; default float64 for float64 inputs,
            float32 otherwise. Scores, masks, weights and the value product use it.
        generator: RNG of the dropout draw when ``dropout_mask`` is None.
        window_size, alibi_slopes, sinks, softcap, block_mask: as :func:`sparse_attn.entmax_attention`
            (differentiable w.r.t. ``sinks`` and ``alibi_slopes``).

    Returns:
        ``out`` ``(B, Hq, Nq, Dv)`` in the input dtype; ``(out, weights)``, ``(out, stats)`` or
        ``(out, weights, stats)`` when asked.
    """
    for name, flag in (("enable_gqa", enable_gqa), ("return_stats", return_stats), ("return_weights", return_weights)):
        check_bool(name, flag)
    if compute_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be None, torch.float32 or torch.float64, got {compute_dtype!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    check_alpha_not_mask(alpha, q)
    inputs = prepare_attention(
        q, k, v, alpha, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
        enable_gqa=True, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, backend="reference", window_size=window_size, alibi_slopes=alibi_slopes,
        sinks=sinks, softcap=softcap, block_mask=block_mask, compute_dtype=compute_dtype,
    )
    if dropout_mask is not None:
        check_mask("dropout_mask", dropout_mask, q.device, inputs.score_shape, keep_means="True = keep")
        if dropout_mask.dtype != torch.bool:
            raise TypeError(f"dropout_mask must be a boolean tensor (True = keep), got {dropout_mask.dtype}")
    res = reference_forward(inputs, dropout_mask=dropout_mask, generator=generator, compute_dtype=compute_dtype,
                            with_weights=return_weights, with_stats=return_stats)
    extra = ((res.weights,) if return_weights else ()) + ((res.stats,) if return_stats else ())
    return (res.out, *extra) if extra else res.out
