"""The fused Triton forward (``kernels/attn/entmax_attn_fwd.py``) against the float64 reference.

Every kernel output is allocated poisoned (NaN, or the int32 max) by the ``poison_uninitialized``
fixture of ``conftest.py``, so a value the kernel fails to write shows up as a mismatch. Errors follow the tolerance
rule (tests/helpers.py):
``err(kernel) <= 2 * err(reference run in the kernel's dtype) + EPS[dtype]``, both measured
against the reference on float64 copies of the same (dtype-rounded) inputs.
"""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from helpers import TOL, count_tma_descriptors

from sparse_attn.kernels._args import dropout_keep_mask
from sparse_attn.kernels._common import dropout_keep
from sparse_attn.kernels.attn.entmax_attn_fwd import DEFAULT_MAX_PASSES, entmax_attn_fwd
from sparse_attn.reference import entmax_attention_reference

# Absolute slack added to twice the reference's own error in the kernel dtype. Measured on CPU
# (interpreter, float32 arithmetic): float32 outputs within 6e-6 of float64 at the default tol.
EPS = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# The same slack for float32 at alpha in (1, 1.01], where the general path must not lose digits.
EPS_NEAR_ONE = 1e-6
# Keys whose float64 z is within this of the float64 tau count as ties for the support check.
TIE_MARGIN = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# A tile may be marked dead only if every reference weight in it is below this.
DEAD_WEIGHT = 1e-6
ALPHAS4 = [1.0, 1.25, 1.5, 2.0]
# what the poison_uninitialized fixture fills int32 outputs with
POISON_INT = torch.iinfo(torch.int32).max

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _rand(shape, gen, dtype, layout="bhnd", mult=1.0):
    """Random ``(B, H, N, D)`` tensor in ``dtype``; ``layout="bnhd"`` returns a transposed view."""
    B, H, N, D = shape
    x = torch.randn(B, N, H, D, generator=gen, dtype=torch.float64) * mult
    x = x.to(dtype)
    return x.transpose(1, 2) if layout == "bnhd" else x.transpose(1, 2).contiguous()


def _on(device, fn, *args, **kw):
    """Call the kernel launcher ``fn`` with every tensor argument moved to ``device``; results back on CPU."""
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    res = fn(*map(move, args), **{key: move(val) for key, val in kw.items()})
    return res._replace(**{f: getattr(res, f).cpu() for f in res._fields if isinstance(getattr(res, f), torch.Tensor)})


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _check_close(name, got, want64, ref_lowp, dtype, eps=None):
    """The tolerance rule; ``want64``/``ref_lowp`` are the reference in float64 / in ``dtype``."""
    err = _max_err(got, want64)
    err_ref = _max_err(ref_lowp, want64)
    bound = 2 * err_ref + (EPS[dtype] if eps is None else eps)
    assert err <= bound, f"{name}: max err {err:.3g} > {bound:.3g} (reference in {dtype}: {err_ref:.3g})"


def _scores64(q, k, scale, bias, causal, cu_q=None, cu_k=None):
    """Float64 scores ``(B, Hq, Nq, Nk)`` with -inf where masked (varlen: block diagonal)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    Nq, Nk = s.shape[-2:]
    keep = torch.zeros(Nq, Nk, dtype=torch.bool)
    bounds = [(0, Nq, 0, Nk)] if cu_q is None else list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                                            cu_k[:-1].tolist(), cu_k[1:].tolist()))
    for q0, q1, k0, k1 in bounds:
        rows = torch.arange(q1 - q0)[:, None]
        cols = torch.arange(k1 - k0)[None, :]
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if causal:
            block = cols <= rows + (k1 - k0) - (q1 - q0)
        keep[q0:q1, k0:k1] = block
    return s.masked_fill(~keep, float("-inf"))


def _weights64(s, alpha, tau):
    """Float64 weights from scores and the reference threshold (z-scale; logsumexp at alpha == 1)."""
    a = alpha.double().view(1, -1, 1, 1)
    t = tau.double()[..., None]
    soft = torch.exp(s - t)
    z = (a - 1) * s
    beta = 1 / (a - 1).clamp_min(1e-30)
    ent = (z - t).clamp_min(0) ** beta
    ent = ent / ent.sum(-1, keepdim=True).clamp_min(1e-300)
    p = torch.where(a == 1, soft, ent)
    return torch.where(torch.isfinite(t), p, torch.zeros_like(p)).nan_to_num(0.0)


def _run_case(B=1, Hq=4, Hk=2, Nq=33, Nk=33, D=16, alphas=ALPHAS4, dtype=torch.float32, causal=False,
              bias=None, layout="bhnd", mult=1.0, cu_q=None, cu_k=None, dropout_p=0.0, seed=0, seed_data=0,
              v_ones=False, device="cpu", **kw):
    """Run kernel (on ``device``) and reference (CPU) on one random problem; check out, tau, lsum, nnz, n_valid,
    live."""
    gen = torch.Generator().manual_seed(seed_data)
    if cu_q is not None:
        cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
        B, Nq, Nk = 1, int(cu_q[-1]), int(cu_k[-1])
    q = _rand((B, Hq, Nq, D), gen, dtype, layout, mult)
    k = _rand((B, Hk, Nk, D), gen, dtype, layout, mult)
    v = torch.ones(B, Hk, Nk, D, dtype=dtype) if v_ones else _rand((B, Hk, Nk, D), gen, dtype, layout)
    alpha = torch.tensor(alphas, dtype=torch.float32)
    bias_k = None if bias is None else bias(B, Hq, Nq, Nk, gen)
    scale = D**-0.5
    res = _on(device, entmax_attn_fwd, q, k, v, alpha, scale, bias=bias_k, is_causal=causal, cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, dropout_p=dropout_p, seed=seed, **kw)

    drop_mask = None
    if dropout_p > 0:
        drop_mask = dropout_keep_mask(seed, B * Hq, Nq, Nk, dropout_p, device).cpu().view(B, Hq, Nq, Nk)
    ref_kw = dict(is_causal=causal, scale=scale, dropout_p=dropout_p, dropout_mask=drop_mask,
                  cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_stats=True)
    alpha64 = alpha.double()
    out64, st64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha64,
                                             attn_mask=None if bias_k is None else bias_k.double(), **ref_kw)
    low = torch.float32 if dtype == torch.bfloat16 else dtype
    out_lp, st_lp = entmax_attention_reference(q.to(low), k.to(low), v.to(low), alpha.to(low),
                                               attn_mask=None if bias_k is None else bias_k.to(low), **ref_kw)

    assert res.out.shape == q.shape and res.out.dtype == dtype
    assert not torch.isnan(res.out).any()
    _check_close("out", res.out, out64, out_lp, dtype)
    valid = st64.n_valid > 0
    assert torch.equal(res.n_valid, st64.n_valid)
    assert torch.equal(valid, torch.isfinite(res.tau))
    tau_want = torch.where(valid, st64.tau, torch.zeros_like(st64.tau))
    tau_lp = torch.where(valid, st_lp.tau.double(), torch.zeros_like(st64.tau))
    _check_close("tau", torch.where(valid, res.tau.double(), torch.zeros_like(st64.tau)), tau_want, tau_lp, dtype)
    empty = ~valid
    assert (res.out[empty.unsqueeze(-1).expand_as(res.out)] == 0).all()
    assert (res.lsum[empty] == 0).all() and (res.nnz[empty] == 0).all()
    assert (res.lsum[valid] > 0).all()
    soft = (alpha == 1).view(1, -1, 1).expand_as(valid)
    assert (res.lsum[valid & soft] == 1).all()
    assert torch.equal(res.nnz[soft], res.n_valid[soft])

    s64 = _scores64(q, k, scale, bias_k, causal, cu_q, cu_k)
    z = (alpha64.view(1, -1, 1, 1) - 1) * s64
    gap = z - st64.tau[..., None]
    margin = TIE_MARGIN[dtype]
    lo = (gap > margin).sum(-1)
    hi = (gap > -margin).sum(-1)
    ent = ~soft & valid
    assert ((res.nnz >= lo) & (res.nnz <= hi))[ent].all(), "support differs from the reference away from ties"

    p64 = _weights64(s64, alpha, st64.tau)
    _check_live(res, p64, cu_q, cu_k)
    assert (res.n_passes >= 1).all() and (res.n_passes <= (kw.get("max_passes") or 32)).all()
    assert (res.n_passes[:, alpha == 1] == 1).all()
    return res, p64, valid


def _check_live(res, p64, cu_q, cu_k):
    """No tile holding a reference weight above DEAD_WEIGHT is marked dead; every word is written."""
    bm, bn = res.block_m, res.block_n
    assert not (res.live == POISON_INT).any()
    live = res.live.long() & 0xFFFFFFFF
    Nq = p64.shape[2]
    for s in range(live.shape[0]):
        if cu_q is None:
            b, q0, q1, k0 = s, 0, Nq, 0
        else:
            b, q0, q1, k0 = 0, int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s])
        h, i, j = torch.nonzero(p64[b, :, q0:q1] > DEAD_WEIGHT, as_tuple=True)
        qt, kt = i // bm, (j - k0) // bn
        bits = (live[s, h, qt, kt // 32] >> (kt % 32)) & 1
        assert bits.all(), "a tile holding a nonzero reference weight is marked dead"
        assert (live[s, :, -(-(q1 - q0) // bm):] == 0).all()


def _alibi_bias(B, H, Nq, Nk, gen):
    """ALiBi-like float bias broadcast over the batch (zero stride), a few -inf entries."""
    dist = (torch.arange(Nk)[None, :] - torch.arange(Nq)[:, None]).abs().double()
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)], dtype=torch.float64)
    bias = -slopes.view(1, H, 1, 1) * dist
    bias = bias.masked_fill(torch.rand(1, 1, Nq, Nk, generator=gen) < 0.1, float("-inf"))
    return bias.float().expand(B, H, Nq, Nk)


def _padding_bias(B, H, Nq, Nk, gen):
    """Boolean key-padding mask converted to 0/-inf, plus a few fully masked rows."""
    keep = torch.ones(B, 1, Nq, Nk, dtype=torch.bool)
    keep[0, :, :, Nk // 2:] = False
    keep[:, :, 1::5, :] = False
    return torch.zeros(B, 1, Nq, Nk).masked_fill(~keep, float("-inf")).expand(B, H, Nq, Nk)


@pytest.mark.parametrize(
    "B,Hq,Hk,Nq,Nk,D,causal",
    [
        (2, 4, 4, 63, 63, 16, False),
        (1, 4, 2, 97, 130, 40, True),
        (1, 4, 1, 130, 97, 80, True),
        (1, 4, 4, 17, 1, 64, False),
        (1, 4, 2, 1, 17, 64, True),
    ],
)
def test_matches_reference_mixed_alpha(B, Hq, Hk, Nq, Nk, D, causal, kernel_device):
    _run_case(device=kernel_device, B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk, D=D, causal=causal)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_single_alpha_small_tiles(alpha, kernel_device):
    _run_case(device=kernel_device, Hq=2, Hk=1, Nq=40, Nk=70, D=16, alphas=[alpha, alpha], causal=alpha > 1.3,
              block_m=16, block_n=16)


def test_forced_launch_config(kernel_device):
    """The tuning hook: tiles, warps and stages forced past the autotuner still give the reference's output."""
    res, _, _ = _run_case(device=kernel_device, Hq=2, Hk=1, Nq=40, Nk=70, D=16, alphas=[1.5, 1.25], causal=True,
                          block_m=16, block_n=32, num_warps=2, num_stages=3)
    assert (res.block_m, res.block_n) == (16, 32)


@pytest.mark.parametrize("split,layout", [(False, "bhnd"), (True, "bhnd"), (True, "bnhd")])
def test_tma_descriptor_loads_match_pointer_loads(split, layout, kernel_device, monkeypatch):
    """K / V tiles through TMA tensor descriptors (on a GPU from sm_90 when the layout allows, in the launches
    ``takes_tma`` picks; here every launch, forced) give the forward of the masked pointer loads: zeros past each
    packed sequence's end (empty ones too) and past the head dim (24 of a 32-wide block), GQA, causal, every alpha
    class, the fused kernel and the split forward's two stages, with the training output ``out_u``, float16, a
    ``(B, N, H, D)`` view too. Checked against float64 and, under the interpreter, against the pointer loads: the
    same counts, bitmap and supports, floats to float32 rounding, then their own dtype's (the interpreter multiplies
    the descriptor's transposed K tile in another order); there the descriptors are counted: made and loaded from
    only with TMA, not at all for float32 inputs, which keep pointer loads."""
    from sparse_attn.kernels import _args
    from sparse_attn.kernels.attn import entmax_attn_fwd as fwd

    monkeypatch.setattr(fwd, "FWD_TMA_BLOCK_D", frozenset({32}))
    monkeypatch.setattr(fwd, "FWD_NO_TMA", frozenset())
    case = dict(device=kernel_device, Hq=4, Hk=2, D=24, cu_q=[0, 5, 5, 27, 36, 40], cu_k=[0, 9, 12, 28, 37, 37],
                causal=True, block_m=16, block_n=16, split=split, need_out_u=True, dtype=torch.float16, layout=layout)
    monkeypatch.setattr(_args, "tma_device", lambda device: False)
    with count_tma_descriptors() as off:
        plain, _, _ = _run_case(**case)
    monkeypatch.setattr(_args, "tma_device", lambda device: True)
    with count_tma_descriptors() as on:
        tma, _, _ = _run_case(**case)
    with count_tma_descriptors() as fp32:
        _run_case(**dict(case, dtype=torch.float32))
    assert tma.out_u is not None
    if kernel_device == "cpu":  # the same values loaded (a GPU build may schedule them apart)
        assert off == fp32 == {"make": 0, "load": 0} and on["make"] > 0 and on["load"] > 0, (off, on, fp32)
        for name in plain._fields:
            a, b = getattr(plain, name), getattr(tma, name)
            if not isinstance(a, torch.Tensor):
                assert a == b, name
            elif a.is_floating_point():
                tol = max(1e-5, 2 * torch.finfo(a.dtype).eps)
                torch.testing.assert_close(b, a, rtol=tol, atol=tol, equal_nan=True, msg=name)
            else:
                assert torch.equal(a, b), name


def test_tma_switch_scratch_and_allocator(monkeypatch):
    """``SPARSE_ATTN_TMA=0`` turns TMA off before any CUDA query; the descriptors' scratch is bounded by the output's
    size (``tma_scratch_fits``); the scratch allocator is set only while a launch runs and only when the caller set
    none (a caller's own stays; a Triton without the private context variable gets it for good), and hands out
    ``alignment``-aligned views."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    from sparse_attn.kernels import _args

    monkeypatch.setenv("SPARSE_ATTN_TMA", "0")
    assert not _args.tma_device(torch.device("cuda", 0))
    assert not _args.tma_device(torch.device("cpu"))
    free = _args.TMA_SCRATCH_FREE // (2 * _args.TMA_DESCRIPTOR_BYTES)  # programs of two descriptors in the free part
    small = torch.empty(64, dtype=torch.bfloat16)
    big = torch.empty(free, 256, dtype=torch.bfloat16)  # twice the free scratch: the scratch of (free, 2, 1) programs
    assert _args.tma_scratch_fits((free, 1, 1), 2, small) and not _args.tma_scratch_fits((free + 1, 1, 1), 2, small)
    assert _args.tma_scratch_fits((free, 2, 1), 2, big) and not _args.tma_scratch_fits((free, 2, 1), 2, small)
    assert not _args.tma_scratch_fits((free + 1, 2, 1), 2, big)

    monkeypatch.setattr(_args, "interpreting", lambda: False)

    def scoped():
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        token = _args._install_scratch_allocator()
        assert token is not None and _allocation._allocator.get() is _args._scratch_on_current_device
        _args._scratch_allocator_var().reset(token)
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)

        def own(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8)

        triton.set_allocator(own)
        assert _args._install_scratch_allocator() is None and _allocation._allocator.get() is own

    contextvars.copy_context().run(scoped)

    def missing():
        raise AttributeError("no _allocator")

    set_for_good = []
    monkeypatch.setattr(_args, "_scratch_allocator_var", missing)  # a Triton without the private context variable
    monkeypatch.setattr(triton, "set_allocator", set_for_good.append)
    assert _args._install_scratch_allocator() is None and set_for_good == [_args._scratch_on_current_device]
    real_empty = torch.empty
    monkeypatch.setattr(_args.torch, "empty", lambda *a, **k: real_empty(*a, **dict(k, device="cpu")))
    for size, alignment in ((256, 128), (1000, 64), (8, 256), (16, 0)):
        buf = _args._scratch_on_current_device(size, alignment, None)
        assert buf.numel() == size and buf.data_ptr() % max(alignment, 1) == 0


def test_tma_rows_takes_only_layouts_a_descriptor_can_stream():
    """``_args.tma_rows`` (the launchers' layout check before TMA descriptors): a contiguous last dim, 16-byte aligned
    base, strides and row length, and rows that do not overlap; anything else keeps the pointer loads."""
    from sparse_attn.kernels._args import tma_rows

    x = torch.zeros(2, 3, 40, 64, dtype=torch.bfloat16)
    assert tma_rows(x) and tma_rows(x.transpose(1, 2).contiguous().transpose(1, 2))  # (B, N, H, D) viewed as BHND
    assert tma_rows(x[:, :, 8:])  # a later row: 8 * 128 bytes on
    assert not tma_rows(x[:, :, :, 1:9])  # a base 2 bytes on, rows of 16 bytes
    assert not tma_rows(x[..., :12])  # rows of 24 bytes
    assert not tma_rows(x.transpose(2, 3))  # head dim not contiguous
    assert not tma_rows(x[:, :, :1].expand(2, 3, 40, 64))  # one row broadcast along the sequence (stride 0)
    assert not tma_rows(torch.zeros(2, 3, 40, 12, dtype=torch.float16))  # 24-byte rows
    assert tma_rows(torch.zeros(2, 3, 40, 24, dtype=torch.float32))  # 96-byte rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 64, 96, 128, 160, 256])
def test_autotuners_try_the_pinned_config_first(head_dim, dtype):
    """On a GPU each attention autotuner keeps three of ``launch_configs()`` per launch: the pinned warps / stages of
    the launch's head dim and input dtype first (what ``SPARSE_ATTN_PINNED=1`` runs), one more stage, the other warp
    count."""
    from sparse_attn.kernels.attn import entmax_attn_bwd as bwd
    from sparse_attn.kernels.attn import entmax_attn_fwd as fwd

    size = dtype.itemsize
    pinned = {"fwd": fwd._pick_config(head_dim, False, size)[2:],
              **{name: bwd._pick_config(head_dim, False, elem_size=size)[name][2:] for name in ("dq", "dkdv", "dbias")}}
    tuners = {"fwd": fwd._entmax_attn_fwd_autotuned, "dq": bwd._entmax_attn_bwd_dq_autotuned,
              "dkdv": bwd._entmax_attn_bwd_dkdv_autotuned, "dbias": bwd._entmax_attn_bwd_dbias_autotuned}
    args = {"HEAD_DIM": head_dim, "Q": torch.empty(0, dtype=dtype)}
    for name, tuner in tuners.items():
        kept = [(c.num_warps, c.num_stages) for c in tuner.early_config_prune(tuner.configs, args)]
        warps, stages = pinned[name]
        assert kept == [(warps, stages), (warps, stages + 1), (12 - warps, stages)], (name, kept)


@pytest.mark.parametrize("name,value,err", [("num_warps", 3, ValueError), ("num_warps", 64, ValueError),
                                            ("num_warps", True, TypeError), ("num_stages", 0, ValueError),
                                            ("num_stages", 2.0, TypeError)])
def test_forced_launch_config_out_of_range(name, value, err):
    q = torch.zeros(1, 1, 16, 16)
    with pytest.raises(err, match=f"{name}: expected .* got .*{value!r}"):
        entmax_attn_fwd(q, q, q, 1.5, 0.25, **{name: value})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype, kernel_device):
    _run_case(device=kernel_device, Nq=63, Nk=97, D=64, dtype=dtype, causal=True)


def test_transposed_layout_and_odd_head_dim(kernel_device):
    _run_case(device=kernel_device, B=2, Nq=17, Nk=45, D=96, layout="bnhd", alphas=[1.5, 1.1, 2.0, 1.0])


def test_float_bias_and_mask(kernel_device):
    _run_case(device=kernel_device, B=2, Nq=40, Nk=50, D=16, bias=_alibi_bias, causal=True)
    _run_case(device=kernel_device, B=2, Nq=40, Nk=50, D=16, bias=_padding_bias)


def test_scores_scaled_100(kernel_device):
    res, _, valid = _run_case(device=kernel_device, Nq=33, Nk=65, D=16, mult=10.0, alphas=[1.0, 1.25, 1.5, 2.0])
    assert torch.isfinite(res.out).all()


def test_rows_sum_to_one(kernel_device):
    res, _, valid = _run_case(device=kernel_device, Nq=50, Nk=70, D=16, v_ones=True, causal=True, bias=_padding_bias)
    rows = res.out[..., 0].double()
    assert torch.allclose(rows[valid], torch.ones_like(rows[valid]), atol=TOL["sum"][torch.float32])
    assert (rows[~valid] == 0).all()


def test_rows_sum_to_one_with_a_loose_threshold(kernel_device):
    """A threshold only pinned to 1e-2 still gives rows that sum to one: the value pass renormalizes."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 50, 16, generator=gen), torch.randn(1, 2, 70, 16, generator=gen)
    v = torch.ones(1, 2, 70, 16)
    res = _on(kernel_device, entmax_attn_fwd, q, k, v, torch.tensor(ALPHAS4), 16**-0.5, is_causal=True, tol=1e-2)
    ones = torch.ones(1, 4, 50, dtype=torch.float64)
    assert torch.allclose(res.out[..., 0].double(), ones, atol=TOL["sum"][torch.float32])


def test_fully_masked_and_empty(kernel_device):
    """Causal with Nq > Nk leaves the first rows without keys; a -inf bias masks whole rows."""
    res, _, valid = _run_case(device=kernel_device, Nq=40, Nk=8, D=16, causal=True, bias=_padding_bias)
    assert (~valid).any()
    assert torch.isinf(res.tau[~valid]).all() and (res.tau[~valid] > 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal, kernel_device):
    _run_case(device=kernel_device, cu_q=[0, 5, 5, 38, 55], cu_k=[0, 7, 10, 50, 50], D=16, causal=causal, block_m=16,
              block_n=16)


def test_dropout_matches_replayed_mask(kernel_device):
    _run_case(device=kernel_device, B=2, Nq=33, Nk=40, D=16, dropout_p=0.3, seed=1234, causal=True)


def test_dropout_varlen(kernel_device):
    _run_case(device=kernel_device, cu_q=[0, 20, 45], cu_k=[0, 30, 47], D=16, dropout_p=0.25, seed=7)


def test_dead_tiles_are_skipped_and_bitmap_words(kernel_device):
    """Sharp sparsemax over 40 key tiles (two bitmap words): many tiles die, none wrongly."""
    res, p64, _ = _run_case(device=kernel_device, Hq=2, Hk=1, Nq=16, Nk=640, D=16, alphas=[2.0, 1.5], mult=2.0,
                            block_m=16, block_n=16)
    assert res.live.shape[-1] == 2
    n_live = sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in res.live.flatten().tolist())
    assert n_live < 2 * 40


def test_pass_cap_still_normalized(kernel_device):
    """Capped at the grid pass and the value pass, the threshold is approximate but every row still sums to one."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 40, 16, generator=gen), torch.randn(1, 2, 60, 16, generator=gen)
    v = torch.ones(1, 2, 60, 16)
    res = _on(kernel_device, entmax_attn_fwd, q, k, v, torch.tensor([1.5, 1.2]), 1.0, max_passes=2, tol=0.0)
    assert (res.n_passes == 2).all()
    assert torch.allclose(res.out.double(), torch.ones_like(res.out.double()), atol=TOL["sum"][torch.float32])


@pytest.mark.parametrize("alpha", [1.0001, 1.001, 1.01])
def test_near_alpha_one_accurate(alpha, kernel_device):
    """The general path forms log(z - tau) as log1p(z - (tau + 1)): no beta-fold loss of digits near alpha = 1.

    Forming ``z - tau`` directly left 1.5e-4 (alpha 1.0001), 1.8e-5 (1.001) and 1.5e-6 (1.01) absolute
    output error against float64 on such a problem; the float32 reference and the kernel now reach ~5e-7.
    """
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=gen) for _ in range(3))
    al = torch.full((4,), alpha)
    scale = 32**-0.5
    res = _on(kernel_device, entmax_attn_fwd, q, k, v, al, scale)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), al.double(), scale=scale)
    out32 = entmax_attention_reference(q, k, v, al, scale=scale)
    _check_close("out", res.out, out64, out32, torch.float32, eps=EPS_NEAR_ONE)
    assert (res.n_passes < DEFAULT_MAX_PASSES).all(), f"passes {res.n_passes.max().item()} hit the cap"
    am1 = al.double().view(1, -1, 1, 1) - 1
    r64 = (am1 * _scores64(q, k, scale, None, False) - res.tau.double()[..., None]).clamp_min(0)
    lsum64 = (r64 ** (1 / am1)).sum(-1)
    lsum_ok = torch.allclose(res.lsum.double(), lsum64, rtol=1e-5, atol=0)  # why: float32 sum of Nk terms vs float64
    assert lsum_ok, "lsum does not match the saved tau"


def test_tighter_tol_is_at_least_as_accurate(kernel_device):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    alpha = torch.tensor([1.5, 1.3])
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha.double(), scale=1.0)
    loose = _on(kernel_device, entmax_attn_fwd, q, k, v, alpha, 1.0, tol=1e-1)
    tight = _on(kernel_device, entmax_attn_fwd, q, k, v, alpha, 1.0, tol=1e-6)
    assert (tight.n_passes >= loose.n_passes).all()
    assert _max_err(tight.out, out64) <= 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_large(dtype, D):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hk, Nq, Nk = 2, 4, 2, 1000, 1500
    q = torch.randn(B, Hq, Nq, D, device=dev, generator=gen).to(dtype)
    k = torch.randn(B, Hk, Nk, D, device=dev, generator=gen).to(dtype)
    v = torch.randn(B, Hk, Nk, D, device=dev, generator=gen).to(dtype)
    alpha = torch.tensor(ALPHAS4, device=dev)
    for causal in (False, True):
        res = entmax_attn_fwd(q, k, v, alpha, D**-0.5, is_causal=causal)
        kw = dict(is_causal=causal, scale=D**-0.5)
        out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha.double(), **kw)
        low = torch.float32 if dtype == torch.bfloat16 else dtype
        out_lp = entmax_attention_reference(q.to(low), k.to(low), v.to(low), alpha.to(low), **kw)
        _check_close("out", res.out, out64, out_lp, dtype)


_SM90_BUILD = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "offline", "sm90_build.py")


def test_compiles_for_sm90():
    """The GPU builds of the forward (mixed, 1.5-entmax and general alpha classes) and of every backward kernel
    (d alpha and every mask-gradient mode), which the interpreter never exercises, compile for sm_90 with the
    specialization a real launch gets (benchmarks/offline/sm90_build.py --check)."""
    # the script builds this checkout's kernels, whichever copy of the package is installed
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, _SM90_BUILD, "--check"], env=env, capture_output=True, text=True,
                          timeout=900)
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]


@triton.jit
def _two_row_keep_kernel(OUT, seed, row_a, row_b, n_cols, dropout_p, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    rows = tl.where(tl.arange(0, 2) == 0, row_a, row_b)
    keep = dropout_keep(seed, 0, rows, cols, n_cols, dropout_p)
    tl.store(OUT + tl.arange(0, 2)[:, None] * BLOCK_N + cols[None, :], keep.to(tl.int8))


def test_dropout_streams_do_not_wrap_past_2_pow_31(kernel_device):
    """Rows 0 and 2**12 with 2**20 keys per row are 2**32 offsets apart: an int32 offset wraps to the
    same stream and repeats the keep-mask; the int64 offset gives independent masks."""
    out = torch.empty(2, 256, dtype=torch.int8, device=kernel_device)
    _two_row_keep_kernel[(1,)](out, 99, 0, 2**12, 2**20, 0.5, BLOCK_N=256)
    a, b = out.bool().cpu()
    assert not torch.equal(a, b)
    assert 0.3 < a.float().mean() < 0.7 and 0.3 < b.float().mean() < 0.7
    small = torch.empty(2, 256, dtype=torch.int8, device=kernel_device)
    _two_row_keep_kernel[(1,)](small, 99, 0, 3, 256, 0.5, BLOCK_N=256)
    mask = dropout_keep_mask(99, 1, 4, 256, 0.5, kernel_device)[0]
    assert torch.equal(small.bool(), mask[[0, 3]])
