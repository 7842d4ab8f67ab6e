"""Tests of csoftmax, csparsemax and fertility-constrained attention.

Forward passes are checked against a float64 bisection on the threshold written here
(independent of the sort-based algorithms), Jacobians against matrices built from
Eq. 13-14 of Malaviya, Ferreira & Martins 2018 (csparsemax) and from the
closed form of the constrained softmax, and decoding against the fertility invariant.
"""

import math

import pytest
import torch
from helpers import EXACT, F32, F64, TOL, gen
from torch.autograd import gradcheck
from torch.autograd.functional import jacobian, jvp

from sparse_attn.constrained import FertilityAttention, FertilityPredictor, csoftmax, csparsemax
from sparse_attn.mappings import sparsemax


def _bisect(z, u, kind, valid=None):
    """Slow reference: ``a = min(u, max(z - tau, 0))`` or ``min(u, exp(z - tau))`` with ``sum a = 1``."""
    if valid is None:
        valid = torch.ones_like(z, dtype=torch.bool)
    lo = torch.full(z.shape[:-1] + (1,), -60.0, dtype=F64)
    hi = torch.full(z.shape[:-1] + (1,), 60.0, dtype=F64)

    def at(t):
        a = torch.clamp(z - t, min=0) if kind == "sparse" else torch.exp(z - t)
        return torch.where(valid, torch.minimum(a, u), torch.zeros_like(a))

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        big = at(mid).sum(-1, keepdim=True) > 1
        lo = torch.where(big, mid, lo)
        hi = torch.where(big, hi, mid)
    return at(0.5 * (lo + hi))


def _bounds(shape, seed, scale=0.45):
    return scale * torch.rand(shape, generator=gen(seed), dtype=F64) + 0.02


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("fn,kind", [(csparsemax, "sparse"), (csoftmax, "soft")])
def test_forward_matches_bisection(fn, kind):
    z = 2 * torch.randn(40, 9, generator=gen(1), dtype=F64)
    u = _bounds((40, 9), 2)
    u[:5, 0] = math.inf
    u[5:10, 3] = 0.0
    a = fn(z, u)
    torch.testing.assert_close(a, _bisect(z, u, kind), atol=TOL["slow_solver"], rtol=0)
    assert (a <= u).all() and (a >= 0).all()
    torch.testing.assert_close(a.sum(-1), torch.ones(40, dtype=F64), atol=TOL["sum"][F64], rtol=0)
    assert (a[5:10, 3] == 0).all()
    tight = torch.full((3, 9), 1.0 / 9, dtype=F64)
    torch.testing.assert_close(fn(z[:3], tight), tight, atol=TOL["ulps"][F64], rtol=0)


@pytest.mark.parametrize("fn,kind", [(csparsemax, "sparse"), (csoftmax, "soft")])
def test_masks_lengths_and_empty_rows(fn, kind):
    z = torch.randn(5, 8, generator=gen(3), dtype=F64)
    u = _bounds((5, 8), 4, scale=0.8)
    mask = torch.rand(5, 8, generator=gen(5)) > 0.3
    mask[:, 0] = True
    mask[:, 1] = True
    u = torch.where(mask, u, torch.zeros_like(u))
    u[:, :2] = 1.0
    mask[4] = False
    a = fn(z, u, mask=mask)
    torch.testing.assert_close(a, _bisect(z, u, kind, mask), atol=TOL["slow_solver"], rtol=0)
    assert (a[4] == 0).all() and (a[~mask] == 0).all()
    torch.testing.assert_close(fn(z.masked_fill(~mask, -math.inf), u), a, **EXACT)
    lengths = torch.tensor([8, 5, 2, 1, 0])
    b = fn(z, torch.ones_like(u), lengths=lengths)
    for r, n in enumerate(lengths.tolist()):
        assert (b[r, n:] == 0).all()
        if n:
            torch.testing.assert_close(b[r, :n], fn(z[r, :n], torch.ones(n, dtype=F64)), atol=TOL["ulps"][F64], rtol=0)
    zr = z.clone().requires_grad_()
    ur = u.clone().requires_grad_()
    fn(zr, ur, mask=mask).mul(torch.randn(5, 8, generator=gen(6), dtype=F64)).sum().backward()
    assert torch.isfinite(zr.grad).all() and torch.isfinite(ur.grad).all()
    assert (zr.grad[~mask] == 0).all() and (ur.grad[~mask] == 0).all()


def test_loose_bounds_limits():
    z = 3 * torch.randn(6, 10, generator=gen(7), dtype=F64)
    loose = torch.full_like(z, 1.5)
    torch.testing.assert_close(csparsemax(z, loose), sparsemax(z), atol=TOL["ulps"][F64], rtol=0)
    torch.testing.assert_close(csoftmax(z, loose), torch.softmax(z, -1), atol=TOL["ulps"][F64], rtol=0)
    inf = torch.full_like(z, math.inf)
    torch.testing.assert_close(csparsemax(z, inf), sparsemax(z), atol=TOL["ulps"][F64], rtol=0)
    torch.testing.assert_close(csoftmax(z, inf), torch.softmax(z, -1), atol=TOL["ulps"][F64], rtol=0)


def test_extreme_scores_stay_finite():
    z = torch.tensor([[1000.0, 0.0, -1000.0, 5.0], [-800.0, -800.5, -2000.0, -801.0]], dtype=F64)
    u = torch.tensor([[0.1, 0.2, 0.9, 0.3], [0.5, 0.5, 0.5, 0.5]], dtype=F64)
    for fn in (csoftmax, csparsemax):
        a = fn(z, u)
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.sum(-1), torch.ones(2, dtype=F64), atol=TOL["sum"][F64], rtol=0)
    torch.testing.assert_close(csoftmax(z, u)[0], torch.tensor([0.1, 0.2, 0.4, 0.3], dtype=F64),
                               atol=TOL["same_values"][F64], rtol=0)


def _offset_rows(offset, seed, rows=40, n=9):
    """float32 scores ``offset + k * spacing`` (integers ``|k| <= 6``, exact in float32) and
    their float64 differences from the row max (exact; a well-conditioned float64 reference)."""
    spacing = float(torch.finfo(torch.float32).eps) * 2.0 ** math.frexp(abs(offset))[1]
    k = torch.randint(-6, 7, (rows, n), generator=gen(seed)).to(F64)
    z = (offset + spacing * k).float()
    return z, (k - k.amax(-1, keepdim=True)) * spacing


def test_csoftmax_large_scores_against_float64():
    z = torch.tensor([[1e8, 0.0, 0.3, 5.0]])
    u = torch.full((1, 4), 0.4)
    rest = 0.6 * _bisect(torch.tensor([[0.0, 0.3, 5.0]], dtype=F64), torch.full((1, 3), 0.4 / 0.6, dtype=F64), "soft")
    expected = torch.cat([torch.full((1, 1), 0.4, dtype=F64), rest], dim=1)
    torch.testing.assert_close(csoftmax(z, u).to(F64), expected, atol=TOL["lowp_vs_f64"][F32], rtol=0)
    torch.testing.assert_close(csoftmax(z.to(F64), torch.full((1, 4), 0.4, dtype=F64)), expected,
                               atol=TOL["slow_solver"], rtol=0)
    u_rows = 0.05 + 0.3 * torch.rand(40, 9, generator=gen(40), dtype=F64)
    u_rows[:, 0] = 1.0
    uf = u_rows.float()
    for offset in (2.0 ** 25, -3e7, 1e30, -1e30):
        zz, shifted = _offset_rows(offset, 41)
        a = csoftmax(zz, uf)
        assert (a <= uf).all()
        ref = csoftmax(shifted, uf.to(F64))
        torch.testing.assert_close(a.to(F64), ref, atol=TOL["lowp_vs_f64"][F32], rtol=0)
    top_u = u_rows.clone()
    top_u[:, :3] = 0.2
    small = 2 * torch.randn(40, 6, generator=gen(42), dtype=F64)
    for offset in (1e30, 2.0 ** 25):
        for dtype in (torch.float32, F64):
            mixed = torch.cat([torch.full((40, 3), offset, dtype=F64), small], dim=1).to(dtype)
            a = csoftmax(mixed, top_u.to(dtype)).to(F64)
            ref = 0.4 * _bisect(mixed[:, 3:].to(F64), top_u[:, 3:].to(dtype).to(F64) / 0.4, "soft")
            torch.testing.assert_close(a[:, 3:], ref, atol=TOL["lowp_vs_f64"][F32], rtol=0)
            torch.testing.assert_close(a[:, :3], torch.full((40, 3), 0.2, dtype=F64), atol=TOL["lowp_vs_f64"][F32],
                                       rtol=0)
    ties = torch.full((2, 4), 1e30)
    torch.testing.assert_close(csoftmax(ties, torch.full((2, 4), 0.3)), torch.full((2, 4), 0.25),
                               atol=TOL["ulps"][F32], rtol=0)


def test_csparsemax_large_scores_against_float64():
    z = torch.tensor([[3e7, 3e7 - 2, 3e7 - 4, 0.0]])
    u = torch.full((1, 4), 0.9)
    expected = torch.tensor([[0.9, 0.1, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(csparsemax(z, u).to(F64), expected, atol=TOL["lowp_vs_f64"][F32], rtol=0)
    torch.testing.assert_close(csparsemax(z.to(F64), torch.full((1, 4), 0.9, dtype=F64)), expected,
                               atol=TOL["same_values"][F64],
                               rtol=0)
    huge = torch.tensor([[1e30, 1e30 - 2, 1e30 - 4, 0.0]], dtype=F64)
    third = torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]], dtype=F64)
    torch.testing.assert_close(csparsemax(huge, torch.full((1, 4), 0.9, dtype=F64)), third,
                               atol=TOL["same_values"][F64], rtol=0)
    u_rows = (0.1 + 0.4 * torch.rand(40, 9, generator=gen(43), dtype=F64)).float()
    for offset in (2.0 ** 22, -3e6):
        zz, shifted = _offset_rows(offset, 44)
        a = csparsemax(zz, u_rows)
        ref = _bisect(shifted, u_rows.to(F64), "sparse")
        torch.testing.assert_close(a.to(F64), ref, atol=TOL["lowp_vs_f64"][F32], rtol=0)
    with pytest.raises(ValueError, match="cannot resolve the bounds"):
        csparsemax(torch.tensor([[0.0, -1e8, -2e8]]), torch.full((1, 3), 0.5))
    # The top entries at their bounds and the mass carried by entries far below them (the row summed to 0.5: the
    # threshold, at about -3e7 after the shift by the row max, rounded onto the free entry's score).
    inf = math.inf
    for dtype in (torch.float32, F64):
        for z, u, expected in (([3e7, 0.0], [0.5, inf], [0.5, 0.5]), ([1e8, -1e8, 0.0, 5.0], [0.5, 1.0, 1.0, inf],
                                                                         [0.5, 0.0, 0.0, 0.5])):
            a = csparsemax(torch.tensor([z], dtype=dtype), torch.tensor([u], dtype=dtype))
            torch.testing.assert_close(a.to(F64), torch.tensor([expected], dtype=F64), atol=TOL["lowp_vs_f64"][F32],
                                       rtol=0)
    # A row that reaches f = 1 (an unbounded entry below) with a bound below the spacing of z where the threshold
    # lies: the breakpoints miss its mass, and it raises too.
    for dtype, big in ((torch.float32, 1e8), (F64, 1e30)):
        with pytest.raises(ValueError, match="cannot resolve the bounds"):
            csparsemax(torch.tensor([[big, -big, 0.0, 0.0]], dtype=dtype),
                       torch.tensor([[0.5, 1.0, 1.0, inf]], dtype=dtype))
    # Bounds below the spacing that carry no mass within the tolerance still run (an exhausted fertility).
    a = csparsemax(torch.tensor([[1e8, 0.0, 5.0]]), torch.tensor([[0.5, 1e-12, inf]]))
    torch.testing.assert_close(a.to(F64), torch.tensor([[0.5, 0.0, 0.5]], dtype=F64), atol=TOL["lowp_vs_f64"][F32],
                               rtol=0)


# ---------------------------------------------------------------- gradients


def test_gradcheck_z_and_u():
    z = torch.randn(4, 7, generator=gen(8), dtype=F64, requires_grad=True)
    u = _bounds((4, 7), 9, scale=0.5).requires_grad_()
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[2, 5:] = False
    for fn in (csparsemax, csoftmax):
        assert gradcheck(fn, (z, u), **TOL["gradcheck"])
        assert gradcheck(lambda a, b, fn=fn: fn(a, b, mask=mask), (z, u), **TOL["gradcheck"])
    u_row = _bounds((1, 7), 10, scale=0.5).requires_grad_()
    for fn in (csparsemax, csoftmax):
        assert gradcheck(lambda a, b, fn=fn: fn(a, b, dim=-1), (z, u_row), **TOL["gradcheck"])
    zt = z.detach().t().contiguous().requires_grad_()
    ut = u.detach().t().contiguous().requires_grad_()
    assert gradcheck(lambda a, b: csparsemax(a, b, dim=0), (zt, ut), **TOL["gradcheck"])


def _csparsemax_jacobians(a, u):
    """Eq. 13-14: dA/dz and dA/du built entry by entry from the sets A and A_R."""
    d = a.shape[0]
    free = [(0 < a[i] < u[i]) for i in range(d)]
    upper = [bool(a[i] == u[i] and a[i] > 0) for i in range(d)]
    n_free = sum(free)
    Jz = torch.zeros(d, d, dtype=F64)
    Ju = torch.zeros(d, d, dtype=F64)
    for i in range(d):
        for j in range(d):
            if free[i] and free[j]:
                Jz[i, j] = (1.0 if i == j else 0.0) - 1.0 / n_free
            if upper[j]:
                if i == j:
                    Ju[i, j] = 1.0
                elif free[i]:
                    Ju[i, j] = -1.0 / n_free
    return Jz, Ju


def _csoftmax_jacobians(a, u):
    """Free set F (a < u): a_i = exp(z_i) (1 - sum_C u) / sum_F exp(z); clipped C: a_i = u_i."""
    d = a.shape[0]
    free = a < u
    mass = a[free].sum()
    Jz = torch.zeros(d, d, dtype=F64)
    Ju = torch.zeros(d, d, dtype=F64)
    for i in range(d):
        for j in range(d):
            if free[i] and free[j]:
                Jz[i, j] = a[i] * ((1.0 if i == j else 0.0) - a[j] / mass)
            if not free[j]:
                Ju[i, j] = 1.0 if i == j else (-a[i] / mass if free[i] else 0.0)
    return Jz, Ju


@pytest.mark.parametrize("fn,build", [(csparsemax, _csparsemax_jacobians), (csoftmax, _csoftmax_jacobians)])
def test_jacobians_and_jvps_match_closed_forms(fn, build):
    d = 7
    z = torch.randn(4, d, generator=gen(11), dtype=F64)
    u = _bounds((4, d), 12, scale=0.4)
    for r in range(4):
        a = fn(z[r], u[r])
        Jz, Ju = build(a, u[r])
        assert Ju.abs().sum() > 0
        Jz_t, Ju_t = jacobian(lambda x, b: fn(x, b), (z[r], u[r]))
        torch.testing.assert_close(Jz_t, Jz, atol=TOL["jacobian"], rtol=0)
        torch.testing.assert_close(Ju_t, Ju, atol=TOL["jacobian"], rtol=0)
        vz = torch.randn(d, generator=gen(20 + r), dtype=F64)
        vu = torch.randn(d, generator=gen(30 + r), dtype=F64)
        _, jv = jvp(lambda x, b: fn(x, b), (z[r], u[r]), (vz, vu))
        torch.testing.assert_close(jv, Jz @ vz + Ju @ vu, atol=TOL["jacobian"], rtol=0)


# ---------------------------------------------------------------- infeasible bounds, dtypes, errors


@pytest.mark.parametrize("fn", [csparsemax, csoftmax])
def test_infeasible_bounds_raise(fn):
    z = torch.randn(3, 4, dtype=F64)
    u = torch.full((3, 4), 0.3, dtype=F64)
    u[1] = 0.2
    with pytest.raises(ValueError, match="u must sum to at least 1"):
        fn(z, u)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 0] = False
    with pytest.raises(ValueError, match="u must sum to at least 1"):
        fn(z, torch.full((3, 4), 0.3, dtype=F64), mask=mask)
    u[1] = 0.3
    a = fn(z, u)
    assert (a <= u).all()
    empty = torch.zeros(3, 4, dtype=torch.bool)
    assert (fn(z, torch.zeros(3, 4, dtype=F64), mask=empty) == 0).all()
    assert fn(torch.empty(0, 4), torch.ones(0, 4)).shape == (0, 4)
    assert fn(torch.empty(3, 0), torch.ones(3, 0)).shape == (3, 0)
    exact = torch.full((2, 4), 0.25, dtype=torch.float32)
    torch.testing.assert_close(fn(z[:2].float(), exact), exact, atol=TOL["ulps"][F32], rtol=0)
    with pytest.raises(ValueError, match="u must be >= 0"):
        fn(z, torch.tensor([-0.1, 0.5, 0.5, 0.5], dtype=F64))
    with pytest.raises(ValueError, match="u must be >= 0"):
        fn(z, torch.tensor([math.nan, 0.5, 0.5, 0.5], dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_against_float64(dtype):
    z = (2 * torch.randn(4, 3, 12, generator=gen(13))).to(dtype)
    u = (0.3 * torch.rand(4, 3, 12, generator=gen(14)) + 0.05).to(dtype)
    for fn in (csparsemax, csoftmax):
        a = fn(z, u)
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a.to(F64), fn(z.to(F64), u.to(F64)), atol=TOL["lowp_vs_f64"][dtype], rtol=0)


# ---------------------------------------------------------------- fertility-constrained attention


def _decode_inputs(seed, batch=3, tgt=9, src=6):
    scores = 2 * torch.randn(batch, tgt, src, generator=gen(seed), dtype=F64)
    lengths = torch.tensor([src, 4, 2])[:batch]
    return scores, lengths


@pytest.mark.parametrize("transform", ["csparsemax", "csoftmax"])
def test_decode_never_exceeds_fertility(transform):
    scores, lengths = _decode_inputs(15)
    per_word = 0.3 + 1.5 * torch.rand(3, 6, generator=gen(16), dtype=F64)
    predictor = FertilityPredictor(5, max_fertility=2.0, hidden_dim=8).double()
    enc = torch.randn(3, 6, 5, generator=gen(17), dtype=F64)
    cases = [
        (FertilityAttention(transform, fertility=1.0, exhaustion=0.2), {}),
        (FertilityAttention(transform, fertility=None, exhaustion=0.5), {"fertility": per_word}),
        (FertilityAttention(transform, fertility=None, predictor=predictor), {"encoder_states": enc}),
    ]
    for module, kwargs in cases:
        attn, state = module(scores, src_lengths=lengths, **kwargs)
        assert attn.shape == (3, 9, 7)
        torch.testing.assert_close(attn.sum(-1), torch.ones(3, 9, dtype=F64), atol=TOL["sum"][F64], rtol=0)
        total = attn.sum(1)[:, :6]
        fert = state.fertility[:, :6]
        assert (total <= fert + TOL["invariant"]).all()
        torch.testing.assert_close(total, state.cumulative[:, :6], atol=TOL["same_values"][F64], rtol=0)
        valid = torch.arange(6) < lengths[:, None]
        assert (attn[:, :, :6][~valid[:, None, :].expand(3, 9, 6)] == 0).all()
        assert torch.isinf(state.fertility[:, 6]).all()
    long_scores = torch.randn(2, 20, 4, generator=gen(18), dtype=F64)
    attn, _ = FertilityAttention(transform, fertility=1.0)(long_scores)
    assert (attn.sum(1)[:, :4] <= 1.0 + TOL["invariant"]).all()
    torch.testing.assert_close(attn[:, -8:, 4], torch.ones(2, 8, dtype=F64), atol=TOL["same_values"][F64], rtol=0)


def test_incremental_equals_whole_target_and_exhaustion():
    scores, lengths = _decode_inputs(19)
    module = FertilityAttention("csparsemax", fertility=1.5, exhaustion=0.3)
    whole, final = module(scores, src_lengths=lengths)
    state = None
    steps = []
    for t in range(scores.shape[1]):
        kwargs = {"src_lengths": lengths} if state is None else {}
        a, state = module.step(scores[:, t], state, **kwargs)
        steps.append(a)
    torch.testing.assert_close(torch.stack(steps, 1), whole, **EXACT)
    torch.testing.assert_close(state.cumulative, final.cumulative, **EXACT)
    first = module.step(scores[:, 0], src_lengths=lengths)[0]
    valid = torch.arange(6) < lengths[:, None]
    u = torch.cat([torch.where(valid, 1.5, 0.0).to(F64), torch.full((3, 1), math.inf, dtype=F64)], -1)
    z = torch.cat([scores[:, 0] + 0.3 * u[:, :6], torch.zeros(3, 1, dtype=F64)], -1)
    torch.testing.assert_close(first, csparsemax(z, u, mask=torch.cat([valid, torch.ones(3, 1, dtype=torch.bool)], -1)),
                               **EXACT)
    plain = FertilityAttention("csparsemax", fertility=1.5, exhaustion=0.0).step(scores[:, 0], src_lengths=lengths)[0]
    assert not torch.allclose(plain, first)


def test_target_mask_and_multihead_shapes():
    scores = torch.randn(2, 3, 5, 4, generator=gen(20), dtype=F64)
    tgt_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, :].expand(2, 3, 5)
    fert = torch.tensor([[1.0, 2.0, 0.5, 1.0], [0.2, 0.2, 3.0, 1.0]], dtype=F64)[:, None, :]
    module = FertilityAttention("csoftmax", fertility=None)
    attn, state = module(scores, tgt_mask=tgt_mask, fertility=fert)
    assert attn.shape == (2, 3, 5, 5)
    assert (attn[1, :, 3:] == 0).all()
    assert (attn.sum(2)[..., :4] <= fert + TOL["invariant"]).all()


def test_decode_without_sink_raises_when_fertility_runs_out():
    scores = torch.randn(2, 5, 3, generator=gen(21), dtype=F64)
    module = FertilityAttention("csparsemax", fertility=1.0, sink=False)
    attn, _ = module(scores[:, :3])
    assert attn.shape == (2, 3, 3)
    with pytest.raises(ValueError, match="u must sum to at least 1"):
        module(scores)


def test_decode_gradients():
    scores = torch.randn(2, 4, 3, generator=gen(22), dtype=F64, requires_grad=True)
    fert = (0.5 + torch.rand(2, 3, generator=gen(23), dtype=F64)).requires_grad_()
    for transform in ("csparsemax", "csoftmax"):
        module = FertilityAttention(transform, fertility=None).double()
        assert gradcheck(lambda s, f, m=module: m(s, fertility=f)[0], (scores, fert), **TOL["gradcheck"])
    predictor = FertilityPredictor(4, max_fertility=2.0).double()
    module = FertilityAttention("csparsemax", fertility=None, predictor=predictor).double()
    enc = torch.randn(2, 3, 4, generator=gen(24), dtype=F64)
    attn, _ = module(scores, encoder_states=enc)
    (attn * torch.randn(attn.shape, generator=gen(25), dtype=F64)).sum().backward()
    assert module.sink_score.grad is not None and torch.isfinite(module.sink_score.grad)
    assert all(p.grad is not None for p in predictor.parameters())


def test_fertility_module_errors():
    with pytest.raises(ValueError, match="transform must be one of"):
        FertilityAttention("softmax")
    with pytest.raises(ValueError, match="fertility must be"):
        FertilityAttention(fertility=-1.0)
    with pytest.raises(ValueError, match="fertility is unknown"):
        FertilityAttention(fertility=None)(torch.randn(2, 3, 4))
    module = FertilityAttention(fertility=1.0)
    _, state = module(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="scores must have 4 source positions"):
        module.step(torch.randn(2, 5), state)
    with pytest.raises(ValueError, match="only accepted with state=None"):
        module.step(torch.randn(2, 4), state, src_lengths=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="fertility must be >= 0"):
        module(torch.randn(2, 3, 4), fertility=torch.full((2, 4), -1.0))
    with pytest.raises(TypeError, match="src_mask must be a boolean"):
        module(torch.randn(2, 3, 4), src_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="scores must have shape"):
        module(torch.randn(4))


def test_fertility_broadcast_lengths():
    module = FertilityAttention(fertility=1.0)
    attn, _ = module(torch.randn(3, 4, 5), src_lengths=torch.tensor(3))
    assert attn.shape == (3, 4, 6) and (attn[..., 3:5] == 0).all()
    mh, _ = module(torch.randn(2, 3, 4, 5), src_lengths=torch.tensor([[5], [2]]))
    assert mh.shape == (2, 3, 4, 6) and (mh[1, :, :, 2:5] == 0).all()
