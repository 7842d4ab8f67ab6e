"""The public entmax_attention: argument validation and the reference backend (the oracle).

The reference is checked here against computations that do not share its code path:
SDPA at alpha = 1, and a per-row bisection written in this file for alpha > 1.
"""

import pytest
import torch
import torch.nn.functional as F

from sparse_attn.attention import entmax_attention
from sparse_attn.reference import causal_keep


def _bisect_entmax(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """Row-wise alpha-entmax of a float64 matrix by plain bisection on tau (independent oracle)."""
    z = (alpha - 1) * s
    lo = z.max(-1, keepdim=True).values - 1
    hi = z.max(-1, keepdim=True).values
    for _ in range(200):
        mid = (lo + hi) / 2
        f = torch.clamp(z - mid, min=0) ** (1 / (alpha - 1))
        big = f.sum(-1, keepdim=True) > 1
        lo = torch.where(big, mid, lo)
        hi = torch.where(big, hi, mid)
    p = torch.clamp(z - lo, min=0) ** (1 / (alpha - 1))
    return p / p.sum(-1, keepdim=True)


def _qkv(b=2, hq=4, hk=4, nq=9, nk=11, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_reference_alpha1_is_softmax_attention(causal):
    q, k, v = _qkv(nq=7, nk=7)
    mask = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    out = entmax_attention(q, k, v, alpha=1.0, attn_mask=mask, is_causal=causal)
    full = mask & causal_keep(7, 7, "cpu") if causal else mask
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0])
def test_reference_matches_bisection(alpha):
    q, k, v = _qkv(hk=2, nq=5, nk=13)
    bias = torch.randn(1, 4, 5, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, stats = entmax_attention(q, k, v, alpha, attn_mask=bias, enable_gqa=True, scale=0.7, return_stats=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    p = _bisect_entmax(0.7 * q @ kk.transpose(-1, -2) + bias, alpha)
    torch.testing.assert_close(out, p @ vv, rtol=1e-7, atol=1e-8)
    # support agrees away from ties (keys whose weight is below 1e-9 may fall either way)
    assert (stats.nnz >= (p > 1e-9).sum(-1)).all() and (stats.nnz <= (p > 0).sum(-1)).all()
    assert torch.equal(stats.n_valid, torch.full_like(stats.n_valid, 13))
    # tau reproduces the weights: p = [(alpha-1) s - tau]_+^(1/(alpha-1))
    s = 0.7 * q @ kk.transpose(-1, -2) + bias
    p_tau = torch.clamp((alpha - 1) * s - stats.tau[..., None], min=0) ** (1 / (alpha - 1))
    torch.testing.assert_close(p_tau, p, rtol=1e-6, atol=1e-9)


def test_reference_per_head_alpha_and_bottom_right_causal():
    q, k, v = _qkv(hq=3, hk=3, nq=4, nk=9)
    alpha = torch.tensor([1.0, 1.5, 2.0], dtype=torch.float64)
    out = entmax_attention(q, k, v, alpha, is_causal=True)
    keep = causal_keep(4, 9, "cpu")
    assert keep[0].sum() == 6 and keep[-1].all()
    s = (q @ k.transpose(-1, -2)) * 8**-0.5
    s = s.masked_fill(~keep, float("-inf"))
    for h, a in enumerate([1.0, 1.5, 2.0]):
        p = torch.softmax(s[:, h], -1) if a == 1.0 else _bisect_entmax(s[:, h], a)
        torch.testing.assert_close(out[:, h], p @ v[:, h], rtol=1e-7, atol=1e-8)


def test_reference_varlen_equals_separate_calls():
    g = torch.Generator().manual_seed(3)
    lens_q = [3, 0, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    q = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    out = entmax_attention(q, k, v, 1.5, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for s in range(3):
        if lens_q[s] == 0:
            continue
        qs = q[:, :, cu_q[s]:cu_q[s + 1]]
        ks, vs = k[:, :, cu_k[s]:cu_k[s + 1]], v[:, :, cu_k[s]:cu_k[s + 1]]
        torch.testing.assert_close(out[:, :, cu_q[s]:cu_q[s + 1]], entmax_attention(qs, ks, vs, 1.5, is_causal=True))


def test_reference_fully_masked_rows_give_zeros_and_zero_grads():
    q, k, v = _qkv(nq=4, nk=5)
    q.requires_grad_(True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    for alpha in (1.0, 1.5, 2.0, 1.3):
        out, stats = entmax_attention(q, k, v, alpha, attn_mask=mask, return_stats=True)
        assert torch.isfinite(out).all()
        assert (out[:, :, 2] == 0).all()
        assert (stats.nnz[:, :, 2] == 0).all() and torch.isinf(stats.tau[:, :, 2]).all()
        (g,) = torch.autograd.grad(out.sum(), q)
        assert torch.isfinite(g).all() and (g[:, :, 2] == 0).all()


def test_reference_gradcheck_inputs_alpha_and_bias():
    q, k, v = _qkv(b=1, hq=2, hk=2, nq=3, nk=5, d=4)
    alpha = torch.tensor([1.3, 1.7], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, 3, 5, dtype=torch.float64, requires_grad=True)
    for t in (q, k, v):
        t.requires_grad_(True)

    def fn(q, k, v, alpha, bias):
        return entmax_attention(q, k, v, alpha, attn_mask=bias, is_causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, alpha, bias), eps=1e-6, atol=1e-5)


def test_transposed_layout_is_accepted():
    q, k, v = _qkv()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    torch.testing.assert_close(entmax_attention(qt, k, v), entmax_attention(q, k, v))


def test_backend_auto_on_cpu_uses_reference(monkeypatch):
    import sparse_attn._attn_autograd as fused

    def fail(*args, **kwargs):
        raise AssertionError("backend='auto' on CPU tensors must not take the fused path")

    monkeypatch.setattr(fused, "fused_entmax_attention", fail)
    q, k, v = (t.float() for t in _qkv())
    out = entmax_attention(q, k, v, backend="auto")
    torch.testing.assert_close(out, entmax_attention(q, k, v, backend="reference"), rtol=0, atol=0)
    assert out.dtype == torch.float32


def test_backend_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.float() for t in _qkv(d=16))
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        entmax_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.3])
def test_reference_without_keys_gives_zeros_and_gradients(alpha):
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    out, stats = entmax_attention(q, k, v, alpha, return_stats=True)
    assert out.shape == (1, 2, 4, 8) and (out == 0).all()
    assert (stats.nnz == 0).all() and (stats.n_valid == 0).all() and torch.isinf(stats.tau).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    # packed sequences that all have no keys
    q1 = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32)
    out = entmax_attention(q1, k, v, alpha, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out.sum().backward()
    assert (out == 0).all() and (q1.grad == 0).all()


def test_reference_softmax_support_counts_every_valid_key():
    q, k, v = _qkv(hq=2, hk=2, nq=3, nk=6)
    q = q * 60  # exp underflows for most keys, yet softmax gives each of them a positive weight
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[:, 4:] = False
    _, stats = entmax_attention(q, k, v, torch.tensor([1.0, 2.0], dtype=torch.float64), attn_mask=mask, return_stats=True)
    assert (stats.nnz[:, 0] == 4).all() and (stats.n_valid == 4).all()
    assert (stats.nnz[:, 1] < 4).any()


def test_alpha_tensor_dtype_and_shape_variants():
    q, k, v = _qkv(hq=4, hk=4)
    base = entmax_attention(q, k, v, 1.5)
    for alpha in (torch.tensor(1.5), torch.tensor([1.5]), torch.full((4,), 1.5, dtype=torch.float16)):
        torch.testing.assert_close(entmax_attention(q, k, v, alpha), base)


_BAD = [
    (dict(q="x"), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(2, 4, 9)), ValueError, "q must have shape"),
    (dict(q=torch.zeros(2, 4, 9, 8, dtype=torch.int64)), TypeError, "q must be float16"),
    (dict(k=torch.zeros(2, 4, 11, 8, dtype=torch.float32)), TypeError, "share one dtype"),
    (dict(v=torch.zeros(2, 4, 12, 8, dtype=torch.float64)), ValueError, "k and v must agree in"),
    (dict(q=torch.zeros(3, 4, 9, 8, dtype=torch.float64)), ValueError, "same batch size"),
    (dict(q=torch.zeros(2, 4, 9, 6, dtype=torch.float64)), ValueError, "same head_dim"),
    (dict(q=torch.zeros(2, 5, 9, 8, dtype=torch.float64), enable_gqa=True, kv_heads=2), ValueError, "multiple of the number of k/v heads"),
    (dict(kv_heads=2), ValueError, "enable_gqa=True"),
    (dict(alpha=0.5), ValueError, "alpha must be finite and in \\[1, 2\\]"),
    (dict(alpha=2.5), ValueError, "alpha must be finite and in \\[1, 2\\]"),
    (dict(alpha=float("nan")), ValueError, "alpha must be finite"),
    (dict(alpha=torch.tensor([1.5, 1.2, 3.0, 1.0])), ValueError, "alpha must be finite and in \\[1, 2\\]"),
    (dict(alpha=torch.tensor([1.5, 1.2])), ValueError, "alpha must be a float or a tensor of shape"),
    (dict(alpha=torch.tensor([1, 2, 1, 2])), TypeError, "floating-point tensor"),
    (dict(alpha="1.5"), TypeError, "alpha must be a float or a tensor"),
    (dict(attn_mask=torch.zeros(2, 4, 9, 10, dtype=torch.bool)), ValueError, "attn_mask must be broadcastable"),
    (dict(attn_mask=torch.zeros(9, 11, dtype=torch.int32)), TypeError, "attn_mask must be boolean"),
    (dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be finite and in \\[0, 1\\)"),
    (dict(scale=float("inf")), ValueError, "scale must be None or a finite number"),
    (dict(scale=torch.tensor(0.5)), TypeError, "scale must be None or a Python number"),
    (dict(enable_gqa="no"), TypeError, "enable_gqa must be a bool"),
    (dict(return_stats=1), TypeError, "return_stats must be a bool"),
    (dict(is_causal=None), TypeError, "is_causal must be a bool"),
    (dict(attn_mask=torch.zeros(9, 11).index_fill(1, torch.tensor([3]), float("nan")), backend="triton", fused=True),
     ValueError, "float attn_mask must be finite or -inf"),
    (dict(attn_mask=torch.zeros(9, 11).index_fill(1, torch.tensor([3]), float("inf")), backend="triton", fused=True),
     ValueError, "float attn_mask must be finite or -inf"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend="triton"), TypeError, "the triton backend takes float16"),
    (dict(cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "must be given together"),
]


@pytest.mark.parametrize("kwargs,err,match", _BAD)
def test_bad_arguments_raise_clear_errors(kwargs, err, match):
    kwargs = dict(kwargs)
    kv_heads = kwargs.pop("kv_heads", 4)
    fused = kwargs.pop("fused", False)
    q, k, v = _qkv(hq=4, hk=kv_heads, d=16 if fused else 8, dtype=torch.float32 if fused else torch.float64)
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(err, match=match):
        entmax_attention(args["q"], args["k"], args["v"], **kwargs)


@pytest.mark.parametrize(
    "cu_q,cu_k,match",
    [
        ([0, 4, 9], [0, 11], "same number of sequences"),
        ([0, 4, 8], [0, 5, 11], "end at the packed length 9"),
        ([1, 4, 9], [0, 5, 11], "start at 0"),
        ([0, 6, 4, 9], [0, 5, 5, 11], "non-decreasing"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, match):
    q, k, v = _qkv(b=1)
    with pytest.raises(ValueError, match=match):
        entmax_attention(q, k, v, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32))


def test_cu_seqlens_needs_batch_one_and_int_dtype():
    q, k, v = _qkv(b=2)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch size 1"):
        entmax_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    q, k, v = _qkv(b=1)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-d int32"):
        entmax_attention(q, k, v, cu_seqlens_q=torch.tensor([0.0, 9.0]), cu_seqlens_k=torch.tensor([0, 11]))
