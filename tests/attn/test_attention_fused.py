"""End to end: ``entmax_attention(..., backend="triton")`` (custom ops + autograd) vs the float64 reference.

The kernels themselves are tested in test_attention_fwd.py / test_attention_bwd.py; here the
public function is exercised as a user would, forward and backward through ``torch.autograd``,
on CPU tensors under the Triton interpreter (on a GPU, on CUDA tensors).
"""

import dataclasses

import pytest
import torch
from helpers import F32, TOL, assert_close_to_ref
from variants import ROWS, Problem, build, cast, eager_attention, grad_leaves, on_route, together

from sparse_attn import entmax_attention
from sparse_attn.attn._attn_autograd import _fwd_op, spec_to_op_args
from sparse_attn.attn.attn_inputs import prepare_attention
from sparse_attn.kernels._args import dropout_keep_mask
from sparse_attn.reference import entmax_attention_reference

# Forward outputs and backward dq / dk / dv are allocated filled with NaN (ints: their max) by the
# poison_uninitialized fixture of conftest.py, so an element a kernel fails to write shows up as a mismatch.
pytestmark = pytest.mark.usefixtures("poison_uninitialized")

# max abs error relative to the largest |float64 value| of the same tensor (tests/helpers.py)
REL_TOL = TOL["fused_rel_f32"]


def _close(got, ref, tol, name):
    got, ref = got.double(), ref.double()
    err = (got - ref).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{name}: max abs error {err:.3e} > {tol:.0e} * {scale:.3e}"


def _close_all(out, out64, grads, grads64, names):
    """``_close`` on the output and on each named gradient (``"dalpha"`` with its own tolerance)."""
    _close(out, out64, REL_TOL["out"], "out")
    for g, g64, gname in zip(grads, grads64, names, strict=True):
        _close(g, g64, REL_TOL["dalpha" if gname == "dalpha" else "grad"], gname)


def _leaves(shapes, gen, device):
    """float32 leaf tensors drawn on CPU (reproducible on every device), moved to ``device``."""
    return [torch.randn(*s, generator=gen).to(device).requires_grad_() for s in shapes]


def _check_per_head_alpha(q, k, v, alphas, mask_shape, opts, gen):
    """One alpha per head (a leaf, with its gradient) and, when ``opts`` asks for ``mask``, a float mask of
    ``mask_shape`` (with its gradient): the fused outputs and every gradient against the float64 reference. Returns the
    fused output."""
    mask = torch.randn(*mask_shape, generator=gen).to(q.device).requires_grad_() if opts.pop("mask", 0) else None
    alpha = torch.tensor(alphas, device=q.device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, mask=mask, **opts)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"] + (["dmask"] if mask is not None else []))
    return out


def _run_both(q, k, v, alpha, mask=None, sinks=None, **kw):
    """Fused (fp32) and float64-reference outputs and gradients for one random cotangent (gradients of
    ``q, k, v``, then of ``alpha``, ``mask`` and ``sinks`` when they are tensors requiring one)."""
    gen = torch.Generator().manual_seed(123)
    mask_grad = mask is not None and mask.requires_grad
    sinks_grad = sinks is not None and sinks.requires_grad
    inputs = ([q, k, v] + ([alpha] if isinstance(alpha, torch.Tensor) else []) + ([mask] if mask_grad else [])
              + ([sinks] if sinks_grad else []))
    out = entmax_attention(q, k, v, alpha, attn_mask=mask, sinks=sinks, backend="triton", **kw)
    do = torch.randn(out.shape, generator=gen).to(out.device)
    grads = torch.autograd.grad((out * do).sum(), inputs)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    q64, k64, v64 = inputs64[:3]
    rest = iter(inputs64[3:])
    a64 = next(rest) if isinstance(alpha, torch.Tensor) else alpha
    m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
    m64 = next(rest) if mask_grad else m64
    s64 = next(rest) if sinks_grad else None if sinks is None else sinks.double()
    out64 = entmax_attention(q64, k64, v64, a64, attn_mask=m64, sinks=s64, backend="reference", **kw)
    grads64 = torch.autograd.grad((out64 * do.double()).sum(), inputs64)
    return out, out64, grads, grads64


CASES = {
    "softmax": dict(alpha=1.0),
    "alpha1.01": dict(alpha=1.01),
    "alpha1.25_causal": dict(alpha=1.25, is_causal=True),
    "entmax15_cross": dict(alpha=1.5, nk=37),
    "sparsemax_causal_cross": dict(alpha=2.0, nk=29, is_causal=True),
    "mixed_gqa": dict(alpha=[1.0, 1.3, 1.5, 2.0], hk=2, enable_gqa=True),
    "mixed_mqa_causal": dict(alpha=[1.7, 1.1, 2.0, 1.5], hk=1, enable_gqa=True, is_causal=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_reference_forward_and_backward(name, kernel_device):
    c = dict(CASES[name])
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    nq, nk, hq, hk, d = 33, c.pop("nk", 33), 4, c.pop("hk", 4), 16
    q, k, v = _leaves([(2, hq, nq, d), (2, hk, nk, d), (2, hk, nk, d)], gen, kernel_device)
    a = c.pop("alpha")
    alpha = torch.tensor(a, device=kernel_device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, **c)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"])


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fused_masks_bias_gradient_and_fully_masked_rows(with_sinks, kernel_device):
    """A float mask and its gradient; a row with no valid key gives zeros and zero gradients, with sinks too (then
    also the sinks' gradient, and the statistics: ``tau`` of such a row is ``+inf`` on both paths)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = _leaves([(2, 2, 21, 16), (2, 2, 26, 16), (2, 2, 26, 16)], gen, kernel_device)
    bias = (0.5 * torch.randn(1, 2, 21, 26, generator=gen)).to(kernel_device).requires_grad_()
    with torch.no_grad():
        bias[0, :, 3] = float("-inf")
    alpha = torch.tensor([1.2, 1.0] if with_sinks else [1.5, 1.2], device=kernel_device, requires_grad=True)
    sinks = torch.tensor([0.3, -0.7], device=kernel_device, requires_grad=True) if with_sinks else None
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, mask=bias, sinks=sinks)
    assert torch.isfinite(out).all() and (out[:, :, 3] == 0).all() and (grads[0][:, :, 3] == 0).all()
    _close(out, out64, REL_TOL["out"], "out")
    for g, g64, gname in zip(grads, grads64, ["dq", "dk", "dv", "dalpha", "dbias", "dsinks"][:len(grads)],
                             strict=True):
        assert torch.isfinite(g).all(), gname
        _close(g, g64, REL_TOL["dalpha" if gname == "dalpha" else "grad"], gname)
    assert grads[4].shape == bias.shape
    if with_sinks:
        with torch.no_grad():
            _, st = entmax_attention(q, k, v, alpha, attn_mask=bias, sinks=sinks, backend="triton", return_stats=True)
            _, st64 = entmax_attention(q.double(), k.double(), v.double(), alpha.double(), attn_mask=bias.double(),
                                       sinks=sinks.double(), backend="reference", return_stats=True)
        assert torch.equal(st.n_valid, st64.n_valid) and (st.nnz - st64.nnz).abs().max() <= 1
        has_keys = st64.n_valid > 0
        assert not has_keys.all() and (st.tau[~has_keys] == float("inf")).all()
        torch.testing.assert_close(st.tau.double(), st64.tau, atol=TOL["tau"][F32], rtol=0)


def test_fused_bool_padding_mask_and_stats(kernel_device):
    gen = torch.Generator().manual_seed(8)
    q, k, v = _leaves([(2, 2, 19, 16), (2, 2, 19, 16), (2, 2, 19, 16)], gen, kernel_device)
    keep = torch.ones(2, 1, 1, 19, dtype=torch.bool)
    keep[1, ..., 11:] = False
    keep = keep.to(kernel_device)
    alpha = torch.tensor([1.5, 2.0], device=kernel_device)
    out, st = entmax_attention(q, k, v, alpha, attn_mask=keep, is_causal=True, backend="triton", return_stats=True)
    out64, st64 = entmax_attention(q.double(), k.double(), v.double(), alpha.double(), attn_mask=keep, is_causal=True,
                                   return_stats=True, backend="reference")
    _close(out, out64, REL_TOL["out"], "out")
    assert torch.equal(st.n_valid, st64.n_valid)
    assert (st.nnz - st64.nnz).abs().max() <= 1
    assert not st.tau.requires_grad
    finite = torch.isfinite(st64.tau)
    torch.testing.assert_close(st.tau[finite].double(), st64.tau[finite], atol=TOL["tau"][F32], rtol=0)


def test_fused_varlen_forward_and_backward(kernel_device):
    gen = torch.Generator().manual_seed(9)
    cu_q = torch.tensor([0, 17, 17, 40], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 20, 25, 50], dtype=torch.int32, device=kernel_device)
    q, k, v = _leaves([(1, 2, 40, 16), (1, 2, 50, 16), (1, 2, 50, 16)], gen, kernel_device)
    alpha = torch.tensor([1.5, 1.0], device=kernel_device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"])


# (nq, nk, window_size, is_causal, alpha per head): windows narrower than a tile, spanning tiles, one-sided,
# with Nq != Nk (bottom-right aligned), rows whose window holds no key (zeros), mixed alpha per head
WINDOW_CASES = {
    "causal_sliding": (70, 70, (9, 0), True, [1.5, 1.0]),
    "two_sided": (70, 70, (20, 3), False, [2.0, 1.3]),
    "right_only_cross": (40, 75, (-1, 5), False, [1.5, 1.5]),
    "left_only_more_queries": (75, 40, (10, -1), False, [1.25, 2.0]),
    "causal_and_right": (70, 70, (33, 4), True, [1.0, 1.5]),
    "empty_rows": (66, 30, (2, 0), False, [1.5, 2.0]),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_fused_sliding_window_forward_and_backward(name, kernel_device):
    """window_size on the kernels (no mask tensor) against the reference, which builds the window's mask."""
    nq, nk, window, causal, alphas = WINDOW_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    q, k, v = _leaves([(1, 2, nq, 16), (1, 2, nk, 16), (1, 2, nk, 16)], gen, kernel_device)
    alpha = torch.tensor(alphas, device=kernel_device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, is_causal=causal, window_size=window)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"])


def test_fused_sliding_window_varlen_and_float_mask_gradient(kernel_device):
    gen = torch.Generator().manual_seed(21)
    cu_q = torch.tensor([0, 37, 37, 70], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 40, 44, 80], dtype=torch.int32, device=kernel_device)
    q, k, v = _leaves([(1, 2, 70, 16), (1, 2, 80, 16), (1, 2, 80, 16)], gen, kernel_device)
    alpha = torch.tensor([1.5, 2.0], device=kernel_device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, is_causal=True, window_size=(12, 0), cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"])
    q, k, v = _leaves([(2, 2, 40, 16), (2, 2, 50, 16), (2, 2, 50, 16)], gen, kernel_device)
    mask = torch.randn(1, 2, 1, 50, generator=gen).to(kernel_device).requires_grad_()
    out, out64, grads, grads64 = _run_both(q, k, v, 1.5, mask=mask, window_size=(6, 6))
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dmask"])


# (nq, nk, options, alpha per head): ALiBi per head and per batch entry, soft-capping, both with causal masking,
# a window, Nq != Nk and a float mask (its gradient), mixed alpha per head
SCORE_CASES = {
    "alibi_heads": (40, 40, dict(alibi=(2,), is_causal=True), [1.5, 1.0]),
    "alibi_batch_cross": (33, 45, dict(alibi=(2, 2)), [2.0, 1.25]),
    "softcap": (40, 40, dict(softcap=1.5), [1.5, 2.0]),
    "softcap_causal_window": (45, 40, dict(softcap=2.0, is_causal=True, window_size=(12, 0)), [1.3, 1.0]),
    "alibi_softcap_mask": (35, 35, dict(alibi=(2,), softcap=3.0, mask=True), [1.5, 1.7]),
}


@pytest.mark.parametrize("name", list(SCORE_CASES))
def test_fused_alibi_and_softcap_forward_and_backward(name, kernel_device):
    """ALiBi slopes and soft-capping computed in the kernels (no bias tensor) against the reference."""
    nq, nk, opts, alphas = SCORE_CASES[name]
    opts = dict(opts)
    gen = torch.Generator().manual_seed(len(name) + 40)
    # two batch entries where something differs per entry (ALiBi slopes per (B, H), a per-entry key mask), else one
    b = 2 if opts.get("alibi") == (2, 2) or opts.get("mask") else 1
    q, k, v = _leaves([(b, 2, nq, 16), (b, 2, nk, 16), (b, 2, nk, 16)], gen, kernel_device)
    q.data *= 2.0  # larger scores: the soft cap bends them
    if "alibi" in opts:
        opts["alibi_slopes"] = (torch.rand(*opts.pop("alibi"), generator=gen) / 4).to(kernel_device)
    _check_per_head_alpha(q, k, v, alphas, (2, 1, 1, nk), opts, gen)


@pytest.mark.parametrize("cap", [1e-40, 1e-300])
def test_fused_softcap_below_float32_is_finite(cap, kernel_device):
    """A cap too small for the kernels' ``1 / cap`` in float32 (a row of zero scores gave 0 * inf = NaN): every score
    capped to about 0, uniform weights, as the reference gives."""
    gen = torch.Generator().manual_seed(46)
    q, k, v = _leaves([(1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)], gen, kernel_device)
    with torch.no_grad():
        q[:, :, 2] = 0.0
    out, out64, grads, grads64 = _run_both(q, k, v, 1.5, softcap=cap)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv"])


def test_fused_alibi_per_sequence_with_varlen(kernel_device):
    gen = torch.Generator().manual_seed(44)
    cu_q = torch.tensor([0, 20, 45], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32, device=kernel_device)
    q, k, v = _leaves([(1, 2, 45, 16), (1, 2, 50, 16), (1, 2, 50, 16)], gen, kernel_device)
    slopes = torch.tensor([[0.5, 0.1], [0.05, 0.3]], device=kernel_device)
    out, out64, grads, grads64 = _run_both(q, k, v, 1.5, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           alibi_slopes=slopes, softcap=2.5)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv"])


# (D, Dv, options, alpha per head): value heads wider and narrower than query/key heads (DeepSeek-V3 style), with
# GQA, causal masking, a window, a float mask's gradient, mixed alpha per head
DV_CASES = {
    "wider_gqa_causal": (16, 32, dict(is_causal=True, hk=1, enable_gqa=True), [1.5, 1.0]),
    "narrower_mask": (32, 16, dict(mask=True), [2.0, 1.25]),
    "odd_window": (16, 24, dict(window_size=(9, 3)), [1.5, 1.7]),
}


@pytest.mark.parametrize("name", list(DV_CASES))
def test_fused_value_head_dim_differs(name, kernel_device):
    d, dv, opts, alphas = DV_CASES[name]
    opts = dict(opts)
    hk = opts.pop("hk", 2)
    gen = torch.Generator().manual_seed(len(name) + 60)
    q, k, v = _leaves([(2, 2, 37, d), (2, hk, 41, d), (2, hk, 41, dv)], gen, kernel_device)
    out = _check_per_head_alpha(q, k, v, alphas, (2, 1, 37, 41), opts, gen)
    assert out.shape == (2, 2, 37, dv)


def test_fused_value_head_dim_differs_varlen(kernel_device):
    gen = torch.Generator().manual_seed(66)
    cu_q = torch.tensor([0, 20, 45], dtype=torch.int32, device=kernel_device)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32, device=kernel_device)
    q, k, v = _leaves([(1, 2, 45, 32), (1, 2, 50, 32), (1, 2, 50, 16)], gen, kernel_device)
    out, out64, grads, grads64 = _run_both(q, k, v, 1.5, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv"])


def test_fused_sliding_window_skips_key_tiles_outside_it(kernel_device):
    """The forward loads only the key tiles a query tile's window reaches: with a causal window of 8 keys
    over 128 (interpreter tiles 32 x 32), each of the 4 query tiles loads at most 2 key tiles per pass."""
    from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 128, 16, generator=gen).to(kernel_device) for _ in range(3))
    alpha = torch.tensor([1.5], device=kernel_device)
    full = entmax_attn_fwd(q, k, v, alpha, 0.25, is_causal=True)
    win = entmax_attn_fwd(q, k, v, alpha, 0.25, is_causal=True, window_size=(7, 0))
    if full.block_m != 32 or full.block_n != 32:
        pytest.skip("the tile counts below are for the interpreter's 32 x 32 tiles")
    per_pass = (win.tile_visits.double() / win.n_passes.double()).flatten()
    assert (per_pass <= 2).all() and per_pass[0] == 1, per_pass.tolist()
    assert (full.tile_visits.flatten() / full.n_passes.flatten()).tolist() != per_pass.tolist()
    ref = entmax_attention_reference(q.double(), k.double(), v.double(), 1.5, is_causal=True, window_size=(7, 0),
                                     scale=0.25)
    _close(win.out, ref, REL_TOL["out"], "out")


def test_fused_fp16_within_twice_the_reference_error(kernel_device):
    gen = torch.Generator().manual_seed(10)
    q, k, v = (t.half() for t in _leaves([(1, 2, 40, 16)] * 3, gen, kernel_device))
    out = entmax_attention(q, k, v, 1.5, backend="triton")
    exact = entmax_attention(q.double(), k.double(), v.double(), 1.5, backend="reference")
    ref16 = entmax_attention_reference(q.float(), k.float(), v.float(), 1.5).half()
    assert out.dtype == torch.float16
    err, err_ref = (out.double() - exact).abs().max(), (ref16.double() - exact).abs().max()
    assert err <= 2 * err_ref + 1e-3


# every variant the fused route runs, at once, in two calls (the test table, tests/variants.py): one with a float
# mask and its gradient, one of packed sequences (whose eager twin takes no attn_mask)
TWIN_CALLS = {"float_mask": together("fused", mask="float") + ["mask_grad"],
              "varlen": together("fused", mask=None) + ["varlen"]}


def test_the_twin_calls_cover_every_variant_of_the_route():
    covered = {n for names in TWIN_CALLS.values() for n in names} | {"grad"}  # grad: q, k, v require it
    assert covered | {"bool_mask"} == {n for n in on_route("fused") if ROWS[n].twin is not None}
    assert "bool_mask" in together("fused")  # the boolean mask: the half-precision test below


@pytest.mark.parametrize("call", list(TWIN_CALLS))
def test_fused_every_variant_against_the_eager_twins(call, kernel_device):
    """float32 kernels against the eager twins of every variant (plain torch in float64), alpha per head: the
    output and the gradients of q, k, v, alpha and of every keyword tensor that requires one."""
    problem = Problem(b=1, hq=2, nq=20, nk=24, dtype=F32, device=kernel_device, grad=True, seed=len(call))
    q, k, v, kw = build(TWIN_CALLS[call], problem)
    alpha = torch.tensor([1.5, 1.5], device=kernel_device, requires_grad=True)
    names = grad_leaves(kw)
    leaves = [q, k, v, alpha] + [kw[n] for n in names]
    out = entmax_attention(q, k, v, alpha, backend="triton", **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    grads = torch.autograd.grad((out * do).sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    kw64 = dict(cast(kw, torch.float64), **dict(zip(names, leaves64[4:], strict=True)))
    out64 = eager_attention(*leaves64[:4], **kw64)
    grads64 = torch.autograd.grad((out64 * do.double().cpu()).sum(), leaves64)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"] + [f"d{n}" for n in names])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_variants_half_precision_within_twice_the_reference_error(dtype, kernel_device):
    """Every variant the fused route runs at once (the test table's: window, ALiBi, soft cap, sinks, Dv != D, GQA,
    causal, a block mask and a boolean mask, with mixed alpha) in fp16 / bf16: outputs and gradients within twice the
    error of the reference run on the same rounded inputs in float32 (rounded to the dtype), against float64 (the
    tolerance rule, tests/helpers.py)."""
    q, k, v, kw = build(together("fused"), Problem(b=1, nq=45, nk=50, dtype=dtype, device=kernel_device, seed=12),
                        block=(16, 16))
    gen = torch.Generator().manual_seed(12)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    alpha = torch.tensor([1.0, 1.3, 1.5, 2.0], device=kernel_device)
    kw = dict(kw, scale=0.5)
    out = entmax_attention(q, k, v, alpha, backend="triton", **kw)
    do = torch.randn(out.shape, generator=gen).to(kernel_device).to(dtype)
    grads = torch.autograd.grad((out.float() * do.float()).sum(), (q, k, v))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out64 = entmax_attention(*leaves64, alpha.double(), backend="reference", **cast(kw, torch.float64))
    grads64 = torch.autograd.grad((out64 * do.double()).sum(), leaves64)
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32 = entmax_attention(*leaves32, alpha, backend="reference", **cast(kw, torch.float32))
    grads32 = torch.autograd.grad((out32 * do.float()).sum(), leaves32)
    assert out.dtype == dtype
    assert_close_to_ref(out, out64, out32.to(dtype), eps=TOL["eps_attention_kernel"][dtype], name="out")
    for g, g64, g32, name in zip(grads, grads64, grads32, ("dq", "dk", "dv"), strict=True):
        assert_close_to_ref(g, g64, g32.to(dtype), eps=TOL["eps_attention_grad"][dtype], name=name)


def test_fused_gradients_are_deterministic(kernel_device):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _leaves([(1, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16)], gen, kernel_device)
    alpha = torch.tensor([1.5, 1.2, 2.0, 1.0], device=kernel_device, requires_grad=True)
    runs = []
    for _ in range(2):
        out = entmax_attention(q, k, v, alpha, enable_gqa=True, is_causal=True, backend="triton")
        runs.append(torch.autograd.grad(out.square().sum(), [q, k, v, alpha]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_double_backward_raises_clear_error(kernel_device):
    gen = torch.Generator().manual_seed(12)
    q, k, v = _leaves([(1, 1, 16, 16)] * 3, gen, kernel_device)
    out = entmax_attention(q, k, v, 1.5, backend="triton")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_fused_dropout_replays_the_forward_mask(kernel_device):
    gen = torch.Generator().manual_seed(13)
    q, k, v = _leaves([(1, 2, 24, 16)] * 3, gen, kernel_device)
    alpha = torch.tensor([1.5, 1.0], device=kernel_device, requires_grad=True)
    seed, p_drop, scale = 1234, 0.3, 0.25
    spec = prepare_attention(q, k, v, alpha, scale=scale, dropout_p=p_drop, backend="triton")
    out = _fwd_op(*spec_to_op_args(dataclasses.replace(spec, alpha_class="mixed", need_grad=True), seed))[0]
    do = torch.randn(out.shape, generator=gen).to(kernel_device)
    grads = torch.autograd.grad((out * do).sum(), [q, k, v, alpha])
    keep = dropout_keep_mask(seed, 2, 24, 24, p_drop, kernel_device).reshape(1, 2, 24, 24)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, alpha)]
    out64 = entmax_attention_reference(*leaves64, scale=scale, dropout_p=p_drop, dropout_mask=keep)
    grads64 = torch.autograd.grad((out64 * do.double()).sum(), leaves64)
    _close_all(out, out64, grads, grads64, ["dq", "dk", "dv", "dalpha"])


def test_fused_public_dropout_is_seeded_by_torch_rng(kernel_device):
    gen = torch.Generator().manual_seed(14)
    q, k, v = _leaves([(1, 2, 16, 16)] * 3, gen, kernel_device)
    torch.manual_seed(5)
    a = entmax_attention(q, k, v, 1.5, dropout_p=0.5, backend="triton")
    torch.manual_seed(5)
    b = entmax_attention(q, k, v, 1.5, dropout_p=0.5, backend="triton")
    c = entmax_attention(q, k, v, 1.5, dropout_p=0.5, backend="triton")
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("alpha0", [1.2, 1.5, 1.8])
def test_fused_dalpha_matches_finite_differences_float32(alpha0, kernel_device):
    gen = torch.Generator().manual_seed(15)
    q, k, v = (t.detach() for t in _leaves([(1, 1, 24, 16)] * 3, gen, kernel_device))
    do = torch.randn(1, 1, 24, 16, generator=gen).to(kernel_device)
    alpha = torch.tensor([alpha0], device=kernel_device, requires_grad=True)
    out = entmax_attention(q, k, v, alpha, backend="triton", scale=1.0)
    (dalpha,) = torch.autograd.grad((out * do).sum(), alpha)
    h = 1e-3

    def loss(a):
        out = entmax_attention(q.double(), k.double(), v.double(), a, scale=1.0, backend="reference")
        return (out * do.double()).sum().item()

    fd = (loss(alpha0 + h) - loss(alpha0 - h)) / (2 * h)
    with torch.no_grad():
        fused_fd = ((entmax_attention(q, k, v, alpha0 + h, backend="triton", scale=1.0)
                     - entmax_attention(q, k, v, alpha0 - h, backend="triton", scale=1.0)) * do).sum().item() / (2 * h)
    assert abs(dalpha.item() - fd) <= 2e-3 * max(1.0, abs(fd))
    assert abs(fused_fd - fd) <= 2e-2 * max(1.0, abs(fd))


def test_training_learnable_per_head_alpha_on_fused_path(kernel_device):
    """A toy reversal task (position i must copy the value at position n - 1 - i) trained through the fused kernels
    with a learnable alpha per head: the loss falls, alpha moves, and every step's loss and the final alphas equal a
    run of the same training on the reference backend (so the kernels' gradients steer the optimizer exactly as the
    reference's would, step after step)."""

    def train(device, backend):
        gen = torch.Generator().manual_seed(16)
        n, d, heads, batch = 16, 16, 2, 2
        pos_q = torch.nn.Parameter(torch.randn(heads, n, d, generator=gen).to(device))
        pos_k = torch.nn.Parameter(torch.randn(heads, n, d, generator=gen).to(device))
        raw_alpha = torch.zeros(heads, device=device, requires_grad=True)
        opt = torch.optim.Adam([pos_q, pos_k, raw_alpha], lr=0.2)
        losses = []
        for _ in range(12):
            x = torch.randn(batch, n, d, generator=gen).to(device)
            alpha = 1 + torch.sigmoid(raw_alpha)
            v = x.unsqueeze(1).expand(batch, heads, n, d)
            out = entmax_attention(pos_q.expand(batch, -1, -1, -1), pos_k.expand(batch, -1, -1, -1), v, alpha,
                                   backend=backend)
            loss = (out.mean(1) - x.flip(1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses), (1 + torch.sigmoid(raw_alpha)).detach().cpu()

    losses, alphas = train(kernel_device, "triton")
    assert losses[-5:].sum() < 0.5 * losses[:5].sum()
    assert (alphas - 1.5).abs().max() > 2e-2
    ref_losses, ref_alphas = train("cpu", "reference")
    rtol = TOL["eps_attention_kernel"][F32]
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=0)
    torch.testing.assert_close(alphas, ref_alphas, rtol=rtol, atol=0)


# Absolute slack (relative to the largest |float64 value|) added to twice the error of the reference
# run in the kernel's dtype (the tolerance rule, tests/helpers.py): fp16/bf16 products on the GPU round P and dS to
# that dtype.
LOWP_EPS = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_public_autograd_low_precision(dtype):
    """entmax_attention(backend="triton") forward + backward on CUDA in fp16/bf16 at a moderate shape."""
    gen = torch.Generator().manual_seed(17)
    B, Hq, Hk, Nq, Nk, D = 2, 4, 2, 300, 357, 64
    shapes = [(B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, D)]
    base = [torch.randn(*s, generator=gen).to(dtype).cuda() for s in shapes]
    do = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype).cuda()
    alpha = torch.tensor([1.0, 1.25, 1.5, 2.0], device="cuda", requires_grad=True)
    kw = dict(is_causal=True, enable_gqa=True)

    def run(dt, backend):
        leaves = [t.detach().to(dt).requires_grad_() for t in base]
        a = alpha.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        out = entmax_attention(*leaves, a, backend=backend, **kw)
        grads = torch.autograd.grad((out.double() * do.double()).sum(), leaves + [a])
        return [out] + list(grads)

    got = run(dtype, "triton")
    exact = run(torch.float64, "reference")
    lowp = run(dtype, "reference")
    for name, g, e, r in zip(["out", "dq", "dk", "dv", "dalpha"], got, exact, lowp):
        assert g.dtype == (torch.float32 if name == "dalpha" else dtype), name
        assert torch.isfinite(g).all(), name
        scale = e.abs().max().item()
        err = (g.double() - e).abs().max().item()
        err_ref = (r.double() - e).abs().max().item()
        assert err <= 2 * err_ref + LOWP_EPS[dtype] * scale, f"{name}: {err:.3e} vs reference {err_ref:.3e}"


MASK_SHAPES = {"key_bias": (2, 1, 1, 26), "shared_2d": (1, 1, 21, 26), "full": (2, 2, 21, 26),
               "head_key": (1, 2, 1, 26), "row_bias": (2, 2, 21, 1)}


@pytest.mark.parametrize("name", list(MASK_SHAPES))
def test_fused_mask_gradient_for_broadcast_masks(name, kernel_device, monkeypatch):
    """d mask for masks broadcast along batch, heads, queries or keys matches float64 autograd, and the
    backward never allocates a (B, H, Nq, Nk) buffer for a mask smaller than that."""
    import sparse_attn.kernels.attn.entmax_attn_bwd as bwd_mod

    shape = MASK_SHAPES[name]
    gen = torch.Generator().manual_seed(20)
    q, k, v = _leaves([(2, 2, 21, 16), (2, 2, 26, 16), (2, 2, 26, 16)], gen, kernel_device)
    mask = (0.7 * torch.randn(*shape, generator=gen)).to(kernel_device)
    with torch.no_grad():
        mask.view(-1)[::7] = float("-inf")
    mask.requires_grad_()
    alpha = torch.tensor([1.5, 1.0], device=kernel_device, requires_grad=True)
    sizes = []
    real_zeros = torch.zeros

    def zeros(*args, **kw):
        t = real_zeros(*args, **kw)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(bwd_mod.torch, "zeros", zeros)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, mask=mask, is_causal=True)
    monkeypatch.undo()
    full = 2 * 2 * 21 * 26
    assert max(sizes) <= max(2 * 2 * 26, mask.numel()) < full or name == "full"
    _close(out, out64, REL_TOL["out"], "out")
    assert grads[-1].shape == mask.shape
    for g, g64, gname in zip(grads, grads64, ["dq", "dk", "dv", "dalpha", "dmask"]):
        assert torch.isfinite(g).all(), gname
        if name == "row_bias" and gname == "dmask":
            # entmax is invariant to a per-row shift: the exact gradient is 0, the kernel's is rounding
            assert g.abs().max() <= REL_TOL["grad"] * grads64[0].abs().max(), gname
            continue
        _close(g, g64, REL_TOL["dalpha" if gname == "dalpha" else "grad"], gname)


def test_backward_op_returns_mask_shaped_gradient(kernel_device):
    """The custom op's d bias already has the mask's (unexpanded) shape, in eager and in its fake impl."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (t.detach() for t in _leaves([(2, 2, 17, 16)] * 3, gen, kernel_device))
    mask = torch.randn(2, 1, 1, 17, generator=gen).to(kernel_device)
    alpha = torch.tensor([1.5, 2.0], device=kernel_device)
    spec = dataclasses.replace(prepare_attention(q, k, v, alpha, attn_mask=mask, scale=0.25, backend="triton"),
                               alpha_class="mixed", need_grad=True)
    out, tau, tau_lo, lsum, _, _, live, _, _, out_u = _fwd_op(*spec_to_op_args(spec, 0))
    args = (out, out, out_u, tau, tau_lo, lsum, live, False, True, *spec_to_op_args(spec, 0))
    dbias = torch.ops.sparse_attn.entmax_attn_bwd(*args)[4]
    assert dbias.shape == mask.shape
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert torch.ops.sparse_attn.entmax_attn_bwd(*fake_args)[4].shape == mask.shape


def test_backward_outputs_are_poisoned_then_fully_written(kernel_device):
    """The poison fixture is active here (the launchers allocate with torch.empty / empty_like, which hand
    out NaN and the int max), and the results have none."""
    like = torch.zeros(3, 2, device=kernel_device).t()
    assert torch.isnan(torch.empty_like(like)).all() and torch.isnan(torch.empty(3, device=kernel_device)).all()
    assert (torch.empty(3, dtype=torch.int32, device=kernel_device) == torch.iinfo(torch.int32).max).all()
    gen = torch.Generator().manual_seed(22)
    q, k, v = _leaves([(1, 2, 37, 16), (1, 1, 45, 16), (1, 1, 45, 16)], gen, kernel_device)
    out = entmax_attention(q, k, v, torch.tensor([1.5, 1.0], device=kernel_device), is_causal=True,
                           enable_gqa=True, backend="triton")
    for g in torch.autograd.grad(out.square().sum(), [q, k, v]):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("D,dtype", [(40, torch.float32), (80, torch.float16), (96, torch.float32)])
def test_transposed_inputs_noncontiguous_grad_and_head_dims(D, dtype, kernel_device):
    """(B, N, H, D) tensors viewed as (B, H, N, D), a non-contiguous output gradient, odd head dims; fp16 by
    The tolerance rule: err <= 2 * err(float32 reference rounded to fp16) + eps, all against float64 autograd."""
    gen = torch.Generator().manual_seed(23 + D)
    B, Hq, Hk, Nq, Nk = 2, 2, 1, 19, 23
    base = [torch.randn(B, n, h, D, generator=gen).to(dtype) for n, h in ((Nq, Hq), (Nk, Hk), (Nk, Hk))]
    do = torch.randn(B, Nq, Hq, D, generator=gen).to(dtype).to(kernel_device).transpose(1, 2)
    alpha = torch.tensor([1.25, 2.0], device=kernel_device, requires_grad=True)
    assert not do.is_contiguous()

    def run(dt, backend, device):
        leaves = [t.to(device=device, dtype=dt).requires_grad_() for t in base]
        a = alpha.detach().to(device=device, dtype=torch.float64 if dt == torch.float64 else torch.float32)
        a.requires_grad_()
        out = entmax_attention(*(t.transpose(1, 2) for t in leaves), a, is_causal=True, enable_gqa=True,
                               backend=backend)
        grads = torch.autograd.grad(out, leaves + [a], grad_outputs=do.to(device=device, dtype=out.dtype))
        return [out] + [g.transpose(1, 2) if g.ndim == 4 else g for g in grads]

    got = run(dtype, "triton", kernel_device)
    exact = run(torch.float64, "reference", "cpu")
    ref32 = run(torch.float32, "reference", "cpu")
    for name, g, e, r in zip(["out", "dq", "dk", "dv", "dalpha"], got, exact, ref32):
        assert torch.isfinite(g).all(), name
        tol = REL_TOL["dalpha" if name == "dalpha" else "out" if name == "out" else "grad"]
        if dtype == torch.float32:
            _close(g.cpu(), e, tol, name)
        else:
            lowp = r if name == "dalpha" else r.to(dtype)
            err = (g.cpu().double() - e).abs().max().item()
            err_ref = (lowp.double() - e).abs().max().item()
            bound = 2 * err_ref + 2e-3 * e.abs().max().item()
            assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


SINK_CASES = {
    "mixed_causal": (33, 33, dict(is_causal=True), [1.0, 1.3, 1.5, 2.0], 4),
    "mixed_gqa_cross": (21, 37, dict(enable_gqa=True), [2.0, 1.5, 1.3, 1.0], 2),
    "entmax15_dominant_sink": (17, 40, dict(), [1.5, 1.5, 1.5, 1.5], 4),
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_fused_sinks_forward_and_backward(name, kernel_device):
    """Per-head sinks in the kernels (a virtual zero-value key in every row's normalization) against the reference:
    the output and the gradients of q, k, v, alpha and the sinks."""
    nq, nk, opts, alphas, hk = SINK_CASES[name]
    gen = torch.Generator().manual_seed(len(name) + 70)
    q, k, v = _leaves([(2, 4, nq, 16), (2, hk, nk, 16), (2, hk, nk, 16)], gen, kernel_device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 1.0])
    if name == "entmax15_dominant_sink":
        sinks = sinks + 3.0  # most of each row's weight on the sink, many rows entirely
    sinks = sinks.to(kernel_device).requires_grad_()
    alpha = torch.tensor(alphas, device=kernel_device, requires_grad=True)
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, sinks=sinks, **opts)
    _close(out, out64, REL_TOL["out"], "out")
    assert grads[-1].shape == sinks.shape and grads[-1].dtype == sinks.dtype
    for g, g64, gname in zip(grads, grads64, ["dq", "dk", "dv", "dalpha", "dsinks"], strict=True):
        assert torch.isfinite(g).all(), gname
        _close(g, g64, REL_TOL["dalpha" if gname == "dalpha" else "grad"], gname)


ATOMIC_CASES = {
    "mixed_gqa_causal_mask_sinks": dict(hk=2, nk=33, is_causal=True, mask=True, sinks=True, enable_gqa=True),
    "entmax15_window_cross": dict(hk=4, nk=45, window_size=(6, 3)),
}


@pytest.mark.parametrize("name", list(ATOMIC_CASES))
def test_fused_atomic_dq_matches_reference(name, kernel_device, monkeypatch):
    """``deterministic=False`` through the public call and autograd: the dK/dV kernel adds dQ and the d alpha row sums
    with atomics; every gradient (q, k, v, alpha, mask, sinks) matches the float64 reference as the deterministic
    backward's do."""
    import sparse_attn.attn._attn_autograd as autograd_mod

    asked = []
    real = autograd_mod.launch_bwd
    monkeypatch.setattr(autograd_mod, "launch_bwd", lambda *a, **kw: asked.append(kw["deterministic"]) or
                        real(*a, **kw))
    c = dict(ATOMIC_CASES[name])
    gen = torch.Generator().manual_seed(len(name) + 90)
    nq, nk, hk = 33, c.pop("nk"), c.pop("hk")
    q, k, v = _leaves([(2, 4, nq, 16), (2, hk, nk, 16), (2, hk, nk, 16)], gen, kernel_device)
    with_sinks, with_mask = c.pop("sinks", False), c.pop("mask", False)
    alpha = torch.tensor([1.0, 1.3, 1.5, 2.0] if with_sinks else [1.5] * 4, device=kernel_device, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 1.0], device=kernel_device, requires_grad=True) if with_sinks else None
    mask = (0.5 * torch.randn(1, 4, nq, nk, generator=gen)).to(kernel_device).requires_grad_() if with_mask else None
    out, out64, grads, grads64 = _run_both(q, k, v, alpha, mask=mask, sinks=sinks, deterministic=False, **c)
    assert asked == [False]
    names = ["dq", "dk", "dv", "dalpha"] + (["dbias"] if mask is not None else []) + (["dsinks"] if sinks is not None
                                                                                      else [])
    _close(out, out64, REL_TOL["out"], "out")
    for g, g64, gname in zip(grads, grads64, names, strict=True):
        assert torch.isfinite(g).all(), gname
        _close(g, g64, REL_TOL["dalpha" if gname == "dalpha" else "grad"], gname)


def test_fused_sinks_minus_inf_is_off_and_nan_poisons_its_head(kernel_device):
    """A -inf sink equals no sink (output and gradients); a NaN / +inf sink makes its head's rows NaN only."""
    gen = torch.Generator().manual_seed(72)
    q, k, v = _leaves([(1, 4, 18, 16), (1, 4, 18, 16), (1, 4, 18, 16)], gen, kernel_device)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.3], device=kernel_device)
    sinks = torch.full((4,), float("-inf"), device=kernel_device, requires_grad=True)
    out = entmax_attention(q, k, v, alpha, sinks=sinks, backend="triton")
    ref = entmax_attention(q, k, v, alpha, backend="triton")
    torch.testing.assert_close(out, ref, atol=TOL["same_values"][F32], rtol=0)
    do = torch.randn(out.shape, generator=gen).to(kernel_device)
    g_sink = torch.autograd.grad((out * do).sum(), [q, k, v, sinks])
    g_none = torch.autograd.grad((ref * do).sum(), [q, k, v])
    for a, b in zip(g_sink[:3], g_none, strict=True):
        torch.testing.assert_close(a, b, atol=TOL["same_values"][F32], rtol=0)
    assert (g_sink[3] == 0).all()
    for poison, head in ((float("nan"), 1), (float("inf"), 0), (float("nan"), 3)):
        bad = torch.zeros(4, device=kernel_device)
        bad[head] = poison
        out = entmax_attention(q, k, v, alpha, sinks=bad, backend="triton")
        others = [h for h in range(4) if h != head]
        assert out[:, head].isnan().all()
        assert torch.isfinite(out[:, others]).all()
