"""The attention variants as one table for the tests: per variant, the keywords that turn it on, its eager twin and
the routes it must run on (as flash-attention's ``tests/cute/score_mod_definitions.py`` pairs each kernel score mod
with an eager one).

A row of :data:`ROWS` per name of the library's ``sparse_attn.attn.routes.VARIANTS`` (``tests/attn/test_routes.py``
checks the two sets are equal, so a new library variant without a row fails there):

* ``field``: the ``AttnSpec`` field the variant lives in (None: it comes from the shapes or the autograd state);
* ``kwargs(p, g)``: the ``entmax_attention`` / ``prepare_attention`` keywords that turn it on for the problem ``p``
  (a :class:`Problem`: shapes, dtype, device), drawn from the generator ``g`` on the CPU;
* ``shape``: what the variant needs of the problem (fewer k/v heads, another value head dim, one packed entry);
* ``implies``: the other variants its keywords turn on (a mask that requires grad is a float mask);
* ``twin``: its eager twin, a plain-torch step of :func:`eager_attention` (None: nothing to compare, as dropout);
* ``routes``: read from the library's ``SUPPORTED`` table, never written here.

:func:`build` turns a set of names into ``q, k, v`` and keywords; :func:`eager_attention` computes attention in
float64 with plain torch ops, each keyword applied by its row's twin. A new variant is one row here, its logic tests,
and the routes' tests pick it up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from helpers import F32, F64, cu_seqlens, gen, qkv

from sparse_attn.attn.masks import BlockSparseMask
from sparse_attn.attn.routes import SUPPORTED

INF = math.inf


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shapes of one attention call (``q (b, hq, nq, d)``, ``k (b, hk, nk, d)``, ``v (b, hk, nk, dv)``; ``hk``
    None: ``hq``), its dtype and device, the seed of its draws and whether ``q, k, v`` require grad; ``block``: the
    block size of a block mask; ``lengths_q`` / ``lengths_k``: the packed sequences of the ``varlen`` variant (its
    row sets ``packed``; empty: two sequences splitting ``nq`` / ``nk``)."""

    b: int = 2
    hq: int = 4
    hk: int | None = None  # None: hq
    nq: int = 12
    nk: int = 12
    d: int = 16
    dv: int = 16
    dtype: torch.dtype = F64
    device: str = "cpu"
    seed: int = 0
    grad: bool = False
    block: tuple[int, int] = (4, 4)
    lengths_q: tuple[int, ...] = ()
    lengths_k: tuple[int, ...] = ()
    packed: bool = False

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of per-head parameters (slopes, sinks): float64 for float64 inputs, float32 otherwise."""
        return F64 if self.dtype == F64 else F32

    @property
    def n_rows(self) -> int:
        """The leading dim of per-sequence tensors: ``b``, or the number of packed sequences."""
        return len(self.lengths_q) if self.packed else self.b


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of :data:`ROWS` (the fields are described at the top of this module)."""

    name: str
    field: str | None
    kwargs: Callable[[Problem, torch.Generator], dict]
    twin: Callable | None
    shape: Callable[[Problem], dict] = lambda p: {}
    implies: frozenset = frozenset()

    @property
    def routes(self) -> frozenset:
        """The routes that run this variant (the library's ``sparse_attn.attn.routes.SUPPORTED``)."""
        return frozenset(route for route, names in SUPPORTED.items() if self.name in names)


class Scores:
    """What the twins of :func:`eager_attention` work on: float64 ``q, k, v`` (``(B, H, N, D)``), the scores ``s``,
    an additive ``bias``, a boolean ``keep`` (True = attend), an extra normalization column ``sink`` and the call's
    keywords ``kw``; ``nq`` / ``nk`` the lengths (bottom-right alignment)."""

    def __init__(self, q, k, v, kw):
        self.q, self.k, self.v, self.kw = q, k, v, kw
        self.nq, self.nk = q.shape[2], k.shape[2]
        self.s = self.bias = self.keep = self.sink = None


# ---- the eager twins: plain torch, one pair at a time where positions matter ----

def loop_keep(nq: int, nk: int, left: int = -1, right: int = -1, causal: bool = False) -> torch.Tensor:
    """flash-attn's window (and causal) rule, bottom-right aligned, one pair at a time: ``(nq, nk)`` booleans."""
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            diag = i + nk - nq
            ok = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
            keep[i, j] = ok and (not causal or j <= diag)
    return keep


def loop_alibi(slopes: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """``-slope * |i + nk - nq - j|``, one pair at a time; slopes ``(H,)`` or ``(B, H)`` -> ``(1|B, H, nq, nk)``."""
    per = slopes if slopes.dim() == 2 else slopes[None]
    bias = torch.zeros(per.shape[0], per.shape[1], nq, nk, dtype=slopes.dtype)
    for i in range(nq):
        for j in range(nk):
            bias[:, :, i, j] = -per * abs(i + nk - nq - j)
    return bias


def expand_blocks(grid: torch.Tensor, block: tuple[int, int], nq: int, nk: int) -> torch.Tensor:
    """A block grid ``(..., ceil(nq / bq), ceil(nk / bk))`` repeated to the element keep mask ``(..., nq, nk)``."""
    rows = grid.repeat_interleave(block[0], dim=-2)[..., :nq, :]
    return rows.repeat_interleave(block[1], dim=-1)[..., :nk]


def _attn_mask(c):
    m = c.kw["attn_mask"]
    if m.dtype == torch.bool:
        c.keep = c.keep & m
    else:
        c.bias = c.bias + m.double()


def _causal(c):
    if c.kw.get("is_causal"):
        c.keep = c.keep & loop_keep(c.nq, c.nk, causal=True)


def _window(c):
    c.keep = c.keep & loop_keep(c.nq, c.nk, *c.kw["window_size"])


def _alibi(c):
    c.bias = c.bias + loop_alibi(c.kw["alibi_slopes"].double(), c.nq, c.nk)


def _sinks(c):
    c.sink = c.kw["sinks"].double().reshape(1, -1, 1, 1)


def _softcap(c):
    cap = c.kw["softcap"]
    c.s = cap * torch.tanh(c.s / cap)


def _gqa(c):
    group = c.q.shape[1] // c.k.shape[1]
    c.k, c.v = c.k.repeat_interleave(group, dim=1), c.v.repeat_interleave(group, dim=1)


def _block_mask(c):
    bm = c.kw["block_mask"]
    if getattr(bm, "bits", None) is not None:
        raise ValueError("the eager twin of block_mask takes boolean block grids (no partial blocks)")
    c.keep = c.keep & expand_blocks(bm.mask, bm.block_size, c.nq, c.nk)


def _nothing(c):
    """Twin of a variant the eager computation does without a step (autograd gives gradients; ``p @ v`` any Dv)."""


def _varlen(c):
    """Packed sequences are separate calls: :func:`eager_attention` splits them before any other twin."""


# ---- keyword builders ----

def _mask_shape(p):
    return (p.b, 1, p.nq, p.nk)


def _bool_mask(p, g):
    keep = torch.rand(*_mask_shape(p), generator=g) < 0.8
    keep[..., 0] = True  # no row left without a key by the mask alone
    return dict(attn_mask=keep.to(p.device))


def _float_mask(p, g, grad=False):
    bias = (torch.randn(*_mask_shape(p), generator=g, dtype=F64) / 2).to(p.dtype).to(p.device)
    return dict(attn_mask=bias.requires_grad_(grad))


def _slopes(p, g, grad=False):
    lead = (p.n_rows, p.hq) if p.packed else (p.hq,)  # one row of slopes per packed sequence
    return dict(alibi_slopes=(torch.rand(*lead, generator=g, dtype=F64) / 4).to(p.param_dtype).to(p.device)
                .requires_grad_(grad))


def _block_grid(p, g):
    bq, bk = p.block
    nq, nk = (max(p.lengths_q), max(p.lengths_k)) if p.packed else (p.nq, p.nk)
    grid = torch.rand(p.n_rows, 1, math.ceil(nq / bq), math.ceil(nk / bk), generator=g) < 0.7
    grid[..., 0] = True  # key block 0 kept: under causal masking (nq <= nk) every row keeps a key
    return dict(block_mask=BlockSparseMask(grid.to(p.device), (bq, bk)))


def _packed_shape(p):
    """One batch entry of two packed sequences (of the problem's lengths unless it names its own)."""
    lq = p.lengths_q or (p.nq // 2 - 1, p.nq - p.nq // 2 + 1)
    lk = p.lengths_k or (p.nk // 2 - 1, p.nk - p.nk // 2 + 1)
    return dict(b=1, nq=sum(lq), nk=sum(lk), lengths_q=lq, lengths_k=lk, packed=True)


def _packed(p, g):
    return dict(cu_seqlens_q=cu_seqlens(p.lengths_q, p.device), cu_seqlens_k=cu_seqlens(p.lengths_k, p.device))


ROWS: dict[str, Variant] = {v.name: v for v in [
    Variant("varlen", "cu_seqlens_q", _packed, _varlen, shape=_packed_shape),
    Variant("bool_mask", "mask", _bool_mask, _attn_mask),
    Variant("float_mask", "mask", _float_mask, _attn_mask),
    Variant("mask_grad", "mask", lambda p, g: _float_mask(p, g, grad=True), _attn_mask,
            implies=frozenset({"float_mask"})),
    Variant("causal", "is_causal", lambda p, g: dict(is_causal=True), _causal),
    Variant("window", "window_size", lambda p, g: dict(window_size=(3, 2)), _window),
    Variant("alibi", "alibi_slopes", _slopes, _alibi),
    Variant("alibi_grad", "alibi_slopes", lambda p, g: _slopes(p, g, grad=True), _alibi,
            implies=frozenset({"alibi"})),
    Variant("sinks", "sinks", lambda p, g: dict(
        sinks=torch.randn(p.hq, generator=g, dtype=F64).to(p.param_dtype).to(p.device)), _sinks),
    Variant("softcap", "softcap", lambda p, g: dict(softcap=2.0), _softcap),
    Variant("dropout", "dropout_p", lambda p, g: dict(dropout_p=0.1), None),
    Variant("gqa", None, lambda p, g: dict(enable_gqa=True), _gqa, shape=lambda p: dict(hk=p.hq // 2)),
    Variant("dv", None, lambda p, g: {}, _nothing, shape=lambda p: dict(dv=2 * p.d)),
    Variant("grad", None, lambda p, g: {}, _nothing, shape=lambda p: dict(grad=True)),
    Variant("block_mask", "block_mask", _block_grid, _block_mask),
]}
"""One row per variant of the library's route table, in its order."""

KEYWORDS: dict[str, frozenset] = {
    name: frozenset(row.kwargs(dataclasses.replace(Problem(), **row.shape(Problem())), gen(0)))
    for name, row in ROWS.items()}
"""The keywords each row sets (its twin runs in :func:`eager_attention` when one of them is given)."""


def on_route(route: str, names=None) -> list[str]:
    """The variants (of ``names``, default all, in table order) that ``route`` runs."""
    return [n for n in (ROWS if names is None else names) if route in ROWS[n].routes]


APART = ("varlen", "dropout", "mask_grad", "alibi_grad", "grad")
"""Variants the "all at once" tests leave to their own tests: packed sequences (one batch entry), dropout (random:
no twin), and the gradient rows (whether a tensor requires grad is each test's choice)."""


def together(route: str, mask: str | None = "bool") -> list[str]:
    """The variants of ``route`` one call uses at once in the "every variant" tests: all but :data:`APART`, and of
    the two masks the one ``mask`` names (``"bool"``, ``"float"`` or None: neither). A new variant joins these
    calls by its row alone."""
    other = {"bool": {"float_mask"}, "float": {"bool_mask"}, None: {"bool_mask", "float_mask"}}
    drop = set(APART) | other[mask]
    return [n for n in on_route(route) if n not in drop]


def build(names, p: Problem = Problem(), **shape):
    """``q, k, v, kwargs`` of one call using the variants ``names`` at once (with what they imply) on the problem
    ``p`` (fields replaced by ``shape``). ``bool_mask`` and ``float_mask`` / ``mask_grad`` both set ``attn_mask``:
    asking for both raises."""
    names = set(names)
    names |= {i for n in names for i in ROWS[n].implies}
    if "bool_mask" in names and "float_mask" in names:
        raise ValueError("one attn_mask: bool_mask and float_mask cannot be built together")
    p = dataclasses.replace(p, **shape)
    ordered = [n for n in ROWS if n in names]
    for n in ordered:
        p = dataclasses.replace(p, **ROWS[n].shape(p))
    q, k, v = qkv(b=p.b, hq=p.hq, hk=p.hk or p.hq, nq=p.nq, nk=p.nk, d=p.d, dv=p.dv, dtype=p.dtype, seed=p.seed,
                  device=p.device, requires_grad=p.grad)
    g = gen(p.seed + 1)
    kw = {}
    for n in ordered:
        if not any(n in ROWS[m].implies for m in ordered):  # a row implied by another: the other's keywords
            kw.update(ROWS[n].kwargs(p, g))
    return q, k, v, kw


def cast(kw: dict, dtype: torch.dtype, grad: bool | None = None) -> dict:
    """``kw`` with its floating tensors as detached ``dtype`` copies (requiring grad as before, or as ``grad``)."""
    def one(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.detach().to(dtype).requires_grad_(t.requires_grad if grad is None else grad)
    return {n: one(t) for n, t in kw.items()}


def grad_leaves(kw: dict) -> list[str]:
    """The keywords of ``kw`` whose tensors require grad, in ``kw``'s order."""
    return [n for n, t in kw.items() if isinstance(t, torch.Tensor) and t.requires_grad]


def eager_attention(q, k, v, alpha, scale=None, **kw) -> torch.Tensor:
    """Attention in float64 with plain torch ops, every keyword applied by its variant's twin: scores
    ``scale * q k^T``, the soft cap, masks, biases and windows, a sink column in the normalization, entmax
    (softmax at alpha = 1, per head when ``alpha`` is a tensor), the weights times ``v``. Rows without a key give 0.
    Differentiable in every float64 tensor. Dropout has no twin (it raises)."""
    if kw.get("dropout_p", 0.0):
        raise ValueError("dropout has no eager twin")
    kw = {n: _on_cpu(t) for n, t in kw.items()}
    if kw.get("cu_seqlens_q") is not None:
        return _eager_packed(q, k, v, alpha, scale, kw)
    c = Scores(q.double().cpu(), k.double().cpu(), v.double().cpu(), kw)
    given = {n for n, t in kw.items() if t is not None and t is not False}
    active = [ROWS[n].twin for n in ROWS if KEYWORDS[n] & given and ROWS[n].twin is not None]
    active = list(dict.fromkeys(active))  # one step per twin (a mask row and its gradient row share one)
    if _gqa in active:  # the k/v heads first, then the scores, the soft cap, masks and biases, the sink column
        _gqa(c)
    scale = c.q.shape[-1] ** -0.5 if scale is None else scale
    c.s = scale * c.q @ c.k.transpose(-1, -2)
    if _softcap in active:
        _softcap(c)
    c.bias = torch.zeros((), dtype=F64)
    c.keep = torch.ones(c.nq, c.nk, dtype=torch.bool)
    for twin in active:
        if twin not in (_gqa, _softcap, _sinks):
            twin(c)
    s = (c.s + c.bias).masked_fill(~c.keep, -INF)
    if _sinks in active:
        _sinks(c)
        s = torch.cat([s, c.sink.expand(*s.shape[:-1], 1)], dim=-1)
    rows = torch.isfinite(s).any(-1, keepdim=True)
    s = torch.where(rows, s, torch.zeros_like(s))
    p = _normalize(s, alpha)
    p = torch.where(rows, p, torch.zeros_like(p))
    if _sinks in active:
        p = p[..., :-1]
    return p @ c.v


def _on_cpu(t):
    if isinstance(t, BlockSparseMask):
        return BlockSparseMask(t.mask.cpu(), t.block_size)
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _normalize(s, alpha):
    from sparse_attn.mappings import entmax

    if not isinstance(alpha, torch.Tensor):
        return torch.softmax(s, -1) if alpha == 1 else entmax(s, alpha, dim=-1)
    return entmax(s, alpha.double().cpu().reshape(1, -1, 1, 1), dim=-1)


def _eager_packed(q, k, v, alpha, scale, kw):
    """The twin of ``varlen``: one call per packed sequence, its slopes row and its block-mask entry."""
    kw = dict(kw)
    cu_q, cu_k = kw.pop("cu_seqlens_q").tolist(), kw.pop("cu_seqlens_k").tolist()
    if kw.get("attn_mask") is not None:
        raise ValueError("the eager twin of varlen takes no attn_mask")
    outs = []
    for s in range(len(cu_q) - 1):
        one = dict(kw)
        if one.get("alibi_slopes") is not None and one["alibi_slopes"].dim() == 2:
            one["alibi_slopes"] = one["alibi_slopes"][s]
        if one.get("block_mask") is not None:
            grid = one["block_mask"].mask
            one["block_mask"] = BlockSparseMask(grid[s if grid.shape[0] > 1 else 0][None], one["block_mask"].block_size)
        sl_q, sl_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        outs.append(eager_attention(q[:, :, sl_q], k[:, :, sl_k], v[:, :, sl_k], alpha, scale, **one))
    return torch.cat(outs, dim=2)
