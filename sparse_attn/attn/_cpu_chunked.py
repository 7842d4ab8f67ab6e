"""The CPU path of :func:`sparse_attn.entmax_attention`: the reference's arithmetic, one block of query rows at a time.

The dense reference (:mod:`sparse_attn.reference`) builds the whole ``(B, H, Nq, Nk)`` score matrix and keeps a
dozen tensors of that size alive (more under autograd). This module computes the same function block by block:
a block is a range of query rows of every ``(batch, head)`` (of one ``(batch, head)`` with dropout, see below,
or when one row of every head would not fit) and only the keys some row of it may see (causal and sliding-window
masks bound the key range), so the extra memory is that of one block, ``O(B * H * rows * Nk)``, chosen under
:data:`BLOCK_BYTES`:

* **Forward**: per block, scores (scale, soft cap, masks, ALiBi, the sink column), the row mapping and the
  value product, written into the output; no tensor of the block is kept.
* **Backward** (:class:`_ChunkedAttention`, a ``torch.autograd.Function``): the forward saves only its inputs
  (and, for a Python alpha of 1.5 or 2, each row's threshold: one number per row); the backward recomputes each
  block under autograd (the weights from the saved thresholds, bitwise the forward's) and back-propagates
  through it alone, then frees it. The gradients are those of the reference's graph (same operations, the row
  mapping's closed-form gradient) for ``q``, ``k``, ``v``, a tensor ``alpha``, a float mask, the sinks and the
  ALiBi slopes. Double backward (``create_graph=True``) works too, with the graph of every block kept (the
  dense reference's memory).

Same results as the reference: each row's arithmetic is the reference's (the same operations in the same
order), so weights, statistics and outputs agree bitwise except where a reduction sums another number of
terms: keys outside the block's key range (masked anyway, weight exactly 0) are left out of the row sums of
softmax and of the iterative solver and out of the value product, which changes the rounding only. For a
Python ``alpha`` of 1.5 or 2 the threshold is not found by sorting whole rows but from the few entries above
a lower bound of it (:func:`_exact_threshold`): the same formula on the same leading sorted values, so the
same threshold bit for bit, at a fraction of the sort's cost; the backward differentiates these weights with
the row mapping's closed form (:class:`_ExactRows`). A tensor ``alpha`` runs the row mapping itself
(:func:`sparse_attn.mappings.entmax`, with a partial sort of the top ``_TOPK`` entries for its 1.5 and 2 heads).
Keys whose structural mask excludes them from every row of a block are not visited at all, so a NaN in such a
key's value reaches fewer rows than on the dense reference (which multiplies it by exact zeros), as on the fused
kernels.

Dropout draws the keep mask of each block from torch's default generator in the reference's order (batch,
head, row, key, and sequence by sequence with ``cu_seqlens``): blocks of one ``(batch, head)`` spanning full
key rows, so the same seed gives the same masks as the reference and leaves the generator in the same state.
The backward replays the draws from a copy of the generator's state taken before the forward.

Problems with fewer than :data:`MIN_SCORES` scores, ``torch.compile`` tracing and non-CPU tensors keep the
dense reference (:func:`chunked_fits`); so do the callers that need the weights (``need_weights``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import Tensor

from sparse_attn.attn.attn_inputs import AttentionInputs, AttentionStats
from sparse_attn.attn.reference import _SAFE_ALPHA, _stats, modify_scores
from sparse_attn.rows.mappings import _apply as _entmax_rows
from sparse_attn.rows.mappings import _rows_vjp, _threshold_from_sorted

__all__ = ["chunked_fits", "chunked_attention", "BLOCK_BYTES", "MIN_SCORES"]

_INF, _NAN = float("inf"), float("nan")

BLOCK_BYTES = 256 * 2**20
"""Budget of one block: its scores, weights and the temporaries of the forward or of the recomputed backward."""

_BLOCK_TEMPS, _SOLVER_TEMPS = 24, 40
"""Block-sized tensors budgeted per block: with a Python alpha of 1, 1.5 or 2 (measured peak of a call: about 16,
in the backward, where a recomputed block's autograd graph and its gradients are alive; about 4 in the forward,
which updates the scores in place), and with the row mapping's iterative solver or per-row routing (other or
tensor alphas; about 26 in the forward). With the default budget a float32 block of the exact alphas holds 2.8M
scores, 11 MiB per block-sized tensor, small enough for the forward's passes over a block to stay in a large
last-level cache (measured: blocks of 0.5M to 4M scores take the same time, larger ones up to 2.5x longer)."""

MIN_SCORES = 1 << 16
"""Problems with fewer scores (``B * Hq * Nq * Nk``) run the dense reference (no gain to chunk them, and the
reference reads nothing back to the host)."""

_TOPK = 64
"""``k`` of the row mapping's partial sort where the row mapping itself runs (the 1.5 and 2 heads of a tensor alpha,
double backward); rows whose support reaches it are redone with a full sort."""

_GROUPS, _BOUND_TOP, _BOUND_MARGIN = 64, 16, 2.0**-10
"""The exact thresholds' candidate search (:func:`_exact_threshold`): groups per row, group maxima in the bound,
safety margin of the bound (z-scale, where the row's entries lie in [-2, 0] or [-4, 0])."""


def chunked_fits(inputs: AttentionInputs) -> bool:
    """Whether :func:`chunked_attention` runs these inputs (the reference backend on CPU tensors, eager, big enough)."""
    q = inputs.q
    return (inputs.backend == "reference" and q.device.type == "cpu" and not torch.compiler.is_compiling()
            and q.shape[0] * q.shape[1] * q.shape[2] * inputs.k.shape[2] >= MIN_SCORES)


class _Block(NamedTuple):
    """Query rows ``rows`` (packed positions) of batch entries ``b`` and heads ``h`` against keys ``keys``.

    ``r0`` / ``k0``: index of the first row / key within its sequence (of ``n_q`` queries and ``n_k`` keys);
    ``seq``: the packed sequence (None without ``cu_seqlens``); ``seq_keys``: the sequence's keys (dropout draws
    whole rows of them).
    """

    b: slice
    h: slice
    rows: slice
    keys: slice
    r0: int
    k0: int
    n_q: int
    n_k: int
    seq: int | None
    seq_keys: slice


def _bounds(inputs: AttentionInputs):
    """``(left, right)`` of the structural masks: row ``i`` sees keys ``i + d - left .. i + d + right``
    (``d = n_k - n_q``); None = unbounded on that side."""
    left = right = None
    if inputs.is_causal:
        right = 0
    if inputs.window_size is not None:
        wl, wr = inputs.window_size
        if wl >= 0:
            left = wl
        if wr >= 0:
            right = wr if right is None else min(right, wr)
    return left, right


def _key_range(inputs: AttentionInputs, r0: int, r1: int, n_q: int, n_k: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that some row of ``r0 .. r1 - 1`` may see; all keys when none may (such rows then go
    through the reference's arithmetic on every key, for its edge cases)."""
    left, right = _bounds(inputs)
    d = n_k - n_q
    lo = 0 if left is None else max(0, r0 + d - left)
    hi = n_k if right is None else min(n_k, r1 + d + right)
    return (lo, hi) if lo < hi else (0, n_k)


def _plan(inputs: AttentionInputs, max_elems: int) -> list[_Block]:
    """Blocks of at most about ``max_elems`` scores (rows split evenly; one batch entry or one ``(batch, head)`` per
    block when a row of all of them would not fit), in the order dropout draws its masks (see the module
    docstring)."""
    q = inputs.q
    n_b, n_h = q.shape[0], q.shape[1]
    if inputs.cu_seqlens_q is None:
        seqs = [(None, 0, q.shape[2], 0, inputs.k.shape[2])]
    else:
        bq, bk = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
        seqs = [(s, bq[s], bq[s + 1], bk[s], bk[s + 1]) for s in range(len(bq) - 1)]
    widest = max(k1 - k0 for _, _, _, k0, k1 in seqs)
    if inputs.dropout_p > 0 or n_h * widest > max_elems:   # one (batch, head) per block
        groups = [(slice(b, b + 1), slice(h, h + 1)) for b in range(n_b) for h in range(n_h)]
        per_row = 1
    elif n_b * n_h * widest > max_elems:   # one batch entry per block
        groups = [(slice(b, b + 1), slice(None)) for b in range(n_b)]
        per_row = n_h
    else:
        groups = [(slice(None), slice(None))]
        per_row = n_b * n_h
    blocks = []
    for seq, q0, q1, k0, k1 in seqs:
        n_q, n_k = q1 - q0, k1 - k0
        if n_q == 0:
            continue
        rows = max(1, min(n_q, max_elems // max(1, per_row * n_k)))
        rows = -(-n_q // -(-n_q // rows))  # equal blocks
        for b, h in groups:
            for r0 in range(0, n_q, rows):
                r1 = min(n_q, r0 + rows)
                lo, hi = _key_range(inputs, r0, r1, n_q, n_k)
                blocks.append(_Block(b, h, slice(q0 + r0, q0 + r1), slice(k0 + lo, k0 + hi), r0, lo, n_q, n_k, seq,
                                     slice(k0, k1)))
    return blocks


def _mask_index(t: Tensor, blk: _Block) -> tuple:
    """Where the block's part of a 4-d tensor broadcastable to ``(B, H, Nq, Nk)`` lies (size-1 dims whole)."""
    return tuple(sel if t.shape[d] > 1 else slice(None) for d, sel in enumerate((blk.b, blk.h, blk.rows, blk.keys)))


def _structural_fill(s: Tensor, inputs: AttentionInputs, blk: _Block) -> Tensor:
    """``s`` (the block's scores) with ``-inf`` where the causal mask or the sliding window excludes the key.

    Only the key columns where some row of the block is cut are touched (the block's ragged edges).
    """
    left, right = _bounds(inputs)
    if left is None and right is None:
        return s
    c, width = s.shape[-2], s.shape[-1]
    d = blk.n_k - blk.n_q
    r0, k0 = blk.r0, blk.k0
    ragged = []
    if left is not None:   # columns below the last row's lower bound
        ragged.append((0, min(width, max(0, r0 + c - 1 + d - left - k0))))
    if right is not None:  # columns above the first row's upper bound
        ragged.append((max(0, min(width, r0 + d + right + 1 - k0)), width))
    if len(ragged) == 2 and ragged[0][1] >= ragged[1][0]:
        ragged = [(0, width)]
    rows = torch.arange(r0, r0 + c, device=s.device)[:, None] + d
    for a, b in ragged:
        if b <= a:
            continue
        cols = torch.arange(k0 + a, k0 + b, device=s.device)[None, :]
        drop = torch.zeros((c, b - a), dtype=torch.bool, device=s.device)
        if left is not None:
            drop |= cols < rows - left
        if right is not None:
            drop |= cols > rows + right
        s[..., a:b].masked_fill_(drop, -_INF)
    return s


def _alibi(slopes: Tensor, blk: _Block) -> Tensor:
    """The ALiBi bias ``-slope * |i + n_k - n_q - j|`` of the block (as :func:`sparse_attn.attn.masks.alibi_bias`)."""
    c = blk.rows.stop - blk.rows.start
    width = blk.keys.stop - blk.keys.start
    if slopes.dim() == 2 and blk.seq is not None:
        slopes = slopes[blk.seq]
    per_head = slopes if slopes.dim() == 2 else slopes[None]
    per_head = per_head[blk.b if per_head.shape[0] > 1 else slice(None), blk.h]
    diag = torch.arange(blk.r0, blk.r0 + c, device=slopes.device)[:, None] + (blk.n_k - blk.n_q)
    dist = (torch.arange(blk.k0, blk.k0 + width, device=slopes.device)[None, :] - diag).abs().to(slopes.dtype)
    return -per_head[:, :, None, None] * dist


class _Tensors(NamedTuple):
    """The differentiable inputs (full tensors, or one block's parts of them in the backward)."""

    q: Tensor
    k: Tensor
    v: Tensor
    alpha: Tensor | None   # (1, H, 1, 1) in the compute dtype, or None for a Python alpha
    mask: Tensor | None    # 4-d
    sinks: Tensor | None   # (H,)
    slopes: Tensor | None


class _State:
    """What one call needs besides its tensors: settings, the block budget, the dropout generator's state."""

    def __init__(self, inputs: AttentionInputs, ct: torch.dtype, block_bytes: int):
        self.inputs = inputs
        self.ct = ct
        self.block_bytes = block_bytes
        self.rng_state = torch.random.get_rng_state() if inputs.dropout_p > 0 else None
        self.create_graph = False  # set by the backward: double backward differentiates the row mapping itself
        self.stats = None
        self.tau = None  # the forward's thresholds (B, H, Nq, 1), kept for the backward (alpha 1.5 or 2)

    def blocks(self) -> list[_Block]:
        itemsize = torch.finfo(self.ct).bits // 8
        temps = _BLOCK_TEMPS if self.inputs.alpha_value in (1.0, 1.5, 2.0) else _SOLVER_TEMPS
        return _plan(self.inputs, max(1, self.block_bytes // (itemsize * temps)))


def _exact_threshold(z: Tensor, beta2: bool, empty: Tensor | None) -> Tensor:
    """The threshold ``(..., 1)`` of 1.5-entmax (``beta2``) or sparsemax of rows ``z`` (z-scale, shifted to max 0,
    ``-inf`` rows allowed), bitwise that of the mapping's full sort (:func:`sparse_attn.mappings._sort_threshold`).

    Only the entries above a lower bound of the threshold can be in the support. The bound is the threshold of
    a subset of the row (at most the row's): the largest of the maxima of ``_GROUPS`` groups of entries, sorted
    and fed to the full sort's formula, less a margin. The candidates above it are gathered, sorted and fed to
    the same formula: they are the row's largest entries (a prefix of its sorted values), and the positions past
    them (``-inf`` padding) never join the support. Rows with more than a quarter of their entries above the
    bound (nearly flat rows) are sorted whole; ``empty`` rows (all ``-inf`` before the shift) get a stand-in
    threshold (their weights are zeroed).
    """
    n = z.shape[-1]
    if n < 4 * _GROUPS:
        return _threshold_from_sorted(torch.sort(z, dim=-1, descending=True).values, beta2)[0]
    g = n // _GROUPS
    head = z[..., :g * _GROUPS].unflatten(-1, (g, _GROUPS)).amax(-2)
    if g * _GROUPS < n:
        head = torch.cat([head, z[..., g * _GROUPS:].amax(-1, keepdim=True)], dim=-1)
    low = _threshold_from_sorted(torch.topk(head, _BOUND_TOP, dim=-1).values, beta2)[0] - _BOUND_MARGIN
    if empty is not None:
        low = low.masked_fill(empty, _INF)
    n_rows = z.numel() // n
    flat = (z > low).reshape(-1).nonzero().squeeze(1)   # candidates, row by row
    rows = torch.div(flat, n, rounding_mode="floor")
    counts = torch.bincount(rows, minlength=n_rows)
    wide = counts > n // 4
    tau_wide = None
    if bool(wide.any()):
        tau_wide = _threshold_from_sorted(torch.sort(z.reshape(n_rows, n)[wide], dim=-1, descending=True).values,
                                          beta2)[0]
        narrow = ~wide[rows]
        flat, rows = flat[narrow], rows[narrow]
        counts = counts.masked_fill(wide, 0)
    width = max(1, int(counts.max()))
    cand = torch.full((n_rows, width), -_INF, dtype=z.dtype, device=z.device)
    pos = torch.arange(flat.numel(), device=z.device) - (counts.cumsum(0) - counts)[rows]
    cand[rows, pos] = z.reshape(-1)[flat]
    cand[:, :1].masked_fill_((counts == 0).unsqueeze(-1), 0.0)  # a stand-in keeps the formula defined on rows set aside
    tau = _threshold_from_sorted(torch.sort(cand, dim=-1, descending=True).values, beta2)[0]
    if tau_wide is not None:
        tau[wide] = tau_wide
    return tau.reshape(*z.shape[:-1], 1)


def _exact_in_place(s: Tensor, rmax: Tensor, alpha: float, tau: Tensor | None = None):
    """alpha-entmax (alpha 1, 1.5 or 2) of score rows ``s`` free of NaN and ``+inf``, with row maxima ``rmax``,
    computed in ``s``'s storage: the operations of the mapping's exact path (:func:`sparse_attn.mappings._exact_rows`
    after its shift by the row max), bitwise; rows of ``-inf`` give zeros. Returns ``(p, tau)``: the threshold
    (z-scale, ``(..., 1)``; None at alpha 1) is searched for unless given (the forward's, in the backward)."""
    empty = rmax == -_INF
    any_empty = bool(empty.any())
    x = s.sub_(rmax.masked_fill(empty, 0.0) if any_empty else rmax)
    if alpha == 1.0:
        p = torch.softmax(x, dim=-1)
    else:
        z = x.clamp_(min=-4.0)
        if alpha == 1.5:
            z = z.mul_(0.5)
        if tau is None:
            tau = _exact_threshold(z, alpha == 1.5, empty if any_empty else None)
        p = z.sub_(tau).clamp_(min=0)
        if alpha == 1.5:
            p = p.square_()
    return (p.masked_fill_(empty, 0.0) if any_empty else p), tau


class _ExactRows(torch.autograd.Function):
    """:func:`_exact_in_place` (with the forward's thresholds) and the row mapping's gradient
    (:mod:`sparse_attn.mappings`): with ``U = p ** (2 - alpha)`` on the support (``sqrt(p)``, the support's
    indicator, ``p`` for alpha 1.5, 2, 1), ``dX = U * (g - sum(U g) / sum(U))``. First order (double backward
    differentiates the mapping itself)."""

    @staticmethod
    def forward(ctx, s, rmax, alpha, tau):
        p, _ = _exact_in_place(s.clone(), rmax, alpha, tau)
        ctx.alpha = alpha
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        if ctx.alpha == 1.5:
            u = p.sqrt()
        elif ctx.alpha == 2.0:
            u = (p > 0).to(p.dtype)
        else:
            u = p
        return _rows_vjp(u, g)[0], None, None, None


def _block_attend(st: _State, t: _Tensors, blk: _Block, gen: torch.Generator | None, with_stats: bool):
    """One block: ``(out (B', H', c, Dv), stats or None)`` in the compute dtype, the reference's arithmetic.

    ``t`` holds the block's parts (``q`` rows, ``k`` / ``v`` keys, the mask's part). Under autograd (the
    backward) the operations are differentiable; otherwise scores are updated in place.
    """
    inputs, ct = st.inputs, st.ct
    s = torch.matmul(t.q.to(ct), t.k.to(ct).transpose(-1, -2)).mul_(inputs.scale)
    s = modify_scores(s, inputs)
    bias = keep = None
    if t.mask is not None:
        if t.mask.dtype == torch.bool:
            keep = t.mask
        else:
            bias = t.mask.to(ct)
    if t.slopes is not None:
        ali = _alibi(t.slopes, blk)
        bias = ali if bias is None else bias + ali
    # in place: no operation before needs its output for its gradient
    if bias is not None:
        s = s.add_(bias)
    if keep is not None:
        s = s.masked_fill_(~keep, -_INF)
    s = _structural_fill(s, inputs, blk)
    n_keys = s.shape[-1]
    if t.sinks is not None:
        s = torch.cat([s, t.sinks.to(ct).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    alpha = inputs.alpha_value if t.alpha is None else t.alpha
    bad_head = None
    if t.alpha is not None and not inputs.alpha_checked:
        bad_head = ~((alpha >= 1) & (alpha <= 2))
    rmax = s.detach().amax(-1, keepdim=True) if s.shape[-1] > 0 else None
    bad = (torch.isnan(rmax) | (rmax == _INF)) if rmax is not None else s.new_zeros((*s.shape[:-1], 1), dtype=bool)
    if bad_head is not None:
        bad = bad | bad_head
    any_bad = bool(bad.any())
    s_in = s.masked_fill(bad, 0.0) if any_bad else s
    a_in = alpha if bad_head is None else torch.where(bad_head, _SAFE_ALPHA, alpha)
    if s.shape[-1] == 0:
        p = s_in * 0
    elif not any_bad and isinstance(a_in, float) and a_in in (1.0, 1.5, 2.0) and not st.create_graph:
        rows = (blk.b, blk.h, blk.rows)
        if s.requires_grad:
            p = _ExactRows.apply(s, rmax, a_in, None if st.tau is None else st.tau[rows])
        else:
            p, tau = _exact_in_place(s.clone() if with_stats else s, rmax, a_in)
            if st.tau is not None:
                st.tau[rows] = tau
    else:
        topk = _TOPK if not isinstance(a_in, float) or a_in in (1.5, 2.0) else None
        p = _entmax_rows(s_in, a_in, -1, topk, 100, True, True)
    stats = None
    if with_stats:
        with torch.no_grad():
            n_valid = (s[..., :n_keys] != -_INF).sum(-1, dtype=torch.int32)
            stats = _stats(s_in, p, a_in, n_valid, bad, n_keys)
    if any_bad:
        poison = torch.zeros(bad.shape, dtype=ct, device=s.device).masked_fill(bad, _NAN)
        p = p + poison * (s.masked_fill(s == -_INF, 0.0) + (alpha if isinstance(alpha, Tensor) else 0.0))
    p = p[..., :n_keys]
    if inputs.dropout_p > 0:
        width = blk.seq_keys.stop - blk.seq_keys.start
        c = p.shape[-2]
        drop_keep = torch.rand((1, 1, c, width), generator=gen, device=p.device, dtype=torch.float32)
        lo = blk.keys.start - blk.seq_keys.start
        drop_keep = drop_keep[..., lo:lo + n_keys] >= inputs.dropout_p
        p = p * drop_keep.to(ct) / (1.0 - inputs.dropout_p)
    return torch.matmul(p, t.v.to(ct)), stats


def _block_tensors(t: _Tensors, blk: _Block) -> _Tensors:
    """The block's parts of the full inputs (``k`` / ``v`` already with one head per q head)."""
    return _Tensors(
        t.q[blk.b, blk.h, blk.rows], t.k[blk.b, blk.h, blk.keys], t.v[blk.b, blk.h, blk.keys],
        None if t.alpha is None else t.alpha[:, blk.h],
        None if t.mask is None else t.mask[_mask_index(t.mask, blk)],
        None if t.sinks is None else t.sinks[blk.h],
        t.slopes,
    )


def _forward(st: _State, t: _Tensors, with_stats: bool) -> Tensor:
    q, v = t.q, t.v
    out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=st.ct, device=q.device)
    stats = None
    if with_stats:
        shape = q.shape[:3]
        stats = AttentionStats(torch.empty(shape, dtype=torch.int32), torch.empty(shape, dtype=st.ct),
                               torch.empty(shape, dtype=torch.int32))
    for blk in st.blocks():
        o, bstats = _block_attend(st, _block_tensors(t, blk), blk, None, with_stats)
        out[blk.b, blk.h, blk.rows] = o
        if with_stats:
            for full, part in zip(stats, bstats):
                full[blk.b, blk.h, blk.rows] = part
    st.stats = stats
    return out


class _ChunkedAttention(torch.autograd.Function):
    """Block-wise attention whose backward recomputes one block at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, st: _State, with_stats: bool, q, k, v, alpha, mask, sinks, slopes):
        t = _Tensors(q, k, v, alpha, mask, sinks, slopes)
        if st.inputs.alpha_value in (1.5, 2.0):   # rows the forward leaves to the mapping keep NaN (never read)
            st.tau = torch.full((*q.shape[:3], 1), _NAN, dtype=st.ct, device=q.device)
        out = _forward(st, t, with_stats)
        ctx.st = st
        ctx.save_for_backward(q, k, v, alpha, mask, sinks, slopes)
        return out

    @staticmethod
    def backward(ctx, d_out):
        st = ctx.st
        create_graph = st.create_graph = torch.is_grad_enabled()
        saved = ctx.saved_tensors
        needs = [need and x is not None for x, need in zip(saved, ctx.needs_input_grad[2:])]
        # gradients accumulate in the compute dtype, as the reference's do before its casts
        grads = [torch.zeros(x.shape, dtype=st.ct, device=x.device) if need else None for x, need in zip(saved, needs)]
        full = _Tensors(*saved)
        gen = None
        if st.rng_state is not None:
            gen = torch.Generator(device=saved[0].device)
            gen.set_state(st.rng_state)
        with torch.enable_grad(), _autocast_off(saved[0]):
            for blk in st.blocks():
                part = _block_tensors(full, blk)
                if create_graph:
                    leaves = list(part)
                else:
                    leaves = [x.detach().to(st.ct).requires_grad_() if need else (None if x is None else x.detach())
                              for x, need in zip(part, needs)]
                o, _ = _block_attend(st, _Tensors(*leaves), blk, gen, False)
                wrt = [i for i, need in enumerate(needs) if need]
                if not o.requires_grad:
                    continue
                got = torch.autograd.grad(o, [leaves[i] for i in wrt], d_out[blk.b, blk.h, blk.rows],
                                          allow_unused=True, create_graph=create_graph)
                for i, g in zip(wrt, got):
                    if g is not None:
                        grads[i] = _accumulate(grads[i], _grad_index(i, grads[i], blk), g, create_graph)
        return (None, None, *(g if g is None else g.to(x.dtype) for g, x in zip(grads, saved)))


def _grad_index(i: int, acc: Tensor, blk: _Block) -> tuple:
    """Where input ``i``'s block part sits in the input (the order of :class:`_Tensors`)."""
    if i in (0, 1, 2):
        return (blk.b, blk.h, blk.rows if i == 0 else blk.keys)
    if i == 3:
        return (slice(None), blk.h)
    if i == 4:
        return _mask_index(acc, blk)
    if i == 5:
        return (blk.h,)
    return (slice(None),)


def _accumulate(acc: Tensor, idx: tuple, g: Tensor, create_graph: bool) -> Tensor:
    """``acc`` with ``g`` added at ``acc[idx]``: in place, or out of place (differentiable) for double backward."""
    if not create_graph:
        acc[idx] += g
        return acc
    out = acc.clone()
    out[idx] = out[idx] + g
    return out


def _autocast_off(x: Tensor):
    return torch.autocast("cpu", enabled=False) if x.device.type == "cpu" else contextlib.nullcontext()


def chunked_attention(inputs: AttentionInputs, with_stats: bool = False, block_bytes: int | None = None):
    """The reference's attention on prepared CPU inputs, block by block; returns ``(out, stats or None)``.

    Args:
        inputs: from :func:`sparse_attn.attn.attn_inputs.prepare_attention` (see :func:`chunked_fits`).
        with_stats: also compute :class:`AttentionStats` (as the reference's).
        block_bytes: the budget of one block (default :data:`BLOCK_BYTES`).
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_heads = q.shape[1]
    if k.shape[1] != n_heads:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    alpha = None if inputs.alpha_value is not None else inputs.alpha.to(ct).reshape(1, n_heads, 1, 1)
    mask = inputs.mask
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    st = _State(inputs, ct, BLOCK_BYTES if block_bytes is None else block_bytes)
    tensors = (q, k, v, alpha, mask, inputs.sinks, inputs.alibi_slopes)
    with _autocast_off(q):
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
            out = _ChunkedAttention.apply(st, with_stats, *tensors)
        else:
            with torch.no_grad():
                out = _forward(st, _Tensors(*tensors), with_stats)
    return out.to(q.dtype), st.stats

