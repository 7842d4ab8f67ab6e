"""Property-based fuzz of the row mappings, the losses and entmax_attention against float64.

Hypothesis draws the structure of each problem (shapes down to size 1 and odd sizes, dtype,
alpha per row or per head, ``-inf`` entries and rows, masks at broadcast shapes with fully masked
rows, causal, GQA, packed sequences, the score variants of the test table (windows, ALiBi, sinks, soft cap, block
masks), magnitudes up to 1e4, rows poisoned with NaN / ``+inf``)
and a seed; the values come from torch generators. Every output and gradient is checked with
the tolerance rule (``helpers.assert_close_to_ref``) against float64 computations on
float64 copies of the same rounded inputs, and the non-finite policy (README, "Non-finite values") is checked
exactly: ``-inf`` entries get weight 0, rows with nothing to attend to give zeros, rows with a
NaN / ``+inf`` score are NaN and leave the other rows as they are without them.

The number of examples comes from the hypothesis profile registered in tests/conftest.py: "ci"
(default: few examples, derandomized) or ``HYPOTHESIS_PROFILE=dev`` (more). The Triton kernels
run under the interpreter on CPU, hence their small shapes and smaller share of the examples.
"""

import math
import os

import torch
from helpers import (
    BF16,
    F16,
    F32,
    F64,
    TOL,
    assert_close_to_ref,
    bf16_toward_zero,
    cu_seqlens,
    entmax_vjp,
    gen,
    random_mask,
    reference_entmax,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from variants import ROWS, Problem, cast, together

import sparse_attn as sa
from sparse_attn.reference import entmax_attention_reference
from sparse_attn.rows._triton_rows import entmax_rows_triton

# The Triton kernels run under the interpreter (CPU tensors), whose bf16 stores round toward zero.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _examples(share: float) -> dict:
    """Settings giving this test ``share`` of the profile's examples (at least 2)."""
    return dict(max_examples=max(2, round(settings.default.max_examples * share)),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _values(shape, seed: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * N(0, 1)`` (clamped to 6 sigma, so fp16 at scale 1e4 stays finite) rounded to ``dtype``."""
    return (torch.randn(tuple(shape), generator=gen(seed), dtype=F64).clamp(-6, 6) * scale).to(dtype)


def _shift_rows(x64: torch.Tensor, dim: int) -> torch.Tensor:
    """Subtract each row's finite maximum (the mappings are shift invariant): an exact float64 reference
    for large magnitudes. Rows without a finite entry are left as they are."""
    top = torch.where(torch.isfinite(x64), x64, torch.full_like(x64, -math.inf)).amax(dim, keepdim=True)
    return x64 - torch.where(torch.isfinite(top), top, torch.zeros_like(top))


# alpha: the exact paths, then the solver away from the limit 1 (where a float64 bisection cannot
# resolve tau; continuity at alpha -> 1 is tested in test_mappings.py).
ALPHA_12 = st.sampled_from([1.0, 1.5, 2.0]) | st.floats(1.001, 2.0)
ALPHA_ANY = ALPHA_12 | st.floats(0.5, 0.999)
MAPPINGS = {
    "sparsemax": (F64, F32, F16, BF16),
    "entmax15": (F64, F32, F16, BF16),
    "entmax": (F64, F32, F16, BF16),
    "entmax_bisect": (F64, F32, F16, BF16),
    "rows_triton": (F32, F16, BF16),
}
SCALES = {F64: [1.0, 10.0, 1e4, 1e30], F32: [1.0, 10.0, 1e4, 1e30], F16: [1.0, 10.0, 1e4], BF16: [1.0, 10.0, 1e4]}


@st.composite
def mapping_problems(draw):
    name = draw(st.sampled_from(sorted(MAPPINGS)))
    dtype = draw(st.sampled_from(MAPPINGS[name]))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    if draw(st.booleans()):
        shape = shape[:-1] + (draw(st.integers(10, 40)),)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    if name == "rows_triton" and shape[dim] == 1:  # test_row_kernels.py::test_rows_of_length_one_along_any_dim
        shape = shape[:dim % len(shape)] + (2,) + shape[dim % len(shape) + 1:]
    n_rows = math.prod(shape) // shape[dim]
    alpha_st = {"sparsemax": st.just(2.0), "entmax15": st.just(1.5), "rows_triton": ALPHA_12}.get(name, ALPHA_ANY)
    per_row = name in ("entmax", "entmax_bisect", "rows_triton") and n_rows <= 64 and draw(st.booleans())
    alpha = draw(st.lists(alpha_st, min_size=n_rows, max_size=n_rows)) if per_row else draw(alpha_st)
    k = draw(st.none() | st.integers(1, 4)) if name in ("sparsemax", "entmax15") else None
    return dict(name=name, dtype=dtype, shape=shape, dim=dim, alpha=alpha, k=k,
                scale=draw(st.sampled_from(SCALES[dtype])), p_neg_inf=draw(st.sampled_from([0.0, 0.3, 0.9])),
                n_empty=draw(st.integers(0, 2)), n_poison=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)))


def _kernel_rounded(t64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t64`` rounded to ``dtype`` as a Triton kernel stores it (toward zero for bf16 under the interpreter)."""
    return bf16_toward_zero(t64) if dtype == BF16 and INTERPRETED else t64.to(dtype)


def _rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``(rows, n)`` with the normalized dim last."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _from_rows(rows: torch.Tensor, shape, dim: int) -> torch.Tensor:
    moved = list(shape)
    moved.append(moved.pop(dim))
    return rows.reshape(moved).movedim(-1, dim)


def _mapping(name, alpha, k, dim):
    if name == "sparsemax":
        return lambda x: sa.sparsemax(x, dim=dim, k=k)
    if name == "entmax15":
        return lambda x: sa.entmax15(x, dim=dim, k=k)
    if name == "entmax":
        return lambda x: sa.entmax(x, alpha, dim=dim)
    if name == "entmax_bisect":
        return lambda x: sa.entmax_bisect(x, alpha, dim=dim)
    return lambda x: entmax_rows_triton(x, alpha, dim=dim)


@settings(**_examples(2.0))
@given(mapping_problems())
def test_mappings_match_float64(problem):
    """Forward and dX against float64 bisection / the closed-form Jacobian; -inf, empty and NaN/+inf rows."""
    name, dtype, shape, dim = problem["name"], problem["dtype"], problem["shape"], problem["dim"]
    seed = problem["seed"]
    rows = _rows_view(_values(shape, seed, problem["scale"], F64), dim)
    g = torch.Generator().manual_seed(seed + 1)
    rows = rows.masked_fill(torch.rand(rows.shape, generator=g) < problem["p_neg_inf"], -math.inf)
    n_rows = rows.shape[0]
    empty = torch.randperm(n_rows, generator=g)[:problem["n_empty"]]
    rows[empty] = -math.inf
    poison = torch.randperm(n_rows, generator=g)[:problem["n_poison"]]
    for r in poison.tolist():
        rows[r, int(torch.randint(rows.shape[1], (1,), generator=g))] = math.nan if r % 2 else math.inf
    bad = torch.zeros(n_rows, dtype=torch.bool)
    bad[poison] = True
    alpha = problem["alpha"]
    if isinstance(alpha, list):
        alpha = _from_rows(torch.tensor(alpha, dtype=F64)[:, None], shape[:dim % len(shape)] + (1,)
                           + shape[dim % len(shape) + 1:], dim)
        alpha = alpha.to(F32 if name == "rows_triton" else dtype)
    fn = _mapping(name, alpha, problem["k"], dim)
    x = _from_rows(rows, shape, dim).to(dtype, copy=True).requires_grad_()
    y = fn(x)
    assert y.dtype == dtype and y.shape == x.shape
    x_rows = _rows_view(x.detach(), dim).double()
    alpha64 = _rows_view(alpha.double(), dim) if isinstance(alpha, torch.Tensor) else alpha
    ref = reference_entmax(_shift_rows(x_rows.masked_fill(bad[:, None], 0.0), -1), alpha64)
    ref[bad] = math.nan
    y_rows = _rows_view(y.detach(), dim)
    kernel = name == "rows_triton"
    base = _kernel_rounded(ref, dtype) if kernel else None
    assert_close_to_ref(y_rows, ref, base, dtype, eps=TOL["eps_mapping"], name=name)
    excluded = (x_rows == -math.inf) & ~bad[:, None]
    assert (y_rows[excluded] == 0).all(), "a -inf entry got a nonzero weight"
    cot = _values(shape, seed + 2, 1.0, dtype)
    y.backward(cot)
    cot_rows = _rows_view(cot, dim).double()
    dx_ref = entmax_vjp(ref.nan_to_num(0.0), cot_rows, alpha64, -1)
    dx_ref[bad] = math.nan
    # The row kernels' backward reads the output saved in the input dtype: its baseline starts from it.
    base = None
    if kernel:
        base = _kernel_rounded(entmax_vjp(y_rows.double().nan_to_num(0.0), cot_rows, alpha64, -1), dtype)
    assert_close_to_ref(_rows_view(x.grad, dim), dx_ref, base, dtype, eps=TOL["eps_mapping"], name=f"{name} dX")
    assert (_rows_view(x.grad, dim)[excluded] == 0).all(), "a -inf entry got a nonzero gradient"
    if bad.any():
        clean = _from_rows(torch.where(bad[:, None], torch.zeros_like(x_rows), x_rows), shape, dim).to(dtype)
        same = _rows_view(fn(clean), dim)[~bad].double()
        torch.testing.assert_close(y_rows[~bad].double(), same, atol=TOL["same_values"][dtype], rtol=0)


LOSSES = {"sparsemax_loss": st.just(2.0), "entmax15_loss": st.just(1.5), "entmax_bisect_loss": ALPHA_ANY}


@st.composite
def loss_problems(draw):
    name = draw(st.sampled_from(sorted(LOSSES)))
    n, c = draw(st.integers(1, 6)), draw(st.integers(1, 20))
    per_row = name == "entmax_bisect_loss" and draw(st.booleans())
    alpha = draw(st.lists(LOSSES[name], min_size=n, max_size=n)) if per_row else draw(LOSSES[name])
    dtype = draw(st.sampled_from([F64, F32, F16, BF16]))
    return dict(name=name, n=n, c=c, alpha=alpha, dtype=dtype, scale=draw(st.sampled_from(SCALES[dtype][:3])),
                labels=draw(st.booleans()), reduction=draw(st.sampled_from(["none", "sum", "mean"])),
                p_neg_inf=draw(st.sampled_from([0.0, 0.3, 0.9])), p_ignored=draw(st.sampled_from([0.0, 0.25, 0.5])),
                n_poison=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)))


def _tsallis(p: torch.Tensor, alpha) -> torch.Tensor:
    """float64 Tsallis entropy of the rows of ``p``: ``-sum p expm1((alpha-1) log p) / ((alpha-1) alpha)``,
    Shannon at alpha = 1; ``alpha`` a float or ``(rows, 1)``."""
    a = torch.as_tensor(alpha, dtype=F64)
    e = a - 1
    log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
    term = torch.where(e == 0, log_p, torch.expm1(e * log_p) / torch.where(e == 0, torch.ones_like(e), e)) / a
    return -torch.where(p > 0, p * term, torch.zeros_like(p)).sum(-1)


@settings(**_examples(2.0))
@given(loss_problems())
def test_losses_match_float64(problem):
    """Loss values (every reduction) and gradients against float64 Fenchel-Young losses; -inf logits with no
    target mass, ignored rows, NaN/+inf rows."""
    n, c, seed, dtype, name = problem["n"], problem["c"], problem["seed"], problem["dtype"], problem["name"]
    g = torch.Generator().manual_seed(seed + 1)
    x = _values((n, c), seed, problem["scale"], F64)
    x = x.masked_fill(torch.rand(n, c, generator=g) < problem["p_neg_inf"], -math.inf)
    if not problem["labels"]:  # label proportions need a finite logit to put their mass on
        x[~torch.isfinite(x).any(-1), 0] = 0.0
    finite = torch.isfinite(x)
    keep = finite.any(-1)  # a row of -inf logits can only be an ignored row
    if problem["labels"]:
        target = torch.multinomial(finite.double() + (~keep[:, None]).double(), 1, generator=g)[:, 0]
        keep &= torch.rand(n, generator=g) >= problem["p_ignored"]
        target = torch.where(keep, target, torch.full_like(target, -100))
        y = torch.nn.functional.one_hot(target.clamp(min=0), c).double() * keep[:, None]
    else:
        w = torch.rand(n, c, generator=g, dtype=F64) * finite * (torch.rand(n, c, generator=g) < 0.6)
        w[torch.arange(n), finite.double().argmax(-1)] += 0.1
        target = y = w / w.sum(-1, keepdim=True)
    poison = torch.randperm(n, generator=g)[:problem["n_poison"]]
    for r in poison.tolist():
        x[r, int(torch.randint(c, (1,), generator=g))] = math.nan if r % 2 else math.inf
    bad = torch.zeros(n, dtype=torch.bool)
    bad[poison] = True
    bad &= keep
    alpha = problem["alpha"]
    alpha_arg = torch.tensor(alpha, dtype=F64)[:, None] if isinstance(alpha, list) else alpha
    kw = dict(reduction=problem["reduction"])
    if name == "entmax_bisect_loss":
        kw["alpha"] = alpha_arg
    xd = x.to(dtype, copy=True).requires_grad_()
    loss = getattr(sa, name)(xd, target, **kw)
    assert loss.dtype == (F64 if dtype == F64 else F32)
    x64 = xd.detach().double().masked_fill(bad[:, None] | ~keep[:, None], 0.0)
    shifted = _shift_rows(x64, -1)
    p = reference_entmax(shifted, alpha_arg if isinstance(alpha_arg, torch.Tensor) else alpha)
    diff = torch.where(keep[:, None], p - y, torch.zeros_like(p))
    lin = torch.where(diff != 0, diff * shifted, torch.zeros_like(p)).sum(-1)
    rows = torch.where(keep, lin + _tsallis(p, alpha_arg) - _tsallis(y, alpha_arg), torch.zeros(n, dtype=F64))
    rows[bad] = math.nan
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / keep.sum().clamp(min=1)}[problem["reduction"]]
    big = float(torch.where(torch.isfinite(x), x, torch.zeros_like(x)).abs().max())
    assert_close_to_ref(loss, expected, None, loss.dtype, eps=TOL["eps_loss"][dtype] * (1 + big), name=name)
    cot = _values(loss.shape, seed + 2, 1.0, loss.dtype)
    loss.backward(cot)
    scale = 1 / keep.sum().clamp(min=1) if problem["reduction"] == "mean" else 1.0
    grad = diff * (cot.double()[:, None] if problem["reduction"] == "none" else cot.double()) * scale
    grad[bad] = math.nan
    assert_close_to_ref(xd.grad, grad, eps=TOL["eps_mapping"], name=f"{name} dX")


# Mask shapes broadcastable to the scores (B, Hq, Nq, Nk); "key" masks whole keys, "row" whole query rows.
MASK_SHAPES = {
    "2d": lambda b, h, nq, nk: (nq, nk), "shared": lambda b, h, nq, nk: (1, 1, nq, nk),
    "batch": lambda b, h, nq, nk: (b, 1, nq, nk), "head": lambda b, h, nq, nk: (1, h, nq, nk),
    "full": lambda b, h, nq, nk: (b, h, nq, nk), "key": lambda b, h, nq, nk: (b, 1, 1, nk),
    "row": lambda b, h, nq, nk: (1, 1, nq, 1),
}


# The score variants a problem may add (any subset), read from the test table (tests/variants.py): every variant of the
# fused route but the masks (drawn above), packed sequences, causal masking and GQA (drawn above), Dv != D and dropout.
FUZZED_VARIANTS = [n for n in together("fused", mask=None) if n not in ("causal", "gqa", "dv")]


@st.composite
def attention_problems(draw, poisons=("none", "q", "k", "mask"), mults=(1.0, 10.0, 1e4)):
    """One entmax_attention problem; ``poisons``: where a NaN / +inf may be put (``"mask"``: float masks only);
    ``mults``: magnitudes of q and k."""
    hk, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    if draw(st.booleans()):
        n_seq = draw(st.integers(1, 3))
        lens_q = draw(st.lists(st.integers(0, 16), min_size=n_seq, max_size=n_seq).filter(lambda x: sum(x) > 0))
        lens_k = draw(st.lists(st.integers(0, 16), min_size=n_seq, max_size=n_seq).filter(lambda x: sum(x) > 0))
        b, nq, nk = 1, sum(lens_q), sum(lens_k)
    else:
        lens_q = lens_k = None
        b, nq, nk = draw(st.integers(1, 2)), draw(st.integers(1, 48)), draw(st.integers(1, 48))
    dtype = draw(st.sampled_from([F32, F16, BF16]))
    alpha = draw(st.lists(ALPHA_12, min_size=hk * group, max_size=hk * group))
    mask = draw(st.sampled_from(["none", "bool", "float"]))
    return dict(b=b, hk=hk, hq=hk * group, nq=nq, nk=nk, lens_q=lens_q, lens_k=lens_k,
                d=draw(st.sampled_from([16, 24, 32])), dtype=dtype, alpha=alpha if draw(st.booleans()) else alpha[0],
                causal=draw(st.booleans()),
                mask=mask, mask_shape=draw(st.sampled_from(sorted(MASK_SHAPES))),
                p_keep=draw(st.sampled_from([0.3, 0.8, 1.0])), empty_rows=draw(st.integers(0, 2)),
                scale=draw(st.none() | st.floats(0.05, 2.0)), mult=draw(st.sampled_from(mults)),
                poison=draw(st.sampled_from([p for p in poisons if p != "mask" or mask == "float"])),
                poison_value=draw(st.sampled_from([math.nan, math.inf])), seed=draw(st.integers(0, 2**31 - 1)),
                variants=sorted(draw(st.sets(st.sampled_from(FUZZED_VARIANTS)))))


def _attention_inputs(pb):
    """q, k, v in the problem's dtype, the keyword arguments of entmax_attention, and a float64 copy of both."""
    b, hq, hk, nq, nk, d = pb["b"], pb["hq"], pb["hk"], pb["nq"], pb["nk"], pb["d"]
    dtype, seed = pb["dtype"], pb["seed"]
    q = _values((b, hq, nq, d), seed, pb["mult"], dtype)
    k = _values((b, hk, nk, d), seed + 1, pb["mult"], dtype)
    v = _values((b, hk, nk, d), seed + 2, 1.0, dtype)
    mask = None
    if pb["mask"] != "none":
        mask = random_mask(MASK_SHAPES[pb["mask_shape"]](b, hq, nq, nk), pb["mask"], seed + 3, pb["p_keep"],
                           pb["empty_rows"])
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    g = torch.Generator().manual_seed(seed + 4)
    target = {"q": q, "k": k, "mask": mask}.get(pb["poison"])
    if target is not None:
        target.view(-1)[int(torch.randint(target.numel(), (1,), generator=g))] = pb["poison_value"]
    alpha = torch.tensor(pb["alpha"], dtype=F32) if isinstance(pb["alpha"], list) else pb["alpha"]
    kw = dict(attn_mask=mask, is_causal=pb["causal"], scale=pb["scale"], enable_gqa=hq > hk)
    if pb["lens_q"] is not None:
        kw.update(cu_seqlens_q=cu_seqlens(pb["lens_q"]), cu_seqlens_k=cu_seqlens(pb["lens_k"]))
    packed = pb["lens_q"] is not None
    table = Problem(b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=d, dv=d, dtype=dtype, seed=seed,
                    lengths_q=tuple(pb["lens_q"] or ()), lengths_k=tuple(pb["lens_k"] or ()), packed=packed)
    for name in pb["variants"]:  # each row's keywords, drawn from one generator in name order
        kw.update(ROWS[name].kwargs(table, g))
    kw64 = cast(kw, F64)
    alpha64 = alpha.double() if isinstance(alpha, torch.Tensor) else alpha
    return (q, k, v, alpha, kw), (q.double(), k.double(), v.double(), alpha64, kw64)


def _float32_scores_baseline(q, k, v64, alpha64, kw64, rounded=True):
    """Exact (float64) attention of the float32 scores ``scale * q k^T`` (float mask added in float32), rounded to
    q's dtype: the error any implementation with float32 scores has; and ``1 + max|score| * max|v|``, the scale of
    the float32 weights' own error. The scores enter the float64 reference as an additive mask on zero queries
    and keys; causal masking, packed sequences and boolean masks are applied there."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if kw64["scale"] is None else kw64["scale"]
    s = (q.float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    finite = s.detach()[torch.isfinite(s.detach())]
    magnitude = 1 + (finite.abs().max().item() if finite.numel() else 0.0) * v64.detach().abs().max().item()
    cap = kw64.get("softcap")
    if cap is not None:  # on the finite float32 scores, before the masks
        s = torch.where(torch.isfinite(s), cap * torch.tanh(s / cap), s)
    mask = kw64["attn_mask"]
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.float()
    elif mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    kw = dict(kw64, attn_mask=s.double(), scale=1.0, softcap=None)
    zq, zk = torch.zeros(q.shape, dtype=F64), torch.zeros(k.shape, dtype=F64)
    out = entmax_attention_reference(zq, zk, v64, alpha64, **kw)
    return (_kernel_rounded(out, q.dtype) if rounded else out), magnitude


@settings(**_examples(2.0))
@given(attention_problems())
def test_attention_reference_backend_matches_float64(problem):
    """backend="reference" in fp32/fp16/bf16: within twice the error of exact attention on its float32 scores."""
    (q, k, v, alpha, kw), (q64, k64, v64, alpha64, kw64) = _attention_inputs(problem)
    out = sa.entmax_attention(q, k, v, alpha, backend="reference", **kw)
    ref64 = entmax_attention_reference(q64, k64, v64, alpha64, **kw64)
    assert out.dtype == q.dtype
    base, magnitude = _float32_scores_baseline(q, k, v64, alpha64, kw64)
    assert_close_to_ref(out, ref64, base, eps=TOL["eps_attention_f32"] * magnitude, name="reference backend")


TRITON_POISONS = ("none", "q", "k", "mask")
TRITON_MULTS = (1.0, 10.0, 1e4)


@settings(**_examples(0.4))
@given(attention_problems(TRITON_POISONS, TRITON_MULTS))
def test_attention_triton_forward_matches_float64(problem):
    """backend="triton" (interpreter on CPU): within twice the error of the reference run in the same dtype."""
    (q, k, v, alpha, kw), (q64, k64, v64, alpha64, kw64) = _attention_inputs(problem)
    out = sa.entmax_attention(q, k, v, alpha, backend="triton", **kw)
    ref64 = entmax_attention_reference(q64, k64, v64, alpha64, **kw64)
    lowp = entmax_attention_reference(q, k, v, alpha, **kw)
    assert out.dtype == q.dtype
    base, magnitude = _float32_scores_baseline(q, k, v64, alpha64, kw64)
    eps = TOL["eps_attention_kernel"][q.dtype] + TOL["eps_attention_f32"] * magnitude
    assert_close_to_ref(out, ref64, (lowp, base), eps=eps, name="triton backend")


def _float_mask(mask) -> bool:
    return mask is not None and mask.dtype != torch.bool


def _attention_grads(backend, q, k, v, alpha, kw, cot, baseline=False):
    """Gradients w.r.t. q, k, v (and alpha, a float mask, when they are tensors) of one call:
    ``backend`` of entmax_attention, the reference function (``backend=None``), or (``baseline``) exact attention
    of the float32 scores, whose q/k gradients flow back through the float32 score product."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.detach().clone().requires_grad_()
        leaves.append(alpha)
    mask = kw["attn_mask"]
    if _float_mask(mask):
        mask = mask.detach().clone().requires_grad_()
        leaves.append(mask)
    kw = dict(kw, attn_mask=mask)
    if baseline:
        out = _float32_scores_baseline(q, k, v.double(), alpha, kw, rounded=False)[0]
    elif backend is None:
        out = entmax_attention_reference(q, k, v, alpha, **kw)
    else:
        out = sa.entmax_attention(q, k, v, alpha, backend=backend, **kw)
    grads = torch.autograd.grad(out, leaves, cot.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _check_attention_gradients(problem, backend):
    (q, k, v, alpha, kw), (q64, k64, v64, alpha64, kw64) = _attention_inputs(problem)
    cot = _values((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), problem["seed"] + 5, 1.0, F64)
    got = _attention_grads(backend, q, k, v, alpha, kw, cot)
    exact = _attention_grads(None, q64, k64, v64, alpha64, kw64, cot)
    # The reference run in the same dtype is the baseline of the fused backward only (for the reference backend
    # it is the output itself); exact attention of the float32 scores is the baseline of both.
    bases = [_attention_grads(None, q, k, v, alpha, kw, cot, baseline=True)]
    if backend != "reference":
        bases.append(_attention_grads(None, q, k, v, alpha, kw, cot))
    names = ["dq", "dk", "dv"] + ["dalpha"] * isinstance(alpha, torch.Tensor) + ["dmask"] * _float_mask(kw["attn_mask"])
    if backend == "reference" and "cu_seqlens_q" in kw and q.dtype != F32 and names[-1] == "dmask":
        names.pop()  # test_attention_api.py::test_reference_low_precision_mask_gradient_is_summed_in_float32
    eps_dtype = 2 if q.dtype == BF16 and INTERPRETED else 1  # the interpreter's bf16 stores round toward zero
    for i, (name, g, g64) in enumerate(zip(names, got, exact)):
        assert g.shape == g64.shape and (i > 2 or g.dtype == q.dtype), name
        eps = eps_dtype * TOL["eps_attention_grad"][q.dtype] * max(1.0, g64.abs().max().item())
        low = [_kernel_rounded(b[i].double(), g.dtype) for b in bases]
        assert_close_to_ref(g, g64, low, g.dtype, eps=eps, name=f"{backend} {name}")


@settings(**_examples(1.0))
@given(attention_problems(("none",)))
def test_attention_reference_gradients_match_float64(problem):
    """Gradients of backend="reference" (q, k, v, a tensor alpha, a float mask) against float64 autograd."""
    _check_attention_gradients(problem, "reference")


# The fused backward takes delta = dO . out_u from the forward's float32 out_u (tests/attn/test_attention_bwd.py::
# test_bf16_delta_from_float32_out_u); at large q, k magnitudes the float32 weights' own error (z - tau cancels,
# relative to |score|) still exceeds the gradient tolerances (fp32 dv at magnitude 100, measured), which the
# gradient rule does not scale for. Gradients are fuzzed at unit magnitudes.
TRITON_GRAD_MULTS = (1.0,)


@settings(**_examples(0.2))
@given(attention_problems(("none",), TRITON_GRAD_MULTS))
def test_attention_triton_gradients_match_float64(problem):
    """Gradients of the fused backward against float64 autograd, within twice the reference's error in the
    same dtype (or exact attention's on float32 scores) + eps relative to the largest gradient."""
    _check_attention_gradients(problem, "triton")
