"""Block-sparse masks (``block_mask=``): a boolean block grid with its block sizes, or torch's flex_attention
``BlockMask`` (noop_mask here; with other mask_mods: tests/attn/test_block_mask_mod.py), intersected with every other
mask; the fused kernels (interpreter) and the reference against the float64 reference, the torch conversion, bad
inputs, rows left without keys, the Hugging Face function, and the kernels' tile-liveness helper
``_masking.block_tile_live``."""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import BF16, EXACT, F16, F32, F64, TOL, assert_close_to_ref, cu_seqlens, gen, qkv, scaled_err
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, noop_mask
from variants import Problem, build, eager_attention, expand_blocks, together

import sparse_attn as sa
from sparse_attn.attn.masks import block_keep, block_mask_from_torch
from sparse_attn.kernels import _args, _masking
from sparse_attn.reference import entmax_attention_reference


def _blocks(shape, seed, p_keep=0.6):
    return torch.rand(*shape, generator=gen(seed)) < p_keep


def _grid(n_q, n_k, bq, bk, lead=(2, 1), seed=0):
    return sa.BlockSparseMask(_blocks((*lead, math.ceil(n_q / bq), math.ceil(n_k / bk)), seed), (bq, bk))


def _run(backend, q, k, v, alpha, kw, do):
    """Output and gradients (q, k, v and alpha when it is a tensor that requires grad) of one call."""
    out = sa.entmax_attention(q, k, v, alpha, backend=backend, **kw)
    leaves = (q, k, v) + ((alpha,) if isinstance(alpha, torch.Tensor) and alpha.requires_grad else ())
    return out, torch.autograd.grad((out.double() * do).sum(), leaves)


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def test_reference_equals_the_expanded_element_mask():
    """The block mask is the keep mask block_keep expands it to (which keeps key j for row i iff block
    (i // bq, j // bk) is True), intersected with attn_mask, causal and window."""
    q, k, v = qkv(b=2, hq=3, hk=3, nq=21, nk=37, d=8)
    bm = _grid(21, 37, 5, 7, lead=(2, 3))
    keep = block_keep(bm, 21, 37)
    rows, cols = torch.arange(21)[:, None], torch.arange(37)[None, :]
    assert torch.equal(keep, bm.mask[:, :, rows // 5, cols // 7])
    assert torch.equal(keep, expand_blocks(bm.mask, bm.block_size, 21, 37))  # the test table's twin
    attn = _blocks((2, 1, 21, 37), seed=3, p_keep=0.8)
    kw = dict(is_causal=True, window_size=(20, 3))
    got = entmax_attention_reference(q, k, v, 1.5, block_mask=bm, attn_mask=attn, **kw)
    want = entmax_attention_reference(q, k, v, 1.5, attn_mask=attn & keep, **kw)
    torch.testing.assert_close(got, want, **EXACT)
    assert not torch.allclose(got, entmax_attention_reference(q, k, v, 1.5, attn_mask=attn, **kw), atol=TOL["changed"])


# the block mask with every other variant its routes run (the test table, tests/variants.py): with each kind of
# attn_mask, and with packed sequences (no attn_mask)
WITH_EVERY_VARIANT = {"bool": together("reference", mask="bool"), "float": together("reference", mask="float"),
                      "varlen": together("reference", mask=None) + ["varlen"]}


@pytest.mark.parametrize("case", list(WITH_EVERY_VARIANT))
def test_reference_with_every_variant_equals_the_eager_twins(case):
    """The reference backend with a block mask and every other variant of its route at once, forward and
    gradients (q, k, v, alpha), against the eager twins (plain torch in float64)."""
    names = WITH_EVERY_VARIANT[case]
    assert "block_mask" in names
    q, k, v, kw = build(names, Problem(nq=13, nk=17, grad=True, seed=4), block=(4, 3))
    alpha = torch.tensor([1.5, 1.0, 2.0, 1.25], dtype=F64, requires_grad=True)
    out = sa.entmax_attention(q, k, v, alpha, backend="reference", **kw)
    want = eager_attention(q, k, v, alpha, **kw)
    torch.testing.assert_close(out, want, atol=TOL["oracle_f64"], rtol=0)
    do = torch.randn(out.shape, generator=gen(6), dtype=F64)
    leaves = (q, k, v, alpha)
    got = torch.autograd.grad((out * do).sum(), leaves)
    for g, w in zip(got, torch.autograd.grad((want * do).sum(), leaves), strict=True):
        torch.testing.assert_close(g, w, atol=TOL["oracle_f64"], rtol=0)
    without = sa.entmax_attention(q, k, v, alpha, backend="reference", **dict(kw, block_mask=None))
    assert not torch.allclose(out, without, atol=TOL["changed"])


# block sizes aligned and not with the interpreter's 32 x 32 tiles (small problems: the interpreter is slow)
@pytest.mark.parametrize("bq,bk,alpha,extra", [
    (16, 16, 1.5, dict(is_causal=True)),
    (32, 32, 2.0, dict(window_size=(24, 8))),
    (48, 16, 1.0, dict(is_causal=True, window_size=(30, 0), mask=True)),
    (64, 48, (1.25, 2.0), dict(mask=True)),
    (16, 128, (1.0, 1.5), dict(is_causal=True, gqa=True, mask=True)),
    (128, 16, 1.5, dict(gqa=True, batch=2)),
])
def test_fused_matches_float64_reference(bq, bk, alpha, extra, kernel_device):
    """float32 kernels (forward and gradients of q, k, v and a learnable per-head alpha) against float64."""
    b, nq, nk, hq = extra.get("batch", 1), 40, 72, 2
    hk = 1 if extra.get("gqa") else hq
    q, k, v = (t.to(kernel_device) for t in qkv(b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=16, dtype=F32, seed=bq + bk))
    bm = _grid(nq, nk, bq, bk, lead=(b, 1) if b > 1 else (1, hq), seed=bq)
    kw = dict(block_mask=sa.BlockSparseMask(bm.mask.to(kernel_device), bm.block_size), enable_gqa=hk != hq,
              is_causal=extra.get("is_causal", False), window_size=extra.get("window_size"))
    if extra.get("mask"):
        kw["attn_mask"] = _blocks((b, 1, nq, nk), seed=7, p_keep=0.85).to(kernel_device)
    if isinstance(alpha, tuple):
        alpha = torch.tensor(alpha, device=kernel_device)
    do = torch.randn(b, hq, nq, 16, generator=gen(1), dtype=F64).to(kernel_device)
    leaves = _leaves((q, k, v) + ((alpha,) if isinstance(alpha, torch.Tensor) else ()), F32)
    a = leaves[3] if len(leaves) == 4 else alpha
    out, grads = _run("triton", *leaves[:3], a, kw, do)
    leaves64 = _leaves(leaves, F64)
    a64 = leaves64[3] if len(leaves64) == 4 else alpha
    out64, grads64 = _run("reference", *leaves64[:3], a64, kw, do)
    assert scaled_err(out, out64) <= TOL["fused_rel_f32"]["out"]
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv", "dalpha"), strict=False):
        assert scaled_err(g, g64) <= TOL["fused_rel_f32"]["dalpha" if name == "dalpha" else "grad"], name


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_fused_half_precision_within_twice_the_reference_error(dtype, kernel_device):
    """fp16 / bf16 (causal + window + block mask + a boolean attn_mask, GQA): outputs and gradients within twice the
    error of the reference in float32 on the same rounded inputs (tests/helpers.py's rule)."""
    nq = nk = 48
    q, k, v = (t.to(kernel_device) for t in qkv(b=1, hq=2, hk=1, nq=nq, nk=nk, d=16, dtype=dtype, seed=5))
    kw = dict(block_mask=_grid(nq, nk, 16, 32, lead=(1, 2), seed=9), is_causal=True, window_size=(30, 0),
              attn_mask=_blocks((1, 1, nq, nk), seed=4, p_keep=0.9), enable_gqa=True)
    kw = {n: (sa.BlockSparseMask(t.mask.to(kernel_device), t.block_size) if n == "block_mask"
              else t.to(kernel_device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    do = torch.randn(1, 2, nq, 16, generator=gen(2), dtype=F64).to(kernel_device)
    out, grads = _run("triton", *_leaves((q, k, v), dtype), 1.5, kw, do)
    out64, grads64 = _run("reference", *_leaves((q, k, v), F64), 1.5, kw, do)
    out32, grads32 = _run("reference", *_leaves((q, k, v), F32), 1.5, kw, do)
    assert_close_to_ref(out, out64, out32.to(dtype), eps=TOL["eps_attention_kernel"][dtype], name="out")
    for g, g64, g32, name in zip(grads, grads64, grads32, ("dq", "dk", "dv"), strict=True):
        assert_close_to_ref(g, g64, g32.to(dtype), eps=TOL["eps_attention_grad"][dtype], name=name)


def test_varlen_block_mask_is_per_sequence_and_local(kernel_device):
    """Packed sequences: the block mask's entry s applies to sequence s in its own coordinates; fused and reference
    equal separate calls."""
    lengths_q, lengths_k = [19, 35], [25, 40]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q, k, v = qkv(b=1, hq=2, hk=2, nq=sum(lengths_q), nk=sum(lengths_k), d=16, dtype=F32, seed=3)
    bm = _grid(max(lengths_q), max(lengths_k), 16, 32, lead=(2, 2), seed=11)
    parts = []
    for s, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True)):
        nq, nk = int(q1 - q0), int(k1 - k0)
        grid = bm.mask[s:s + 1, :, :math.ceil(nq / 16), :math.ceil(nk / 32)]
        parts.append(entmax_attention_reference(
            q[:, :, q0:q1].double(), k[:, :, k0:k1].double(), v[:, :, k0:k1].double(), 1.5, is_causal=True,
            block_mask=sa.BlockSparseMask(grid, (16, 32))))
    want = torch.cat(parts, dim=2)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=True, block_mask=bm)
    ref = sa.entmax_attention(q.double(), k.double(), v.double(), 1.5, backend="reference", **kw)
    torch.testing.assert_close(ref, want, atol=TOL["same_values"][F64], rtol=0)
    dev = {n: t.to(kernel_device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    dev["block_mask"] = sa.BlockSparseMask(bm.mask.to(kernel_device), bm.block_size)
    out = sa.entmax_attention(*(t.to(kernel_device) for t in (q, k, v)), 1.5, backend="triton", **dev)
    assert scaled_err(out, want) <= TOL["fused_rel_f32"]["out"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rows_without_a_visible_block_give_zeros_and_zero_gradients(backend, kernel_device):
    q, k, v = _leaves(qkv(b=1, hq=2, hk=2, nq=40, nk=50, d=16, dtype=F32, seed=8), F32)
    grid = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    grid[0, 1, 1] = False        # rows 16..31 of head 1 see nothing
    grid[0, 0, :, 2] = False     # keys 32..47 are hidden from head 0
    dev = [t.to(kernel_device).detach().requires_grad_() for t in (q, k, v)] if backend == "triton" else [q, k, v]
    bm = sa.BlockSparseMask(grid.to(dev[0].device), (16, 16))
    out, stats = sa.entmax_attention(*dev, 1.5, block_mask=bm, backend=backend, return_stats=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), dev)
    assert torch.equal(out[0, 1, 16:32], torch.zeros_like(out[0, 1, 16:32]))
    assert torch.equal(dq[0, 1, 16:32], torch.zeros_like(dq[0, 1, 16:32]))
    assert torch.equal(dk[0, 0, 32:48], torch.zeros_like(dk[0, 0, 32:48]))
    assert torch.equal(dv[0, 0, 32:48], torch.zeros_like(dv[0, 0, 32:48]))
    assert int(stats.n_valid[0, 1, 20]) == 0 and int(stats.n_valid[0, 0, 0]) == 50 - 16


def test_torch_block_masks_equal_the_boolean_block_mask():
    """create_block_mask(noop_mask) keeps every block (partial and full ones); BlockMask.from_kv_blocks with random
    kv lists is the boolean grid it lists; the attention is the same."""
    q, k, v = qkv(b=2, hq=2, hk=2, nq=50, nk=70, d=8)
    full = create_block_mask(noop_mask, 2, 1, 50, 70, device="cpu", BLOCK_SIZE=(16, 32))
    conv = block_mask_from_torch(full)
    assert conv.block_size == (16, 32) and conv.mask.shape == (2, 1, 4, 3) and bool(conv.mask.all())
    grid = _blocks((2, 2, 4, 3), seed=5)
    order = torch.argsort((~grid).to(torch.int32), dim=-1, stable=True)
    partial = grid.clone()
    partial[..., 1:] = False  # some blocks listed as partial, the rest as full
    n_part = (grid & partial).sum(-1)
    idx_part = torch.argsort((~(grid & partial)).to(torch.int32), dim=-1, stable=True)
    idx_full = torch.argsort((~(grid & ~partial)).to(torch.int32), dim=-1, stable=True)
    tbm = BlockMask.from_kv_blocks(n_part.int(), idx_part.int(), (grid & ~partial).sum(-1).int(), idx_full.int(),
                                   BLOCK_SIZE=(16, 32), seq_lengths=(50, 70))
    assert torch.equal(block_mask_from_torch(tbm).mask, grid)
    only_partial = BlockMask.from_kv_blocks(grid.sum(-1).int(), order.int(), BLOCK_SIZE=(16, 32), seq_lengths=(50, 70))
    ours = entmax_attention_reference(q, k, v, 1.5, block_mask=sa.BlockSparseMask(grid, (16, 32)))
    for torch_mask in (tbm, only_partial):
        torch.testing.assert_close(entmax_attention_reference(q, k, v, 1.5, block_mask=torch_mask), ours, **EXACT)


def test_a_torch_block_mask_with_a_mask_mod_is_its_element_mask(kernel_device):
    """create_block_mask(causal mask_mod) (partial diagonal blocks: tests/attn/test_block_mask_mod.py for the others)
    gives what is_causal gives, on the reference exactly and on the kernels within float32 rounding."""
    q, k, v = (t.to(kernel_device) for t in qkv(b=1, hq=2, hk=2, nq=40, nk=40, d=16, dtype=F32))
    causal = create_block_mask(lambda b, h, i, j: j <= i, None, None, 40, 40, device=kernel_device, BLOCK_SIZE=16)
    want = entmax_attention_reference(q.double(), k.double(), v.double(), 1.5, is_causal=True)
    got = entmax_attention_reference(q.double(), k.double(), v.double(), 1.5, block_mask=causal)
    torch.testing.assert_close(got, want, **EXACT)
    out = sa.entmax_attention(q, k, v, 1.5, block_mask=causal, backend="triton")
    assert scaled_err(out, want) <= TOL["fused_rel_f32"]["out"]


@pytest.mark.parametrize("block_mask,err,match", [
    ("blocks", TypeError, "block_mask must be None, a sparse_attn.BlockSparseMask"),
    (sa.BlockSparseMask(torch.ones(1, 1, 1, 1), (16, 16)), TypeError, "block_mask: the mask must be a boolean"),
    (sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), (0, 16)), ValueError, "block_size must be"),
    (sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), (16.0, 16)), ValueError, "block_size must be"),
    (sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool), (16, 2**64)), ValueError, "block_size must be"),
    (sa.BlockSparseMask(torch.ones(1, 1, 2, 1, dtype=torch.bool), (16, 16)), ValueError,
     r"block_mask: the mask must have shape \(batch or 1, heads or 1"),
    (sa.BlockSparseMask(torch.ones(3, 1, 1, 1, dtype=torch.bool), (16, 16)), ValueError, "the mask must have shape"),
    (sa.BlockSparseMask(torch.ones(1, 1, 1, 1, dtype=torch.bool, device="meta"), (16, 16)), ValueError,
     "block_mask must be on the device"),
])
def test_bad_block_masks_raise_naming_the_argument(block_mask, err, match):
    q, k, v = qkv(b=2, hq=4, hk=4, nq=9, nk=11, d=16, dtype=F32)
    for fn in (sa.entmax_attention, entmax_attention_reference):
        with pytest.raises(err, match=match):
            fn(q, k, v, 1.5, block_mask=block_mask)


def test_hf_attention_function_takes_a_block_mask():
    """The Hugging Face attention function: ``block_mask=`` among the kwargs, or a torch BlockMask as
    ``attention_mask``, intersected with the layer's causal mask."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse_attn.integrations.hf import entmax_attention_forward

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    attn = LlamaForCausalLM._from_config(config, attn_implementation="entmax").model.layers[0].self_attn
    q, k, v = qkv(b=2, hq=4, hk=2, nq=40, nk=40, d=16, dtype=F32, seed=4)
    grid = _blocks((2, 1, 3, 3), seed=6)
    grid[:, :, :, 0] = True  # every row keeps its first keys (causal leaves them visible)
    want = sa.entmax_attention(q, k, v, 1.5, is_causal=True, enable_gqa=True, scale=0.25,
                               block_mask=sa.BlockSparseMask(grid, (16, 16)))
    got, _ = entmax_attention_forward(attn, q, k, v, None, scaling=0.25, block_mask=sa.BlockSparseMask(grid, 16))
    torch.testing.assert_close(got.transpose(1, 2), want, **EXACT)
    order = torch.argsort((~grid).to(torch.int32), dim=-1, stable=True)
    tbm = BlockMask.from_kv_blocks(grid.sum(-1).int(), order.int(), BLOCK_SIZE=16, seq_lengths=(40, 40))
    got, _ = entmax_attention_forward(attn, q, k, v, tbm, scaling=0.25)
    torch.testing.assert_close(got.transpose(1, 2), want, **EXACT)


@triton.jit
def _tile_live_kernel(OUT, MODS, seqlen_q, seqlen_k, n_k_tiles, SCORE, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    pid_m, h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    mods = _masking.program_mods(MODS, seq, seq, h, seq * 0, seq * 0, SCORE)
    row_lo = pid_m * BLOCK_M
    row_hi = tl.minimum(row_lo + BLOCK_M, seqlen_q) - 1
    out_row = OUT + ((seq * tl.num_programs(1) + h) * tl.num_programs(0) + pid_m) * n_k_tiles
    for kt in range(0, n_k_tiles):
        live = _masking.block_tile_live(mods, row_lo, row_hi, kt, seqlen_k, SCORE, BLOCK_N)
        tl.store(out_row + kt, live.to(tl.int32))


@pytest.mark.parametrize("bq,bk", [(16, 16), (48, 16), (16, 48), (64, 128), (7, 5)])
def test_block_tile_live_says_whether_a_tile_meets_a_kept_block(bq, bk):
    """The kernels' skip test: query tile x key tile is live iff some kept block meets it (from the expanded mask)."""
    nq, nk, bm_, bn = 70, 90, 32, 32
    grid = _blocks((2, 3, math.ceil(nq / bq), math.ceil(nk / bk)), seed=bq * bk, p_keep=0.15)
    like = torch.empty(1)
    mods = _args.mods_args(None, (2, 3, nq, nk), None, None, like, (grid, (bq, bk)))["MODS"]
    n_qt, n_kt = triton.cdiv(nq, bm_), triton.cdiv(nk, bn)
    out = torch.full((2, 3, n_qt, n_kt), -1, dtype=torch.int32)
    _tile_live_kernel[(n_qt, 3, 2)](out, mods, nq, nk, n_kt, _args.score_spec(None, False, False, 2),
                                    BLOCK_M=bm_, BLOCK_N=bn)
    keep = block_keep(sa.BlockSparseMask(grid, (bq, bk)), nq, nk)
    pad = torch.zeros(2, 3, n_qt * bm_, n_kt * bn, dtype=torch.bool)
    pad[..., :nq, :nk] = keep
    want = pad.unflatten(2, (n_qt, bm_)).unflatten(4, (n_kt, bn)).any(dim=(3, 5)).to(torch.int32)
    torch.testing.assert_close(out, want, **EXACT)
    assert 0 < int(want.sum()) < want.numel()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_key_tiles_the_block_mask_hides_are_never_loaded(alpha, kernel_device):
    """The forward's tile-visit counter: with a block-diagonal mask of the kernels' own tile size, each query tile's
    grid (or softmax) pass loads its one kept key tile only, and the later passes no more than that tile, where
    without the block mask the grid pass alone loads every key tile; the outputs match the reference."""
    from sparse_attn.kernels.attn.entmax_attn_fwd import entmax_attn_fwd, fwd_block_sizes

    block_m, block_n = fwd_block_sizes(32)
    n_tiles = 4
    n = n_tiles * max(block_m, block_n)
    q, k, v = (t.to(kernel_device) for t in qkv(b=1, hq=2, hk=2, nq=n, nk=n, d=32, dtype=F32, seed=7))
    grid = torch.eye(n // block_m, n // block_n, dtype=torch.bool, device=kernel_device)[None, None]
    alphas = torch.full((2,), alpha, device=kernel_device)
    plain = entmax_attn_fwd(q, k, v, alphas, 32 ** -0.5)
    masked = entmax_attn_fwd(q, k, v, alphas, 32 ** -0.5, block_mask=(grid, (block_m, block_n)))
    assert bool((plain.tile_visits >= n // block_n).all())
    kept = (grid.sum(-1)[0, 0]).to(torch.int32)  # key tiles kept per query tile: 1
    assert torch.equal(masked.tile_visits.cpu() <= masked.n_passes.cpu() * kept.cpu(),
                       torch.ones_like(masked.tile_visits.cpu(), dtype=torch.bool))
    assert int(masked.tile_visits.sum()) < int(plain.tile_visits.sum())
    ref = entmax_attention_reference(q.double(), k.double(), v.double(), alpha,
                                     block_mask=sa.BlockSparseMask(grid, (block_m, block_n)))
    assert scaled_err(masked.out, ref) <= TOL["fused_rel_f32"]["out"]
