"""FlexAttention ``BlockMask`` objects built with a ``mask_mod`` (``create_block_mask``): FlexAttention's semantics
(a pair is kept when its block is full, or partial and ``mask_mod(b, h, q_idx, kv_idx)`` is True) from the host
conversion (bits of the partial blocks, evaluated once and cached) to the kernels (interpreter) and the reference,
against the float64 reference, the equivalent element mask (``attn_mask=``), varlen, decode, and the refusals."""

import math

import pytest
import torch
from helpers import EXACT, F32, F64, TOL, cu_seqlens, gen, qkv, scaled_err
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import sparse_attn as sa
from sparse_attn.attn import decode as decode_mod
from sparse_attn.attn.attn_inputs import prepare_attention
from sparse_attn.attn.masks import block_keep, block_mask_from_torch
from sparse_attn.kernels import _args
from sparse_attn.kernels._args import spec_block_mask
from sparse_attn.kernels.attn import entmax_decode as decode_kernels
from sparse_attn.reference import entmax_attention_reference


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 20)


PREFIX = torch.tensor([5, 37])


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


DOCS = torch.tensor([0] * 23 + [1] * 41 + [2] * 9 + [3] * 55)


def document(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def strided(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 3 == 0) | (kv_idx < 4)


WINDOWS = torch.tensor([7, 60, 18, 33])


def per_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOWS[h])


def _listed(num, idx, n_kb):
    """The blocks a BlockMask's (num, indices) pair lists, as a boolean (B, H, q blocks, n_kb) grid (plain loops)."""
    grid = torch.zeros(*idx.shape[:3], n_kb, dtype=torch.bool)
    if num is None:
        return grid
    for b, h, qb in torch.cartesian_prod(*(torch.arange(s) for s in idx.shape[:3])).tolist():
        grid[b, h, qb, idx[b, h, qb, :num[b, h, qb]].long()] = True
    return grid


def _flex_keep(bm, mask_mod, n_rows, n_heads):
    """FlexAttention's keep mask of a BlockMask, computed independently of the library: full blocks whole, partial
    blocks where torch's create_mask (mask_mod at every actual b, h) keeps the pair. (n_rows, n_heads, Nq, Nk)"""
    (n_q, n_k), (bq, bk) = bm.seq_lengths, bm.BLOCK_SIZE
    n_kb = math.ceil(n_k / bk)
    rows, cols = torch.arange(n_q) // bq, torch.arange(n_k) // bk
    full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, n_kb)[:, :, rows[:, None], cols[None, :]]
    part = _listed(bm.kv_num_blocks, bm.kv_indices, n_kb)[:, :, rows[:, None], cols[None, :]]
    return full | (part & create_mask(mask_mod, n_rows, n_heads, n_q, n_k, device="cpu"))


# (mask_mod, B and H the BlockMask is built for, the call's batch entries and heads, N, BLOCK_SIZE)
HOST_CASES = {
    "causal-64": (causal, None, None, 2, 3, 100, 64),
    "window-16x48": (sliding_window, 1, 1, 1, 2, 90, (16, 48)),
    "prefix-per-batch": (prefix_lm, 2, None, 2, 2, 70, 32),
    "prefix-built-for-b0": (prefix_lm, None, None, 2, 1, 70, 32),
    "document-unaligned": (document, None, None, 1, 1, 128, (24, 40)),
    "strided-all-partial": (strided, 1, 1, 1, 1, 50, 16),
    "per-head": (per_head, None, 4, 1, 4, 128, 32),
    "per-head-built-for-h0": (per_head, None, None, 1, 4, 128, 32),
}


@pytest.mark.parametrize("name", list(HOST_CASES))
def test_conversion_expands_to_flex_attention_semantics(name):
    """The converted mask (block states and bits) expands (block_keep, the reference's oracle) to FlexAttention's keep
    mask at the call's batch entries and heads, including where the BlockMask broadcasts over them while its mask_mod
    reads b or h; the bits cover the partial blocks left only, one bit per pair."""
    mask_mod, B, H, n_rows, n_heads, n, size = HOST_CASES[name]
    bm = create_block_mask(mask_mod, B, H, n, n, device="cpu", BLOCK_SIZE=size)
    conv = block_mask_from_torch(bm, n_rows, n_heads)
    want = _flex_keep(bm, mask_mod, n_rows, n_heads)
    torch.testing.assert_close(block_keep(conv, n, n).expand_as(want), want, **EXACT)
    bq, bk = conv.block_size
    n_listed = int(bm.kv_num_blocks.sum()) * (n_rows if bm.kv_num_blocks.shape[0] == 1 else 1) * (
        n_heads if bm.kv_num_blocks.shape[1] == 1 else 1)
    assert conv.bits is not None and conv.mask.dtype == torch.int32
    n_partial = conv.bits.shape[0]
    assert conv.bits.shape == (n_partial, bq, math.ceil(bk / 32)) and 0 < n_partial <= n_listed
    assert int(conv.mask.max()) == n_partial + 1 and set(conv.mask.unique().tolist()) <= set(range(n_partial + 2))
    # a broadcast dim is expanded only when the mask_mod's values differ along it
    reads = {"prefix-built-for-b0": (n_rows, 1), "per-head-built-for-h0": (1, n_heads)}
    if name in reads:
        assert tuple(conv.mask.shape[:2]) == reads[name]
    elif B is None and H is None:
        assert tuple(conv.mask.shape[:2]) == (1, 1)


def test_blocks_the_mask_mod_keeps_whole_become_full_and_an_aligned_mask_is_a_boolean_grid():
    """A block-aligned mask_mod listed without separate full blocks (every kept block partial): the evaluation finds
    each block whole or empty, so the result is today's boolean grid (the tile skip alone, no per-score work)."""
    def block_causal(b, h, q_idx, kv_idx):
        return q_idx // 32 >= kv_idx // 32

    bm = create_block_mask(block_causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32, separate_full_blocks=False)
    assert bm.full_kv_num_blocks is None and int(bm.kv_num_blocks.sum()) == 6
    conv = block_mask_from_torch(bm, 1, 1)
    assert conv.bits is None and conv.mask.dtype == torch.bool
    torch.testing.assert_close(conv.mask[0, 0], torch.ones(3, 3, dtype=torch.bool).tril(), **EXACT)
    assert _args.blocks_mode((conv.mask, conv.block_size, conv.bits), (32, 32)) == 1
    partial = block_mask_from_torch(create_block_mask(causal, 1, 1, 96, 96, device="cpu", BLOCK_SIZE=32), 1, 1)
    assert [_args.blocks_mode(tuple(partial), t) for t in ((32, 32), (64, 32))] == [3, 4]


def test_the_mask_mod_is_evaluated_once_per_mask_object():
    calls = []

    def counted(b, h, q_idx, kv_idx):
        calls.append(1)
        return q_idx >= kv_idx

    q, k, v = qkv(b=1, hq=2, hk=2, nq=40, nk=40, d=8)
    bm = create_block_mask(counted, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=16)
    n_build = len(calls)
    first = entmax_attention_reference(q, k, v, 1.5, block_mask=bm)
    n_eval = len(calls) - n_build
    second = entmax_attention_reference(q, k, v, 1.5, block_mask=bm)
    assert n_eval > 0 and len(calls) == n_build + n_eval
    assert block_mask_from_torch(bm, 1, 2) is block_mask_from_torch(bm, 1, 2)
    torch.testing.assert_close(first, second, **EXACT)


# (mask_mod, B and H of the BlockMask, batch, q heads, kv heads, N, BLOCK_SIZE, alpha); the interpreter's tiles are
# 32 x 32 (forward) and 64 x 16 / 16 x 64 (backward): 64-blocks are aligned everywhere (SCORE.blocks 3), 32-blocks in
# the forward only, 16 and 24 x 40 nowhere (SCORE.blocks 4)
FUSED_CASES = {
    "causal-aligned": (causal, None, None, 1, 2, 2, 96, 64, 1.5),
    "window-fwd-aligned": (sliding_window, None, None, 1, 2, 2, 100, 32, 2.0),
    "prefix-per-batch": (prefix_lm, 2, None, 2, 2, 1, 70, (64, 32), 1.0),
    "document-unaligned": (document, None, None, 1, 2, 2, 128, (24, 40), (1.25, 1.75)),
    "strided-16": (strided, None, None, 1, 1, 1, 50, 16, 1.5),
    "per-head-gqa": (per_head, None, 4, 1, 4, 2, 128, 64, (1.0, 1.5, 2.0, 1.3)),
}


def _grads(backend, q, k, v, alpha, dtype, do, **kw):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    a = alpha
    if isinstance(alpha, torch.Tensor):
        a = alpha.detach().to(dtype).requires_grad_()
        leaves.append(a)
    out = sa.entmax_attention(*leaves[:3], a, backend=backend, **kw)
    return out, torch.autograd.grad((out.double() * do).sum(), leaves)


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_kernels_match_float64_and_the_element_mask(name, kernel_device):
    """float32 kernels with the BlockMask (forward, dq, dk, dv and a per-head alpha's gradient) against the float64
    reference, which equals the reference with the element mask; and against the kernels given that element mask as
    attn_mask (the same scores, fewer tiles loaded)."""
    mask_mod, B, H, b, hq, hk, n, size, alpha = FUSED_CASES[name]
    q, k, v = (t.to(kernel_device) for t in qkv(b=b, hq=hq, hk=hk, nq=n, nk=n, d=16, dtype=F64, seed=n))
    bm = create_block_mask(mask_mod, B, H, n, n, device=kernel_device, BLOCK_SIZE=size)
    dense = _flex_keep(bm, mask_mod, b, hq).to(kernel_device)
    if isinstance(alpha, tuple):
        alpha = torch.tensor(alpha, dtype=F64, device=kernel_device)
    do = torch.randn(b, hq, n, 16, generator=gen(3), dtype=F64).to(kernel_device)
    common = dict(enable_gqa=hk != hq)
    out64, g64 = _grads("reference", q, k, v, alpha, F64, do, block_mask=bm, **common)
    out64_el, g64_el = _grads("reference", q, k, v, alpha, F64, do, attn_mask=dense, **common)
    torch.testing.assert_close(out64, out64_el, **EXACT)
    for g, g_el in zip(g64, g64_el, strict=True):
        torch.testing.assert_close(g, g_el, **EXACT)
    out, grads = _grads("triton", q, k, v, alpha, F32, do, block_mask=bm, **common)
    assert scaled_err(out, out64) <= TOL["fused_rel_f32"]["out"]
    for i, (g, g_ref) in enumerate(zip(grads, g64, strict=True)):
        assert scaled_err(g, g_ref) <= TOL["fused_rel_f32"]["dalpha" if i == 3 else "grad"], ("dq", "dk", "dv", "da")[i]
    out_el, grads_el = _grads("triton", q, k, v, alpha, F32, do, attn_mask=dense, **common)
    torch.testing.assert_close(out, out_el, atol=TOL["same_values"][F32], rtol=0)
    for g, g_el in zip(grads, grads_el, strict=True):
        torch.testing.assert_close(g, g_el, atol=TOL["same_values"][F32], rtol=0)


def test_varlen_mask_mod_sees_the_sequence_and_local_positions(kernel_device):
    """Packed sequences: b is the sequence, q_idx / kv_idx count from its first row / key; fused and reference equal
    separate calls with the element mask."""
    lengths = [37, 70]
    cu = cu_seqlens(lengths)
    q, k, v = qkv(b=1, hq=2, hk=2, nq=sum(lengths), nk=sum(lengths), d=16, dtype=F64, seed=5)
    bm = create_block_mask(prefix_lm, 2, 1, max(lengths), max(lengths), device="cpu", BLOCK_SIZE=32)
    parts = []
    for s, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        keep = create_mask(prefix_lm, 2, 1, hi - lo, hi - lo, device="cpu")[s:s + 1]
        parts.append(entmax_attention_reference(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], 1.5, attn_mask=keep))
    want = torch.cat(parts, dim=2)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    ref = sa.entmax_attention(q, k, v, 1.5, backend="reference", block_mask=bm, **kw)
    torch.testing.assert_close(ref, want, atol=TOL["same_values"][F64], rtol=0)
    dev = {n: t.to(kernel_device) for n, t in kw.items()}
    bm_dev = create_block_mask(prefix_lm, 2, 1, max(lengths), max(lengths), device=kernel_device, BLOCK_SIZE=32)
    out = sa.entmax_attention(*(t.float().to(kernel_device) for t in (q, k, v)), 1.5, backend="triton",
                              block_mask=bm_dev, **dev)
    assert scaled_err(out, want) <= TOL["fused_rel_f32"]["out"]


def test_decode_kernels_take_the_partial_blocks(monkeypatch, kernel_device):
    """A decoding step (3 queries against 80 keys, GQA, mixed alpha) with a BlockMask of a bottom-right sliding window
    as its mask_mod: the decode kernels get the bits and match the float64 reference with the element mask."""
    seen = []
    real = decode_kernels.launch_decode

    def spy(spec, *args, **kwargs):
        seen.append(spec_block_mask(spec))
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(decode_kernels, "launch_decode", spy)
    nq, nk = 3, 80

    def recent(b, h, q_idx, kv_idx):
        pos = q_idx + nk - nq
        return (kv_idx <= pos) & (pos - kv_idx <= 9 + 5 * h)

    q, k, v = qkv(b=2, hq=4, hk=2, nq=nq, nk=nk, d=16, dtype=F64, seed=9)
    bm = create_block_mask(recent, None, 4, nq, nk, device=kernel_device, BLOCK_SIZE=(2, 16))
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25], dtype=F64)
    kw = dict(enable_gqa=True, return_stats=True)
    spec = prepare_attention(*(t.float().to(kernel_device) for t in (q, k, v)), alpha.float().to(kernel_device),
                             backend="triton", block_mask=bm, enable_gqa=True)
    assert decode_mod.decode_fits(spec) and spec.block_bits is not None
    out, st = sa.entmax_attention(*(t.float().to(kernel_device) for t in (q, k, v)), alpha.float().to(kernel_device),
                                  backend="triton", block_mask=bm, **kw)
    assert len(seen) == 1 and seen[0][2] is not None
    dense = _flex_keep(bm, recent, 2, 4)
    out64, st64 = entmax_attention_reference(q, k, v, alpha, attn_mask=dense, **kw)
    assert scaled_err(out, out64) <= TOL["fused_rel_f32"]["out"]
    assert torch.equal(st.n_valid.cpu(), st64.n_valid)


def test_mask_mods_that_cannot_be_evaluated_are_refused_by_name():
    q, k, v = qkv(b=1, hq=2, hk=2, nq=40, nk=40, d=16, dtype=F32)

    def branchy(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if bool(q_idx > 3) else q_idx == kv_idx

    def counts(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).clamp(min=0)

    for mask_mod, match in ((branchy, "mask_mod branchy cannot be evaluated vectorized"),
                            (counts, "mask_mod counts must return a boolean tensor")):
        bm = create_block_mask(causal, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=16)
        bm.mask_mod = mask_mod
        for backend in ("reference", "triton"):
            with pytest.raises(ValueError, match=f"block_mask: the BlockMask's {match}"):
                sa.entmax_attention(q, k, v, 1.5, block_mask=bm, backend=backend)
    short = create_block_mask(causal, 1, 1, 32, 32, device="cpu", BLOCK_SIZE=16)
    q, k, v = qkv(b=1, hq=2, hk=2, nq=40, nk=40, d=16, dtype=F32)
    with pytest.raises(ValueError, match=r"block_mask: the BlockMask was built for seq_lengths \(32, 32\)"):
        sa.entmax_attention(q[:, :, :31], k, v, 1.5, block_mask=short)


@pytest.mark.parametrize("bias_shape", [(1, 2, 64, 64), (2, 2, 64, 64), (2, 2, 64, 1), (2, 1, 1, 64)])
def test_mask_gradients_honour_the_partial_blocks(bias_shape, kernel_device):
    """A float attn_mask that requires grad next to a BlockMask with partial blocks: the gradient of the mask (the d
    bias kernel for a batch- or head-broadcast mask, the dQ kernel's dS tiles for a full one, its row sums, the dK/dV
    kernel's column sums) and of q, k, v against float64; pairs the BlockMask hides get no gradient."""
    n = 64
    q, k, v = (t.to(kernel_device) for t in qkv(b=2, hq=2, hk=2, nq=n, nk=n, d=16, dtype=F64, seed=11))
    bias = torch.randn(bias_shape, generator=gen(12), dtype=F64).to(kernel_device)
    bm = create_block_mask(sliding_window, None, None, n, n, device=kernel_device, BLOCK_SIZE=32)
    do = torch.randn(2, 2, n, 16, generator=gen(13), dtype=F64).to(kernel_device)
    grads = {}
    for backend, dtype in (("reference", F64), ("triton", F32)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, bias)]
        out = sa.entmax_attention(*leaves[:3], 1.5, attn_mask=leaves[3], block_mask=bm, backend=backend)
        grads[backend] = torch.autograd.grad((out.double() * do).sum(), leaves)
    for g, g64, name in zip(grads["triton"], grads["reference"], ("dq", "dk", "dv", "dmask"), strict=True):
        assert scaled_err(g, g64) <= TOL["fused_rel_f32"]["grad"], name
    if bias_shape == (2, 2, 64, 64):
        hidden = ~_flex_keep(bm, sliding_window, 2, 2).to(kernel_device)
        assert bool(hidden.any()) and bool((grads["triton"][3][hidden] == 0).all())


CACHE_PREFIX = torch.tensor([9, 40, 3])


def cache_prefix(b, h, q_idx, kv_idx):
    return (kv_idx < CACHE_PREFIX[b]) | ((kv_idx + q_idx + h) % 3 == 0)


@pytest.mark.parametrize("nq", [3, 20])
def test_entmax_decode_takes_a_mask_mod_block_mask(nq, kernel_device):
    """entmax_decode over a KV cache with a BlockMask whose mask_mod reads b and h: a decoding step (the decode
    kernels) and a prompt chunk of 20 queries (packed on the fused kernels), sequences of different lengths (one
    empty); the triton backend and the reference backend (per sequence, the grid cut to its keys) against the
    reference given the element mask."""
    from sparse_attn.decode import entmax_decode

    n = 48
    q, k, v = qkv(b=3, hq=4, hk=2, nq=nq, nk=n, d=16, dtype=F64, seed=21)
    lengths = torch.tensor([48, 0, 30], dtype=torch.int32)
    bm = create_block_mask(cache_prefix, 3, 4, nq, n, device=kernel_device, BLOCK_SIZE=(2 if nq < 16 else 16, 16))
    dense = _flex_keep(bm, cache_prefix, 3, 4)
    kw = dict(is_causal=True, return_stats=True)
    want, st_want = entmax_decode(q, k, v, lengths, 1.5, backend="reference", attn_mask=dense, **kw)
    ref, st_ref = entmax_decode(q, k, v, lengths, 1.5, backend="reference", block_mask=bm, **kw)
    torch.testing.assert_close(ref, want, **EXACT)
    assert torch.equal(st_ref.n_valid, st_want.n_valid)
    dev = [t.float().to(kernel_device) for t in (q, k, v)]
    out, st = entmax_decode(*dev, lengths.to(kernel_device), 1.5, backend="triton", block_mask=bm, **kw)
    assert scaled_err(out, want) <= TOL["fused_rel_f32"]["out"]
    assert torch.equal(st.n_valid.cpu(), st_want.n_valid)
