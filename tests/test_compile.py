"""torch.compile(fullgraph=True) of entmax_attention and EntmaxMultiheadAttention matches eager (CPU: aot_eager)."""

import pytest
import torch
import torch._dynamo
from helpers import TOL, qkv

from sparse_attn.attention import entmax_attention
from sparse_attn.mappings import entmax
from sparse_attn.modules import EntmaxMultiheadAttention
from sparse_attn.stats import record_head_stats


def _compiled(fn, fullgraph=True, dynamic=None):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic, backend="aot_eager")


def _check_fwd_bwd(fn, compiled, inputs):
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    ref = fn(*inputs)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    torch.testing.assert_close(out, ref, **TOL["same_model_f32"])
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, **TOL["same_model_f32"])


def _qkv(b=2, h=4, h_kv=2, n_q=24, n_k=32, d=16, seed=0):
    return qkv(b, h, h_kv, n_q, n_k, d, torch.float32, seed, requires_grad=True)


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_functional_reference_fullgraph(alpha):
    q, k, v = _qkv()
    keep = torch.rand(2, 1, 24, 32, generator=torch.Generator().manual_seed(1)) > 0.2

    def fn(q, k, v):
        return entmax_attention(q, k, v, alpha, attn_mask=keep, is_causal=True, enable_gqa=True, backend="reference")

    _check_fwd_bwd(fn, _compiled(fn), (q, k, v))


def test_functional_reference_float_mask_and_empty_rows_fullgraph():
    """The reference's non-finite handling (NaN-row poison, -inf exclusion) traces without graph breaks."""
    q, k, v = _qkv(h=2, h_kv=2, n_q=8, n_k=10, seed=9)
    bias = torch.randn(1, 2, 8, 10, generator=torch.Generator().manual_seed(10)).requires_grad_()
    with torch.no_grad():
        bias[:, :, 3] = float("-inf")

    def fn(q, k, v, bias):
        return entmax_attention(q, k, v, 1.3, attn_mask=bias, backend="reference")

    _check_fwd_bwd(fn, _compiled(fn), (q, k, v, bias))


@pytest.mark.parametrize("need_weights", [False, True])
def test_module_fullgraph_fixed_alpha(need_weights):
    torch.manual_seed(2)
    mod = EntmaxMultiheadAttention(32, 4, alpha=1.5, batch_first=True)
    x = torch.randn(2, 12, 32, requires_grad=True)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, -3:] = True

    def fn(x):
        return mod(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0]

    _check_fwd_bwd(fn, _compiled(fn), (x,))


def test_head_stats_recorded_inside_fullgraph():
    torch.manual_seed(5)
    mod = EntmaxMultiheadAttention(32, 4, alpha=2.0)
    model = torch.nn.ModuleDict({"attn": mod})
    x = torch.randn(9, 2, 32)

    def fn(x):
        return mod(x, x, x, need_weights=False, is_causal=True)[0]

    with record_head_stats(model) as eager_rec:
        fn(x)
    compiled = _compiled(fn)
    with record_head_stats(model) as rec:
        compiled(x)
        compiled(x)
    torch.testing.assert_close(rec.density(), eager_rec.density())
    assert (rec.density() < 1).any()
    assert rec._sinks[0].calls == 2


def test_entmax_per_row_alpha_fullgraph():
    """Per-row alphas (exact values 1, 1.5, 2 and solver values) trace branch-free and match eager."""
    g = torch.Generator().manual_seed(6)
    x = (3 * torch.randn(8, 3, 17, generator=g)).requires_grad_()
    with torch.no_grad():
        x[0, 0, :5] = -float("inf")
        x[1, 2] = -float("inf")
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.2, 1.75, 1.999, 0.7, 3.0]).reshape(8, 1, 1).requires_grad_()

    def fn(x, alpha):
        return entmax(x, alpha, dim=-1)

    _check_fwd_bwd(fn, _compiled(fn), (x, alpha))


def test_functional_reference_learnable_per_head_alpha_fullgraph():
    q, k, v = _qkv(h=4, h_kv=4, n_q=12, n_k=20, seed=7)
    alpha = torch.tensor([1.2, 1.5, 1.8, 2.0], requires_grad=True)
    keep = torch.rand(2, 1, 12, 20, generator=torch.Generator().manual_seed(8)) > 0.3

    def fn(q, k, v, alpha):
        return entmax_attention(q, k, v, alpha, attn_mask=keep, is_causal=True, backend="reference")

    _check_fwd_bwd(fn, _compiled(fn), (q, k, v, alpha))


def test_module_learnable_alpha_compiles_on_reference():
    """Per-head learnable alphas go through the row-wise solver with a fixed iteration count."""
    torch.manual_seed(3)
    mod = EntmaxMultiheadAttention(32, 4, learnable=True, alpha_init=torch.tensor([1.2, 1.5, 1.7, 1.9]))
    x = torch.randn(10, 2, 32)

    def fn(x):
        return mod(x, x, x, need_weights=False, is_causal=True)[0]

    ref = fn(x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), mod.alpha_logit)
    out = _compiled(fn)(x)
    (g,) = torch.autograd.grad(out.square().sum(), mod.alpha_logit)
    torch.testing.assert_close(out, ref, **TOL["same_model_f32"])
    torch.testing.assert_close(g, g_ref, **TOL["same_model_f32"])


def test_functional_reference_dynamic_shapes_fullgraph():
    """dynamic=True: symbolic sequence lengths reach the alpha shape check and the iterative solver's tolerance
    (a per-head tensor alpha runs the solver) without graph breaks; one graph serves the later lengths."""
    alpha = torch.tensor([1.3, 2.0], requires_grad=True)

    def fn(q, k, v, alpha):
        return entmax_attention(q, k, v, alpha, is_causal=True, backend="reference")

    compiled = _compiled(fn, dynamic=True)
    for n in (12, 17, 24):
        q, k, v = _qkv(b=1, h=2, h_kv=2, n_q=n, n_k=n, d=8, seed=n)
        _check_fwd_bwd(fn, compiled, (q, k, v, alpha))


def test_python_alpha_and_dropout_as_arguments_fullgraph():
    """Python floats passed to a compiled function become symbolic after a call with another value (and from the
    start with dynamic=True): each alpha still gets its own graph, and a dropout_p argument traces."""

    def fn(q, k, v, alpha, dropout_p):
        return entmax_attention(q, k, v, alpha, dropout_p=dropout_p, is_causal=True, backend="reference")

    for dynamic in (None, True):
        compiled = _compiled(fn, dynamic=dynamic)
        for alpha in (1.5, 1.7, 1.0, 2.0):
            _check_fwd_bwd(fn, compiled, (*_qkv(h=2, h_kv=2, seed=11), alpha, 0.0))


def _check_dropout_replayed(backend, device, sizes, dynamic):
    """Compiled dropout: with v the identity the output is the dropped weights, so dv = out^T @ dout holds only if the
    backward applies the forward's mask; a second call draws another mask."""

    def fn(q, k, v):
        return entmax_attention(q, k, v, 1.5, dropout_p=0.4, backend=backend)

    compiled = _compiled(fn, dynamic=dynamic)
    g = torch.Generator().manual_seed(12)
    for n in sizes:
        q, k = (torch.randn(1, 2, n, n, generator=g).to(device).requires_grad_() for _ in range(2))
        v = torch.eye(n, device=device).expand(1, 2, n, n).clone().requires_grad_()
        d_out = torch.randn(1, 2, n, n, generator=g).to(device)
        out = compiled(q, k, v)
        (out * d_out).sum().backward()
        assert (out == 0).any()
        assert not torch.equal(compiled(q, k, v), out)
        torch.testing.assert_close(v.grad, out.detach().transpose(-1, -2) @ d_out, **TOL["same_model_f32"])


def test_dropout_dynamic_shapes_replays_mask_in_backward():
    """Reference dropout under dynamic=True (symbolic sizes reach the mask's draw)."""
    _check_dropout_replayed("reference", "cpu", (8, 12), dynamic=True)


@pytest.mark.parametrize("dynamic", [None, True])
def test_fused_dropout_fullgraph(kernel_device, dynamic):
    """The fused forward's dropout seed, drawn in the graph, reaches the custom ops as a symbolic int."""
    _check_dropout_replayed("triton", kernel_device, (16, 20), dynamic=dynamic)


@pytest.mark.parametrize("alpha", [1.5, torch.tensor([1.2, 1.5, 1.8, 2.0])])
def test_module_dynamic_shapes_fullgraph(alpha):
    """A module's float attributes (a fixed alpha, dropout) are symbolic under dynamic=True."""
    torch.manual_seed(13)
    mod = EntmaxMultiheadAttention(32, 4, alpha=alpha, dropout=0.1, batch_first=True).eval()

    def fn(x):
        return mod(x, x, x, need_weights=False, is_causal=True)[0]

    compiled = _compiled(fn, dynamic=True)
    for n in (5, 9, 14):
        _check_fwd_bwd(fn, compiled, (torch.randn(2, n, 32, requires_grad=True),))
    mod.train()
    x = torch.randn(2, 7, 32, requires_grad=True)
    (grad,) = torch.autograd.grad(compiled(x).square().sum(), x)
    assert torch.isfinite(grad).all()


def test_functional_and_module_fullgraph_fused(kernel_device):
    q, k, v = (t.detach().to(kernel_device).requires_grad_() for t in _qkv(b=1, h=2, h_kv=1, n_q=20, n_k=40))
    alpha = torch.tensor([1.3, 2.0], device=kernel_device, requires_grad=True)

    def fn(q, k, v, alpha):
        return entmax_attention(q, k, v, alpha, is_causal=True, enable_gqa=True, backend="triton")

    _check_fwd_bwd(fn, _compiled(fn), (q, k, v, alpha))

    torch.manual_seed(4)
    mod = EntmaxMultiheadAttention(32, 2, learnable=True, alpha_init=torch.tensor([1.4, 1.8]),
                                   batch_first=True, backend="triton", device=kernel_device)
    x = torch.randn(1, 20, 32, device=kernel_device, requires_grad=True)

    def run(x):
        return mod(x, x, x, need_weights=False, is_causal=True)[0]

    _check_fwd_bwd(run, _compiled(run), (x,))
