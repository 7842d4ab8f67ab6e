"""The fused forward's threshold search: pass and tile-visit counters, the dead-tile certificate,
compile-time alpha classes against the run-time (mixed) path, accuracy per dtype, keep masks and
the non-finite policy. Kernels run on the kernel device (the interpreter on CPU)."""

import math

import pytest
import torch
import triton
import triton.language as tl

from sparse_attn.kernels._args import mask_spec
from sparse_attn.kernels._masking import key_tile, mark_tile, visit_tile, walk_words
from sparse_attn.kernels.attn.entmax_attn_fwd import alpha_class_of, entmax_attn_fwd, runs_split
from sparse_attn.mappings import entmax
from sparse_attn.reference import entmax_attention_reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _inputs(dev, b=1, h=2, nq=80, nk=None, d=32, std=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    q = torch.randn(b, h, nq, d, generator=g) * std
    k = torch.randn(b, h, nk, d, generator=g) * std
    v = torch.randn(b, h, nk, d, generator=g)
    return (t.to(device=dev, dtype=dtype) for t in (q, k, v))


def _popcount(live: torch.Tensor) -> torch.Tensor:
    """Set bits per query tile of a liveness bitmap ``(S, H, n_qt, words)``."""
    bits = (live.long().unsqueeze(-1) >> torch.arange(32, device=live.device)) & 1
    return bits.sum(dim=(-1, -2))


def _flash_style(q, k, v, alpha, scale, dtype, causal=False):
    """FlashAttention-style low-precision output: fp32 scores, the float64 threshold rounded to fp32,
    weights rounded to ``dtype`` before the value product, fp32 normalizer, output in ``dtype``."""
    s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
    s32 = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        nq, nk = s64.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s64 = s64.masked_fill(~keep, float("-inf"))
        s32 = s32.masked_fill(~keep, float("-inf"))
    if alpha == 1.0:
        p = torch.exp(s32 - torch.logsumexp(s64, -1, keepdim=True).float())
    else:
        p64 = entmax(s64, alpha, dim=-1)
        z64 = (alpha - 1) * s64
        idx = p64.argmax(-1, keepdim=True)
        tau = (z64.gather(-1, idx) - p64.gather(-1, idx) ** (alpha - 1)).float()
        p = ((alpha - 1) * s32 - tau).clamp_min(0) ** (1 / (alpha - 1))
    out = (p.to(dtype).float() @ v.float()) / p.sum(-1, keepdim=True)
    return out.to(dtype)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_counters_match_the_bitmap(kernel_device, alpha):
    """n_passes counts every pass (1 for softmax); tile_visits lies between the bounds the live sets give:
    the first pass visits every visible tile, every later pass at least the finally-live ones."""
    q, k, v = _inputs(kernel_device, nq=96, nk=160)
    res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), 32 ** -0.5,
                          block_m=32, block_n=32)
    visible = math.ceil(160 / 32)
    final = _popcount(res.live).cpu()
    passes, visits = res.n_passes.cpu(), res.tile_visits.cpu()
    if alpha == 1.0:
        assert torch.all(passes == 1) and torch.all(visits == visible) and torch.all(final == visible)
    else:
        assert torch.all(passes >= 2)
        assert torch.all(visits >= visible + (passes - 1) * final)
        assert torch.all(visits <= passes * visible)


def test_dense_rows_take_at_most_two_passes_before_the_value_pass(kernel_device):
    """bf16 / fp16 inputs at alpha 1.5 and 2 (random scores, all tiles live): the fused forward takes the grid pass
    and one candidate pass; the split forward the max pass, the bracket pass and one refinement pass at alpha 1.5,
    two at alpha 2 (docs/kernels.md, "Design study")."""
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _inputs(kernel_device, nq=128, nk=256, dtype=dtype, seed=3)
        for alpha in (1.5, 2.0):
            res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), 32 ** -0.5,
                                  block_m=64, block_n=64)
            cls = alpha_class_of([alpha])
            limit = {"entmax15": 4, "sparsemax": 5}[cls] if runs_split(cls) else 3
            assert res.n_passes.max().item() <= limit, (dtype, alpha, res.n_passes)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 1.75])
@pytest.mark.parametrize("causal", [False, True])
def test_dead_tiles_hold_no_weight(kernel_device, alpha, causal):
    """Certificate: no key tile marked dead holds a float64 reference weight above 1e-6 for any row."""
    q, k, v = _inputs(kernel_device, nq=64, nk=192, std=2.0, seed=5)
    # local structure: nearby keys align with each query, so many far tiles die
    k = k + torch.linspace(-3, 3, 192, device=kernel_device)[None, None, :, None]
    q = q + torch.linspace(-3, 3, 64, device=kernel_device)[None, None, :, None]
    bm = bn = 16
    res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), 32 ** -0.5, is_causal=causal,
                          block_m=bm, block_n=bn)
    _, weights = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, is_causal=causal,
                                            scale=32 ** -0.5, return_weights=True)
    w = weights[0].cpu()  # (H, Nq, Nk)
    tile_max = w.reshape(2, 64 // bm, bm, 192 // bn, bn).amax(dim=(2, 4))  # (H, n_qt, n_kt)
    bits = (res.live[0].cpu().long().unsqueeze(-1) >> torch.arange(32)) & 1  # (H, n_qt, words, 32)
    live = bits.flatten(-2)[..., : 192 // bn].bool()
    assert (~live).any(), "the test needs dead tiles"
    assert tile_max[~live].max().item() <= 1e-6


@pytest.mark.parametrize("alphas", [[1.5, 1.5], [2.0, 2.0], [1.3, 1.7], [1.0, 1.0]])
def test_specialized_class_equals_the_mixed_path(kernel_device, alphas):
    """The same heads compiled for their alpha class and through the run-time branch give identical bits."""
    q, k, v = _inputs(kernel_device, nq=48, nk=72, seed=7)
    a = torch.tensor(alphas, device=kernel_device)
    cls = alpha_class_of(alphas)
    assert cls != "mixed"
    one = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, alpha_class=cls)
    mixed = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, alpha_class="mixed")
    for name in ("out", "tau", "lsum", "nnz", "n_valid", "live", "n_passes", "tile_visits"):
        assert torch.equal(getattr(one, name), getattr(mixed, name)), name


def test_mixed_heads_in_one_launch_match_single_class_launches(kernel_device):
    q, k, v = _inputs(kernel_device, h=4, nq=40, seed=8)
    alphas = [1.0, 1.5, 2.0, 1.3]
    mixed = entmax_attn_fwd(q, k, v, torch.tensor(alphas, device=kernel_device), 32 ** -0.5, alpha_class="mixed")
    for h, a in enumerate(alphas):
        one = entmax_attn_fwd(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], torch.tensor([a], device=kernel_device),
                              32 ** -0.5)
        assert torch.equal(one.out[:, 0], mixed.out[:, h]), a
        assert torch.equal(one.tau[:, 0], mixed.tau[:, h]), a


def test_alpha_class_of():
    assert alpha_class_of([1.0, 1.0]) == "softmax"
    assert alpha_class_of([2.0]) == "sparsemax"
    assert alpha_class_of([1.5, 1.5]) == "entmax15"
    assert alpha_class_of([1.2, 1.7]) == "general"
    assert alpha_class_of([1.2, 1.5]) == "mixed"
    assert alpha_class_of([1.0, 1.3]) == "mixed"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_within_twice_a_flash_style_pipeline(kernel_device, dtype, alpha, causal):
    dt = DTYPES[dtype]
    q, k, v = _inputs(kernel_device, nq=64, nk=96, std=1.5, seed=11, dtype=dt)
    scale = 32 ** -0.5
    res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), scale, is_causal=causal)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, is_causal=causal, scale=scale)
    err = (res.out.double() - out64).abs().max().item()
    err_ref = (_flash_style(q, k, v, alpha, scale, dt, causal).double() - out64).abs().max().item()
    assert err <= 2 * err_ref + 1e-5, (err, err_ref)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 1.0001, 1.9])
@pytest.mark.parametrize("std", [0.3, 1.0, 3.0])
def test_fp32_within_2e_5(kernel_device, alpha, std):
    q, k, v = _inputs(kernel_device, nq=64, nk=112, std=std, seed=13)
    res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), 32 ** -0.5)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, scale=32 ** -0.5)
    assert (res.out.double() - out64).abs().max().item() <= 2e-5


def test_keep_mask_is_read_as_is(kernel_device):
    """A boolean keep mask at its own broadcast shape (zero strides) gives the reference's result."""
    q, k, v = _inputs(kernel_device, nq=40, nk=56, seed=17)
    g = torch.Generator().manual_seed(0)
    keep = (torch.rand(1, 1, 40, 56, generator=g) > 0.4).to(kernel_device)
    keep[..., 5, :] = False  # a row with nothing to attend to
    for alpha in (1.0, 1.5, 1.3):
        res = entmax_attn_fwd(q, k, v, torch.full((2,), alpha, device=kernel_device), 32 ** -0.5,
                              bias=keep)
        out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, attn_mask=keep,
                                           scale=32 ** -0.5)
        assert (res.out.double() - out64).abs().max().item() <= 2e-5
        assert torch.all(res.out[..., 5, :] == 0) and torch.all(res.n_valid[..., 5] == 0)


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.3])
def test_nan_and_inf_scores_give_nan_rows(kernel_device, alpha):
    """Policy: a NaN (from q) or +inf (from a float mask) among a row's scores makes that row NaN; -inf is excluded;
    other rows are untouched."""
    q, k, v = _inputs(kernel_device, nq=40, nk=40, seed=19)
    q[0, 0, 3, 5] = float("nan")
    bias = torch.zeros(1, 2, 40, 40, device=kernel_device)
    bias[:, :, 7, 9] = float("inf")
    bias[:, :, 8, :] = float("-inf")
    a = torch.full((2,), alpha, device=kernel_device)
    res = entmax_attn_fwd(q, k, v, a, 32 ** -0.5, bias=bias)
    assert torch.isnan(res.out[0, 0, 3]).all()
    assert torch.isnan(res.out[0, :, 7]).all()
    assert torch.all(res.out[0, :, 8] == 0)
    # the other rows: as the reference gives them (rows of a tile stop together, so not bitwise a clean run's)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, attn_mask=bias.double(),
                                       scale=32 ** -0.5)
    others = [i for i in range(40) if i not in (3, 7, 8)]
    assert (res.out[0, 1, others].double() - out64[0, 1, others]).abs().max().item() <= 2e-5
    assert (res.out[0, 0, [i for i in others if i != 3]].double() - out64[0, 0, [i for i in others if i != 3]]
            ).abs().max().item() <= 2e-5


def test_alpha_outside_range_gives_nan_head_on_the_mixed_path(kernel_device):
    """Unchecked (device) alpha values outside [1, 2] or NaN: that head's outputs are NaN, others unchanged."""
    q, k, v = _inputs(kernel_device, h=3, nq=24, seed=23)
    res = entmax_attn_fwd(q, k, v, torch.tensor([1.5, 2.5, float("nan")], device=kernel_device), 32 ** -0.5,
                          alpha_class="mixed")
    good = entmax_attn_fwd(q[:, :1], k[:, :1], v[:, :1], torch.tensor([1.5], device=kernel_device), 32 ** -0.5)
    assert torch.equal(res.out[:, 0], good.out[:, 0])
    assert torch.isnan(res.out[:, 1:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("alpha_class", ["softmax", "sparsemax", "entmax15", "general", "mixed"])
def test_gpu_configs(d, alpha_class):
    """The pinned GPU configs (128-row tiles up to head dim 128) run and match the reference in bf16."""
    alpha = {"softmax": 1.0, "sparsemax": 2.0, "entmax15": 1.5, "general": 1.3, "mixed": 1.3}[alpha_class]
    q, k, v = _inputs("cuda", b=2, h=4, nq=1000, nk=1100, d=d, seed=29, dtype=torch.bfloat16)
    for causal in (False, True):
        res = entmax_attn_fwd(q, k, v, torch.full((4,), alpha, device="cuda"), d ** -0.5, is_causal=causal,
                              alpha_class=alpha_class)
        out64 = entmax_attention_reference(q.double(), k.double(), v.double(), alpha, is_causal=causal,
                                           scale=d ** -0.5)
        err = (res.out.double() - out64).abs().max().item()
        err_ref = (_flash_style(q, k, v, alpha, d ** -0.5, torch.bfloat16, causal).double() - out64).abs().max().item()
        assert err <= 2 * err_ref + 1e-5, (err, err_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_softmax_calls_take_sdpa_with_our_semantics(causal):
    """alpha = 1 for every head without statistics runs PyTorch's SDPA (bottom-right causal, GQA) and agrees with
    the float64 reference as our own online-softmax path (return_stats=True keeps the Triton kernel) does."""
    from sparse_attn import entmax_attention

    g = torch.Generator().manual_seed(31)
    q = torch.randn(2, 8, 300, 64, generator=g).cuda().bfloat16()
    k = torch.randn(2, 2, 500, 64, generator=g).cuda().bfloat16()
    v = torch.randn(2, 2, 500, 64, generator=g).cuda().bfloat16()
    out = entmax_attention(q, k, v, 1.0, is_causal=causal, enable_gqa=True)
    ours, _ = entmax_attention(q, k, v, 1.0, is_causal=causal, enable_gqa=True, return_stats=True)
    out64 = entmax_attention_reference(q.double(), k.double(), v.double(), 1.0, is_causal=causal, enable_gqa=True)
    err = (out.double() - out64).abs().max().item()
    err_ours = (ours.double() - out64).abs().max().item()
    assert err <= 2 * err_ours + 1e-3, (err, err_ours)


@triton.jit
def _walk_kernel(LIVE, ORDER, WORDS, kt_lo, kt_hi, first):
    """Walk ``[kt_lo, kt_hi)`` from ``first`` as the grid pass does; store the order and the liveness words built
    by ``mark_tile`` from the bits ``LIVE[kt]``."""
    word_c, word_lo, w_lo, word_hi, w_hi = walk_words()
    for i in range(0, kt_hi - kt_lo):
        kt = visit_tile(i, kt_lo, kt_hi, first)
        tl.store(ORDER + i, kt)
        w, word, word_c, word_lo, w_lo, word_hi, w_hi = mark_tile(kt, tl.load(LIVE + kt), first, word_c, word_lo, w_lo,
                                                                  word_hi, w_hi)
        tl.store(WORDS + w, word)


@pytest.mark.parametrize("kt_lo,kt_hi", [(0, 1), (0, 7), (0, 100), (5, 70), (31, 33), (40, 129)])
def test_max_first_walk_visits_every_tile_once_and_builds_the_bitmap(kernel_device, kt_lo, kt_hi):
    """The grid pass's outward walk from any start: a permutation of the range, each side monotone away from the
    start, and the liveness words equal to the ascending order's."""
    g = torch.Generator().manual_seed(kt_hi)
    live = (torch.rand(160, generator=g) < 0.4).to(torch.int32)
    expected = torch.zeros(5, dtype=torch.int64)
    for kt in range(kt_lo, kt_hi):
        expected[kt // 32] |= int(live[kt]) << (kt % 32)
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).to(torch.int32)
    for first in sorted({kt_lo, kt_hi - 1, (kt_lo + kt_hi) // 2, min(kt_lo + 3, kt_hi - 1)}):
        order = torch.full((kt_hi - kt_lo,), -1, dtype=torch.int32, device=kernel_device)
        words = torch.zeros(5, dtype=torch.int32, device=kernel_device)
        _walk_kernel[(1,)](live.to(kernel_device), order, words, kt_lo, kt_hi, first)
        order = order.cpu().tolist()
        assert sorted(order) == list(range(kt_lo, kt_hi)) and order[0] == first
        below = [kt for kt in order if kt < first]
        above = [kt for kt in order if kt > first]
        assert below == sorted(below, reverse=True) and above == sorted(above)
        # the nearest tiles first while both sides last
        both = min(len(below), len(above))
        assert all(abs(order[i] - first) == (i + 1) // 2 for i in range(2 * both + 1))
        assert torch.equal(words.cpu(), expected)


@triton.jit
def _key_tile_kernel(INSIDE, COLS, n_kt, seqlen_q, seqlen_k, MASK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store ``key_tile``'s ``inside`` flag and key indices of every key tile of query tile ``program_id(0)``."""
    qt = tl.program_id(0)
    for kt in range(0, n_kt):
        key = key_tile(kt, qt * BLOCK_M, seqlen_q, seqlen_k, MASK, BLOCK_M, BLOCK_N)
        tl.store(INSIDE + qt * n_kt + kt, key.inside.to(tl.int32))
        tl.store(COLS + kt * BLOCK_N + tl.arange(0, BLOCK_N), key.cols)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (50, 77), (96, 40)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (20, 5)), (True, (33, -1))])
def test_key_tile_is_full_exactly_when_every_pair_is_visible(kernel_device, seqlen_q, seqlen_k, causal, window):
    """The tile loops' key tiles (``_masking.key_tile``): a tile is full (``inside``: its scores skip the per-score
    mask) exactly when every (row, key) pair of it lies in the sequences and inside the causal mask and the window
    (bottom-right aligned), so a partial tile never loses its mask and a full one never pays for it."""
    bm, bn = 16, 16
    n_qt, n_kt = -(-seqlen_q // bm) + 1, -(-seqlen_k // bn) + 1  # one tile past each end
    inside = torch.full((n_qt, n_kt), -1, dtype=torch.int32, device=kernel_device)
    cols = torch.full((n_kt * bn,), -1, dtype=torch.int32, device=kernel_device)
    _key_tile_kernel[(n_qt,)](inside, cols, n_kt, seqlen_q, seqlen_k, mask_spec(causal, window), bm, bn)
    i = torch.arange(n_qt * bm)[:, None]
    j = torch.arange(n_kt * bn)[None, :]
    d = j - (i + seqlen_k - seqlen_q)
    ok = (i < seqlen_q) & (j < seqlen_k)
    if causal:
        ok &= d <= 0
    if window is not None:
        left, right = window
        ok &= (d >= -left) if left >= 0 else True
        ok &= (d <= right) if right >= 0 else True
    full = ok.reshape(n_qt, bm, n_kt, bn).all(dim=3).all(dim=1).to(torch.int32)
    assert torch.equal(inside.cpu(), full)
    if window is None:  # both kinds occur (the ragged tiles past the ends are never full)
        assert 0 < int(full.sum()) < full.numel()
    assert torch.equal(cols.cpu(), torch.arange(n_kt * bn, dtype=torch.int32))
