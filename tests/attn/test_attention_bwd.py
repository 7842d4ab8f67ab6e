"""The fused Triton backward (``kernels/attn/entmax_attn_bwd.py``) against float64 autograd.

The oracle is ``torch.autograd`` through the materialized float64 reference. The kernel is fed
the reference's threshold ``tau`` rounded to float32 and the matching renormalizer ``lsum``
(what the fused forward saves), so it recomputes the reference weights to float32 accuracy.
"""

import pytest
import torch
from helpers import TOL, assert_close_to_ref, bf16_toward_zero, count_tma_descriptors

from sparse_attn.attention import entmax_attention
from sparse_attn.kernels._args import dropout_keep_mask
from sparse_attn.kernels.attn.entmax_attn_bwd import entmax_attn_bwd
from sparse_attn.reference import entmax_attention_reference

pytestmark = pytest.mark.usefixtures("poison_uninitialized")

# max abs error relative to the largest |reference gradient| (tests/helpers.py, "bwd_kernel_rel")
REL_TOL, GPU_TOL = TOL["bwd_kernel_rel"], TOL["bwd_kernel_rel_gpu"]


def _rand(shape, gen, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)


def _live_from_weights(p, block_m, block_n):
    """Tile liveness bits ``(B, H, n_qt, words)`` of a weight tensor ``p (B, H, Nq, Nk)``."""
    B, H, Nq, Nk = p.shape
    n_qt, n_kt = -(-Nq // block_m), -(-Nk // block_n)
    padded = p.new_zeros(B, H, n_qt * block_m, n_kt * block_n)
    padded[..., :Nq, :Nk] = p
    tiles = (padded.reshape(B, H, n_qt, block_m, n_kt, block_n) != 0).any(5).any(3)
    words = torch.zeros(B, H, n_qt, -(-n_kt // 32), dtype=torch.int64)
    for kt in range(n_kt):
        words[..., kt // 32] |= tiles[..., kt].long() << (kt % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Case:
    """One random problem: float64 reference gradients and everything the kernel needs."""

    def __init__(self, B=2, Hq=2, Hk=2, Nq=40, Nk=40, D=16, alpha=1.5, dtype=torch.float32, causal=False,
                 mask=None, dropout_p=0.0, seed=0, cu_q=None, cu_k=None, scale=None, mask_grad=False, data_seed=0,
                 device="cpu"):
        gen = torch.Generator().manual_seed(data_seed)
        self.dtype, self.causal, self.dropout_p, self.seed = dtype, causal, dropout_p, seed
        self.scale = D**-0.5 if scale is None else scale
        self.cu_q = None if cu_q is None else torch.tensor(cu_q, dtype=torch.int32)
        self.cu_k = None if cu_k is None else torch.tensor(cu_k, dtype=torch.int32)
        if cu_q is not None:
            B, Nq, Nk = 1, cu_q[-1], cu_k[-1]
        q = _rand((B, Hq, Nq, D), gen, dtype).requires_grad_()
        k = _rand((B, Hk, Nk, D), gen, dtype).requires_grad_()
        v = _rand((B, Hk, Nk, D), gen, dtype).requires_grad_()
        do = _rand((B, Hq, Nq, D), gen, dtype)
        alphas = torch.tensor([alpha] * Hq if isinstance(alpha, float) else alpha, dtype=torch.float64)
        self.alpha32 = alphas.float()
        alpha64 = alphas.float().double().requires_grad_()
        if mask is not None and mask.is_floating_point():
            mask = mask.double().requires_grad_(mask_grad)
        self.mask = mask
        kw = dict(attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=Hq != Hk,
                  cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k)
        keep = None
        if dropout_p > 0:
            keep = dropout_keep_mask(seed, B * Hq, Nq, Nk, dropout_p, device).cpu().reshape(B, Hq, Nq, Nk)
        out, stats = entmax_attention_reference(q, k, v, alpha64, dropout_p=dropout_p, dropout_mask=keep,
                                                return_stats=True, **kw)
        grads = torch.autograd.grad((out * do).sum(), [q, k, v, alpha64] + ([mask] if mask_grad else []))
        self.ref = dict(zip(["dq", "dk", "dv", "dalpha", "dbias"], grads))
        with torch.no_grad():
            eye = torch.eye(Nk, dtype=torch.float64).expand(B, Hk, Nk, Nk)
            self.p = entmax_attention_reference(q, k, eye, alpha64, **kw)
            # what the forward's value pass saves for delta: sum_j U_ij v_j (dropped) / sum_j U_ij, U = p^(2 - alpha)
            u = torch.where(self.p > 0, self.p ** (2.0 - alphas.view(1, Hq, 1, 1)), torch.zeros_like(self.p))
            u_drop = u if keep is None else u * keep / (1.0 - dropout_p)
            u_sum = u.sum(-1, keepdim=True)
            out_u = u_drop @ v.detach().repeat_interleave(Hq // Hk, dim=1) / torch.where(u_sum > 0, u_sum, 1.0)
        tau64 = stats.tau.double()
        tau32 = tau64.float()
        beta = 1.0 / (alphas.view(1, Hq, 1, 1) - 1.0).clamp_min(1e-300)
        shift = (tau64 - tau32.double()).unsqueeze(-1)
        r = torch.where(self.p > 0, self.p ** (alphas.view(1, Hq, 1, 1) - 1.0) + shift, torch.zeros_like(self.p))
        lsum = (r.clamp_min(0) ** beta).sum(-1)
        lsum = torch.where((alphas == 1.0).view(1, Hq, 1), torch.ones_like(lsum), lsum)
        valid = stats.n_valid > 0
        self.tau = torch.where(valid, tau32, torch.full_like(tau32, float("inf")))
        self.lsum = torch.where(valid, lsum, torch.zeros_like(lsum)).float()
        self.q, self.k, self.v, self.do = (t.detach().to(dtype) for t in (q, k, v, do))
        self.out = out.detach().to(dtype)
        self.out_u = out_u.float()  # the forward saves it in float32
        bias = None
        if mask is not None:
            bias = mask.detach().float()
            if not mask.is_floating_point():
                bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        self.bias = bias
        self.device = device
        self.to(device)

    def to(self, device):
        for name in ("q", "k", "v", "do", "out", "out_u", "tau", "lsum", "alpha32", "bias", "cu_q", "cu_k"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def run(self, **kw):
        args = dict(bias=self.bias, is_causal=self.causal, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                    dropout_p=self.dropout_p, seed=self.seed, need_dalpha=True, out_u=self.out_u)
        args.update(kw)
        return entmax_attn_bwd(self.do, self.q, self.k, self.v, self.out, self.tau, self.lsum, self.alpha32,
                               self.scale, **args)

    def forward(self, **kw):
        """The fused forward on this problem (``kw``: launcher options)."""
        from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd

        bias = None if self.bias is None else self.bias.expand(*self.q.shape[:3], self.k.shape[2])
        return entmax_attn_fwd(self.q, self.k, self.v, self.alpha32, self.scale, bias=bias, is_causal=self.causal,
                               cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k, dropout_p=self.dropout_p,
                               seed=self.seed, **kw)

    def run_after_forward(self, fwd_kw=None, **kw):
        """The fused forward's out/tau/lsum/live/out_u fed to the backward (the autograd path)."""
        fwd = self.forward(need_out_u=True, **(fwd_kw or {}))
        args = dict(bias=self.bias, is_causal=self.causal, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                    dropout_p=self.dropout_p, seed=self.seed, need_dalpha=True, live=fwd.live,
                    block_m=fwd.block_m, block_n=fwd.block_n, out_u=fwd.out_u)
        args.update(kw)
        return entmax_attn_bwd(self.do, self.q, self.k, self.v, fwd.out, fwd.tau, fwd.lsum, self.alpha32,
                               self.scale, **args)

    def check(self, res, names=("dq", "dk", "dv", "dalpha"), tol=None):
        tol = (GPU_TOL if self.device == "cuda" else REL_TOL)[self.dtype] if tol is None else tol
        got = dict(zip(["dq", "dk", "dv", "dalpha", "dbias"], res))
        for name in names:
            ref, val = self.ref[name], got[name].cpu()
            assert val.shape == ref.shape, name
            assert torch.isfinite(val).all(), name
            err = (val.double() - ref).abs().max().item()
            bound = tol * max(ref.abs().max().item(), 1e-3)
            assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("alpha", [1.0, 1.01, 1.25, 1.5, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_match_reference(alpha, causal, kernel_device):
    case = Case(device=kernel_device, alpha=alpha, causal=causal, Nq=37, Nk=45, D=24)
    res = case.run(block_m=16, block_n=32)
    case.check(res)
    assert res[4] is None  # no mask gradient asked for, none returned


def test_mixed_alpha_gqa_float_mask_dbias(kernel_device):
    gen = torch.Generator().manual_seed(5)
    mask = torch.randn(2, 4, 33, 50, generator=gen)
    mask[0, 1, 3, :] = float("-inf")
    mask[1, :, :, 7] = float("-inf")
    case = Case(device=kernel_device, Hq=4, Hk=2, Nq=33, Nk=50, alpha=[1.0, 1.3, 1.5, 2.0], mask=mask, mask_grad=True,
                causal=True)
    res = case.run(block_m=16, block_n=16, need_dbias=True)
    case.check(res, names=("dq", "dk", "dv", "dalpha", "dbias"))
    assert torch.equal(res[4][0, 1, 3].cpu(), torch.zeros(50))


def test_mqa_bool_mask_fully_masked_rows(kernel_device):
    mask = torch.rand(1, 1, 30, 41, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[..., 4, :] = False
    mask[..., 20:23, :] = False
    case = Case(device=kernel_device, B=1, Hq=3, Hk=1, Nq=30, Nk=41, alpha=[1.75, 1.0, 1.5], mask=mask)
    dq, dk, dv, dalpha, _ = case.run(block_m=16, block_n=16)
    case.check((dq, dk, dv, dalpha))
    assert torch.equal(dq[:, :, 4], torch.zeros_like(dq[:, :, 4]))
    assert torch.equal(dq[:, :, 20:23], torch.zeros_like(dq[:, :, 20:23]))


def test_varlen_causal_cross_lengths(kernel_device):
    cu_q, cu_k = [0, 5, 5, 27, 36, 40], [0, 9, 12, 28, 37, 37]
    case = Case(device=kernel_device, Hq=2, Hk=1, alpha=[1.5, 1.2], cu_q=cu_q, cu_k=cu_k, causal=True)
    dq, dk, dv, dalpha, _ = case.run(block_m=16, block_n=16, max_seqlen_q=22, max_seqlen_k=16)
    case.check((dq, dk, dv, dalpha))
    assert torch.equal(dq[:, :, 36:], torch.zeros_like(dq[:, :, 36:]))


def test_single_query_row_causal(kernel_device):
    case = Case(device=kernel_device, B=1, Hq=2, Hk=1, Nq=1, Nk=37, alpha=[1.0, 1.5], causal=True, D=20)
    case.check(case.run(block_m=16, block_n=16))


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_dropout_replays_forward_mask(alpha, kernel_device):
    case = Case(device=kernel_device, alpha=alpha, dropout_p=0.3, seed=1234, Nq=21, Nk=35, Hq=2, Hk=1)
    case.check(case.run(block_m=16, block_n=16))


@pytest.mark.parametrize("alpha", [1.0, 1.0001, 1.001, 1.01])
def test_near_alpha_one(alpha, kernel_device):
    # the naive d alpha formula loses all digits at alpha = 1.0001 in float32 (docs/backward.md)
    case = Case(device=kernel_device, alpha=alpha, B=1, Nq=24, Nk=40, scale=1.0)
    res = case.run(block_m=16, block_n=32)
    case.check(res)


@pytest.mark.parametrize("Hk", [2, 1])
def test_fp16_grads(Hk, kernel_device):
    """Also GQA with heads of two alpha classes in one group: the class launches add dK/dV in float32 partials."""
    case = Case(device=kernel_device, alpha=[1.0, 1.5], dtype=torch.float16, causal=True, Nq=33, Nk=33, Hk=Hk)
    res = case.run(block_m=16, block_n=16)
    assert all(t.dtype == torch.float16 for t in res[:3])
    case.check(res)


def test_live_bitmap_skips_dead_tiles(kernel_device):
    mask = torch.ones(2, 1, 48, 64, dtype=torch.bool)
    mask[:, :, :16, 32:] = False
    mask[:, :, 32:, :16] = False
    case = Case(device=kernel_device, alpha=2.0, mask=mask, Nq=48, Nk=64, scale=2.0)
    live = _live_from_weights(case.p, 16, 16).to(kernel_device)
    assert (live != 2**4 - 1).any(), "the test needs dead tiles"
    full = case.run(block_m=16, block_n=16, need_dbias=True)
    skipped = case.run(block_m=16, block_n=16, need_dbias=True, live=live)
    for a, b in zip(full, skipped):
        assert torch.equal(a, b)
    dead = case.run(block_m=16, block_n=16, live=torch.zeros_like(live))
    assert all(torch.equal(t, torch.zeros_like(t)) for t in dead if t is not None)


def test_deterministic_and_layout_independent(kernel_device):
    case = Case(device=kernel_device, Hq=4, Hk=2, alpha=[1.0, 1.1, 1.5, 2.0], causal=True, Nq=40, Nk=40)
    a = case.run(block_m=16, block_n=16, need_dbias=True)
    b = case.run(block_m=16, block_n=16, need_dbias=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for name in ("q", "k", "v", "do", "out"):
        t = getattr(case, name)
        setattr(case, name, t.transpose(1, 2).contiguous().transpose(1, 2))
    c = case.run(block_m=16, block_n=16, need_dbias=True)
    assert all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("alpha, causal, dropout_p", [([1.0, 1.5], True, 0.0), ([2.0, 1.25], False, 0.2)])
def test_after_fused_forward(alpha, causal, dropout_p, kernel_device):
    mask = torch.randn(1, 2, 40, 48, generator=torch.Generator().manual_seed(3))
    case = Case(device=kernel_device, Hq=2, Hk=1, alpha=alpha, causal=causal, Nq=40, Nk=48, mask=mask,
                dropout_p=dropout_p, seed=11)
    case.check(case.run_after_forward())


def test_after_fused_forward_above_head_dim_128(kernel_device):
    """Gradients from the training forward whose out_u comes from its second value pass (head dim 160)."""
    case = Case(device=kernel_device, Hq=2, Hk=1, D=160, alpha=[1.5, 1.25], causal=True, Nq=24, Nk=40)
    case.check(case.run_after_forward())


def test_bad_arguments(kernel_device):
    """User errors are ValueError/TypeError of the public function (the launcher does not re-validate);
    internal inconsistencies fail the launcher's asserts, which name the argument."""
    case = Case(device=kernel_device, B=1, Hq=2, Hk=2, Nq=16, Nk=16)
    with pytest.raises(ValueError, match="alpha"):
        entmax_attention(case.q, case.k, case.v, torch.tensor([0.5, 1.5], device=kernel_device), backend="triton")
    with pytest.raises(TypeError, match="share one dtype"):
        entmax_attention(case.q, case.k.half(), case.v, 1.5, backend="triton")
    with pytest.raises(AssertionError, match="block_m"):
        case.run(live=torch.zeros(1, 2, 1, 1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="k, v, do, out"):
        entmax_attn_bwd(case.do, case.q, case.k.half(), case.v, case.out, case.tau, case.lsum, case.alpha32, 1.0)
    with pytest.raises(AssertionError, match="tau"):
        entmax_attn_bwd(case.do, case.q, case.k, case.v, case.out, case.tau[:, :, :3], case.lsum, case.alpha32, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_after_fused_forward(dtype, causal):
    case = Case(device="cuda", B=2, Hq=4, Hk=2, Nq=300, Nk=333, D=64, alpha=[1.0, 1.2, 1.5, 2.0], dtype=dtype,
                causal=causal)
    case.check(case.run_after_forward(), tol=GPU_TOL[dtype])


@pytest.mark.gpu
def test_gpu_varlen_gqa_dropout_dbias():
    mask = torch.randn(1, 4, 700, 650, generator=torch.Generator().manual_seed(9))
    case = Case(device="cuda", Hq=4, Hk=1, alpha=[1.0, 1.05, 1.5, 2.0], D=128, cu_q=[0, 200, 201, 700],
                cu_k=[0, 150, 400, 650], causal=True, dropout_p=0.1, seed=3, mask=mask, mask_grad=True)
    res = case.run_after_forward(need_dbias=True)
    case.check(res, names=("dq", "dk", "dv", "dalpha", "dbias"), tol=GPU_TOL[torch.float32])
    again = case.run_after_forward(need_dbias=True)
    assert all(torch.equal(x, y) for x, y in zip(res, again))


def test_dalpha_matches_finite_differences_of_fused_forward(kernel_device):
    from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd

    case = Case(device=kernel_device, B=1, Hq=4, Hk=2, Nq=24, Nk=40, alpha=[1.05, 1.3, 1.5, 1.9], causal=True)
    step = 1e-3

    def head_losses(alpha):
        out = entmax_attn_fwd(case.q, case.k, case.v, alpha, case.scale, is_causal=True, tol=1e-6).out
        return (out.double() * case.do.double()).sum(dim=(0, 2, 3))

    fd = (head_losses(case.alpha32 + step) - head_losses(case.alpha32 - step)) / (2 * step)
    dalpha = case.run_after_forward()[3].double()
    assert (dalpha - fd).abs().max() <= 2e-3 * fd.abs().max()


def test_empty_inputs(kernel_device):
    q = torch.randn(1, 2, 5, 16, device=kernel_device)
    k = torch.randn(1, 2, 0, 16, device=kernel_device)
    stats = torch.zeros(1, 2, 5, device=kernel_device)
    dq, dk, dv, dalpha, dbias = entmax_attn_bwd(q, q, k, k, q, stats, stats, 1.5, 1.0, need_dalpha=True,
                                                need_dbias=True)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dbias.shape == (1, 2, 5, 0)
    assert torch.equal(dalpha, torch.zeros_like(dalpha))


def test_learnable_alpha_training_loop_on_fused_path(kernel_device):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    target = entmax_attention_reference(q, k, v, torch.tensor([1.1, 1.9], dtype=torch.float64), scale=1.0).float()
    q, k, v, target = (t.float().to(kernel_device) for t in (q, k, v, target))
    alpha = torch.tensor([1.5, 1.5], device=kernel_device, requires_grad=True)
    opt = torch.optim.Adam([alpha], lr=0.1)
    losses = []
    for _ in range(12):
        loss = (entmax_attention(q, k, v, alpha, scale=1.0, backend="triton") - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            alpha.clamp_(1.0, 2.0)
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    assert alpha[0].item() < 1.35 and alpha[1].item() > 1.7


def test_grid_limits_raise_value_error():
    """Heads and batch are launch-grid axes 1 and 2 (CUDA caps each at 65535): more must fail clearly,
    in the backward launcher and through the public function."""
    q = torch.zeros(1, 65536, 1, 16)
    stats = torch.zeros(1, 65536, 1)
    with pytest.raises(ValueError, match="65535 heads"):
        entmax_attn_bwd(q, q, q, q, q, stats, stats, 1.5, 1.0)
    with pytest.raises(ValueError, match="65535 heads"):
        entmax_attention(q, q, q, 1.5, backend="triton")


@pytest.mark.gpu
def test_gpu_batch_times_heads_beyond_65535():
    """B * H = 65536 programs per tile index: the (tiles, heads, batch) grid launches them all."""
    case = Case(device="cuda", B=1024, Hq=64, Hk=64, Nq=16, Nk=16, D=16, alpha=1.5)
    case.check(case.run_after_forward())


@pytest.mark.parametrize("shape", [(1, 1, 55, 50), (1, 2, 1, 50), (1, 1, 55, 1)])
def test_varlen_broadcast_mask_dbias(shape, kernel_device):
    """Varlen with masks broadcast over heads, queries or keys: d bias in the mask's own shape."""
    mask = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    case = Case(device=kernel_device, Hq=2, Hk=1, alpha=[1.5, 1.0], cu_q=[0, 5, 5, 38, 55], cu_k=[0, 7, 10, 50, 50],
                causal=True, mask=mask, mask_grad=True)
    res = case.run(block_m=16, block_n=16, need_dbias=True)
    assert res[4].shape == shape
    names = ("dq", "dk", "dv", "dalpha") + (("dbias",) if shape[-1] > 1 else ())
    case.check(res, names=names)


FWD_FIELDS = ("out", "tau", "lsum", "nnz", "n_valid", "live", "n_passes", "tile_visits")


@pytest.mark.parametrize("kw", [
    dict(alpha=[1.0, 1.3, 1.5, 2.0], Hq=4, Hk=2, causal=True, dropout_p=0.25, mask="float"),
    dict(alpha=[1.0001, 1.7], Hq=2, Hk=1, cu_q=[0, 9, 9, 40], cu_k=[0, 13, 20, 47], causal=True, mask="bool"),
    dict(alpha=2.0, Nq=33, Nk=50),
    # head dim above 128: out_u in a second value pass (kernels/attn/_fwd_rows.py, SPLIT_U)
    dict(alpha=[1.0, 1.25, 1.5, 2.0], Hq=4, Hk=2, D=160, Nq=24, Nk=40, causal=True, dropout_p=0.25, mask="float"),
])
def test_training_forward_equals_inference_forward(kw, kernel_device):
    """The forward with the backward's bookkeeping (need_out_u) gives bitwise the outputs and statistics of the
    inference forward, and out_u = sum_j U_ij v_j (dropped) / sum_j U_ij matches the float64 reference. Above head
    dim 128 the training forward runs one more pass over the live tiles (out_u) on alpha > 1 heads, and counts it."""
    kw = dict(kw)
    mask_kind = kw.pop("mask", None)
    shape = (1 if "cu_q" in kw else 2, 1, 40 if "cu_q" in kw else kw.get("Nq", 40), 47 if "cu_q" in kw else
             kw.get("Nk", 40))
    gen = torch.Generator().manual_seed(31)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(*shape, generator=gen)
        mask[..., 2, :] = float("-inf")
    elif mask_kind == "bool":
        mask = torch.rand(*shape, generator=gen) > 0.3
    case = Case(device=kernel_device, mask=mask, seed=7, **kw)
    infer = case.forward()
    train = case.forward(need_out_u=True)
    assert infer.out_u is None and train.out_u.shape == case.q.shape and train.out_u.dtype == torch.float32
    split = kw.get("D", 16) > 128
    for name in FWD_FIELDS:
        if split and name in ("n_passes", "tile_visits"):
            continue
        assert torch.equal(getattr(infer, name), getattr(train, name)), name
    soft = (case.alpha32 == 1.0).to(kernel_device)
    if split:
        extra = (~soft).int().view(1, -1, 1)  # one more pass on alpha > 1 heads, over the tiles live after the forward
        assert torch.equal(train.n_passes, infer.n_passes + extra)
        live_tiles = torch.stack([sum((w >> b) & 1 for b in range(32)) for w in train.live.unbind(-1)], -1).sum(-1)
        assert torch.equal(train.tile_visits, infer.tile_visits + extra * live_tiles)
    # alpha = 1 heads: U = p, out_u is the output before rounding to q.dtype
    assert torch.equal(train.out_u[:, soft].to(case.q.dtype), train.out[:, soft])
    got = train.out_u
    if case.cu_q is not None:  # rows outside every sequence
        got = got[:, :, : int(case.cu_q[-1])]
    err = (got.double() - case.out_u.double()).abs().max().item()
    assert err <= 2e-5 * case.out_u.abs().max().item(), err


def test_out_u_only_when_gradients_are_needed(kernel_device, monkeypatch):
    """The autograd op asks the forward for out_u only in grad mode with an input requiring grad: inference
    (torch.no_grad, or no input requiring grad) does not pay for it, and the outputs are the same."""
    import sparse_attn.attn._attn_autograd as autograd_mod

    asked = []
    real = autograd_mod.launch_fwd

    def recording(*args, **kw):
        asked.append(kw["need_out_u"])
        return real(*args, **kw)

    monkeypatch.setattr(autograd_mod, "launch_fwd", recording)
    gen = torch.Generator().manual_seed(32)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=gen).to(kernel_device) for _ in range(3))
    alpha = torch.tensor([1.5, 1.2], device=kernel_device)
    plain = entmax_attention(q, k, v, alpha, backend="triton")
    with torch.no_grad():
        no_grad = entmax_attention(q.requires_grad_(), k, v, alpha, backend="triton")
    graded = entmax_attention(q, k, v, alpha, backend="triton")
    only_alpha = entmax_attention(q.detach(), k, v, alpha.requires_grad_(), backend="triton")
    softmax = entmax_attention(q, k, v, 1.0, backend="triton", return_stats=True)[0]
    assert asked == [False, False, True, True, False]  # softmax: delta = dO . out, no out_u
    assert torch.equal(plain, no_grad) and torch.equal(plain, graded.detach()) and torch.equal(plain, only_alpha)
    assert softmax.requires_grad


def test_backward_without_out_u(kernel_device):
    """out_u is required unless every head is softmax (where delta = dO . out)."""
    case = Case(device=kernel_device, B=1, Hq=2, Hk=1, Nq=20, Nk=24, alpha=1.5)
    with pytest.raises(AssertionError, match="out_u"):
        case.run(out_u=None)
    soft = Case(device=kernel_device, B=1, Hq=2, Hk=1, Nq=20, Nk=24, alpha=1.0)
    soft.check(soft.run(out_u=None, alpha_class="softmax"))
    soft.check(entmax_attn_bwd(soft.do, soft.q, soft.k, soft.v, soft.out, soft.tau, soft.lsum, 1.0, soft.scale,
                               need_dalpha=True))


def test_mixed_class_launches_match_single_class_launches(kernel_device):
    """A device alpha starts one filtered launch per alpha class; a head gets bitwise the gradients of a launch of
    its class alone (one q head per kv head, so no cross-class dK/dV sums)."""
    case = Case(device=kernel_device, B=1, Hq=4, Hk=4, Nq=37, Nk=45, alpha=[1.0, 2.0, 1.5, 1.3], causal=True)
    mixed = case.run(block_m=16, block_n=16, alpha_class="mixed")
    for h in range(4):
        one = slice(h, h + 1)
        single = entmax_attn_bwd(case.do[:, one], case.q[:, one], case.k[:, one], case.v[:, one], case.out[:, one],
                                 case.tau[:, one], case.lsum[:, one], case.alpha32[one], case.scale, is_causal=True,
                                 need_dalpha=True, block_m=16, block_n=16, out_u=case.out_u[:, one])
        for got, want in zip(mixed[:3], single[:3]):
            assert torch.equal(got[:, one], want)
        assert torch.equal(mixed[3][one], single[3])
    case.check(mixed)


def test_many_tiles_and_backward_tiles_inside_forward_tiles(kernel_device):
    """More than 32 query and key tiles (two liveness words per row, two 32-tile chunks per key-tile column), and
    backward query tiles that are halves of the forward's 128-row tiles (the bitmap's rows)."""
    n = 544
    idx = torch.arange(n)
    # a sliding window of 24 keys plus the first 16 keys: few live tiles per row (the interpreter is slow), rows
    # past key tile 32 live in both words
    mask = ((idx[:, None] - idx[None, :]).abs() < 24) | (idx[None, :] < 16)
    mask = mask.expand(1, 1, n, n)
    case = Case(device=kernel_device, B=1, Hq=1, Hk=1, Nq=n, Nk=n, D=16, alpha=2.0, scale=3.0, mask=mask,
                causal=True)
    live = _live_from_weights(case.p, 16, 16).to(kernel_device)
    assert live.shape[-1] == 2 and (live[..., 0] != -1).any(), "the test needs two words per row and dead tiles"
    assert ((live[..., 0] != 0) & (live[..., 1] != 0)).any(), "the test needs rows with live tiles in both words"
    case.check(case.run(block_m=16, block_n=16, live=live))
    halves = case.run(block_m=128, block_n=16, live=_live_from_weights(case.p, 128, 16).to(kernel_device))
    case.check(halves)


@pytest.mark.parametrize("data_seed,scale", [(0, 20.0), (1, 10.0)])
def test_bf16_delta_from_float32_out_u(data_seed, scale, kernel_device):
    """Where the weights saturate, dS = U (dP - delta) cancels: delta from an out_u rounded to bf16 left dq, dk
    errors up to 3.6x the bound of the tolerance rule at these inputs (measured), the forward's float32
    out_u keeps them within half of it. Baselines: the reference run in bf16, and the float64 gradient rounded to
    bf16 as a kernel stores it."""
    if kernel_device != "cpu":
        pytest.skip("on a GPU the products round P and dS to bf16 (GPU_TOL); this is the interpreter's float32 math")
    case = Case(B=1, Hq=2, Hk=1, Nq=32, Nk=48, D=16, alpha=[1.0, 1.5], dtype=torch.bfloat16, scale=scale,
                causal=True, data_seed=data_seed)
    assert case.out_u.dtype == torch.float32
    q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = entmax_attention_reference(q, k, v, torch.tensor([1.0, 1.5]), is_causal=True, scale=case.scale,
                                     enable_gqa=True)
    bf16_ref = torch.autograd.grad((out.float() * case.do.float()).sum(), [q, k, v])
    for name, got, base in zip(("dq", "dk", "dv"), case.run()[:3], bf16_ref):
        ref64 = case.ref[name]
        assert_close_to_ref(got, ref64, [base, bf16_toward_zero(ref64)], eps=0.0, name=name)


@pytest.mark.parametrize("elem_size", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_pinned_tiles(head_dim, deterministic, elem_size, kernel_device, monkeypatch):
    """Forward and backward at the tiles the GPU pins for this head dim and inputs of ``elem_size`` bytes (the
    forward's ``_pick_config(head_dim, False, elem_size)``, which fix the bitmap, and the backward kernels' own,
    ``entmax_attn_bwd._pick_config``: for 16-bit inputs 64 to 128 query rows or keys, the dK/dV products by keys or,
    above head dim 128, by rows; for float32 the narrow tiles that fit sm_90's shared memory), with partial tiles at
    both ends, causal, per-head alpha in three classes, with the atomic dQ too: the gradients match float64 as at the
    interpreter's tiles (float32 inputs here either way)."""
    from sparse_attn.kernels.attn import entmax_attn_bwd as bwd
    from sparse_attn.kernels.attn.entmax_attn_fwd import _pick_config

    gpu_tiles = bwd._pick_config
    monkeypatch.setattr(bwd, "_pick_config",
                        lambda d, interpret, *flags: gpu_tiles(d, False, *flags[:4], elem_size=elem_size))
    block_m, block_n, _, _ = _pick_config(head_dim, False, elem_size)
    case = Case(device=kernel_device, B=1, Hq=3, Hk=1, Nq=block_m + 7, Nk=2 * block_n + 5, D=head_dim,
                alpha=[1.5, 1.25, 2.0], causal=True)
    case.check(case.run_after_forward(fwd_kw=dict(block_m=block_m, block_n=block_n), deterministic=deterministic))


@pytest.mark.parametrize("kw, mask_shape", [
    # GQA with heads of every class in a group, causal, a dense float mask with its gradient (dS stored by dK/dV)
    (dict(B=2, Hq=4, Hk=2, Nq=33, Nk=50, alpha=[1.0, 1.3, 1.5, 2.0], causal=True), (2, 4, 33, 50)),
    # varlen, cross lengths, a mask broadcast over queries (column sums) and dropout
    (dict(Hq=2, Hk=1, alpha=[1.5, 1.2], cu_q=[0, 5, 5, 27, 36, 40], cu_k=[0, 9, 12, 28, 37, 37], causal=True,
          dropout_p=0.2, seed=5), (1, 1, 1, 37)),
    # a mask broadcast over keys (row sums of dS, added with atomics) and over heads (the d bias kernel)
    (dict(B=2, Hq=2, Hk=2, Nq=37, Nk=45, alpha=2.0), (2, 2, 37, 1)),
    (dict(B=2, Hq=2, Hk=1, Nq=37, Nk=45, alpha=[1.01, 1.75]), (1, 1, 37, 45)),
])
def test_atomic_dq_matches_reference(kw, mask_shape, kernel_device):
    """``deterministic=False``: the dK/dV kernel adds dQ and the d alpha row sums with atomics (five products per
    tile). Every gradient matches float64 within the deterministic backward's tolerance; dK and dV are computed as in
    the deterministic backward, dQ and d alpha agree with it to float32 rounding."""
    mask = torch.randn(*mask_shape, generator=torch.Generator().manual_seed(8))
    case = Case(device=kernel_device, mask=mask, mask_grad=True, **kw)
    det = case.run(block_m=16, block_n=16, need_dbias=True)
    res = case.run(block_m=16, block_n=16, need_dbias=True, deterministic=False)
    names = ("dq", "dk", "dv", "dalpha") + (("dbias",) if mask_shape[-1] > 1 else ())
    case.check(res, names=names)
    assert res[4].shape == mask_shape
    for name, a, b in zip(("dq", "dk", "dv", "dalpha", "dbias"), det, res):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if kernel_device == "cpu" and name in ("dk", "dv"):
            assert torch.equal(a, b), name  # the interpreter runs the same products in the same order


def test_atomic_dq_after_fused_forward_half_precision(kernel_device):
    """The atomic dQ from the fused forward's bitmap (fp16, GQA, one alpha class per launch and mixed classes)."""
    case = Case(device=kernel_device, alpha=[1.0, 1.5], dtype=torch.float16, causal=True, Nq=45, Nk=40, Hk=1)
    res = case.run_after_forward(deterministic=False)
    assert all(t.dtype == torch.float16 for t in res[:3])
    case.check(res)
    case.check(case.run_after_forward(deterministic=False, alpha_class="mixed"))


@pytest.mark.parametrize("deterministic", [True, False])
def test_tma_descriptor_loads_match_pointer_loads(deterministic, kernel_device, monkeypatch):
    """The loops' K / V and Q / dO tiles through TMA tensor descriptors (on a GPU from sm_90 when the layout allows;
    forced here) give the gradients of the masked pointer loads: zeros past each packed sequence's end and past the
    head dim (24 of a 32-wide block), GQA, causal, a head-broadcast mask (the d bias kernel's loop too). Every kernel
    takes the descriptors here (``_TMA_KERNELS`` limits them to the dQ kernel on a GPU)."""
    from sparse_attn.kernels import _args
    from sparse_attn.kernels.attn import entmax_attn_bwd as bwd

    monkeypatch.setattr(bwd, "_TMA_KERNELS", ("dq", "dkdv", "dbias"))

    mask = torch.randn(1, 1, 40, 37, generator=torch.Generator().manual_seed(6))
    case = Case(device=kernel_device, Hq=2, Hk=1, D=24, alpha=[1.5, 1.0], cu_q=[0, 5, 5, 27, 36, 40],
                cu_k=[0, 9, 12, 28, 37, 37], causal=True, mask=mask, mask_grad=True)
    monkeypatch.setattr(_args, "tma_device", lambda device: False)
    with count_tma_descriptors() as off:
        plain = case.run(block_m=16, block_n=16, need_dbias=True, deterministic=deterministic)
    monkeypatch.setattr(_args, "tma_device", lambda device: True)
    assert all(_args.tma_rows(t) for t in (case.q, case.k, case.v, case.do))
    with count_tma_descriptors() as on:
        tma = case.run(block_m=16, block_n=16, need_dbias=True, deterministic=deterministic)
    case.check(tma, names=("dq", "dk", "dv", "dalpha", "dbias"))
    if kernel_device == "cpu":  # the same loads: bitwise the same gradients (a GPU build may schedule them apart)
        assert off == {"make": 0, "load": 0} and on["make"] > 0 and on["load"] > 0, (off, on)
        for name, a, b in zip(("dq", "dk", "dv", "dalpha", "dbias"), plain, tma):
            assert torch.equal(a, b), name
