"""Split-K decoding (``sparse_attn.decode.entmax_decode``, ``kernels/attn/entmax_decode.py``) against the float64
reference.

The reference is ``entmax_attention_reference`` on the cache gathered into a contiguous float64 ``(B, Hk, Nk, D)``
tensor with a keep mask for ``cache_seqlens`` (and causality), built here independently of the decode module.
Errors follow the tolerance rule (tests/helpers.py):
``err(kernel) <= 2 * err(reference in the kernel's dtype, fp32 scores) + EPS[dtype]``.
Kernel outputs are allocated poisoned (``poison_uninitialized``), so a value the kernels fail to write shows up.
"""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import TOL, assert_close_to_ref
from variants import ROWS, Problem, build, cast, eager_attention, together

import sparse_attn as sa
import sparse_attn.kernels.attn.entmax_decode as decode_kernels
from sparse_attn import AttentionStats, entmax_attention, record_head_stats
from sparse_attn.attn.attn_inputs import prepare_attention
from sparse_attn.attn.masks import block_keep
from sparse_attn.decode import decode_fits, decode_unsupported, entmax_decode
from sparse_attn.kernels._args import spec_block_mask
from sparse_attn.kernels.attn.entmax_decode import entmax_decode_fwd
from sparse_attn.reference import entmax_attention_reference

# Absolute slack added to twice the reference's own error in the kernel dtype (the fused kernels' slack).
EPS = TOL["eps_attention_kernel"]
# Keys whose float64 z is within this of the float64 tau count as ties for the support-size check.
TIE_MARGIN = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
MIXED = [1.0, 1.5, 2.0, 1.25]

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _cache(gen, B, Hk, N, D, dtype, layout="bhnd", mult=1.0):
    """Random ``(B, Hk, N, D)`` cache tensor; ``layout="bnhd"`` returns a transposed view of a ``(B, N, Hk, D)``."""
    x = (torch.randn(B, N, Hk, D, generator=gen, dtype=torch.float64) * mult).to(dtype)
    return x.transpose(1, 2) if layout == "bnhd" else x.transpose(1, 2).contiguous()


def _page(k, v, seqlens, page_size, gen):
    """Scatter contiguous ``(B, Hk, N, D)`` / ``(B, Hk, N, Dv)`` caches into shuffled page pools ``(pages, page_size,
    Hk, D or Dv)`` with spare pages; slots past each sequence hold NaN (never read). Returns ``(k_pool, v_pool,
    block_table)``."""
    B, Hk, N, _ = k.shape
    per_seq = -(-N // page_size)
    n_pages = B * per_seq + 3
    order = torch.randperm(n_pages, generator=gen)
    table = order[: B * per_seq].view(B, per_seq).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.full((n_pages, page_size, Hk, x.shape[-1]), float("nan"), dtype=x.dtype)
        for b in range(B):
            for j in range(int(seqlens[b])):
                pool[table[b, j // page_size], j % page_size] = x[b, :, j]
        pools.append(pool)
    return pools[0], pools[1], table


def _offsets(seqlens, Nq, N):
    """``d = j - (i + seqlens[b] - Nq)`` ``(B, 1, Nq, N)``: key ``j``'s offset from query ``i``'s own position."""
    lengths = torch.as_tensor(seqlens).long()[:, None, None, None]
    return torch.arange(N) - (torch.arange(Nq)[None, None, :, None] + lengths - Nq)


def _keep(seqlens, Nq, N, causal, window=None):
    """Keep mask: the first ``seqlens[b]`` keys, causal (``d <= 0``) and within the window ``-left <= d <= right``."""
    keep = torch.arange(N) < torch.as_tensor(seqlens).long()[:, None, None, None]
    d = _offsets(seqlens, Nq, N)
    if causal:
        keep = keep & (d <= 0)
    if window is not None:
        keep = keep & ((d >= -window[0]) | (window[0] < 0)) & ((d <= window[1]) | (window[1] < 0))
    return keep


def _oracle_mask(seqlens, Nq, N, causal=False, mask=None, window=None, slopes=None):
    """The reference's ``attn_mask`` for a decode step: :func:`_keep`, the caller's mask and ALiBi's ``-slope * |d|``
    (slopes ``(Hq,)`` or ``(B, Hq)``) as a float64 bias, or a boolean mask when there is no bias."""
    keep = _keep(seqlens, Nq, N, causal, window)
    bias = None
    if slopes is not None:
        bias = -slopes.double().view(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1) * _offsets(
            seqlens, Nq, N).abs()
    if mask is not None and mask.is_floating_point():
        bias = mask.double() if bias is None else bias + mask.double()
    elif mask is not None:
        keep = keep & mask
    return keep if bias is None else torch.where(keep, bias, float("-inf"))


def _reference(q, k, v, alpha, seqlens, causal=False, mask=None, dtype=torch.float64, window=None, slopes=None,
               sinks=None, softcap=None):
    """Reference on the contiguous cache in ``dtype`` (float64: the truth; else fp32 scores, output in ``dtype``);
    the window and ALiBi enter as the mask of :func:`_oracle_mask`, soft cap and sinks as themselves."""
    keep = _oracle_mask(seqlens, q.shape[2], k.shape[2], causal, mask, window, slopes)
    keep = keep.to(dtype) if keep.is_floating_point() else keep
    lp = dtype if dtype == torch.float64 else torch.float32
    a = alpha.to(lp) if isinstance(alpha, torch.Tensor) else alpha
    return entmax_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), a, attn_mask=keep, enable_gqa=True,
                                      return_stats=True, sinks=None if sinks is None else sinks.to(lp),
                                      softcap=softcap)


def _max_err(a, b):
    return (a.double() - b.double()).abs().nan_to_num(0.0).max().item() if a.numel() else 0.0


def _check(name, got, want64, ref_lp, dtype):
    assert_close_to_ref(got, want64, ref_lp, dtype, eps=EPS[dtype], name=name)


def _run(B=2, Hq=4, Hk=2, Nq=1, N=40, D=16, alpha=1.5, seqlens=None, dtype=torch.float32, layout="bhnd",
         page_size=None, causal=False, mask=None, num_splits=2, seed=0, mult=1.0, q_mult=1.0, dv=None, tau_hint=None,
         **variants):
    """Decode on the triton backend (interpreter on CPU) and check out, tau, nnz, n_valid against the reference.

    ``tau_hint``: None, or a function of the float64 reference's ``tau`` giving ``entmax_decode``'s ``tau_hint``.

    ``variants``: ``window``, ``slopes``, ``sinks``, ``softcap`` (``entmax_decode``'s ``window_size``,
    ``alibi_slopes``, ``sinks``, ``softcap``); each must change the float64 reference's output (no vacuous case).
    """
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([N] * B if seqlens is None else seqlens, dtype=torch.int32)
    q = (torch.randn(B, Hq, Nq, D, generator=gen, dtype=torch.float64) * q_mult * mult).to(dtype)
    k = _cache(gen, B, Hk, N, D, dtype, layout, mult)
    v = _cache(gen, B, Hk, N, dv or D, dtype, layout)
    alpha_t = torch.tensor(alpha, dtype=torch.float32) if isinstance(alpha, list) else alpha
    if page_size is None:
        kc, vc, table = k, v, None
    else:
        kc, vc, table = _page(k, v, seqlens, page_size, gen)
    names = dict(window="window_size", slopes="alibi_slopes", sinks="sinks", softcap="softcap")
    out64, st64 = _reference(q, k, v, alpha_t, seqlens, causal, mask, **variants)
    out, st = entmax_decode(q, kc, vc, seqlens, alpha_t, block_table=table, attn_mask=mask, is_causal=causal,
                            num_splits=num_splits, return_stats=True, backend="triton",
                            tau_hint=None if tau_hint is None else tau_hint(st64.tau),
                            **{names[n]: x for n, x in variants.items()})
    out_lp, st_lp = _reference(q, k, v, alpha_t, seqlens, causal, mask, dtype=dtype, **variants)
    for name in variants:
        without = _reference(q, k, v, alpha_t, seqlens, causal, mask, **dict(variants, **{name: None}))[0]
        assert _max_err(without, out64) > 1e-3, f"{name} does not change this case"
    assert isinstance(st, AttentionStats) and out.shape == (*q.shape[:3], dv or D) and out.dtype == dtype
    assert not torch.isnan(out).any()
    _check("out", out, out64, out_lp, dtype)
    assert torch.equal(st.n_valid, st64.n_valid)
    valid = st64.n_valid > 0
    assert torch.equal(valid, torch.isfinite(st.tau))
    zero = torch.zeros_like(st64.tau)
    _check("tau", torch.where(valid, st.tau.double(), zero), torch.where(valid, st64.tau, zero),
           torch.where(valid, st_lp.tau.double(), zero), dtype)
    assert (out[~valid] == 0).all() and (st.nnz[~valid] == 0).all()
    a = (alpha_t if isinstance(alpha_t, torch.Tensor) else torch.tensor(alpha)).double().expand(Hq)
    soft = (a == 1).view(1, -1, 1).expand_as(valid)
    assert torch.equal(st.nnz[soft], st.n_valid[soft])
    # the support away from ties: keys clearly above tau are in, clearly below are out
    kk = k.double().repeat_interleave(Hq // Hk, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * D ** -0.5
    if variants.get("softcap") is not None:
        s = variants["softcap"] * torch.tanh(s / variants["softcap"])
    bias = _oracle_mask(seqlens, Nq, N, causal, mask, variants.get("window"), variants.get("slopes"))
    s = s + bias if bias.is_floating_point() else s.masked_fill(~bias, float("-inf"))
    gap = (a.view(1, -1, 1, 1) - 1) * s - st64.tau[..., None]
    lo, hi = (gap > TIE_MARGIN[dtype]).sum(-1), (gap > -TIE_MARGIN[dtype]).sum(-1)
    ent = ~soft & valid
    assert ((st.nnz >= lo) & (st.nnz <= hi))[ent].all(), "support differs from the reference away from ties"
    return out, st


@pytest.mark.parametrize(
    "case",
    [
        dict(alpha=1.5, Hq=4, Hk=2, seqlens=[37, 40]),
        dict(alpha=2.0, Hq=4, Hk=1, Nq=2, layout="bnhd", num_splits=3),
        dict(alpha=1.25, Hq=2, Hk=2, page_size=16, seqlens=[0, 1, 45], B=3, N=45),
        dict(alpha=1.0, Hq=4, Hk=2, page_size=5, seqlens=[23, 40]),
        dict(alpha=MIXED, Hq=4, Hk=1, Nq=3, causal=True, page_size=7, seqlens=[33, 2], N=33, D=24),
        dict(alpha=MIXED * 2, Hq=8, Hk=2, Nq=1, seqlens=[18, 29], N=29, D=32, num_splits=1),
        dict(alpha=[1.1, 1.75], Hq=2, Hk=1, Nq=2, seqlens=[31], B=1, N=31, mult=2.0),
    ],
    ids=["gqa-varlen", "mqa-bnhd-nq2", "paged-mha-empty-onetoken", "softmax-paged", "mixed-causal-paged",
         "mixed-gqa4", "general-per-head"],
)
def test_matches_reference(case):
    _run(**case)


@pytest.mark.parametrize("dtype,alpha", [(torch.float16, MIXED), (torch.bfloat16, 1.5)], ids=["fp16-mixed", "bf16"])
def test_half_precision(dtype, alpha):
    _run(Hq=4, Hk=2, Nq=2, N=37, D=32, alpha=alpha, dtype=dtype, seqlens=[37, 21], page_size=8, causal=True)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
VARIANT_CASES = {
    "window-gqa-paged-ragged": dict(alpha=1.5, B=3, N=100, seqlens=[100, 0, 13], page_size=16, num_splits=3,
                                    window=(20, 0)),
    "window-right-mqa-nq3-mixed": dict(alpha=MIXED, Hk=1, Nq=3, N=70, seqlens=[70, 9], window=(25, 1)),
    "window-causal-nq4-softmax": dict(alpha=1.0, Nq=4, causal=True, N=64, seqlens=[64, 30], window=(12, -1)),
    "softcap-mixed-paged": dict(alpha=MIXED, N=40, seqlens=[40, 17], page_size=7, softcap=1.0, mult=2.0),
    "alibi-per-head-causal": dict(alpha=[1.0, 1.25, 2.0, 1.5], Nq=2, causal=True, N=48, seqlens=[48, 20],
                                  slopes=SLOPES),
    "alibi-per-batch-general": dict(alpha=1.25, N=40, seqlens=[40, 31],
                                    slopes=torch.stack([SLOPES, SLOPES.flip(0)])),
    "sinks-mixed-empty": dict(alpha=MIXED, Hk=1, N=40, seqlens=[40, 0], sinks=torch.tensor([1.0, 2.5, 0.5, 1.5])),
    "sinks-dominant-entmax15": dict(alpha=1.5, Nq=2, causal=True, N=33, sinks=torch.tensor([3.0, 4.0, 2.0, 3.5])),
    "dv-mixed-paged": dict(alpha=MIXED, dv=32, page_size=8, N=45, seqlens=[45, 20]),
    "all-mixed-gqa4": dict(alpha=MIXED * 2, B=3, Hq=8, Hk=2, Nq=2, causal=True, N=120, seqlens=[120, 0, 25], D=32,
                           dv=16, page_size=16, num_splits=3, window=(30, 0), softcap=2.0, mult=1.5,
                           slopes=torch.cat([SLOPES, SLOPES]).view(1, 8).expand(3, 8) * torch.tensor([[1.0], [2.0],
                                                                                                      [0.5]]),
                           sinks=torch.linspace(-1.0, 2.5, 8)),
}


@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_variants_match_reference(name):
    """Sliding window (the decode alignment: query ``i`` at key position ``i + cache_seqlens[b] - Nq``), soft cap,
    ALiBi, sinks and ``Dv != D`` on the decode kernels, each alone and all at once, against the float64 reference:
    outputs, thresholds, valid-key counts and supports; sequences of 0 keys and shorter than the window."""
    _run(**VARIANT_CASES[name])


@pytest.mark.parametrize("dtype,alpha", [(torch.float16, MIXED), (torch.bfloat16, 1.5)], ids=["fp16-mixed", "bf16"])
def test_variants_half_precision(dtype, alpha):
    """Every variant at once in half precision, within twice the error of the reference in that dtype."""
    _run(Hq=4, Hk=2, Nq=2, N=60, D=16, dv=32, alpha=alpha, dtype=dtype, seqlens=[60, 14], page_size=8, causal=True,
         window=(24, 0), softcap=2.0, slopes=SLOPES / 8, sinks=torch.tensor([0.5, 2.0, -1.0, 1.0]), mult=1.5)


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_window_blocks_outside_are_never_read(alpha):
    """A sliding window over a 200-key cache in 16-key blocks: keys and values no query's window holds are NaN, and
    the output stays finite and right (a block outside the window, if read, would turn softmax rows NaN through
    ``0 * NaN`` in ``P V``); the score pass reads exactly the window's blocks, split 0 starting at its first."""
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hk, Nq, N, D, window = 2, 4, 2, 2, 200, 16, (40, 0)
    seqlens = torch.tensor([200, 150], dtype=torch.int32)
    q = torch.randn(B, Hq, Nq, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, D, torch.float32)
    first = (seqlens - Nq - window[0]) // 16  # the block of each sequence's first key in a window
    # keys outside every window; values of the blocks before the first (a block's rows go through P V together)
    k_nan = k.masked_fill(~_keep(seqlens, Nq, N, True, window).any(2)[..., None], float("nan"))
    v_nan = v.masked_fill((torch.arange(N) < 16 * first.view(B, 1, 1))[..., None], float("nan"))
    res = entmax_decode_fwd(q, k_nan, v_nan, seqlens, alpha, D ** -0.5, is_causal=True, window_size=window,
                            num_splits=2)
    out64, _ = _reference(q, k, v, alpha, seqlens, True, window=window)
    out_lp, _ = _reference(q, k, v, alpha, seqlens, True, dtype=torch.float32, window=window)
    assert not torch.isnan(res.out).any()
    _check("out", res.out, out64, out_lp, torch.float32)
    assert torch.equal(res.blocks_read[..., 0].sum(dim=(0, 3, 4)), (-(-seqlens // 16) - first).view(B, 1).expand(B, Hk))
    full = entmax_decode_fwd(q, k, v, seqlens, alpha, D ** -0.5, is_causal=True, num_splits=2)
    assert (full.blocks_read[..., 0].sum(dim=(0, 3, 4)) > res.blocks_read[..., 0].sum(dim=(0, 3, 4))).all()


def test_sinks_minus_inf_is_off_and_nan_poisons_its_head():
    """As the fused forward: a ``-inf`` sink is no sink (bitwise); a NaN or ``+inf`` sink makes its head's rows NaN
    (``tau`` NaN, ``nnz`` 0), an empty cache's rows included, and leaves the other heads as they were."""
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = _cache(gen, 2, 2, 40, 16, torch.float32), _cache(gen, 2, 2, 40, 16, torch.float32)
    seqlens = torch.tensor([40, 0], dtype=torch.int32)
    alpha = torch.tensor(MIXED)
    run = functools.partial(entmax_decode, q, k, v, seqlens, alpha, num_splits=2, return_stats=True,
                            backend="triton")
    base, st0 = run()
    off, st = run(sinks=torch.full((4,), float("-inf")))
    assert torch.equal(off, base) and torch.equal(st.tau, st0.tau) and torch.equal(st.nnz, st0.nnz)
    for poison, head in ((float("nan"), 1), (float("inf"), 0), (float("nan"), 3), (float("inf"), 2)):
        sinks = torch.zeros(4)
        sinks[head] = poison
        out, st = run(sinks=sinks)
        others = [h for h in range(4) if h != head]
        assert out[:, head].isnan().all() and st.tau[:, head].isnan().all() and (st.nnz[:, head] == 0).all()
        assert not out[:, others].isnan().any() and not st.tau[:, others].isnan().any()


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
def test_split_counts(num_splits):
    """Every split count gives the reference's result; splits beyond the key blocks are not launched."""
    alpha = 2.0 if num_splits % 2 else 1.5
    _run(B=1, Hq=2, Hk=1, N=128, D=16, alpha=alpha, num_splits=num_splits, seed=num_splits)


def test_long_context_few_thousand_keys():
    """3000 keys in 128-key blocks and 8 splits, one sequence shorter than the capacity."""
    gen = torch.Generator().manual_seed(5)
    N, seqlens = 3000, torch.tensor([3000, 1000], dtype=torch.int32)
    q = torch.randn(2, 2, 1, 32, generator=gen)
    k, v = _cache(gen, 2, 1, N, 32, torch.float32), _cache(gen, 2, 1, N, 32, torch.float32)
    res = entmax_decode_fwd(q, k, v, seqlens, 1.5, 32 ** -0.5, num_splits=8, block_n=128)
    out64, st64 = _reference(q, k, v, 1.5, seqlens)
    out_lp, _ = _reference(q, k, v, 1.5, seqlens, dtype=torch.float32)
    _check("out", res.out, out64, out_lp, torch.float32)
    assert torch.equal(res.n_valid, st64.n_valid)
    assert torch.equal(res.blocks_read[..., 0].sum(-1).flatten(), torch.tensor([24, 8], dtype=torch.int32))


def test_empty_and_one_token_caches():
    """Length 0 gives zeros, tau = +inf, nnz = 0; length 1 gives that key's value row (weight 1) for every alpha."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 1, 16, generator=gen)
    k, v = _cache(gen, 3, 2, 20, 16, torch.float32), _cache(gen, 3, 2, 20, 16, torch.float32)
    seqlens = torch.tensor([0, 1, 0], dtype=torch.int32)
    out, st = entmax_decode(q, k, v, seqlens, torch.tensor(MIXED), return_stats=True, backend="triton")
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert torch.isinf(st.tau[0]).all() and (st.tau[0] > 0).all() and (st.nnz[0] == 0).all()
    assert torch.allclose(out[1], v[1, :, :1].repeat_interleave(2, 0), atol=TOL["lowp_vs_f64"][torch.float32])
    assert (st.nnz[1] == 1).all() and (st.n_valid[1] == 1).all()
    out0 = entmax_decode(q, k[:, :, :0], v[:, :, :0], 0, 1.5, backend="triton")
    assert out0.shape == q.shape and (out0 == 0).all()


def test_masks_padding_and_float_bias():
    """A left-padding keep mask and an ALiBi-like float bias (with -inf entries), indexed by key position."""
    B, N = 2, 40
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[0, ..., :7] = False
    _run(B=B, Hq=4, Hk=2, Nq=2, N=N, mask=keep, causal=True, seqlens=[40, 31])
    gen = torch.Generator().manual_seed(3)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, 4, 1, 1)
    bias = -slopes * (N - 1 - torch.arange(N)).float()
    bias = bias.masked_fill(torch.rand(1, 1, 1, N, generator=gen) < 0.15, float("-inf"))
    _run(B=B, Hq=4, Hk=2, N=N, mask=bias, alpha=MIXED, page_size=8)


def test_nan_and_inf_give_nan_rows():
    """NaN in q, NaN in a valid key, +inf in a float mask: NaN rows (tau NaN, nnz 0); garbage past the cache length
    and -inf mask entries change nothing."""
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hk, N, D = 2, 4, 2, 30, 16
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, D, torch.float32)
    seqlens = torch.tensor([30, 20], dtype=torch.int32)
    q[0, 1, 0, 3] = float("nan")
    k[1, 1, 5, 0] = float("nan")  # valid key of batch 1, kv head 1: q heads 2, 3
    k[1, 0, 25] = float("nan")  # past the length of batch 1: never read
    v[1, 0, 25] = float("nan")
    bias = torch.zeros(B, Hq, 1, N)
    bias[0, 3, 0, 2] = float("inf")
    bias[0, 2, 0, :10] = float("-inf")
    alpha = torch.tensor(MIXED)
    # the public entry point: a +inf mask entry gives a NaN row, no exception (the non-finite policy)
    out, st = entmax_decode(q, k, v, seqlens, alpha, attn_mask=bias, num_splits=2, return_stats=True, backend="triton")
    bad = torch.zeros(B, Hq, 1, dtype=torch.bool)
    bad[0, 1] = bad[1, 2] = bad[1, 3] = bad[0, 3] = True
    assert torch.isnan(out[bad]).all() and torch.isnan(st.tau[bad]).all() and (st.nnz[bad] == 0).all()
    assert not torch.isnan(out[~bad]).any()
    k_ok, q_ok = k.clone(), q.clone()
    k_ok[1, 1, 5, 0] = 0.0
    q_ok[0, 1, 0, 3] = 0.0
    bias_ok = bias.masked_fill(bad[..., None].expand_as(bias), 0.0)
    out64, _ = _reference(q_ok, k_ok.nan_to_num(), v.nan_to_num(), alpha, seqlens, mask=bias_ok)
    assert _max_err(out[~bad], out64[~bad]) < 1e-5


def test_value_blocks_without_weight_are_not_read():
    """Locally correlated cache (the query near the last key): value rows of blocks with no weight hold NaN, and
    the output is still finite and right; the value pass read fewer blocks than the score pass."""
    gen = torch.Generator().manual_seed(6)
    N, D = 256, 16
    k = torch.randn(1, 1, N, D, generator=gen) * 0.3
    k[..., -20:, :] += torch.randn(1, 1, 1, D, generator=gen) * 2.0
    q = k[:, :, -1:].expand(1, 2, 1, D).clone() * 2.0
    v = torch.randn(1, 1, N, D, generator=gen)
    seqlens = torch.tensor([N], dtype=torch.int32)
    for alpha in (1.5, 2.0):
        out64, st64 = _reference(q, k, v, alpha, seqlens)
        z = (alpha - 1) * (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
        weight = (z - st64.tau[..., None] + 1e-3).clamp_min(0).amax(dim=(1, 2))[0]  # (N,): any row, with margin
        block_dead = weight.view(-1, 16).amax(-1) == 0
        assert block_dead.sum() >= 8
        v_poison = v.clone()
        v_poison[0, 0, block_dead.repeat_interleave(16)] = float("nan")
        res = entmax_decode_fwd(q, k, v_poison, seqlens, alpha, D ** -0.5, num_splits=3)
        assert _max_err(res.out, out64) < 2e-5 and not torch.isnan(res.out).any()
        reads = res.blocks_read.sum(dim=(0, 1, 2, 3, 4))
        assert reads[0] == N // 16 and reads[-1] <= (~block_dead).sum() and reads[-1] < reads[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_threshold_pinned_in_total_weight(dtype):
    """Large scores (z up to ~20, a few keys in the support): the kernel's threshold puts the row's total weight
    ``sum_j [z_j - tau]_+^beta`` (float64 scores) within about the dtype's tolerance of 1, whatever |tau| (the
    stopping rule bounds the change of total weight across the bracket, not its width relative to 1 + |tau|)."""
    gen = torch.Generator().manual_seed(11)
    N, D = 96, 16
    k = torch.randn(1, 1, N, D, generator=gen) * 0.3
    k[..., -12:, :] += torch.randn(1, 1, 1, D, generator=gen)
    q = (k[:, :, -1:] * 1.5 + torch.randn(1, 4, 1, D, generator=gen) * 0.3).to(dtype)
    k, v = k.to(dtype), torch.randn(1, 1, N, D, generator=gen).to(dtype)
    alpha = torch.tensor([1.5, 2.0, 1.25, 1.75])
    res = entmax_decode_fwd(q, k, v, torch.tensor([N], dtype=torch.int32), alpha, 4.0, num_splits=2)
    z = (alpha.double().view(1, -1, 1, 1) - 1) * 4 * (q.double() @ k.double().transpose(-1, -2))
    assert z.amax() > 5
    beta = 1 / (alpha.double().view(1, -1, 1, 1) - 1)
    mass = ((z - res.tau.double()[..., None]).clamp_min(0) ** beta).sum(-1)
    tol = {torch.bfloat16: 1e-3, torch.float16: 3e-4}[dtype]
    assert ((mass - 1).abs() <= 2 * tol).all(), (mass - 1).abs().max()


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0, 1.25])
def test_counters(alpha):
    """Passes within [2, max_passes] (1 for softmax); the score pass reads every block of each sequence once;
    later passes read no more blocks than the pass before; V blocks <= score blocks of the value pass."""
    gen = torch.Generator().manual_seed(7)
    seqlens = torch.tensor([90, 17], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = _cache(gen, 2, 2, 90, 16, torch.float32), _cache(gen, 2, 2, 90, 16, torch.float32)
    res = entmax_decode_fwd(q, k, v, seqlens, alpha, 0.25, num_splits=3)
    n_slots = res.blocks_read.shape[-1]
    assert res.n_splits == 3 and res.block_n == 16 and n_slots == 6  # float32: 5 passes at most
    reads = res.blocks_read.sum(dim=(0, 4))  # (B, Hk, row tiles, slots)
    assert (reads[..., 0] == torch.tensor([6, 2]).view(2, 1, 1)).all()
    if alpha == 1.0:
        assert (res.n_passes == 1).all() and torch.equal(reads[..., -1], reads[..., 0])
        assert (reads[..., 1:-1] == 0).all()
        return
    cand, zval, vals = reads[..., 1:-2], reads[..., -2], reads[..., -1]
    # candidate passes that ran read ever fewer blocks; the skipped ones (rows pinned down) read none
    assert (cand.diff(dim=-1) <= 0).all() and (cand[..., 0] <= reads[..., 0]).all()
    assert torch.equal(res.n_passes[0], 2 + (cand > 0).sum(-1))
    last = torch.where(cand > 0, cand, reads[..., :1]).amin(-1)
    assert (zval <= last).all() and (vals <= zval).all() and (vals >= 1).all()


def test_mixed_launches_equal_single_class_launches():
    """alpha_class="mixed" (four filtered launches, as a CUDA alpha gets) gives bitwise the outputs of per-class
    launches; a head whose unchecked alpha is outside [1, 2] is NaN."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 2, 16, generator=gen)
    k, v = _cache(gen, 1, 2, 40, 16, torch.float32), _cache(gen, 1, 2, 40, 16, torch.float32)
    seqlens = torch.tensor([40], dtype=torch.int32)
    alpha = torch.tensor(MIXED)
    mixed = entmax_decode_fwd(q, k, v, seqlens, alpha, 0.25, alpha_class="mixed", num_splits=2)
    for h, a in enumerate(MIXED):
        kv = h // 2
        one = entmax_decode_fwd(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], seqlens, a, 0.25, num_splits=2)
        assert torch.equal(mixed.out[:, h:h + 1], one.out) and torch.equal(mixed.tau[:, h:h + 1], one.tau)
        assert torch.equal(mixed.nnz[:, h:h + 1], one.nnz)
    bad = entmax_decode_fwd(q, k, v, seqlens, torch.tensor([1.5, 2.5, 2.0, 1.0]), 0.25, alpha_class="mixed")
    assert torch.isnan(bad.out[:, 1]).all() and torch.isnan(bad.tau[:, 1]).all()
    assert not torch.isnan(bad.out[:, [0, 2, 3]]).any()


def _garbage_hint(tau):
    """Hints no threshold search may trust: NaN, +-inf, huge values and values far on either side of the root."""
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e6, -50.0, 0.0], dtype=torch.float64)
    return bad[torch.arange(tau.numel()) % bad.numel()].view(tau.shape).float()


HINTS = {
    "exact": lambda tau: tau.float(),
    "close": lambda tau: (tau + 3e-4).float(),
    "stale": lambda tau: (tau - 0.07).float(),
    "garbage": _garbage_hint,
}


@pytest.mark.parametrize("hint", sorted(HINTS))
@pytest.mark.parametrize(
    "case",
    [
        dict(alpha=1.5, Hq=4, Hk=2, seqlens=[37, 40]),
        dict(alpha=2.0, Hq=4, Hk=1, Nq=2, page_size=8, seqlens=[33, 12], N=33, causal=True),
        dict(alpha=MIXED, Hq=4, Hk=1, Nq=1, seqlens=[0, 29], N=29, dtype=torch.bfloat16),
        dict(alpha=[1.1, 1.75], Hq=2, Hk=1, seqlens=[31], B=1, N=31, mult=2.0, sinks=torch.tensor([0.5, -1.0]),
             softcap=3.0, slopes=torch.tensor([0.1, 0.3])),
    ],
    ids=["entmax15-gqa", "sparsemax-paged-causal-nq2", "mixed-bf16-empty", "general-sinks-softcap-alibi"],
)
def test_tau_hint_matches_reference(case, hint):
    """With a threshold hint (the float64 tau itself, a close one, a stale one, garbage: NaN, +-inf, huge and far
    values), outputs and statistics meet the same float64 reference checks as without one (:func:`_run`: output and
    tau by the tolerance rule, support sizes away from ties, n_valid exactly)."""
    _run(tau_hint=HINTS[hint], **case)


def test_tau_hint_broadcasts_and_non_finite_entries_are_ignored_bitwise():
    """A hint of shape (B, Hq, 1) broadcasts over the queries; NaN and infinite entries add no point, so a hint of only
    such entries gives bitwise the result of no hint (same passes, same blocks read)."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 4, 2, 16, generator=gen)
    k, v = _cache(gen, 2, 2, 70, 16, torch.float32), _cache(gen, 2, 2, 70, 16, torch.float32)
    lens = torch.tensor([70, 50], dtype=torch.int32)
    base = entmax_decode_fwd(q, k, v, lens, 1.5, 0.25, num_splits=2)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")]).view(1, 4, 1).expand(2, 4, 1)
    none = entmax_decode_fwd(q, k, v, lens, 1.5, 0.25, num_splits=2, tau_hint=bad)
    for a, b in zip(base[:6], none[:6], strict=True):
        assert torch.equal(a, b)
    one = entmax_decode_fwd(q, k, v, lens, 1.5, 0.25, num_splits=2, tau_hint=base.tau[:, :, :1])
    two = entmax_decode_fwd(q, k, v, lens, 1.5, 0.25, num_splits=2, tau_hint=base.tau[:, :, :1].expand(2, 4, 2)
                            .contiguous())
    for a, b in zip(one[:6], two[:6], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
def test_tau_hint_cuts_the_candidate_passes(alpha):
    """A step whose threshold search needs candidate passes (float32, 4 x 64 random keys) needs none with the
    previous step's tau as the hint when the step changed nothing but one appended key outside the support: 2 passes
    (score and value pass) on every row tile, no stored-score block read between them; the result stays within the
    tolerance rule of the float64 reference. A stale hint (off by 0.05) never costs a pass."""
    gen = torch.Generator().manual_seed(22)
    N, D = 256, 16
    q = torch.randn(1, 8, 1, D, generator=gen)
    k, v = _cache(gen, 1, 2, N + 1, D, torch.float32), _cache(gen, 1, 2, N + 1, D, torch.float32)
    group_q = q[0, :, 0].view(2, 4, D).sum(1)
    k[0, :, N] = -4 * group_q / group_q.norm(dim=-1, keepdim=True)  # scores low for its group: outside every support
    prev = entmax_decode_fwd(q, k, v, torch.tensor([N], dtype=torch.int32), alpha, 0.25, num_splits=4, block_n=16)
    lens = torch.tensor([N + 1], dtype=torch.int32)
    base = entmax_decode_fwd(q, k, v, lens, alpha, 0.25, num_splits=4, block_n=16)
    hinted = entmax_decode_fwd(q, k, v, lens, alpha, 0.25, num_splits=4, block_n=16, tau_hint=prev.tau)
    stale = entmax_decode_fwd(q, k, v, lens, alpha, 0.25, num_splits=4, block_n=16, tau_hint=prev.tau - 0.05)
    assert (base.n_passes > 2).any(), "no candidate pass to save in this case"
    assert (hinted.n_passes == 2).all() and (hinted.blocks_read[..., 1:-2] == 0).all()
    assert (stale.n_passes <= base.n_passes).all()
    out64, st64 = _reference(q, k, v, alpha, lens)
    out_lp, st_lp = _reference(q, k, v, alpha, lens, dtype=torch.float32)
    assert torch.equal(st64.nnz, _reference(q, k, v, alpha, lens - 1)[1].nnz), "the appended key is in a support"
    for res in (base, hinted, stale):
        _check("out", res.out, out64, out_lp, torch.float32)
        _check("tau", res.tau, st64.tau, st_lp.tau, torch.float32)


def test_reference_backend_gathers_pages():
    """backend="reference" (CPU "auto") on a paged cache equals the contiguous float64 reference, with every variant
    too (each sequence aligned on its own length, ``Dv != D``, an empty cache)."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 4, 2, 16, generator=gen, dtype=torch.float64)
    k, v = _cache(gen, 3, 2, 30, 16, torch.float64), _cache(gen, 3, 2, 30, 8, torch.float64)
    seqlens = torch.tensor([30, 11, 0], dtype=torch.int32)
    kp, vp, table = _page(k, v, seqlens, 4, gen)
    out, st = entmax_decode(q, kp, vp, seqlens, 1.5, block_table=table, is_causal=True, return_stats=True)
    out64, st64 = _reference(q, k, v, 1.5, seqlens, causal=True)
    assert torch.allclose(out, out64, atol=TOL["same_values"][torch.float64]) and torch.equal(st.nnz, st64.nnz)
    variants = dict(window=(6, 0), slopes=torch.rand(3, 4, generator=gen, dtype=torch.float64), softcap=2.0,
                    sinks=torch.randn(4, generator=gen, dtype=torch.float64))
    alpha = torch.tensor(MIXED, dtype=torch.float64)
    out, st = entmax_decode(q, kp, vp, seqlens, alpha, block_table=table, is_causal=True, return_stats=True,
                            window_size=(6, 0), alibi_slopes=variants["slopes"], softcap=2.0, sinks=variants["sinks"])
    out64, st64 = _reference(q, k, v, alpha, seqlens, causal=True, **variants)
    f64 = TOL["same_values"][torch.float64]
    assert torch.allclose(out, out64, atol=f64) and torch.allclose(st.tau, st64.tau, atol=f64)
    assert torch.equal(st.nnz, st64.nnz) and torch.equal(st.n_valid, st64.n_valid)


def _bad_call(**overrides):
    gen = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(2, 4, 1, 16, generator=gen), k_cache=torch.randn(2, 2, 10, 16, generator=gen),
                v_cache=torch.randn(2, 2, 10, 16, generator=gen), cache_seqlens=torch.tensor([10, 4]), alpha=1.5)
    args.update(overrides)
    return entmax_decode(**args)


@pytest.mark.parametrize(
    "overrides,exc,match",
    [
        (dict(q=torch.randn(2, 3, 1, 16)), ValueError, "multiple of the number of kv heads"),
        (dict(q=torch.randn(2, 4, 17, 16), attn_mask=torch.zeros(1, 1, 17, 10), window_size=(3, 0), backend="triton"),
         ValueError, "window_size or alibi_slopes without is_causal"),
        (dict(block_mask=torch.ones(2, 1, 1, 3, dtype=torch.bool)), TypeError, "block_mask"),
        (dict(block_mask=sa.BlockSparseMask(torch.ones(2, 1, 1, 2, dtype=torch.bool), (1, 4))), ValueError,
         "block_mask"),
        (dict(k_cache=torch.randn(3, 2, 10, 16), v_cache=torch.randn(3, 2, 10, 16)), ValueError, "batch size"),
        (dict(v_cache=torch.randn(2, 2, 9, 16)), ValueError, "k_cache and v_cache"),
        (dict(k_cache=torch.randn(2, 2, 10, 16).half()), TypeError, "one dtype"),
        (dict(cache_seqlens=torch.tensor([11, 4])), ValueError, "cache_seqlens must lie in"),
        (dict(cache_seqlens=torch.tensor([1.0, 2.0])), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([1])), ValueError, r"cache_seqlens must have shape \(2,\)"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
        (dict(alpha=2.5), ValueError, "alpha"),
        (dict(alpha=torch.tensor([1.5, 0.5, 1.5, 1.5])), ValueError, "alpha"),
        (dict(alpha=torch.ones(3)), ValueError, "alpha"),
        (dict(attn_mask=torch.ones(2, 1, 1, 9, dtype=torch.bool)), ValueError, "attn_mask"),
        (dict(attn_mask=torch.ones(2, 1, 1, 10, dtype=torch.int32)), TypeError, "attn_mask"),
        (dict(block_table=torch.zeros(2, 3)), TypeError, "block_table"),
        (dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "block_table"),
        (dict(k_cache=torch.randn(4, 5, 2, 16), v_cache=torch.randn(4, 5, 2, 16),
              block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32), cache_seqlens=torch.tensor([10, 7])),
         ValueError, "block_table"),
        (dict(k_cache=torch.randn(4, 5, 2, 16), v_cache=torch.randn(4, 5, 2, 16),
              block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32), cache_seqlens=7),
         ValueError, r"block_table\[1\] must index pages"),
        (dict(k_cache=torch.randn(4, 5, 2, 16), v_cache=torch.randn(4, 5, 2, 16),
              block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32), cache_seqlens=None),
         ValueError, r"block_table\[0\] must index pages"),
        (dict(max_seqlen_k=3), ValueError, "max_seqlen_k"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(is_causal=1), TypeError, "is_causal"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(window_size=4), TypeError, "window_size"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(batch, heads\)"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.int32)), TypeError, "alibi_slopes"),
        (dict(sinks=torch.ones(2, 4)), ValueError, "sinks"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap"),
        (dict(alibi_slopes=torch.ones(4, requires_grad=True), backend="triton"), ValueError,
         "alibi_slopes that require grad"),
        (dict(v_cache=torch.randn(2, 2, 10, 8), backend="triton"), ValueError, "v_cache of head_dim 8"),
        (dict(tau_hint=[0.0]), TypeError, "tau_hint must be a torch.Tensor"),
        (dict(tau_hint=torch.zeros(2, 4, 1, dtype=torch.float64)), TypeError, "tau_hint must be a float32"),
        (dict(tau_hint=torch.zeros(3, 4, 1)), ValueError, r"tau_hint must be broadcastable to .* \(2, 4, 1\)"),
        (dict(tau_hint=torch.zeros(2, 4, 2)), ValueError, "tau_hint must be broadcastable"),
        (dict(tau_hint=torch.zeros(1, 2, 4, 1)), ValueError, "tau_hint must be broadcastable"),
        (dict(tau_hint=torch.zeros(2, 4, 1, device="meta")), ValueError, "tau_hint must be on the device of q"),
        (dict(q=torch.randn(2, 4, 17, 16), tau_hint=torch.zeros(2, 4, 17), backend="triton"), ValueError,
         "tau_hint is taken with at most 16 queries"),
    ],
)
def test_bad_arguments(overrides, exc, match):
    with pytest.raises(exc, match=match):
        _bad_call(**overrides)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_flash_attn_layout_cache_error_names_the_layout_and_the_fix(backend):
    """A contiguous flash-attn ``(B, N, Hk, D)`` cache given as it is raises a ValueError that names the expected
    ``(B, Hk, N, D)`` layout, the shapes it got and the fix (``.transpose(1, 2)``); the transposed views then run
    and match the float64 reference on the same cache."""
    gen = torch.Generator().manual_seed(21)
    B, Hq, Hk, N, D = 2, 4, 2, 10, 16
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k_fa = torch.randn(B, N, Hk, D, generator=gen)  # flash-attn layout, contiguous
    v_fa = torch.randn(B, N, Hk, D, generator=gen)
    seqlens = torch.tensor([10, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"multiple of the number of kv heads \(10\)") as info:
        entmax_decode(q, k_fa, v_fa, seqlens, 1.5, backend=backend)
    msg = str(info.value)
    for part in ("(B, Hk, N, D)", "got k_cache of shape (2, 10, 2, 16)", "q of shape (2, 4, 1, 16)",
                 "flash-attn (B, N, Hk, D)", "k_cache.transpose(1, 2)", "no copy"):
        assert part in msg, (part, msg)
    # A flash-attn q (B, Nq, Hq, D) with it: the same message shows both shapes.
    with pytest.raises(ValueError, match=re.escape("got k_cache of shape (2, 10, 2, 16) for q of shape (2, 1, 4, 16)")):
        entmax_decode(q.transpose(1, 2).contiguous(), k_fa, v_fa, seqlens, 1.5, backend=backend)
    k, v = k_fa.transpose(1, 2), v_fa.transpose(1, 2)
    assert k.data_ptr() == k_fa.data_ptr() and not k.is_contiguous()
    out = entmax_decode(q, k, v, seqlens, 1.5, backend=backend)
    out64, _ = _reference(q, k, v, 1.5, seqlens)
    out_lp, _ = _reference(q, k, v, 1.5, seqlens, dtype=torch.float32)
    _check("out", out, out64, out_lp, torch.float32)


def test_paged_cache_heads_error_names_the_page_layout():
    """With ``block_table`` the heads error names the page-pool layout ``(num_pages, page_size, Hk, D)`` and the shape
    it got (no flash-attn transpose hint: flash-attn's paged layout is already the one taken)."""
    q = torch.randn(2, 4, 1, 16)
    pool = torch.randn(6, 4, 3, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape("a paged k_cache must have shape (num_pages, page_size, Hk, D), "
                                                   "got (6, 4, 3, 16)")) as info:
        entmax_decode(q, pool, pool, torch.tensor([8, 5], dtype=torch.int32), 1.5, block_table=table)
    assert "transpose" not in str(info.value)


def _spy_decode(monkeypatch, variants: list | None = None) -> list:
    """Record every launch chain of the decode kernels (``launch_decode``, which the decode op hands its spec) as the
    number of queries per sequence (and, into ``variants``, the spec's ``window_size``, ``alibi_slopes``, ``sinks`` and
    ``softcap``)."""
    calls, real = [], decode_kernels.launch_decode

    def spy(spec, *args, **kwargs):
        calls.append(spec.q.shape[2])
        if variants is not None:
            variants.append({n: getattr(spec, n) for n in ("window_size", "alibi_slopes", "sinks", "softcap")})
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(decode_kernels, "launch_decode", spy)
    return calls


@pytest.mark.parametrize(
    "alpha,n_q,causal,mask_kind,variants",
    [(MIXED, 1, False, "padding", {}), (1.5, 16, True, "float", {}),
     (MIXED, 3, True, "padding", dict(window_size=(20, 0), softcap=2.0, alibi_slopes=SLOPES / 4,
                                     sinks=torch.tensor([1.0, -0.5, 2.0, 0.5]), dv=32))],
    ids=["mixed-padding-nq1", "entmax15-causal-float-nq16", "mixed-all-variants-nq3"],
)
def test_entmax_attention_runs_decoding_steps_on_the_decode_kernels(monkeypatch, alpha, n_q, causal, mask_kind,
                                                                    variants):
    """``entmax_attention`` on the fused path with Nq <= 16 queries against a longer cache (GQA, per-head alpha,
    left padding or a float bias with -inf, bottom-right causal; a sliding window, soft cap, ALiBi, sinks and
    ``Dv != D``) takes the decode kernels, once, and matches the float64 reference, statistics included."""
    calls = _spy_decode(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    B, Hq, Hk, N, D = 2, 4, 2, 45, 16
    variants = dict(variants)
    q = torch.randn(B, Hq, n_q, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, variants.pop("dv", D), torch.float32)
    mask = None
    if mask_kind == "padding":
        mask = torch.ones(B, 1, 1, N, dtype=torch.bool)
        mask[1, ..., :9] = False
    elif mask_kind == "float":
        mask = torch.randn(1, Hq, n_q, N, generator=gen).masked_fill(torch.rand(1, 1, 1, N, generator=gen) < 0.2,
                                                                    float("-inf"))
    a = torch.tensor(alpha) if isinstance(alpha, list) else alpha
    kw = dict(is_causal=causal, enable_gqa=True, return_stats=True, attn_mask=mask, **variants)
    out, st = entmax_attention(q, k, v, a, backend="triton", **kw)
    assert calls == [n_q]
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    kw64 = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in kw.items()}
    out64, st64 = entmax_attention_reference(q.double(), k.double(), v.double(), a64, **kw64)
    out32, st32 = entmax_attention_reference(q, k, v, a, **kw)
    _check("out", out, out64, out32, torch.float32)
    _check("tau", st.tau, st64.tau, st32.tau, torch.float32)
    assert torch.equal(st.n_valid, st64.n_valid) and st.nnz.shape == st64.nnz.shape


def test_decode_path_rules():
    """Which fused-path calls run on the decode kernels: 1..16 queries against more keys, nothing needing a
    gradient (sinks included), no dropout, no packed sequences; every attention variant of the route table's decode
    route runs there (tests/variants.py), the others do not; what it refuses (slopes requiring grad, value head
    dims outside [16, 256]) raises before any kernel."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 4, n, 16, generator=gen) for n in (1, 20, 20))

    def fits(q=q, k=k, v=v, **kw):
        return decode_fits(prepare_attention(q, k, v, 1.5, backend="triton", **kw))

    assert fits() and fits(q=torch.randn(2, 4, 16, 16), is_causal=True)
    assert not fits(q=torch.randn(2, 4, 17, 16)) and not fits(k=k[:, :, :1], v=v[:, :, :1])
    assert not fits(dropout_p=0.1)
    assert not decode_fits(prepare_attention(q, k, v, 1.5, backend="reference"))
    qg = q.clone().requires_grad_()
    assert not fits(q=qg)
    with torch.no_grad():
        assert fits(q=qg)
    packed = dict(q=q.transpose(0, 2).reshape(1, 4, 2, 16), k=k[:1, :, :6], v=v[:1, :, :6],
                  cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32))
    assert not fits(**packed)
    step = Problem(b=2, hq=4, nq=1, nk=20, dtype=torch.float32, lengths_q=(1, 1), lengths_k=(9, 11))
    for name, row in ROWS.items():  # each variant alone: on the decode kernels exactly when the route lists it
        q1, k1, v1, kw = build([name], step)
        if "fused" not in row.routes:
            with pytest.raises(ValueError, match="not supported"):
                fits(q=q1, k=k1, v=v1, **kw)
        else:
            assert fits(q=q1, k=k1, v=v1, **kw) == ("decode" in row.routes), name
    sinks = torch.zeros(4, requires_grad=True)
    assert decode_unsupported(prepare_attention(q, k, v, 1.5, backend="triton", sinks=sinks)) == [
        "gradients"]
    with pytest.raises(ValueError, match="not supported by the fused Triton kernels"):
        entmax_attention(q, k, v[..., :8], 1.5, backend="triton")
    with pytest.raises(ValueError, match="alibi_slopes that require grad"):
        entmax_attention(q, k, v, 1.5, backend="triton", alibi_slopes=torch.ones(4, requires_grad=True))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_decode_every_variant_against_the_eager_twins(monkeypatch, mask):
    """Every variant the decode route runs, at once (the test table, tests/variants.py; one mask kind per case), on
    the decode kernels through ``entmax_attention`` (three queries, mixed alpha per head) against the eager twins in
    float64."""
    calls = _spy_decode(monkeypatch)
    names = together("decode", mask=mask)
    q, k, v, kw = build(names, Problem(b=2, hq=4, nq=3, nk=40, dtype=torch.float32, seed=21))
    alpha = torch.tensor(MIXED)
    out = entmax_attention(q, k, v, alpha, backend="triton", **kw)
    assert calls == [3]
    want = eager_attention(q.double(), k.double(), v.double(), alpha.double(), **cast(kw, torch.float64))
    base = entmax_attention_reference(q, k, v, alpha, **kw)
    _check("out", out, want, base, torch.float32)


def test_training_calls_take_the_general_forward(monkeypatch):
    """A decoding-shaped call whose inputs require grad runs the general fused forward (the decode kernels have no
    backward), and gives the same output as the decode kernels under no_grad."""
    calls = _spy_decode(monkeypatch)
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (1, 30, 30))
    alpha = torch.tensor([1.5, 2.0], requires_grad=True)
    out = entmax_attention(q, k, v, alpha, backend="triton")
    assert calls == [] and out.requires_grad
    with torch.no_grad():
        out_decode = entmax_attention(q, k, v, alpha, backend="triton")
    assert calls == [1]
    torch.testing.assert_close(out_decode, out.detach(), atol=EPS[torch.float32], rtol=0)


def test_decode_step_compiles_fullgraph(monkeypatch):
    """The decode kernels are a custom op (``sparse_attn::entmax_decode``): a decoding step of ``entmax_attention``
    compiles with ``fullgraph=True``, runs the decode kernels and equals eager."""
    calls = _spy_decode(monkeypatch)
    gen = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((2, 1), (1, 30), (1, 30)))
    alpha = torch.tensor([1.5, 2.0])

    def step(q, k, v, alpha):
        return entmax_attention(q, k, v, alpha, enable_gqa=True, backend="triton")

    with torch.no_grad():
        eager = step(q, k, v, alpha)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, alpha)
    assert calls == [1, 1] and torch.equal(compiled, eager)


HF_DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=2, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=None)),
}


@pytest.mark.parametrize("arch", list(HF_DECODERS))
def test_hf_generate_takes_the_decode_path_and_records_stats(monkeypatch, arch):
    """Tiny Llama, gpt-oss (sinks, a sliding window of 4 on one layer) and Gemma-2 (soft cap, sliding window)
    models (GQA, left padding, per-head alpha) with ``attn_implementation="entmax"`` on the fused backend: every
    ``generate()`` step after the prompt runs the decode kernels, with the model's variants, past the window; the
    logits of each step match a recomputation of the whole sequence on the float64-capable reference, and
    ``record_head_stats(history=True)`` holds one density per step, layer and head."""
    transformers = pytest.importorskip("transformers")

    import sparse_attn.integrations.hf as entmax_hf

    config_name, model_name, extra = HF_DECODERS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation="entmax").eval()
    for name, p in model.named_parameters():
        if "q_proj" in name or "k_proj" in name:
            torch.nn.init.normal_(p, std=0.5)  # sharper scores: sparse weights
        if name.endswith("sinks"):
            torch.nn.init.normal_(p, std=2.0)
    entmax_hf.attach_entmax_alpha(model, alpha=[1.5, 2.0], learnable=False)
    model.config.entmax_backend = "triton"
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (2, 7), generator=gen)
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0
    variants = []
    calls = _spy_decode(monkeypatch, variants)
    new = 3
    with torch.no_grad(), record_head_stats(model, history=True) as rec:
        res = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    assert calls == [1] * (new - 1) * config.num_hidden_layers
    if arch != "llama":
        assert (3, 0) in [kw["window_size"] for kw in variants]  # the sliding layers' window reaches the kernels
        assert all((kw["sinks"] is not None) == (arch == "gpt_oss") for kw in variants)
        assert all((kw["softcap"] is not None) == (arch == "gemma2") for kw in variants)
    hist = rec.density_history()
    assert hist.shape == (new, config.num_hidden_layers, 2)
    assert ((hist > 0) & (hist <= 1)).all() and (hist[1:] < 1).any()
    model.config.entmax_backend = "reference"
    full_mask = torch.cat([mask, torch.ones(2, new, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(res.sequences, attention_mask=full_mask).logits
    tol = TOL["fused_vs_reference_f32"]["out"]
    for t, step in enumerate(res.logits):
        torch.testing.assert_close(step, logits[:, ids.shape[1] - 1 + t], atol=tol, rtol=tol)
    assert torch.equal(res.sequences[:, ids.shape[1]:], torch.stack([s.argmax(-1) for s in res.logits], 1))


_DECODE_BENCH = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "offline", "decode.py")


def test_compiles_for_sm90():
    """Every launch of a decode step (score and value pass of each alpha class, with the candidate passes and the
    combine of their last programs) compiles for sm_90 with the specialization a real launch gets, paged and causal,
    with a float mask and a threshold hint, and again with a boolean mask and every attention variant at once
    (benchmarks/offline/decode.py --sm90-check)."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, _DECODE_BENCH, "--sm90-check"], env=env, capture_output=True, text=True,
                          timeout=900)
    if "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_reference(dtype):
    """On a GPU: a longer paged cache, mixed alpha, the real block sizes and default splits."""
    gen = torch.Generator().manual_seed(10)
    B, Hq, Hk, N, D = 3, 8, 2, 5000, 128
    seqlens = torch.tensor([5000, 1, 3333], dtype=torch.int32)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(dtype)
    k, v = _cache(gen, B, Hk, N, D, dtype), _cache(gen, B, Hk, N, D, dtype)
    kp, vp, table = _page(k, v, seqlens, 16, gen)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25] * 2)
    out = entmax_decode(q.cuda(), kp.cuda(), vp.cuda(), seqlens.cuda(), alpha.cuda(), block_table=table.cuda())
    out64, _ = _reference(q, k, v, alpha, seqlens)
    out_lp, _ = _reference(q, k, v, alpha, seqlens, dtype=dtype)
    _check("out", out.cpu(), out64, out_lp, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_variants_match_reference(dtype):
    """On a GPU: a paged cache of 5000 keys, 2 queries per sequence (causal), mixed alpha, and every variant at once:
    a 1024-key window, ALiBi per head, a soft cap, sinks and Dv = 64 < D, at the real block sizes and splits."""
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hk, Nq, N, D, Dv = 3, 8, 2, 2, 5000, 128, 64
    seqlens = torch.tensor([5000, 2, 3333], dtype=torch.int32)
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype)
    k, v = _cache(gen, B, Hk, N, D, dtype), _cache(gen, B, Hk, N, Dv, dtype)
    kp, vp, table = _page(k, v, seqlens, 16, gen)
    alpha = torch.tensor([1.0, 1.5, 2.0, 1.25] * 2)
    slopes = torch.linspace(0.001, 0.05, Hq)
    sinks = torch.linspace(-1.0, 2.0, Hq)
    kw = dict(window_size=(1024, 0), alibi_slopes=slopes, sinks=sinks, softcap=20.0)
    out = entmax_decode(q.cuda(), kp.cuda(), vp.cuda(), seqlens.cuda(), alpha.cuda(), block_table=table.cuda(),
                        is_causal=True, **{n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
    ref = dict(causal=True, window=(1024, 0), slopes=slopes, sinks=sinks, softcap=20.0)
    out64, _ = _reference(q, k, v, alpha, seqlens, **ref)
    out_lp, _ = _reference(q, k, v, alpha, seqlens, dtype=dtype, **ref)
    _check("out", out.cpu(), out64, out_lp, dtype)


def _block_grid(B, Hq, Nq, N, bq, bk, seed, p_keep=0.5):
    """A random boolean block grid ``(B, Hq, ceil(Nq / bq), ceil(N / bk))`` (a head dim of 1 when ``Hq == 1``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(B, Hq, -(-Nq // bq), -(-N // bk), generator=gen) < p_keep


def _hidden_tiles_read(grid, bq, bk, seqlens, Nq, Hq, Hk, block_n):
    """Cache key blocks of ``block_n`` keys the score pass must read per (batch entry, kv head): those holding a key
    of the sequence in a block the grid keeps for some query of a q head of the group. ``(B, Hk)``"""
    B = len(seqlens)
    keep = block_keep(sa.BlockSparseMask(grid, (bq, bk)), Nq, int(max(seqlens)))
    keep = keep.expand(B, Hq, Nq, keep.shape[-1]) & (torch.arange(keep.shape[-1]) < seqlens.view(B, 1, 1, 1))
    per_kv = keep.unflatten(1, (Hk, Hq // Hk)).any(dim=(2, 3))  # (B, Hk, N)
    n_tiles = -(-per_kv.shape[-1] // block_n)
    pad = torch.zeros(B, Hk, n_tiles * block_n, dtype=torch.bool)
    pad[..., :per_kv.shape[-1]] = per_kv
    return pad.unflatten(2, (n_tiles, block_n)).any(-1).sum(-1).to(torch.int32)


BLOCK_CASES = {
    "softmax-gqa-contiguous-nq1": dict(alpha=1.0, Hq=4, Hk=2, Nq=1, seqlens=[70, 45], bq=1, bk=8),
    "entmax15-paged-nq3-per-head": dict(alpha=1.5, Hq=4, Hk=2, Nq=3, seqlens=[70, 33], bq=2, bk=16, page_size=8),
    "sparsemax-paged-causal-nq4-broadcast-heads": dict(alpha=2.0, Hq=4, Hk=1, Nq=4, seqlens=[70, 64], bq=3, bk=24,
                                                       page_size=16, causal=True, heads=1),
    "mixed-gqa-contiguous-nq2": dict(alpha=MIXED, Hq=4, Hk=2, Nq=2, seqlens=[70, 18], bq=16, bk=32, batch1=True),
}


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_block_mask_matches_reference(name):
    """``block_mask=`` on the decode kernels (the grid's rows are the query's index among the ``Nq``, its columns key
    positions, as the fused forward's): out, tau, n_valid and supports against the float64 reference with the
    expanded keep mask; GQA rows of different heads read their own head's grid (or one broadcast over heads, or over
    the batch); paged and contiguous caches; key blocks the grid hides from every row of a kv head are not read."""
    case = dict(BLOCK_CASES[name])
    bq, bk, heads, batch1 = case.pop("bq"), case.pop("bk"), case.pop("heads", None), case.pop("batch1", False)
    alpha, Hq, Hk, Nq, page_size = case["alpha"], case["Hq"], case["Hk"], case["Nq"], case.get("page_size")
    causal = case.get("causal", False)
    B, N, D = 2, 70, 16
    seqlens = torch.tensor(case["seqlens"], dtype=torch.int32)
    grid = _block_grid(1 if batch1 else B, heads or Hq, Nq, N, bq, bk, seed=len(name), p_keep=0.4)
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(B, Hq, Nq, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, D, torch.float32)
    kc, vc, table = (k, v, None) if page_size is None else _page(k, v, seqlens, page_size, gen)
    alpha_t = torch.tensor(alpha) if isinstance(alpha, list) else alpha
    res = entmax_decode_fwd(q, kc, vc, seqlens, alpha_t, D ** -0.5, block_table=table, is_causal=causal,
                            max_seqlen_k=N, num_splits=2, block_n=16, block_mask=(grid, (bq, bk)))
    keep = block_keep(sa.BlockSparseMask(grid, (bq, bk)), Nq, N).expand(B, Hq, Nq, N)
    out64, st64 = _reference(q, k, v, alpha_t, seqlens, causal, keep)
    out_lp, st_lp = _reference(q, k, v, alpha_t, seqlens, causal, keep, dtype=torch.float32)
    assert _max_err(_reference(q, k, v, alpha_t, seqlens, causal)[0], out64) > 1e-3, "the grid changes nothing"
    assert not torch.isnan(res.out).any()
    _check("out", res.out, out64, out_lp, torch.float32)
    assert torch.equal(res.n_valid, st64.n_valid) and (st64.n_valid == 0).any() == (res.out.abs().sum(-1) == 0).any()
    valid = st64.n_valid > 0
    assert torch.equal(valid, torch.isfinite(res.tau))
    zero = torch.zeros_like(st64.tau)
    _check("tau", torch.where(valid, res.tau.double(), zero), torch.where(valid, st64.tau, zero),
           torch.where(valid, st_lp.tau.double(), zero), torch.float32)
    want = _hidden_tiles_read(grid, bq, bk, seqlens, Nq, Hq, Hk, 16)
    full = -(-seqlens.view(B, 1) // 16).expand(B, Hk)
    assert (want < full).any()
    if isinstance(alpha, list):  # one launch per alpha class, each over the rows of its class: no more than all rows
        assert (res.blocks_read[..., 0].sum(dim=(3, 4)) <= want).all()
    else:
        assert torch.equal(res.blocks_read[..., 0].sum(dim=(0, 3, 4)), want)


@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_key_blocks_the_block_mask_hides_are_never_read(alpha):
    """A block-diagonal grid over a 128-key cache in the kernels' 16-key blocks: each query's heads keep one key
    block; keys and values of every other block are NaN and the output stays finite and right (a value block read
    by the softmax pass would turn its rows NaN through ``0 * NaN`` in ``P V``); the score pass reads one block per
    query block, the value pass no more."""
    gen = torch.Generator().manual_seed(33)
    B, Hq, Hk, Nq, N, D = 1, 4, 2, 2, 128, 16
    seqlens = torch.tensor([N], dtype=torch.int32)
    grid = torch.zeros(1, 1, Nq, N // 16, dtype=torch.bool)
    grid[0, 0, 0, 2] = grid[0, 0, 1, 5] = True
    q = torch.randn(B, Hq, Nq, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, D, torch.float32)
    hidden = ~grid[0, 0].any(0).repeat_interleave(16)[:N]
    k_nan, v_nan = (x.masked_fill(hidden[:, None], float("nan")) for x in (k, v))
    res = entmax_decode_fwd(q, k_nan, v_nan, seqlens, alpha, D ** -0.5, num_splits=3, block_n=16,
                            block_mask=(grid, (1, 16)))
    keep = block_keep(sa.BlockSparseMask(grid, (1, 16)), Nq, N).expand(B, Hq, Nq, N)
    out64, _ = _reference(q, k, v, alpha, seqlens, mask=keep)
    out_lp, _ = _reference(q, k, v, alpha, seqlens, mask=keep, dtype=torch.float32)
    assert not torch.isnan(res.out).any()
    _check("out", res.out, out64, out_lp, torch.float32)
    reads = res.blocks_read.sum(dim=(0, 4))  # (B, Hk, row tiles, slots)
    assert (reads[..., 0] == 2).all() and (reads[..., -1] <= 2).all()


def test_entmax_attention_block_mask_decoding_step_takes_the_decode_kernels(monkeypatch):
    """A decoding-shaped ``entmax_attention`` call with a block mask (GQA, per-head alpha, causal) fits the decode
    route and runs on the decode kernels, once, with the block grid, matching the float64 reference."""
    calls, grids = _spy_decode(monkeypatch), []
    real = decode_kernels.launch_decode

    def spy(spec, *args, **kwargs):
        grids.append(spec_block_mask(spec))
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(decode_kernels, "launch_decode", spy)
    gen = torch.Generator().manual_seed(34)
    B, Hq, Hk, Nq, N, D = 2, 4, 2, 3, 50, 16
    q = torch.randn(B, Hq, Nq, D, generator=gen)
    k, v = _cache(gen, B, Hk, N, D, torch.float32), _cache(gen, B, Hk, N, D, torch.float32)
    bm = sa.BlockSparseMask(_block_grid(B, Hq, Nq, N, 2, 8, seed=5), (2, 8))
    a = torch.tensor(MIXED)
    kw = dict(is_causal=True, enable_gqa=True, return_stats=True, block_mask=bm)
    assert decode_fits(prepare_attention(q, k, v, a, backend="triton", enable_gqa=True, block_mask=bm))
    out, st = entmax_attention(q, k, v, a, backend="triton", **kw)
    assert calls == [Nq] and len(grids) == 1 and grids[0][1] == (2, 8) and torch.equal(grids[0][0], bm.mask)
    out64, st64 = entmax_attention_reference(q.double(), k.double(), v.double(), a.double(), **kw)
    out32, st32 = entmax_attention_reference(q, k, v, a, **kw)
    assert _max_err(entmax_attention_reference(q.double(), k.double(), v.double(), a.double(), is_causal=True,
                                               enable_gqa=True), out64) > 1e-3
    _check("out", out, out64, out32, torch.float32)
    _check("tau", st.tau, st64.tau, st32.tau, torch.float32)
    assert torch.equal(st.n_valid, st64.n_valid)
