"""Materialized reference for entmax attention: the oracle every kernel is tested against.

It builds the full ``(B, H, Nq, Nk)`` score matrix, applies the row-wise mapping
:func:`sparse_attn.mappings.entmax` and aggregates the values. It uses only PyTorch, supports
every option of :func:`sparse_attn.entmax_attention`, is differentiable (inputs, ``alpha``,
float masks) and computes in the dtype it is given, so float64 inputs give a float64 oracle.
Its memory is O(N^2): it is for tests, CPU tensors and small problems. It traces under
``torch.compile(fullgraph=True)`` for any alpha (float, per-head or learnable tensor) except
with ``cu_seqlens_q``/``cu_seqlens_k``: the packed-sequence loop reads the offsets to the host
and runs eagerly only (shapes depend on them; not traceable with ``fullgraph=True``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_attn.mappings import entmax


class AttentionStats(NamedTuple):
    """Per-row statistics of an attention call, each of shape ``(B, Hq, Nq)``.

    nnz:     int32, number of keys with a nonzero weight (support size); at alpha == 1 every
             valid key (softmax's support, whatever the floating-point underflow).
    tau:     float32 (the input dtype on the reference), the threshold: for alpha > 1 the
             entmax threshold in the z = (alpha - 1) * score scale, so that
             ``p = [z - tau]_+^(1 / (alpha - 1))``; for alpha == 1 the row's logsumexp.
             ``+inf`` for rows with no valid key.
    n_valid: int32, number of keys the query may attend to (not masked).
    """

    nnz: torch.Tensor
    tau: torch.Tensor
    n_valid: torch.Tensor


def causal_keep(n_q: int, n_k: int, device) -> torch.Tensor:
    """Boolean ``(n_q, n_k)`` causal mask, bottom-right aligned: row i sees key j iff j <= i + n_k - n_q."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows + (n_k - n_q)


def _alpha_view(alpha, n_heads: int, like: torch.Tensor):
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(device=like.device, dtype=like.dtype)
        return alpha.reshape(1, n_heads, 1, 1) if alpha.numel() > 1 else alpha.reshape(())
    return float(alpha)


def _row_threshold(scores: torch.Tensor, p: torch.Tensor, alpha) -> torch.Tensor:
    """Recover the threshold tau of each row from the scores and the weights (see AttentionStats)."""
    valid = torch.isfinite(scores).any(-1)
    neg_inf = torch.finfo(scores.dtype).min
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.tensor(alpha, dtype=scores.dtype, device=scores.device)
    alpha = alpha.detach().to(scores.dtype)
    a = alpha.squeeze(-1) if alpha.dim() == 4 else alpha
    lse = torch.logsumexp(scores.masked_fill(~torch.isfinite(scores), neg_inf), dim=-1)
    z = (alpha - 1) * scores.masked_fill(~torch.isfinite(scores), neg_inf)
    zmax, idx = z.max(dim=-1)
    pmax = p.gather(-1, idx.unsqueeze(-1)).squeeze(-1).to(scores.dtype)
    am1 = a - 1
    entmax_tau = zmax - pmax.clamp_min(torch.finfo(scores.dtype).tiny) ** am1
    tau = torch.where(am1 == 0, lse, entmax_tau)
    return torch.where(valid, tau, torch.full_like(tau, float("inf")))


def _stats(scores: torch.Tensor, p: torch.Tensor, alpha) -> AttentionStats:
    """Per-row statistics of one dense block (see AttentionStats); at alpha = 1 every valid key counts."""
    n_valid = torch.isfinite(scores).sum(-1, dtype=torch.int32)
    if scores.shape[-1] == 0:
        return AttentionStats(n_valid, torch.full(n_valid.shape, float("inf"), dtype=scores.dtype, device=scores.device), n_valid)
    nnz = (p > 0).sum(-1, dtype=torch.int32)
    if isinstance(alpha, torch.Tensor):
        is_softmax = (alpha.squeeze(-1) if alpha.dim() == 4 else alpha) == 1
    else:
        is_softmax = torch.tensor(alpha == 1.0, device=scores.device)
    return AttentionStats(torch.where(is_softmax, n_valid, nnz), _row_threshold(scores, p, alpha), n_valid)


def _attend(q, k, v, alpha, bias, keep, scale, dropout_p, dropout_mask, generator, want_stats):
    """One dense block: q (B,H,Nq,D), k/v (B,H,Nk,D), bias/keep broadcastable to (B,H,Nq,Nk)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    a = _alpha_view(alpha, q.shape[1], scores)
    # no key at all: the (empty) weights still connect the zero output to the inputs
    p = scores * 0 if scores.shape[-1] == 0 else entmax(scores, a, dim=-1)
    stats = None
    if want_stats:
        with torch.no_grad():
            stats = _stats(scores.detach(), p.detach(), a)
    if dropout_mask is not None:
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    elif dropout_p > 0:
        drop_keep = torch.rand(p.shape, generator=generator, device=p.device, dtype=torch.float32) >= dropout_p
        p = p * drop_keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p.to(v.dtype), v), stats


def entmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha=1.5,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_stats: bool = False,
    generator: torch.Generator | None = None,
):
    """Materialized entmax attention (the oracle). Arguments as :func:`sparse_attn.entmax_attention`.

    Args:
        q: ``(B, Hq, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``Hq % Hk == 0``.
        alpha: float or ``(Hq,)`` tensor in [1, 2] (differentiable).
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, Hq, Nq, Nk)``.
        dropout_mask: optional bool keep-mask broadcastable to ``(B, Hq, Nq, Nk)``; when given it
            replaces the random draw (used to replay the kernels' RNG in tests).
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1,)`` for packed sequences; then ``B == 1``
            and masks are indexed with global (packed) row/column positions.

    Returns:
        ``out`` of shape ``(B, Hq, Nq, D)`` in the input dtype, and ``AttentionStats`` when
        ``return_stats``.
    """
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    bias = keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            bias = attn_mask
    if dropout_mask is not None:
        dropout_mask = dropout_mask.expand(q.shape[0], n_heads, q.shape[2], k.shape[2])
    if cu_seqlens_q is None:
        if is_causal:
            c = causal_keep(q.shape[2], k.shape[2], q.device)
            keep = c if keep is None else keep & c
        out, stats = _attend(q, k, v, alpha, bias, keep, scale, dropout_p, dropout_mask, generator, return_stats)
    else:
        outs, all_stats = [], []
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        full_shape = (q.shape[0], n_heads, q.shape[2], k.shape[2])
        for s in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
            sl = (slice(None), slice(None), slice(q0, q1), slice(k0, k1))
            b = bias.expand(full_shape)[sl] if bias is not None else None
            kp = keep.expand(full_shape)[sl] if keep is not None else None
            if is_causal:
                c = causal_keep(q1 - q0, k1 - k0, q.device)
                kp = c if kp is None else kp & c
            dm = dropout_mask[sl] if dropout_mask is not None else None
            o, st = _attend(q[sl[:3]], k[:, :, k0:k1], v[:, :, k0:k1], alpha, b, kp, scale, dropout_p, dm,
                            generator, return_stats)
            outs.append(o)
            all_stats.append(st)
        out = torch.cat(outs, dim=2)
        stats = AttentionStats(*(torch.cat(t, dim=2) for t in zip(*all_stats))) if return_stats else None
    if return_stats:
        return out, stats
    return out
