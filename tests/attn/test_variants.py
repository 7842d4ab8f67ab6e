"""Attention variants real models use, on the reference: sliding windows, ALiBi, per-head sinks, softcap, Dv != D.

Each variant is checked against a computation that does not use it: masks and biases built here with loops
and passed as ``attn_mask``; a sink as an extra key with zero key and value whose bias column is the sink
logit; softmax with an appended sink column (gpt-oss's eager attention); softcapped scores through the row
mapping; PyTorch's SDPA at alpha = 1; a zero-padded value for Dv != D. Then varlen, low precision, the
statistics, the non-finite policy, the argument checks and the fused path's refusal of the variants.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TOL
from variants import KEYWORDS, ROWS, Problem, build, cast, eager_attention, grad_leaves, loop_alibi, loop_keep, together

import sparse_attn.attn._cpu_chunked as chunked_mod
import sparse_attn.attn.attn_inputs as attn_inputs
from sparse_attn.attention import entmax_attention
from sparse_attn.mappings import entmax
from sparse_attn.reference import entmax_attention_reference

ALPHAS = [1.0, 1.3, 1.5, 2.0]
INF = float("inf")


def _qkv(b=2, hq=4, hk=2, nq=7, nk=9, d=8, dv=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, nk, dv or d, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _grads(out, tensors, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors, allow_unused=True, retain_graph=True)


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


WINDOWS = [(2, 0), (0, 3), (3, -1), (-1, 2), (0, 0), (1, 1)]


@pytest.mark.parametrize("nq,nk", [(7, 9), (9, 6), (8, 8)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_equals_its_materialized_mask(nq, nk, window, causal):
    """Bottom-right aligned window, intersected with causal masking and a user mask, for every alpha (GQA)."""
    q, k, v = _qkv(nq=nq, nk=nk, grad=True)
    user = torch.rand(2, 1, nq, nk, generator=torch.Generator().manual_seed(5)) > 0.2
    keep = user & loop_keep(nq, nk, *window, causal=causal)
    for alpha in ALPHAS:
        out = entmax_attention(q, k, v, alpha, attn_mask=user, is_causal=causal, window_size=window, enable_gqa=True)
        ref = entmax_attention(q, k, v, alpha, attn_mask=keep, enable_gqa=True)
        _close(out, ref)
        for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
            _close(g, r)
    rows = keep.any(-1, keepdim=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~rows, enable_gqa=True)
    out = entmax_attention(q, k, v, 1.0, attn_mask=user, is_causal=causal, window_size=window, enable_gqa=True)
    _close(out.masked_fill(~rows, 0), sdpa.masked_fill(~rows, 0))


def test_window_minus_one_is_unbounded_and_causal_is_window_minus_one_zero():
    q, k, v = _qkv(nq=6, nk=10)
    _close(entmax_attention(q, k, v, enable_gqa=True, window_size=(-1, -1)), entmax_attention(q, k, v, enable_gqa=True))
    _close(entmax_attention(q, k, v, enable_gqa=True, window_size=(-1, 0)),
           entmax_attention(q, k, v, enable_gqa=True, is_causal=True))
    _close(entmax_attention(q, k, v, enable_gqa=True, window_size=[2, 0]),
           entmax_attention(q, k, v, enable_gqa=True, window_size=(2, 0)))
    # a side wider than any int64 index is unbounded too (it raised OverflowError in the mask arithmetic)
    for huge in (2**63, 2**64):
        _close(entmax_attention(q, k, v, enable_gqa=True, window_size=(huge, 0)),
               entmax_attention(q, k, v, enable_gqa=True, is_causal=True))
        _close(entmax_attention(q, k, v, enable_gqa=True, window_size=(1, huge)),
               entmax_attention(q, k, v, enable_gqa=True, window_size=(1, -1)))


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_equals_its_materialized_bias(per_batch, causal):
    """``-slope * |i + Nk - Nq - j|`` added to the scores, with a float user mask; SDPA at alpha = 1."""
    q, k, v = _qkv(nq=6, nk=9, grad=True)
    g = torch.Generator().manual_seed(2)
    slopes = torch.rand((2, 4) if per_batch else (4,), generator=g, dtype=torch.float64).requires_grad_(True)
    user = torch.randn(1, 4, 6, 9, generator=g, dtype=torch.float64)
    for alpha in ALPHAS:
        bias = user + loop_alibi(slopes, 6, 9)
        out = entmax_attention(q, k, v, alpha, attn_mask=user, is_causal=causal, alibi_slopes=slopes,
                               enable_gqa=True)
        ref = entmax_attention(q, k, v, alpha, attn_mask=bias, is_causal=causal, enable_gqa=True)
        _close(out, ref)
        for gr, r in zip(_grads(out, (q, k, v, slopes)), _grads(ref, (q, k, v, slopes))):
            _close(gr, r)
    keep = loop_keep(6, 9, causal=causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~keep, -INF), enable_gqa=True)
    _close(entmax_attention(q, k, v, 1.0, attn_mask=user, is_causal=causal, alibi_slopes=slopes, enable_gqa=True),
           sdpa)


def _sink_as_extra_key(q, k, v, sinks, keep):
    """The same attention with the sink as a real extra key: zero key and value, bias column = sink logit."""
    b, hq, nq, _ = q.shape
    k_ext = torch.cat([k, k.new_zeros(b, k.shape[1], 1, k.shape[-1])], dim=2)
    v_ext = torch.cat([v, v.new_zeros(b, v.shape[1], 1, v.shape[-1])], dim=2)
    nk = k.shape[2]
    bias = torch.cat([torch.zeros(1, hq, nq, nk, dtype=q.dtype), sinks.reshape(1, hq, 1, 1).expand(1, hq, nq, 1)], -1)
    keep_ext = torch.cat([keep.expand(b, 1, nq, nk), torch.ones(b, 1, nq, 1, dtype=torch.bool)], dim=-1)
    return q, k_ext, v_ext, bias.masked_fill(~keep_ext, -INF)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_equal_an_extra_zero_key_whose_score_is_the_sink(alpha, causal):
    """Forward and gradients (q, k, v, sinks) for every alpha, with GQA, a mask and causal masking."""
    q, k, v = _qkv(nq=7, nk=9, grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    user = torch.rand(2, 1, 7, 9, generator=torch.Generator().manual_seed(4)) > 0.3
    user[0, 0, 2] = False  # a row with no key: the sink takes all the weight, the output is 0
    keep = user & loop_keep(7, 9, causal=causal)
    out = entmax_attention(q, k, v, alpha, attn_mask=user, is_causal=causal, sinks=sinks, enable_gqa=True)
    q2, k_ext, v_ext, bias = _sink_as_extra_key(q, k, v, sinks, keep)
    ref = entmax_attention(q2, k_ext, v_ext, alpha, attn_mask=bias, enable_gqa=True)
    _close(out, ref)
    assert (out[0, :, 2] == 0).all()
    for g, r in zip(_grads(out, (q, k, v, sinks)), _grads(ref, (q, k, v, sinks))):
        _close(g, r)


def test_sinks_at_alpha_one_are_softmax_with_an_appended_column():
    """gpt-oss's eager attention: softmax over [scores, sink], the sink column dropped."""
    q, k, v = _qkv(hq=4, hk=4, nq=5, nk=5)
    sinks = torch.randn(4, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(8) + torch.zeros(5, 5).masked_fill(~loop_keep(5, 5, causal=True), -INF)
    logits = torch.cat([s, sinks.reshape(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    expected = torch.softmax(logits, dim=-1)[..., :-1] @ v
    _close(entmax_attention(q, k, v, 1.0, is_causal=True, sinks=sinks), expected)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_sink_takes_weight_and_minus_inf_turns_it_off(alpha):
    q, k, v = _qkv(hq=4, hk=4)
    sinks = torch.tensor([3.0, -INF, 0.0, 1.0], dtype=torch.float64)
    _, w = entmax_attention_reference(q, k, v, alpha, sinks=sinks, return_weights=True)
    _, w_plain = entmax_attention_reference(q, k, v, alpha, return_weights=True)
    total = w.sum(-1)
    assert (total[:, 0] < 1 - 1e-3).all()  # a big sink takes weight
    _close(w[:, 1], w_plain[:, 1])  # -inf: as without a sink
    assert (total <= 1 + 1e-12).all()
    _close(entmax_attention(q, k, v, alpha, sinks=sinks)[:, 1], entmax_attention(q, k, v, alpha)[:, 1])


@pytest.mark.parametrize("alpha", ALPHAS)
def test_nonfinite_sink_gives_nan_rows_of_its_head_only(alpha):
    q, k, v = _qkv(hq=4, hk=4, grad=True)
    for bad in (float("nan"), INF):
        sinks = torch.tensor([0.0, bad, 1.0, 0.5], dtype=torch.float64, requires_grad=True)
        out = entmax_attention(q, k, v, alpha, sinks=sinks)
        assert torch.isnan(out[:, 1]).all() and torch.isfinite(out[:, [0, 2, 3]]).all()
        gq, gs = _grads(out, (q, sinks))
        assert torch.isnan(gq[:, 1]).all() and torch.isfinite(gq[:, [0, 2, 3]]).all()
        assert torch.isnan(gs[1]) and torch.isfinite(gs[[0, 2, 3]]).all()


@pytest.mark.parametrize("alpha", ALPHAS)
def test_fully_masked_rows_with_sinks_give_zeros_and_zero_gradients(alpha):
    q, k, v = _qkv(hq=4, hk=4, grad=True)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    keep[1, 0, 3] = False
    out = entmax_attention(q, k, v, alpha, attn_mask=keep, sinks=sinks)
    assert (out[1, :, 3] == 0).all()
    gq, gs = _grads(out, (q, sinks))
    assert (gq[1, :, 3] == 0).all() and torch.isfinite(gs).all()


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_equals_capped_scores_through_the_row_mapping(alpha, causal):
    """Gemma-2: ``cap * tanh(scale * q k / cap)``, then the mask; the row mapping on those scores by hand."""
    q, k, v = _qkv(hq=4, hk=4, nq=6, nk=8, grad=True)
    q_big = q * 6  # scores large enough for the cap to matter
    bias = torch.randn(1, 1, 6, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out = entmax_attention(q_big, k, v, alpha, attn_mask=bias, is_causal=causal, softcap=2.5)
    s = 2.5 * torch.tanh(q_big @ k.transpose(-1, -2) / math.sqrt(8) / 2.5) + bias
    s = s.masked_fill(~loop_keep(6, 8, causal=causal), -INF)
    p = torch.softmax(s, -1) if alpha == 1 else entmax(s, alpha, dim=-1)
    ref = p @ v
    _close(out, ref)
    for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        _close(g, r)
    assert not torch.allclose(out, entmax_attention(q_big, k, v, alpha, attn_mask=bias, is_causal=causal))


def test_softcap_zero_or_none_is_off_and_keeps_minus_inf_masking():
    q, k, v = _qkv(hq=4, hk=4)
    plain = entmax_attention(q, k, v, 1.5)
    _close(entmax_attention(q, k, v, 1.5, softcap=0.0), plain)
    _close(entmax_attention(q, k, v, 1.5, softcap=None), plain)
    keep = torch.ones(7, 9, dtype=torch.bool)
    keep[:, 4] = False
    _, w = entmax_attention_reference(q, k, v, 1.0, attn_mask=keep, softcap=1.0, return_weights=True)
    assert (w[..., 4] == 0).all()
    q_inf = q.clone()
    q_inf[0, 0, 1, 0] = INF  # +inf score: a NaN row, even though tanh would cap it
    out = entmax_attention(q_inf, k, v, 1.5, softcap=1.0)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(out[0, 0, [0, 2]]).all()


@pytest.mark.parametrize("cap", [1e300, 4e38, 1e38, 1e-46, 1e-300])
def test_softcap_at_the_ends_of_the_float_range(cap):
    """Any finite cap (docs/design.md), float32 scores with a zero row: a cap beyond float32 (it rounded to inf: NaN
    outputs) or near it (the backward overflowed) leaves the scores as they are; a cap below float32's smallest (it
    rounded to 0: NaN at zero scores) sends every score to about 0, uniform weights. Outputs and gradients finite."""
    q, k, v = _qkv(dtype=torch.float32, grad=True)
    with torch.no_grad():
        q[:, :, 2] = 0.0
    out = entmax_attention(q, k, v, 1.5, softcap=cap, enable_gqa=True)
    grads = _grads(out, (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    if cap > 1:
        want = entmax_attention(q, k, v, 1.5, enable_gqa=True)
        tol = TOL["eps_attention_kernel"][torch.float32]
        torch.testing.assert_close(out, want, atol=tol, rtol=0)
        for g, r in zip(grads, _grads(want, (q, k, v))):
            torch.testing.assert_close(g, r, atol=TOL["eps_attention_grad"][torch.float32], rtol=0)
    else:
        uniform = v.detach().mean(2, keepdim=True).repeat_interleave(2, 1).expand(out.shape)
        torch.testing.assert_close(out, uniform, atol=TOL["eps_attention_kernel"][torch.float32], rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_value_head_dim_differs_from_query_key_head_dim(causal):
    """DeepSeek-V3-style Dv != D: SDPA at alpha = 1; for alpha > 1 the output equals the first Dv columns
    of the output with v zero-padded to D (the weights do not depend on v)."""
    q, k, v = _qkv(nq=6, nk=8, d=16, dv=8, grad=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=loop_keep(6, 8, causal=causal), enable_gqa=True)
    _close(entmax_attention(q, k, v, 1.0, is_causal=causal, enable_gqa=True), sdpa)
    v_pad = torch.cat([v, torch.zeros(2, 2, 8, 8, dtype=v.dtype)], dim=-1)
    for alpha in ALPHAS[1:]:
        out = entmax_attention(q, k, v, alpha, is_causal=causal, enable_gqa=True)
        assert out.shape == (2, 4, 6, 8)
        ref = entmax_attention(q, k, v_pad, alpha, is_causal=causal, enable_gqa=True)[..., :8]
        _close(out, ref)
        for g, r in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
            _close(g, r)


# every variant of the reference route in one call (the test table's, with a boolean mask)
TOGETHER = together("reference")


def _all_variants(seed=0, dtype=torch.float64, grad=False):
    """q, k, v and the keywords of every variant of ``TOGETHER`` (the test table's rows) at once."""
    q, k, v, kwargs = build(TOGETHER, Problem(nq=7, nk=9, d=16, dtype=dtype, seed=seed, grad=grad))
    kwargs.pop("is_causal")  # the tests choose
    return q, k, v, kwargs


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_precision_inputs_match_float64(alpha, causal, dtype):
    """Every variant at once in float32 / float16 against float64 on the same (rounded) inputs."""
    q, k, v, kwargs = _all_variants(dtype=dtype)
    out = entmax_attention(q, k, v, alpha, is_causal=causal, **kwargs)
    assert out.dtype == dtype
    ref = entmax_attention(q.double(), k.double(), v.double(), alpha, is_causal=causal, **cast(kwargs, torch.float64))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_gradcheck_every_variant_and_alpha():
    q, k, v = _qkv(b=1, hq=2, hk=1, nq=4, nk=5, d=4, dv=3, grad=True)
    slopes = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.1, -0.4], dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor([1.3, 1.7], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, slopes, sinks, alpha):
        return entmax_attention(q, k, v, alpha, enable_gqa=True, is_causal=True, window_size=(2, -1),
                                alibi_slopes=slopes, sinks=sinks, softcap=1.5)

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, sinks, alpha))


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_varlen_with_variants_equals_separate_calls(alpha):
    """Windows, ALiBi (one slope row per sequence), sinks and softcap apply within each packed sequence."""
    g = torch.Generator().manual_seed(9)
    lq, lk = [3, 5, 2], [4, 5, 6]
    q = torch.randn(1, 4, sum(lq), 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, sum(lk), 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, sum(lk), 8, generator=g, dtype=torch.float64)
    slopes = torch.rand(3, 4, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 15], dtype=torch.int32)
    common = dict(is_causal=True, window_size=(2, 0), sinks=sinks, softcap=2.0, enable_gqa=True)
    out = entmax_attention(q, k, v, alpha, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes, **common)
    for s in range(3):
        qs, ks, vs = q[:, :, cu_q[s]:cu_q[s + 1]], k[:, :, cu_k[s]:cu_k[s + 1]], v[:, :, cu_k[s]:cu_k[s + 1]]
        ref = entmax_attention(qs, ks, vs, alpha, alibi_slopes=slopes[s], **common)
        _close(out[:, :, cu_q[s]:cu_q[s + 1]], ref)


@pytest.mark.parametrize("name,route", [(n, r) for n in ROWS for r in ("reference", "chunked")
                                        if ROWS[n].twin is not None and r in ROWS[n].routes])
def test_each_variant_equals_its_eager_twin(name, route, monkeypatch):
    """Each variant of the test table (with causal masking and mixed alpha per head) on each CPU route of the
    reference backend that lists it (the materialized reference; the row blocks of the chunked path, forced here
    for a small call) against its eager twin (``tests/variants.py``: the same attention in plain torch ops): forward
    and the gradients of q, k, v and of every keyword tensor that requires one. A variant with a spec field must
    change the output (no vacuous row)."""
    alpha = torch.tensor([1.0, 1.3, 1.5, 2.0], dtype=torch.float64, requires_grad=True)
    q, k, v, kw = build({name, "causal"}, Problem(grad=True))
    calls = _force_chunked(monkeypatch, q, k) if route == "chunked" else []
    out = entmax_attention(q, k, v, alpha, backend="reference", **kw)
    assert len(calls) == (route == "chunked")
    ref = eager_attention(q, k, v, alpha, **kw)
    _close(out, ref)
    leaves = (q, k, v, alpha, *(kw[n] for n in grad_leaves(kw)))
    for g, r in zip(_grads(out, leaves), _grads(ref, leaves), strict=True):
        _close(g, r)
    if ROWS[name].field is not None:
        plain = {n: t for n, t in kw.items() if n not in KEYWORDS[name]}
        assert not torch.allclose(out, eager_attention(q, k, v, alpha, **plain), atol=TOL["changed"]), name


def _force_chunked(monkeypatch, q, k) -> list:
    """Make the reference backend take the chunked route for ``q, k`` (blocks of about 4 query rows); returns the
    list its calls are recorded in."""
    calls, real = [], chunked_mod.chunked_attention
    monkeypatch.setattr("sparse_attn.attention.chunked_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(chunked_mod, "MIN_SCORES", 0)
    rows = 4 * q.shape[0] * q.shape[1] * k.shape[2] * q.element_size() * chunked_mod._BLOCK_TEMPS
    monkeypatch.setattr(chunked_mod, "BLOCK_BYTES", rows)
    return calls


def test_stats_count_real_keys_and_the_threshold_includes_the_sink():
    q, k, v = _qkv(hq=4, hk=4, nq=6, nk=8)
    sinks = torch.randn(4, dtype=torch.float64)
    _, stats = entmax_attention(q, k, v, 1.0, window_size=(2, 1), sinks=sinks, return_stats=True)
    expected_valid = loop_keep(6, 8, 2, 1).sum(-1).to(torch.int32)
    assert (stats.n_valid == expected_valid).all() and (stats.nnz == stats.n_valid).all()
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~loop_keep(6, 8, 2, 1), -INF)
    lse = torch.logsumexp(torch.cat([s, sinks.reshape(1, 4, 1, 1).expand(2, 4, 6, 1)], -1), dim=-1)
    _close(stats.tau, lse)
    _, w, stats = entmax_attention_reference(q, k, v, 1.5, sinks=sinks, return_weights=True, return_stats=True)
    assert (stats.nnz == (w > 0).sum(-1)).all() and (stats.n_valid == 8).all()
    z = 0.5 * q @ k.transpose(-1, -2) / math.sqrt(8)
    p = torch.clamp(z - stats.tau[..., None], min=0) ** 2
    _close(p, w)


_X = _qkv(d=16, dtype=torch.float32)
# (arguments, error, message)
BAD = [
    (dict(window_size=3), TypeError, "window_size must be None or a pair of ints"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be None or a pair of ints"),
    (dict(window_size=(1.0, 2)), TypeError, "window_size must be None or a pair of ints"),
    (dict(window_size=(True, 2)), TypeError, "window_size must be None or a pair of ints"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must hold ints >= -1"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be None or a floating-point tensor"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.int32)), TypeError, "alibi_slopes must be a floating-point"),
    (dict(alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes must have shape \(4,\) or \(batch, heads\)"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, r"alibi_slopes must have shape .* = \(2, 4\)"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes must be on the device of q"),
    (dict(sinks=torch.ones(2)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.ones(1, 4)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.ones(4, dtype=torch.int64)), TypeError, "sinks must be a floating-point tensor"),
    (dict(sinks=1.0), TypeError, "sinks must be None or a floating-point tensor"),
    (dict(sinks=torch.ones(4, device="meta")), ValueError, "sinks must be on the device of q"),
    (dict(softcap=-1.0), ValueError, "softcap must be None, 0 .off. or a finite positive number"),
    (dict(softcap=INF), ValueError, "softcap must be None, 0 .off. or a finite positive number"),
    (dict(softcap=float("nan")), ValueError, "softcap must be None"),
    (dict(softcap=torch.tensor(2.0)), TypeError, "softcap must be None or a Python number"),
    (dict(softcap=True), TypeError, "softcap must be None or a Python number"),
]


@pytest.mark.parametrize("row", range(len(BAD)))
@pytest.mark.parametrize("fn", ["entmax_attention", "reference"])
def test_bad_variant_arguments_raise_clear_errors(row, fn):
    kwargs, err, match = BAD[row]
    call = entmax_attention if fn == "entmax_attention" else entmax_attention_reference
    with pytest.raises(err, match=match):
        call(*_X, 1.5, enable_gqa=True, **kwargs)


def test_alibi_slopes_per_sequence_with_varlen_checked_against_nseq():
    q, k, v = _qkv(b=1, hq=4, hk=4, nq=6, nk=6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(nseq, heads\) = \(2, 4\)"):
        entmax_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, alibi_slopes=torch.ones(1, 4, dtype=q.dtype))


VARIANTS = {
    "alibi_slopes": (dict(alibi_slopes=torch.ones(4, requires_grad=True)),
                     r"alibi_slopes that require grad \(the kernels give no gradient for the slopes; detach them\)"),
    "dv": (dict(v=torch.zeros(2, 2, 9, 8)), r"v of head_dim 8 \(the kernels take value head dims in \[16, 256\]\)"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("backend", ["triton", "auto_on_cuda"])
def test_fused_path_refuses_variants_naming_them(name, backend, monkeypatch):
    """backend='triton', and 'auto' where it would pick the kernels (CUDA: simulated), raise before any
    launch, naming the argument and the remedy; nothing falls back to the dense path silently."""
    kwargs, match = VARIANTS[name]
    kwargs = dict(kwargs)
    q, k, v = _X
    v = kwargs.pop("v", v)
    if backend == "auto_on_cuda":
        monkeypatch.setattr(attn_inputs, "_on_kernel_device", lambda t: True)
    with pytest.raises(ValueError, match=match) as info:
        entmax_attention(q, k, v, 1.5, enable_gqa=True, backend=backend.removesuffix("_on_cuda"), **kwargs)
    message = str(info.value)
    assert "backend='reference'" in message and "not supported by the fused Triton kernels yet" in message


def test_several_variants_are_named_together_and_reference_or_cpu_auto_runs_them():
    q, k, _ = _X
    v = torch.randn(2, 2, 9, 8)
    kwargs = dict(window_size=(2, 2), alibi_slopes=torch.ones(4, requires_grad=True), sinks=torch.zeros(4),
                  softcap=5.0, enable_gqa=True)
    with pytest.raises(ValueError, match=r"^alibi_slopes that require grad .*; v of head_dim 8"):
        entmax_attention(q, k, v, backend="triton", **kwargs)
    _close(entmax_attention(q, k, v, backend="auto", **kwargs), entmax_attention(q, k, v, backend="reference",
                                                                                 **kwargs), tol=0)
