"""The route table (``sparse_attn/attn/routes.py``): every variant named, every route refusing what it does not list.

A new field of ``AttentionInputs`` or a new variant without a row in the test table (``tests/variants.py``: its
keywords, its eager twin, its routes) fails the coverage tests; a variant a route does not list is refused there
(the dummy-variant test), and what the SDPA route claims to run is checked against the reference on the CPU (the
route itself only runs on CUDA).
"""

import contextlib
import dataclasses

import pytest
import torch
from helpers import F64, TOL
from variants import ROWS, Problem, build

from sparse_attn.attention import run_attention
from sparse_attn.attn._attn_autograd import _sdpa, fused_entmax_attention, sdpa_refuses
from sparse_attn.attn.attn_inputs import AttentionInputs, prepare_attention
from sparse_attn.attn.routes import PROBLEM_FIELDS, SUPPORTED, VARIANTS, refused
from sparse_attn.decode import decode_fits, decode_unsupported
from sparse_attn.distributed import context_parallel_attention, ulysses_attention
from sparse_attn.kernels._spec import DECLS

B, H, N, D = 2, 4, 12, 16


def _qkv(n_q=N, n_k=N, h_k=H, d_v=D, dtype=torch.float64, grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n_q, D, generator=gen, dtype=dtype)
    k = torch.randn(B, h_k, n_k, D, generator=gen, dtype=dtype)
    v = torch.randn(B, h_k, n_k, d_v, generator=gen, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


PROBLEM = Problem(b=B, hq=H, hk=H, nq=N, nk=N, d=D, dv=D)


def _inputs(variant=None, alpha=1.0, backend="reference"):
    """The spec of one call using ``variant`` alone (its row of tests/variants.py), or none."""
    q, k, v, kw = build([] if variant is None else [variant], PROBLEM)
    return prepare_attention(q, k, v, alpha, backend=backend, **kw)


def test_every_variant_and_field_is_covered():
    """The test table has one row per library variant (in the library's order) and each row's field is the spec's;
    every field of AttentionInputs is a problem field or a variant's; a row's routes are the library's."""
    assert list(ROWS) == list(VARIANTS)
    fields = {f.name for f in dataclasses.fields(AttentionInputs)}
    assert fields - PROBLEM_FIELDS == {row.field for row in ROWS.values() if row.field is not None}
    # each field declares its variants (kernels/_spec.py, DECLS): those of the rows that set it, all of them known
    assert all(row.name in DECLS[row.field].variants for row in ROWS.values() if row.field is not None)
    assert {name for decl in DECLS.values() for name in decl.variants} <= set(VARIANTS)
    assert set(SUPPORTED) == {"sdpa", "decode", "fused", "chunked", "reference", "context_parallel", "ulysses"}
    assert all(route_set <= set(VARIANTS) for route_set in SUPPORTED.values())
    assert all(ROWS[name].routes == {r for r, names in SUPPORTED.items() if name in names} for name in ROWS)
    assert ROWS["grad"].routes >= {"reference", "fused"} and "decode" not in ROWS["grad"].routes


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_row_sets_its_field(variant):
    """A row's keywords land in its spec field (the shape- and autograd-made variants: no field)."""
    row, plain = ROWS[variant], _inputs()
    if row.field is not None:
        assert _differs(getattr(_inputs(variant), row.field), getattr(plain, row.field)), row.field


def _differs(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (a is None) != (b is None) or not torch.equal(a, b)
    return a != b


def test_plain_call_uses_nothing():
    with torch.no_grad():
        assert _inputs().used() == frozenset()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_example_turns_its_variant_on(variant):
    used = _inputs(variant).used()
    assert variant in used
    # the examples are minimal: nothing else but the gradient their tensors ask for (and the variant a gradient of
    # a mask or of slopes needs)
    assert used - {variant, "grad"} == ROWS[variant].implies, used


@pytest.mark.parametrize("route", sorted(SUPPORTED))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_by_route(variant, route):
    """Every variant x route pair: the routers' answer is the table's, and a refusal names the variant."""
    inputs = _inputs(variant)
    accepted = variant in SUPPORTED[route]
    phrases = {"sdpa": lambda: sdpa_refuses(inputs, False), "decode": lambda: decode_unsupported(inputs)}.get(
        route, lambda: refused(route, inputs.used()))()
    assert (VARIANTS[variant] not in phrases) == accepted, (variant, route, phrases)
    if route == "decode" and not accepted:
        assert not decode_fits(dataclasses.replace(inputs, backend="triton", q=inputs.q[:, :, :1], max_seqlen_q=1))


@pytest.mark.parametrize("variant", sorted(SUPPORTED["sdpa"] - {"dropout"}))
def test_sdpa_route_computes_what_it_claims(variant):
    """Softmax through PyTorch's SDPA (CPU here, CUDA in use) equals the reference for each variant the route lists."""
    inputs = _inputs(variant)
    assert not sdpa_refuses(inputs, False)
    with torch.no_grad():
        ref = run_attention(inputs)
        got = _sdpa(inputs)
    torch.testing.assert_close(got, ref, atol=TOL["same_values"][F64], rtol=0)


def test_sdpa_route_causal_needs_keys_for_every_row():
    q, k, v = _qkv(n_q=N, n_k=N - 4)
    inputs = prepare_attention(q, k, v, 1.0, is_causal=True, backend="reference")
    assert "causal with more queries than keys" in sdpa_refuses(inputs, False)


def test_a_variant_no_route_lists_is_refused_everywhere(monkeypatch):
    """A variant added to a call but to no route's set: every router refuses it, naming it and the route."""
    used = AttentionInputs.used
    monkeypatch.setattr(AttentionInputs, "used", lambda self: used(self) | {"dummy_variant"})
    inputs = _inputs()
    assert "dummy_variant" in sdpa_refuses(inputs, False)
    assert "dummy_variant" in decode_unsupported(inputs)
    assert not decode_fits(dataclasses.replace(inputs, backend="triton", q=inputs.q[:, :, :1], max_seqlen_q=1))
    q, k, v = (t.float() for t in _qkv())
    fused = prepare_attention(q, k, v, 1.5, backend="triton")
    with pytest.raises(ValueError, match="dummy_variant: not supported on route 'fused'"):
        fused_entmax_attention(fused, False)
    with pytest.raises(ValueError, match="dummy_variant: not supported on route 'reference'"):
        run_attention(inputs)
    with _one_rank_group() as group:
        q, k, v = (t.float() for t in _qkv())
        with pytest.raises(ValueError, match="dummy_variant: not supported on route 'context_parallel'"):
            context_parallel_attention(q, k, v, group=group, backend="reference")
        with pytest.raises(ValueError, match="dummy_variant: not supported on route 'ulysses'"):
            ulysses_attention(q, k, v, group=group, backend="reference")


def test_context_parallel_refuses_slopes_that_require_grad():
    """Slope gradients would be per rank with nobody summing them: both schemes refuse them by name."""
    q, k, v = (t.float() for t in _qkv())
    slopes = torch.rand(H, requires_grad=True)
    with _one_rank_group() as group:
        for fn, route in ((context_parallel_attention, "context_parallel"), (ulysses_attention, "ulysses")):
            with pytest.raises(ValueError, match=f"alibi_slopes that require grad .*route '{route}'"):
                fn(q, k, v, group=group, is_causal=True, alibi_slopes=slopes, backend="reference")


@contextlib.contextmanager
def _one_rank_group():
    """A gloo process group of this process alone (the distributed routers' checks need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield None
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def test_fused_route_refuses_by_name():
    """The fused kernels' refusal (slopes requiring grad) as a ValueError naming the variant and the route."""
    q, k, v = (t.float() for t in _qkv())
    with pytest.raises(ValueError, match="alibi_slopes that require grad"):
        prepare_attention(q, k, v, 1.5, backend="triton", alibi_slopes=torch.rand(H, requires_grad=True))
    inputs = prepare_attention(q, k, v, 1.5, backend="triton")
    inputs = dataclasses.replace(inputs, alibi_slopes=torch.rand(H, requires_grad=True))
    with pytest.raises(ValueError, match="alibi_slopes that require grad .*: not supported on route 'fused'"):
        fused_entmax_attention(inputs, False)


def test_entmax_decode_refuses_gradients_up_front():
    """The public decode entry is the decode route: inputs that need a gradient raise at the call, by name (not at
    backward, where the decode op has no formula); under no_grad, or on the reference backend, the call runs."""
    from sparse_attn.decode import entmax_decode

    q, k, v = (torch.randn(1, 2, n, 16) for n in (1, 20, 20))
    qg = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="gradients: not supported on route 'decode'"):
        entmax_decode(qg, k, v, backend="triton")
    with pytest.raises(ValueError, match="gradients: not supported on route 'decode'"):
        entmax_decode(q, k, v, alpha=torch.tensor([1.5, 1.2], requires_grad=True), backend="triton")
    with torch.no_grad():
        out = entmax_decode(qg, k, v, backend="triton")
    ref = entmax_decode(qg, k, v, backend="reference")
    assert ref.requires_grad
    torch.testing.assert_close(out, ref.detach(), rtol=2e-5, atol=2e-5)  # why: float32 kernel vs reference


def test_field_declarations_name_only_their_own_variants():
    """``FieldDecl.used_by`` (what ``used_variants`` reads) names only variants its field declares, none for an
    unset field, and the declared first variant for a field merely given."""
    import torch

    for name, decl in DECLS.items():
        assert decl.used_by(None) == (), name
    mask = torch.zeros(2, 3)
    assert DECLS["mask"].used_by(mask.bool()) == ("bool_mask",)
    assert DECLS["mask"].used_by(mask) == ("float_mask",)
    assert DECLS["mask"].used_by(mask.requires_grad_()) == ("float_mask", "mask_grad")
    assert DECLS["alibi_slopes"].used_by(torch.ones(2)) == ("alibi",)
    assert DECLS["is_causal"].used_by(False) == () and DECLS["is_causal"].used_by(True) == ("causal",)
    assert DECLS["dropout_p"].used_by(0.0) == () and DECLS["dropout_p"].used_by(0.1) == ("dropout",)
    assert DECLS["window_size"].used_by((4, 0)) == ("window",)
    for name, decl in DECLS.items():
        if decl.variants:
            assert set(decl.used_by(torch.ones(1, requires_grad=True) if decl.op_type == "Tensor?" else 1.0)) <= set(
                decl.variants), name
