"""The attention problem as one frozen value (``kernels/_spec.py``): built once by ``prepare_attention`` (also for
decode and context parallelism), carried across the fused custom op's boundary by one flatten / unflatten pair, and
naming its variants as the route table does."""

import contextlib
import dataclasses

import pytest
import torch
from variants import ROWS, Problem, build

import sparse_attn.decode as decode_mod
import sparse_attn.distributed as distributed_mod
from sparse_attn.attn import routes
from sparse_attn.attn._attn_autograd import FWD_FIELDS, spec_from_op_args, spec_to_op_args
from sparse_attn.attn.attn_inputs import AttentionInputs, prepare_attention
from sparse_attn.kernels._spec import DIFFERENTIABLE, AttnSpec

B, H, HK, N, D, DV = 1, 4, 2, 10, 16, 32


def _every_variant():
    """A spec whose call uses every variant of the route table at once (the test table's rows; a float mask: not
    ``bool_mask``), on the reference backend."""
    q, k, v, kw = build(set(ROWS) - {"bool_mask"}, Problem(b=B, hq=H, nq=N, nk=N, d=D))
    return prepare_attention(q, k, v, torch.tensor([1.2, 1.5, 2.0, 1.0], dtype=torch.float64), backend="reference",
                             need_stats=True, **kw)


def _paged_decode_spec():
    q = torch.randn(2, H, 1, D)
    k_pool, v_pool = torch.randn(5, 4, HK, D), torch.randn(5, 4, HK, DV)
    table = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    return prepare_attention(q, k_pool, v_pool, 1.5, kv_cache=True, cache_seqlens=torch.tensor([9, 6]),
                             block_table=table, num_splits=2, window_size=(4, 0), backend="reference")


def test_the_spec_is_frozen_and_is_attention_inputs():
    spec = _every_variant()
    assert AttentionInputs is AttnSpec and isinstance(spec, AttnSpec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.scale = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.q = spec.k
    assert dataclasses.replace(spec, scale=1.0).scale == 1.0 and spec.scale == D ** -0.5


def test_every_variant_is_used_and_matches_the_route_table():
    spec = _every_variant()
    assert spec.used() == frozenset(routes.VARIANTS) - {"bool_mask"}  # one mask: float here, boolean below
    assert "bool_mask" in dataclasses.replace(spec, mask=spec.mask.detach() > 0).used()
    assert routes.used_variants(spec.q, spec.k, spec.v, alpha=spec.alpha, mask=spec.mask, is_causal=spec.is_causal,
                                dropout_p=spec.dropout_p, cu_seqlens_q=spec.cu_seqlens_q,
                                window_size=spec.window_size, alibi_slopes=spec.alibi_slopes, sinks=spec.sinks,
                                softcap=spec.softcap, block_mask=spec.block_mask) == spec.used()
    with pytest.raises(TypeError, match="state no variant"):
        routes.used_variants(spec.q, spec.k, spec.v, scale=2.0)
    with torch.no_grad():
        assert "grad" not in _every_variant().used()


@pytest.mark.parametrize("make", [_every_variant, _paged_decode_spec], ids=["every_variant", "paged_decode"])
def test_op_flatten_and_unflatten_round_trip_every_field(make):
    spec = make()
    args = spec_to_op_args(spec, 1234)
    assert len(args) == len(FWD_FIELDS) and set(DIFFERENTIABLE) <= set(FWD_FIELDS)
    back, seed = spec_from_op_args(args)
    assert seed == 1234
    for field in dataclasses.fields(AttnSpec):
        got, want = getattr(back, field.name), getattr(spec, field.name)
        if isinstance(want, torch.Tensor):
            assert got is want, field.name
        else:
            assert got == want and type(got) is type(want), (field.name, got, want)


def test_the_spec_carries_the_decisions():
    """alpha class, statistics and gradients are decided once, where the spec is built."""
    q, k, v = (torch.randn(1, 2, 6, 16) for _ in range(3))
    assert prepare_attention(q, k, v, 1.0).alpha_class == "softmax"
    assert prepare_attention(q, k, v, torch.tensor([1.5, 1.5])).alpha_class == "entmax15"
    assert prepare_attention(q, k, v, torch.tensor([1.5, 2.0])).alpha_class == "mixed"
    assert prepare_attention(q, k, v, torch.tensor([1.3, 1.7])).alpha_class == "general"
    plain = prepare_attention(q, k, v)
    assert not plain.need_stats and not plain.need_grad
    assert prepare_attention(q, k, v, need_stats=True).need_stats
    alpha = torch.tensor([1.5, 1.2], requires_grad=True)
    assert prepare_attention(q, k, v, alpha).need_grad
    with torch.no_grad():
        assert not prepare_attention(q, k, v, alpha).need_grad
    with pytest.raises(ValueError, match="cache_seqlens is only used with a KV cache"):
        prepare_attention(q, k, v, cache_seqlens=3)


def test_derived_shapes():
    spec = _every_variant()
    assert (spec.is_varlen, spec.n_seqs, spec.n_heads, spec.n_kv_heads, spec.kv_group) == (True, 2, H, HK, 2)
    assert (spec.head_dim, spec.head_dim_v, spec.score_shape) == (D, DV, (B, H, N, N))
    paged = _paged_decode_spec()
    assert (paged.is_paged, paged.n_kv_heads, paged.seqlen_k, paged.score_shape) == (True, HK, 12, (2, H, 1, 12))
    assert paged.max_seqlen_k == 9 and paged.cache_seqlens.dtype == torch.int32
    assert "gqa" in paged.used() and "window" in paged.used()


@contextlib.contextmanager
def _spy(monkeypatch, module):
    """Count the calls ``module`` makes to ``prepare_attention`` (and keep the specs)."""
    specs = []

    def spy(*args, **kwargs):
        specs.append(prepare_attention(*args, **kwargs))
        return specs[-1]

    monkeypatch.setattr(module, "prepare_attention", spy)
    yield specs


def test_decode_goes_through_prepare_attention(monkeypatch):
    q, k, v = torch.randn(2, H, 1, D), torch.randn(2, HK, 12, D), torch.randn(2, HK, 12, D)
    with _spy(monkeypatch, decode_mod) as specs:
        out, stats = decode_mod.entmax_decode(q, k, v, torch.tensor([9, 12]), 1.5, return_stats=True,
                                              backend="reference")
    assert len(specs) == 1 and specs[0].need_stats and specs[0].cache_seqlens.tolist() == [9, 12]
    assert out.shape == (2, H, 1, D) and stats.nnz.shape == (2, H, 1)
    # the arguments decode shares with every call are checked by prepare_attention, with its words
    with pytest.raises(ValueError, match="window_size must hold ints >= -1"):
        decode_mod.entmax_decode(q, k, v, window_size=(-2, 0))


def test_context_parallel_goes_through_prepare_attention(monkeypatch):
    import torch.distributed as dist

    q, k, v = (torch.randn(1, H, 8, D) for _ in range(3))
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with _spy(monkeypatch, distributed_mod) as specs:
            distributed_mod.context_parallel_attention(q, k, v, is_causal=True, window_size=(3, 0),
                                                       return_stats=True, backend="reference")
            assert len(specs) == 1 and specs[0].window_size == (3, 0) and specs[0].need_stats
            distributed_mod.ulysses_attention(q, k, v, is_causal=True, backend="reference")
            assert len(specs) == 2
    finally:
        if own:
            dist.destroy_process_group()
