"""Huge finite scores: a constant added to a row (through an additive mask) changes nothing beyond the rounding of
the shifted scores, on every attention route (fused forward and backward, decode with its split-K merge, the CPU
path) and in the row kernels; ``finfo.min`` padding rows come out uniform, ``+1e30`` entries take the whole weight;
soft caps of any size match the float64 reference.

The oracle is the float64 attention of the scores as the kernels round them. ``q`` and ``k`` hold small dyadic
numbers (multiples of 1/8), so ``scale * q.k`` is exact in every dtype, in the kernels' products and here, and the
masked score ``fl32(s + c)`` (one rounding, as the kernels and the CPU path form it; ``(alpha - 1)`` is a power of
two for every alpha tested, so the z-scale rounds alike) is computed here exactly. The weights are the float64
entmax of those scores taken relative to their row max (exact near it), so the oracle depends on ``c`` only through
that rounding: for large ``|c|`` every score of a row rounds to one value and the row is uniform. Arithmetic that
sees the magnitude of the shifted scores (a threshold or a bracket in absolute terms) misses it by far more than the
tolerances, so these tests fail on such kernels (they did: NaN rows from ``-1e30`` on, errors of 1e-3 at ``1e4``).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    BF16,
    F16,
    F32,
    F64,
    TOL,
    assert_close_to_ref,
    bf16_toward_zero,
    entmax_vjp,
    gen,
    reference_entmax,
)

from sparse_attn import entmax, entmax_attention
from sparse_attn.kernels.rows.row_entmax import (
    MODE_ENTMAX15,
    MODE_GENERAL,
    MODE_SOFTMAX,
    MODE_SPARSEMAX,
    entmax_rows_fwd,
)

SCALE = 0.25
DTYPES = (F32, BF16, F16)
ALPHAS = {"1": 1.0, "1.25": 1.25, "1.5": 1.5, "2": 2.0, "mixed": (1.0, 1.25, 1.5, 2.0)}
# (Nq, Nk) and whether gradients are taken: the fused path, and a decoding step (the decode kernels on "triton")
ROUTES = {"fused": ((40, 44), True), "decode": ((8, 100), False)}


def _row_constants(dtype) -> tuple:
    """The constants added to the rows (cycled over them): none, +-1e4, +-1e10, +-1e30 and the dtype's ``finfo.min``
    (the padding idiom), as float32 values (the masks are float32: a float16 mask cannot hold 1e10)."""
    return (0.0, 1e4, -1e4, 1e10, -1e10, 1e30, -1e30, torch.finfo(dtype).min)


def _alpha(key: str):
    """``(alpha for the call, float64 alpha per head broadcastable to (B, H, Nq, 1), number of heads)``."""
    a = ALPHAS[key]
    if isinstance(a, tuple):
        return torch.tensor(a, dtype=F32), torch.tensor(a, dtype=F64).view(1, -1, 1, 1), len(a)
    return a, torch.tensor(a, dtype=F64).view(1, 1, 1, 1), 2


def _dyadic(shape, g) -> torch.Tensor:
    """float64 multiples of 1/8 in [-1, 1]: exact in float16 / bfloat16 / float32, and so are their dot products."""
    return torch.randint(-8, 9, shape, generator=g).to(F64) / 8


def _problem(nq: int, nk: int, alpha_key: str, dtype, causal: bool, seed: int, entries: bool = False):
    """Inputs and a float32 mask ``(1, H, nq, nk)``: random ``-inf`` exclusions (row 0: every key) plus, per row, one
    of :func:`_row_constants` (``entries``: instead a random ``+-1e30`` at every entry, a few ``+1e30`` per row)."""
    alpha, alpha64, heads = _alpha(alpha_key)
    g = gen(seed)
    q64, k64 = _dyadic((1, heads, nq, 16), g), _dyadic((1, heads, nk, 16), g)
    v64 = torch.randn(1, heads, nk, 16, generator=g, dtype=F64)
    keep = torch.rand(1, heads, nq, nk, generator=g) < 0.85
    keep[:, :, 0] = False  # a row without keys: zeros, zero gradients
    if entries:
        add = torch.where(torch.rand(1, heads, nq, nk, generator=g) < 0.1, 1e30, -1e30)
    else:
        rows = torch.tensor(_row_constants(dtype), dtype=F64)
        add = rows[torch.arange(nq) % len(rows)].view(1, 1, nq, 1).expand(1, heads, nq, nk)
    mask = torch.where(keep, add, -math.inf).to(F32)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    do = torch.randn(1, heads, nq, 16, generator=g, dtype=F64).to(dtype)
    return dict(q=q, k=k, v=v, mask=mask, alpha=alpha, alpha64=alpha64, causal=causal, do=do)


def _oracle(p: dict) -> dict:
    """float64 output and gradients of the scores the kernels see: ``fl32(scale q.k + mask)``, causal ``-inf``."""
    q, k, v, do = (p[name].to(F64) for name in ("q", "k", "v", "do"))
    s = q @ k.transpose(-1, -2) * SCALE  # exact (dyadic)
    s32 = (s.to(F32) + p["mask"]).to(F64)  # one float32 rounding of the masked score
    nq, nk = s.shape[-2:]
    if p["causal"]:
        visible = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        s32 = s32.masked_fill(~visible, -math.inf)
    top = s32.amax(-1, keepdim=True)
    rel = s32 - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # exact near the max
    w = reference_entmax(rel, p["alpha64"])
    ds = entmax_vjp(w, do @ v.transpose(-1, -2), p["alpha64"])
    return dict(out=w @ v, q=SCALE * ds @ k, k=SCALE * ds.transpose(-1, -2) @ q, v=w.transpose(-1, -2) @ do, mask=ds)


def _run(p: dict, device, backend: str, grad: bool) -> dict:
    """The library's output (and gradients of q, k, v and the mask) on ``device`` through ``backend``."""
    leaves = {name: p[name].to(device).requires_grad_(grad) for name in ("q", "k", "v", "mask")}
    alpha = p["alpha"].to(device) if isinstance(p["alpha"], torch.Tensor) else p["alpha"]
    out = entmax_attention(leaves["q"], leaves["k"], leaves["v"], alpha, attn_mask=leaves["mask"],
                           is_causal=p["causal"], scale=SCALE, backend=backend)
    got = {"out": out.detach().cpu()}
    if grad:
        out.backward(p["do"].to(device))
        got.update({name: t.grad.cpu() for name, t in leaves.items()})
    return got


def _check(got: dict, want: dict, dtype) -> None:
    """Outputs by the tolerance rule (baseline: the float64 result rounded to ``dtype``, to nearest and, for the
    interpreter's bfloat16 stores, toward zero); gradients relative to ``max(1, max |float64 gradient|)``."""
    bases = [want["out"].to(dtype)] + ([bf16_toward_zero(want["out"])] if dtype == BF16 else [])
    assert_close_to_ref(got["out"], want["out"], bases, eps=TOL["eps_attention_kernel"][dtype])
    for name in set(got) - {"out"}:
        g, g64 = got[name].double(), want[name]
        assert torch.isfinite(g).all(), f"d{name}: not finite"
        err = float((g - g64).abs().max() / g64.abs().max().clamp_min(1.0))
        assert err <= TOL["eps_attention_grad"][dtype], f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_key", list(ALPHAS))
def test_kernels_row_constants(alpha_key, dtype, causal, route, kernel_device):
    """Every row constant, every alpha: the fused forward and backward (a sequence longer than one tile) and the
    decode kernels (8 queries against 100 keys: several splits, merged with their own reference scores)."""
    shape, grad = ROUTES[route]
    p = _problem(*shape, alpha_key, dtype, causal, seed=1)
    _check(_run(p, kernel_device, "triton", grad=grad), _oracle(p), dtype)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_key", list(ALPHAS))
def test_cpu_path_row_constants(alpha_key, dtype, causal, route):
    """The CPU path (``backend="auto"`` on CPU tensors) at both shapes, forward and backward, against the same
    oracle."""
    p = _problem(*ROUTES[route][0], alpha_key, dtype, causal, seed=3)
    _check(_run(p, "cpu", "auto", grad=True), _oracle(p), dtype)


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("alpha_key", list(ALPHAS))
def test_random_plus_minus_1e30_entries(alpha_key, route, backend, kernel_device):
    """A mask of random ``+-1e30`` entries: each row is uniform over its ``+1e30`` keys (the ties of the rounded
    scores), on the fused / decode kernels and the CPU path."""
    shape, grad = ROUTES[route]
    p = _problem(*shape, alpha_key, F32, False, seed=4, entries=True)
    device = kernel_device if backend == "triton" else "cpu"
    _check(_run(p, device, backend, grad=grad), _oracle(p), F32)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_one_plus_1e30_key_is_one_hot(alpha, route, kernel_device):
    """A single ``+1e30`` key takes the whole weight: the row's output is that key's value row, its gradients
    finite."""
    (nq, nk), grad = ROUTES[route]
    g = gen(5)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (nq, nk, nk))
    mask = torch.zeros(1, 2, nq, nk)
    hot = torch.randint(0, nk, (nq,), generator=g)
    mask[0, :, torch.arange(nq), hot] = 1e30
    leaves = [t.to(kernel_device).requires_grad_(grad) for t in (q, k, v)]
    out = entmax_attention(*leaves, alpha, attn_mask=mask.to(kernel_device), backend="triton")
    assert torch.equal(out.detach().cpu(), v[0, :, hot][None])
    if grad:
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_issue_reproducer_padding_row_is_uniform(kernel_device):
    """The issue's reproducer: a query row fully padded with ``finfo.min`` gives the mean of the values (uniform
    weights), as the reference, for every alpha, on the fused kernels and the decode kernels."""
    g = gen(6)
    for nk in (4, 20):  # 4 keys: the fused forward; 20 keys for 4 queries: the decode kernels
        q = torch.randn(1, 1, 4, 16, generator=g)
        k, v = torch.randn(1, 1, nk, 16, generator=g), torch.randn(1, 1, nk, 16, generator=g)
        m = torch.zeros(4, nk)
        m[0] = torch.finfo(torch.float32).min
        for alpha in (1.0, 1.25, 1.5, 2.0):
            out = entmax_attention(*(t.to(kernel_device) for t in (q, k, v)), alpha, attn_mask=m.to(kernel_device),
                                   backend="triton").cpu()
            ref = entmax_attention(q, k, v, alpha, attn_mask=m, backend="reference")
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out[0, 0, 0], v[0, 0].mean(0), atol=TOL["same_values"][F32], rtol=0)
            torch.testing.assert_close(out, ref, atol=TOL["fused_vs_reference_f32"]["out"], rtol=0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_two_layer_model_with_left_padding(dtype, kernel_device):
    """The ``masked_fill(~keep, finfo(dtype).min)`` padding idiom in two stacked causal attention layers with a
    4-token left padding: no NaN anywhere (the padded query rows are uniform over padded keys), outputs and weight
    gradients as the reference backend's."""
    g = gen(7)
    b, h, n, d = 2, 2, 24, 16
    x = torch.randn(b, n, h * d, generator=g, dtype=F64)
    weights = [torch.randn(h * d, 3 * h * d, generator=g, dtype=F64) / (h * d) ** 0.5 for _ in range(2)]
    pad = torch.arange(n) < 4  # left padding of both sequences
    keep = ~pad[None, :] & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
    alpha = torch.tensor([1.5, 1.25])

    def model(backend, device):
        w = [t.to(device, dtype).requires_grad_() for t in weights]
        mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~keep.to(device), torch.finfo(dtype).min)
        y = x.to(device, dtype)
        for wl in w:
            qkv = (y @ wl).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
            y = y + entmax_attention(qkv[0], qkv[1], qkv[2], alpha.to(device), attn_mask=mask,
                                     backend=backend).transpose(1, 2).reshape(b, n, h * d)
        y.square().mean().backward()
        return y.detach().cpu().double(), [t.grad.cpu().double() for t in w]

    out, grads = model("triton", kernel_device)
    out_ref, grads_ref = model("reference", "cpu")
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)
    tol = TOL["fused_vs_reference_f32"] if dtype == F32 else {"out": 4 * TOL["eps_attention_kernel"][BF16],
                                                              "grad": 4 * TOL["eps_attention_grad"][BF16]}
    torch.testing.assert_close(out, out_ref, atol=tol["out"], rtol=tol["out"])
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=tol["grad"], rtol=tol["grad"])


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_softcap_sweep(alpha, route, kernel_device):
    """Soft caps from 1 to 1e30 match the float64 reference by the tolerance rule (baseline: the reference in float32,
    whose ``tanh`` is accurate): the cap's ``tanh`` keeps its relative accuracy for small arguments. Fused: output and
    gradients; decode: output."""
    (nq, nk), grad = ROUTES[route]
    g = gen(8)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=F64) * 2 for n in (nq, nk, nk))
    for cap in (1.0, 30.0, 1e2, 1e4, 1e6, 1e30):
        leaves = [t.float().to(kernel_device).requires_grad_(grad) for t in (q, k, v)]
        out = entmax_attention(*leaves, alpha, softcap=cap, backend="triton")
        ref64 = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        want = entmax_attention(*ref64, alpha, softcap=cap, backend="reference")
        ref32 = entmax_attention(q.float(), k.float(), v.float(), alpha, softcap=cap, backend="reference")
        assert_close_to_ref(out.detach().cpu(), want.detach(), ref32, eps=TOL["eps_attention_kernel"][F32],
                            name=f"out at softcap {cap:g}")
        if grad:
            do = torch.randn(out.shape, generator=g, dtype=F64)
            out.backward(do.float().to(kernel_device))
            want.backward(do)
            for got, w64 in zip(leaves, ref64):
                err = float((got.grad.cpu().double() - w64.grad).abs().max() / w64.grad.abs().max().clamp_min(1.0))
                assert err <= TOL["eps_attention_grad"][F32], f"grad at softcap {cap:g}: {err:.3g}"


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("mode,alpha", [(MODE_SOFTMAX, 1.0), (MODE_SPARSEMAX, 2.0), (MODE_ENTMAX15, 1.5),
                                        (MODE_GENERAL, 1.25)], ids=["softmax", "sparsemax", "entmax15", "general"])
def test_row_kernels_row_constants(mode, alpha, dtype, kernel_device):
    """The Triton row kernels (long rows, several chunks) on rows shifted by the constants of :func:`_row_constants`
    (those the dtype holds): the float64 entmax of the rounded rows, relative to their max."""
    consts = torch.tensor([c for c in _row_constants(dtype) if abs(c) <= torch.finfo(dtype).max], dtype=F64)
    g = gen(9)
    x64 = _dyadic((len(consts) * 2, 300), g) * 4
    x = (x64 + consts.repeat(2)[:, None]).to(dtype)  # one rounding, in the row's dtype
    y = entmax_rows_fwd(x.to(kernel_device), alpha, mode, block=64).cpu()
    xr = x.to(F64)
    want = reference_entmax(xr - xr.amax(-1, keepdim=True), alpha)
    bases = [want.to(dtype)] + ([bf16_toward_zero(want)] if dtype == BF16 else [])
    assert_close_to_ref(y, want, bases, eps=TOL["lowp_vs_f64"][dtype])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_mappings_cpu_row_constants(alpha, dtype):
    """The mappings' CPU path (``sparse_attn.entmax``) on the same shifted rows, output and gradient."""
    consts = torch.tensor(_row_constants(dtype), dtype=F64)
    g = gen(10)
    x = (_dyadic((len(consts), 50), g) * 4 + consts[:, None]).to(dtype).requires_grad_()
    y = entmax(x, alpha)
    xr = x.detach().to(F64)
    want = reference_entmax(xr - xr.amax(-1, keepdim=True), alpha)
    assert_close_to_ref(y.detach(), want, eps=TOL["eps_mapping"] if dtype == F32 else TOL["lowp_vs_f64"][dtype])
    dy = torch.randn(x.shape, generator=g, dtype=F64)
    y.backward(dy.to(dtype))
    dx64 = entmax_vjp(want, dy, alpha)
    err = float((x.grad.double() - dx64).abs().max() / dx64.abs().max().clamp_min(0.1))
    assert err <= TOL["rows_dx"][dtype], f"dx: {err:.3g}"


@pytest.mark.gpu
def test_gpu_issue_reproducer():
    """The issue's reproducer on CUDA (the default backend there is the Triton kernels): row 0, fully padded with
    ``finfo.min``, is the mean of the values."""
    q = k = v = torch.randn(1, 1, 4, 16, device="cuda")
    m = torch.zeros(4, 4, device="cuda")
    m[0] = torch.finfo(torch.float32).min
    for alpha in (1.0, 1.25, 1.5, 2.0):
        out = entmax_attention(q, k, v, alpha, attn_mask=m)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[0, 0, 0], v[0, 0].mean(0), atol=TOL["same_values"][F32], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha_key", list(ALPHAS))
def test_gpu_row_constants(alpha_key, dtype, causal):
    """The property on CUDA tensors at a GPU tile size: the fused forward and backward (a few hundred rows) and the
    decode kernels (16 queries against 2000 keys, many splits)."""
    p = _problem(300, 320, alpha_key, dtype, causal, seed=11)
    _check(_run(p, "cuda", "triton", grad=True), _oracle(p), dtype)
    p = _problem(16, 2000, alpha_key, dtype, causal, seed=12)
    _check(_run(p, "cuda", "triton", grad=False), _oracle(p), dtype)
