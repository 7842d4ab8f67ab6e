"""Entmax attention over a sequence split across processes: all-gather K/V and Ulysses (torch.distributed).

Both schemes take the local shards of one long sequence, layout ``(batch, heads, seq_local,
head_dim)``, on every rank of a process group, and give every rank the attention output of its
own query rows, equal (up to rounding) to what one process would compute on the whole sequence:

* :func:`context_parallel_attention` all-gathers K and V across the group (one collective for
  both), runs each local query chunk against the gathered keys, and reduce-scatters dK and dV in
  the backward. The entmax threshold of a row needs all of the row's keys, which every rank then
  holds, so the threshold search stays local.
* :func:`ulysses_attention` (DeepSpeed-Ulysses) turns sequence shards into head shards with one
  all-to-all (each rank then holds the whole sequence for ``H / P`` heads), runs any attention
  call on them, and turns the output back with the inverse all-to-all (the adjoint pair gives the
  backward).

Every rank must pass the same shapes, dtypes and options (its shard of one sequence). Before any
data moves, each entry point all-gathers a small int64 description of every rank's arguments (one
collective; on the CPU when the group has a CPU backend) and, when they differ, raises the same
``ValueError`` on every rank, naming the argument, the ranks, what they have and what rank 0 has;
when one rank's own argument checks fail, that rank raises its error and the others a
``ValueError`` naming it. No rank hangs or aborts in the backend. The backward needs no second
check: autograd fixes its shapes.

Sharding: the sequence of length ``N`` is cut into ``2P`` chunks of ``N / (2P)`` positions and
rank ``r`` holds chunks ``r`` and ``2P - 1 - r`` (``load_balance=True``, the default: every rank
gets the same causal work), or into ``P`` chunks with rank ``r`` holding chunk ``r``
(``load_balance=False``). :func:`shard_sequence`, :func:`unshard_sequence`,
:func:`shard_positions` (global positions of the local rows, for positional encodings) and
:func:`pad_for_context_parallel` (uneven lengths) follow the same layout, and
:class:`ContextParallelMultiheadAttention` is :class:`sparse_attn.EntmaxMultiheadAttention` on
sequence shards. Causal attention is bottom-right aligned, so a query chunk holding global
positions ``[s, e)`` attends with exact causal semantics to the gathered keys sliced to
``[0, e)`` (a view): see :func:`_attend_query_chunk`, the one place where a kernel-level query
offset would go. Design notes, memory and the choice between the schemes: ``docs/scaling.md``.

Parameters (a per-head ``alpha``, projections) are replicated; each rank's backward leaves in
their ``.grad`` the contribution of its own tokens, and the gradient of the whole sequence is the
sum over the group: reduce them as data-parallel gradients (DDP or FSDP2 over the group, whose
averaging matches a loss that is the mean over each rank's local tokens), or all-reduce them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from sparse_attn._validation import check_bool
from sparse_attn.attn.attention import entmax_attention
from sparse_attn.attn.attn_inputs import AttentionStats, check_head_alpha, prepare_attention
from sparse_attn.attn.masks import check_mask
from sparse_attn.attn.routes import refusal_message, refused
from sparse_attn.models._cp_layout import (
    _all_gather_seq,
    _AllToAll,
    _chunk_size,
    _GatherSequence,
    _heads_to_seq,
    _Layout,
    _layout,
    _ranks_agree,
)
from sparse_attn.models._cp_shard import (
    _unshard,
    pad_for_context_parallel,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from sparse_attn.models.modules import EntmaxMultiheadAttention
from sparse_attn.models.stats import head_stats_sink

__all__ = [
    "context_parallel_attention",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "pad_for_context_parallel",
    "gather_head_density",
    "ContextParallelMultiheadAttention",
    "enable_context_parallel",
    "SCHEMES",
]

SCHEMES = ("allgather", "ulysses")
_QKV_DIMS = ("batch", "heads", "seq_local", "head_dim")
_V_DIMS = ("batch", "heads", "seq_local", "value head_dim")
_MASK_DIMS = ("batch", "seq_local")
_ULYSSES_OPTIONS = ("scale", "dropout_p", "backend", "window_size", "softcap", "sinks", "alibi_slopes")

def _refuse(route: str, inputs) -> None:
    """``ValueError`` naming the variants of ``inputs`` (this rank's shards) that ``route`` does not list in
    :data:`sparse_attn.attn.routes.SUPPORTED`."""
    why = refused(route, inputs.used())
    if why:
        raise ValueError(refusal_message(route, why, "pass them to sparse_attn.entmax_attention on one process"))


def _check_local(q, k, v, key_padding_mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_local, head_dim), got {tuple(t.shape)}")
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, Tensor) or not (
            key_padding_mask.dtype == torch.bool or key_padding_mask.is_floating_point()):
        got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
        raise TypeError(f"key_padding_mask must be a boolean (True = real key) or float (additive) tensor, got {got}")
    if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"key_padding_mask must have shape (batch, seq_local) = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != k.device:
        raise ValueError(f"key_padding_mask must be on the device of k ({k.device}), got {key_padding_mask.device}")


def _gather_key_mask(key_padding_mask, lay: _Layout):
    """The local ``(B, N_local)`` key mask (bool keep or float additive), gathered to ``(B, 1, 1, N)``, or None."""
    if key_padding_mask is None:
        return None
    if key_padding_mask.dtype == torch.bool:
        return _all_gather_seq([key_padding_mask.to(torch.uint8)], 1, lay)[0].bool()[:, None, None, :]
    return _GatherSequence.apply(lay, 1, key_padding_mask)[0][:, None, None, :]


def _cat_results(results, return_stats: bool):
    if not return_stats:
        return torch.cat(results, dim=2)
    outs, stats = zip(*results)
    return torch.cat(outs, dim=2), AttentionStats(*(torch.cat(f, dim=2) for f in zip(*stats)))


def _key_span(start: int, end: int, shift: int, n_k: int, is_causal: bool, window) -> tuple[int, int, tuple | None]:
    """Keys ``[lo, hi)`` the query rows at global positions ``[start, end)`` may see, and the window that gives a call
    on that slice the global semantics.

    Row ``p`` sits at key position ``p + shift`` (``shift = N_k - N_q``: bottom-right alignment over the whole
    sequence). The kernels align a slice's rows the same way, at ``i + (hi - lo) - n``; the slice is that of the
    global row, ``i + start + shift - lo``, exactly when ``hi = end + shift``, which the causal rule gives (and
    which ALiBi distances need); otherwise the window's two bounds absorb the difference.
    """
    left, right = window if window is not None else (-1, -1)
    lo = 0 if left < 0 else min(max(start + shift - left, 0), n_k)
    hi = end + shift if is_causal else (n_k if right < 0 else end + shift + right)
    hi = min(max(hi, lo), n_k)
    if window is None:
        return lo, hi, None
    moved = hi - end - shift
    return lo, hi, (-1 if left < 0 else max(left + moved, 0), -1 if right < 0 else max(right - moved, 0))


def _attend_query_chunk(q_chunk: Tensor, k_all: Tensor, v_all: Tensor, span: tuple, mask, **kw):
    """Attention of the query rows of one chunk to the gathered keys of ``span = (lo, hi, window)``
    (:func:`_key_span`): the keys are sliced (a view, no copy). A kernel-level query offset would replace this
    slicing: this function and :func:`_key_span` are the one place to change."""
    lo, hi, window = span
    mask = None if mask is None else mask[..., lo:hi]
    return entmax_attention(q_chunk, k_all[:, :, lo:hi], v_all[:, :, lo:hi], attn_mask=mask, window_size=window, **kw)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    group=None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    return_stats: bool = False,
    backend: str = "auto",
    load_balance: bool = True,
    window_size: tuple[int, int] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """:func:`sparse_attn.entmax_attention` of a sequence sharded over a process group, by all-gathering K/V.

    Every rank passes its shards (same shapes on every rank) and gets the output of its own query
    rows. K and V are all-gathered (one collective) into global order; each local query chunk
    attends to them, with causal masking sliced to the keys up to the chunk's end; the backward
    reduce-scatters dK and dV (one collective). Memory per rank: the gathered K/V of the whole
    sequence, ``B * Hk * N * (D + Dv)`` elements, plus its gradient in the backward. Arguments
    that differ across ranks raise the same ``ValueError`` on every rank before any data moves
    (see the module docstring).

    Args:
        q: ``(B, Hq, N_local, D)`` this rank's query rows (see :func:`shard_sequence`).
        k, v: ``(B, Hk, N_local_k, D)`` and ``(B, Hk, N_local_k, Dv)`` this rank's keys and values,
            sharded like ``q`` (``N_local_k == N_local`` when ``is_causal``).
        alpha: float in [1, 2] or a ``(Hq,)`` / ``()`` tensor, the same on every rank (replicated).
            Its gradient on each rank is the contribution of the local rows: sum it over the group
            (DDP / FSDP2 do, see the module docstring). Default 1.5.
        group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        is_causal: causal attention over the global positions.
        key_padding_mask: ``(B, N_local_k)``, this rank's shard of a mask over the keys: bool, True =
            a real key (e.g. :func:`pad_for_context_parallel`'s ``keep``), or float, added to the
            scores (``-inf`` = excluded; differentiable).
        scale, dropout_p, enable_gqa, backend: as :func:`sparse_attn.entmax_attention`. Dropout
            masks are drawn on each rank (they differ from a single process's).
        return_stats: also return :class:`sparse_attn.AttentionStats` of the local rows, each
            ``(B, Hq, N_local)``; :func:`gather_head_density` aggregates densities over ranks.
        load_balance: the sharding layout (chunks ``r`` and ``2P - 1 - r``, or chunk ``r``). Default True.
        window_size, alibi_slopes, softcap, sinks: as :func:`sparse_attn.entmax_attention`, over the global
            positions (bottom-right aligned on the whole sequence). With a window, each local query chunk reads
            only the gathered keys inside its window (a view). ``alibi_slopes`` needs ``is_causal`` or a window
            with ``right == 0`` here (non-causal ALiBi: :func:`ulysses_attention`). ``sinks`` are replicated like
            ``alpha``: sum their gradient over the group.

    Returns:
        ``out`` ``(B, Hq, N_local, Dv)`` (this rank's rows), or ``(out, stats)``.
    """
    lay = _layout(group, load_balance)
    variants = dict(alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    args = [("q", q, _QKV_DIMS), ("k", k, _QKV_DIMS), ("v", v, _V_DIMS), ("alpha", alpha, None),
            ("is_causal", is_causal, None), ("key_padding_mask", key_padding_mask, _MASK_DIMS), ("scale", scale, None),
            ("dropout_p", dropout_p, None), ("enable_gqa", enable_gqa, None), ("return_stats", return_stats, None),
            ("backend", backend, None), ("load_balance", load_balance, None), ("window_size", window_size, None),
            *((name, val, None) for name, val in variants.items())]
    with _ranks_agree(lay, "context_parallel_attention", args):
        _check_local(q, k, v, key_padding_mask)
        check_bool("return_stats", return_stats)
        spec = prepare_attention(q, k, v, alpha, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                 enable_gqa=enable_gqa, backend=backend, window_size=window_size,
                                 need_stats=return_stats, **variants)
        _refuse("context_parallel", spec)
        window = spec.window_size
        if alibi_slopes is not None and not is_causal and (window is None or window[1] != 0):
            raise ValueError("alibi_slopes with context_parallel_attention needs is_causal=True or window_size=(left, "
                             "0): a query chunk's ALiBi distances need its keys to end at the chunk's last position; "
                             "use ulysses_attention for non-causal ALiBi")
        if is_causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"is_causal needs q and k sharded from one sequence (the same seq_local), "
                             f"got {q.shape[2]} and {k.shape[2]}")
        c = _chunk_size(q.shape[2], lay, "q.shape[2] (seq_local)")
        _chunk_size(k.shape[2], lay, "k.shape[2] (seq_local)")
    if k.shape[-1] == v.shape[-1]:
        k_all, v_all = _GatherSequence.apply(lay, 2, k, v)
    else:
        (k_all,), (v_all,) = _GatherSequence.apply(lay, 2, k), _GatherSequence.apply(lay, 2, v)
    mask = _gather_key_mask(key_padding_mask, lay)
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa, return_stats=return_stats, backend=backend,
              **variants)
    if not is_causal and window is None:
        return entmax_attention(q, k_all, v_all, alpha, attn_mask=mask, **kw)
    n_k = k_all.shape[2]
    shift = n_k - c * lay.n_chunks
    results = [_attend_query_chunk(q[:, :, s * c:(s + 1) * c], k_all, v_all,
                                   _key_span(g * c, (g + 1) * c, shift, n_k, is_causal, window), mask, alpha=alpha,
                                   is_causal=is_causal, **kw)
               for s, g in enumerate(lay.chunks(lay.rank))]
    return _cat_results(results, return_stats)


def _ulysses_kv_heads(h_q: int, h_k: int, p: int) -> int:
    """How many times each kv head is repeated before the all-to-all (1: kv heads are sharded)."""
    if h_q % p:
        raise ValueError(f"ulysses_attention needs the number of q heads ({h_q}) to be a multiple of the group "
                         f"size ({p}); use context_parallel_attention (all-gather K/V) instead")
    if h_k % p == 0:
        return 1
    if p % h_k == 0:
        return p // h_k
    raise ValueError(f"ulysses_attention needs the number of k/v heads ({h_k}) to be a multiple or a divisor of "
                     f"the group size ({p})")


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    group=None,
    attn_fn=None,
    is_causal: bool = False,
    key_padding_mask: Tensor | None = None,
    enable_gqa: bool = False,
    return_stats: bool = False,
    load_balance: bool = True,
    **kwargs,
):
    """Any attention call on a sequence sharded over a process group, by all-to-all to head shards (Ulysses).

    Each rank passes its sequence shards; one all-to-all gives it the whole sequence for its
    ``Hq / P`` heads (``alpha`` sliced to them), ``attn_fn`` runs there, and the inverse
    all-to-all returns this rank's rows for all heads. The backward is the adjoint all-to-all of
    each. Needs ``Hq % P == 0``; kv heads are sharded when ``Hk % P == 0`` and otherwise, when
    ``P % Hk == 0`` (e.g. multi-query attention), each kv head is repeated ``P / Hk`` times first
    (more all-to-all volume for K/V, gradients summed back). Memory per rank: q, k, v and the
    output of the whole sequence for ``H / P`` heads. Arguments that differ across ranks (shapes,
    dtypes, options, ``attn_fn``) raise the same ``ValueError`` on every rank before any data
    moves (see the module docstring).

    Args:
        q: ``(B, Hq, N_local, D)``; k, v: ``(B, Hk, N_local_k, D)`` / ``(B, Hk, N_local_k, Dv)``, sharded
            alike (see :func:`shard_sequence`; ``N_local_k == N_local`` when ``is_causal``).
        alpha: float, or a ``(Hq,)`` / ``()`` tensor replicated on every rank (each rank's gradient
            holds its heads' entries; sum it over the group). Default 1.5.
        group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        attn_fn: the attention, called as ``attn_fn(q, k, v, alpha, is_causal=..., **options)`` on
            ``(B, Hq / P, N, D)`` head shards, where the options are ``attn_mask`` (``(B, 1, 1, N)``,
            only with a key padding mask), ``enable_gqa=True`` and
            ``return_stats=True`` (only when asked) and ``**kwargs``. Default
            :func:`sparse_attn.entmax_attention`.
        is_causal: causal attention over the global positions.
        key_padding_mask: ``(B, N_local)``, this rank's shard of a key mask, as in
            :func:`context_parallel_attention` (bool True = real key, or float additive).
        enable_gqa: allow ``Hk < Hq``.
        return_stats: also return ``attn_fn``'s :class:`sparse_attn.AttentionStats`, brought back to
            this rank's rows for all heads, ``(B, Hq, N_local)`` each.
        load_balance: the sharding layout of the inputs. Default True.
        **kwargs: passed to ``attn_fn`` (e.g. ``scale``, ``dropout_p``, ``backend``, ``window_size``, ``softcap``);
            the per-head tensors ``sinks`` ``(Hq,)`` and ``alibi_slopes`` ``(Hq,)`` / ``(B, Hq)`` are sliced to this
            rank's heads, like ``alpha`` (sum the sinks' gradient over the group).

    Returns:
        ``out`` ``(B, Hq, N_local, Dv)``, or ``(out, stats)``.
    """
    lay = _layout(group, load_balance)
    others = ",".join(sorted(name for name in kwargs if name not in _ULYSSES_OPTIONS))
    fn_name = None if attn_fn is None or attn_fn is entmax_attention else (
        f"{getattr(attn_fn, '__module__', '')}.{getattr(attn_fn, '__qualname__', type(attn_fn).__qualname__)}")
    args = [("q", q, _QKV_DIMS), ("k", k, _QKV_DIMS), ("v", v, _V_DIMS), ("alpha", alpha, None),
            ("is_causal", is_causal, None), ("key_padding_mask", key_padding_mask, _MASK_DIMS),
            ("enable_gqa", enable_gqa, None), ("return_stats", return_stats, None),
            ("load_balance", load_balance, None), ("attn_fn (its qualified name)", fn_name, None),
            *((name, kwargs.get(name), None) for name in _ULYSSES_OPTIONS),
            ("the names of the other keyword arguments", others, None)]
    with _ranks_agree(lay, "ulysses_attention", args):
        _check_local(q, k, v, key_padding_mask)
        check_bool("return_stats", return_stats)
        check_bool("enable_gqa", enable_gqa)
        for name in ("attn_mask", "cu_seqlens_q", "cu_seqlens_k"):
            if name in kwargs:
                raise ValueError(f"{name} is not supported by ulysses_attention: pass key_padding_mask (and is_causal)")
        if attn_fn is None:
            attn_fn = entmax_attention
            _refuse("ulysses", prepare_attention(q, k, v, alpha, is_causal=is_causal, enable_gqa=enable_gqa,
                                                 need_stats=return_stats, **kwargs))
        elif not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        if is_causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"is_causal needs q and k sharded from one sequence (the same seq_local), "
                             f"got {q.shape[2]} and {k.shape[2]}")
        _chunk_size(q.shape[2], lay, "q.shape[2] (seq_local)")
        _chunk_size(k.shape[2], lay, "k.shape[2] (seq_local)")
        h_q, h_k = q.shape[1], k.shape[1]
        if h_k != h_q and not enable_gqa:
            raise ValueError(f"q has {h_q} heads and k/v have {h_k}: pass enable_gqa=True")
        check_head_alpha("alpha", alpha, h_q)
        repeat = _ulysses_kv_heads(h_q, h_k, lay.world)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if q.shape[-1] == v.shape[-1]:
        q_h, k_h, v_h = _AllToAll.apply(lay, True, q, k, v)
    else:
        (q_h, k_h), (v_h,) = _AllToAll.apply(lay, True, q, k), _AllToAll.apply(lay, True, v)
    h = h_q // lay.world
    if isinstance(alpha, Tensor) and alpha.numel() > 1:
        alpha = alpha.reshape(-1)[lay.rank * h:(lay.rank + 1) * h]
    options = dict(kwargs)
    for name in ("sinks", "alibi_slopes"):
        if isinstance(options.get(name), Tensor):
            options[name] = options[name][..., lay.rank * h:(lay.rank + 1) * h]
    mask = _gather_key_mask(key_padding_mask, lay)
    if mask is not None:
        options["attn_mask"] = mask
    if enable_gqa:
        options["enable_gqa"] = True
    if return_stats:
        options["return_stats"] = True
    res = attn_fn(q_h, k_h, v_h, alpha, is_causal=is_causal, **options)
    out_h, stats = res if return_stats else (res, None)
    (out,) = _AllToAll.apply(lay, False, out_h)
    if not return_stats:
        return out
    with torch.no_grad():
        stats = AttentionStats(*(_heads_to_seq([f.unsqueeze(-1)], lay)[0].squeeze(-1) for f in stats))
    return out, stats


def gather_head_density(stats: AttentionStats, group=None, row_mask: Tensor | None = None) -> Tensor:
    """Mean density per head over the rows of every rank: ``nnz / n_valid`` averaged over rows with ``n_valid > 0``.

    Args:
        stats: this rank's :class:`sparse_attn.AttentionStats` (``(B, H, N_local)`` each), e.g. from
            :func:`context_parallel_attention` or :func:`ulysses_attention` with ``return_stats=True``.
        group: the process group (None, a ``ProcessGroup`` or a 1-d ``DeviceMesh``).
        row_mask: optional bool ``(B, N_local)``, True for the query rows to count (e.g. leave the
            padded rows out).

    Returns:
        float64 ``(H,)`` on the stats' device, the same on every rank; NaN for a head with no row.
    """
    lay = _layout(group, False)
    fields = stats if isinstance(stats, AttentionStats) else (stats, None, None)
    args = [(f"stats.{name}", val, ("batch", "heads", "seq_local"))
            for name, val in zip(AttentionStats._fields, fields)]
    with _ranks_agree(lay, "gather_head_density", [*args, ("row_mask", row_mask, _MASK_DIMS)]):
        if not isinstance(stats, AttentionStats):
            raise TypeError(f"stats must be an AttentionStats, got {type(stats).__name__}")
        valid = stats.n_valid > 0
        if row_mask is not None:
            if not isinstance(row_mask, Tensor) or row_mask.dtype != torch.bool or row_mask.shape != (
                    valid.shape[0], valid.shape[2]):
                got = f"{row_mask.dtype} {tuple(row_mask.shape)}" if isinstance(row_mask, Tensor) else row_mask
                raise ValueError(f"row_mask must be a boolean tensor of shape {(valid.shape[0], valid.shape[2])}, "
                                 f"got {got}")
    if row_mask is not None:
        valid = valid & row_mask[:, None, :]
    frac = torch.where(valid, stats.nnz.double() / stats.n_valid.clamp_min(1).double(), 0.0)
    totals = torch.stack([frac.sum((0, 2)), valid.sum((0, 2)).double()])
    dist.all_reduce(totals, group=lay.group)
    return totals[0] / totals[1]


class ContextParallelMultiheadAttention(EntmaxMultiheadAttention):
    """:class:`sparse_attn.EntmaxMultiheadAttention` whose inputs are sequence shards of a process group.

    Same constructor (plus the keyword arguments below), parameters and state dict as
    :class:`sparse_attn.EntmaxMultiheadAttention`, so a single-process checkpoint loads as is; the
    forward takes this rank's shard of the sequence (query and key/value sharded alike, see
    :func:`shard_sequence` with ``dim=1`` for ``batch_first`` input) and returns this rank's rows.
    Parameters are replicated: reduce their gradients over the group (DDP / FSDP2 over it).

    Args:
        process_group: None (the default group), a ``ProcessGroup`` or a 1-d ``DeviceMesh``.
        scheme: ``"allgather"`` (:func:`context_parallel_attention`, default) or ``"ulysses"``
            (:func:`ulysses_attention`, needs ``num_heads % P == 0``).
        load_balance: the sharding layout. Default True.

    Forward: as ``nn.MultiheadAttention.forward`` with these limits (others raise
    ``ValueError``): batched input; ``need_weights=False``; no ``attn_mask`` (use
    ``is_causal=True`` for causal attention over the global positions); ``key_padding_mask``
    ``(N, S_local)`` as in ``nn.MultiheadAttention`` (bool True = padding, or float additive);
    no ``add_bias_kv`` / ``add_zero_attn``. A
    :func:`sparse_attn.record_head_stats` recorder gets the statistics of every rank's rows, so
    its densities are those of the whole sequence (head diversity needs dense weights and is not
    available).
    """

    def __init__(self, embed_dim: int, num_heads: int, *args, process_group=None, scheme: str = "allgather",
                 load_balance: bool = True, **kwargs):
        super().__init__(embed_dim, num_heads, *args, **kwargs)
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        check_bool("load_balance", load_balance)
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported with context parallelism")
        self.process_group = process_group
        self.scheme = scheme
        self.load_balance = load_balance

    @classmethod
    def from_entmax(cls, mha: EntmaxMultiheadAttention, **kwargs) -> ContextParallelMultiheadAttention:
        """A context-parallel copy of ``mha`` (configuration, alpha, weights and ``requires_grad``).

        Args:
            mha: the :class:`sparse_attn.EntmaxMultiheadAttention` (kept unchanged).
            **kwargs: ``process_group``, ``scheme``, ``load_balance``.
        """
        if not isinstance(mha, EntmaxMultiheadAttention):
            raise TypeError(f"mha must be an EntmaxMultiheadAttention, got {type(mha).__name__}")
        if mha.learnable_alpha:
            mid = (mha.alpha_min + mha.alpha_max) / 2
            alpha_kw = dict(learnable=True, alpha=mid, alpha_min=mha.alpha_min, alpha_max=mha.alpha_max)
        else:
            alpha_kw = dict(alpha=mha._alpha_arg())
        return cls.from_mha(mha, backend=mha.backend, **alpha_kw, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme}, load_balance={self.load_balance}"

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, None]:
        """Attend over the whole sequence from this rank's shard; ``(out, None)``, ``out`` shaped like ``query``."""
        self._check_inputs(query, key, value)
        if need_weights:
            raise ValueError("need_weights=True is not supported with context parallelism: pass need_weights=False")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with context parallelism: pass is_causal=True (causal over "
                             "the global positions) and key_padding_mask")
        check_bool("is_causal", is_causal)
        if query.dim() != 3:
            raise ValueError(f"query, key and value must be batched (3-d) with context parallelism, "
                             f"got shape {tuple(query.shape)}")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        n, l_q = query.shape[:2]
        keep = None
        if key_padding_mask is not None:
            check_mask("key_padding_mask", key_padding_mask, query.device, keep_means="True = padding")
            keep = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
        q, k, v = self._project(query, key, value, query is key and key is value)
        heads = (self.num_heads, self.head_dim)
        q, k, v = (t.unflatten(-1, heads).transpose(1, 2) for t in (q, k, v))
        sink = head_stats_sink(self)
        if sink is not None and sink.wants_weights:
            raise ValueError("head diversity needs dense weights, which context parallelism does not materialize: "
                             "record with record_head_stats(model, diversity=False)")
        kw = dict(group=self.process_group, is_causal=is_causal, key_padding_mask=keep, return_stats=sink is not None,
                  dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                  load_balance=self.load_balance)
        if self.scheme == "allgather":
            res = context_parallel_attention(q, k, v, self._alpha_arg(), **kw)
        else:
            res = ulysses_attention(q, k, v, self._alpha_arg(), **kw)
        out = res[0] if sink is not None else res
        if sink is not None:
            lay = _layout(self.process_group, self.load_balance)
            with torch.no_grad():  # shapes checked by the attention call: no second agreement check
                nnz, n_valid = (_unshard(f, 2, lay) for f in (res[1].nnz, res[1].n_valid))
            sink(nnz, n_valid, self.alpha, None)
        out = self.out_proj(out.transpose(1, 2).reshape(n, l_q, self.embed_dim))
        return (out if self.batch_first else out.transpose(0, 1)), None


def enable_context_parallel(model: torch.nn.Module, group=None, *, scheme: str = "allgather",
                            load_balance: bool = True) -> list[str]:
    """Replace every :class:`sparse_attn.EntmaxMultiheadAttention` of ``model`` by its context-parallel copy, in place.

    Run it before building the optimizer (parameters are new objects) and before wrapping the
    model with DDP / FSDP2. The rest of the model must work on sequence shards (token-wise layers
    do; positional encodings need :func:`shard_positions`).

    Args:
        model: the model (e.g. after :func:`sparse_attn.swap_attention`).
        group, scheme, load_balance: as :class:`ContextParallelMultiheadAttention`.

    Returns:
        The qualified names of the replaced modules.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, EntmaxMultiheadAttention):
        raise ValueError("model is itself an EntmaxMultiheadAttention: "
                         "use ContextParallelMultiheadAttention.from_entmax(model)")
    _layout(group, load_balance)
    new_of, names = {}, []
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            if type(child) is not EntmaxMultiheadAttention:
                continue
            if id(child) not in new_of:
                new_of[id(child)] = ContextParallelMultiheadAttention.from_entmax(
                    child, process_group=group, scheme=scheme, load_balance=load_balance)
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
            setattr(parent, child_name, new_of[id(child)])
    return names
