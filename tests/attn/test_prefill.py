"""Chunked prefill: ``entmax_decode`` with more than 16 queries per sequence over a (paged) KV cache, against a
float64 oracle built here with flash-attn's ``flash_attn_with_kvcache`` semantics (the cache already holding the
chunk's keys): query ``i`` of ``Nq`` stands at key position ``cache_seqlens[b] - Nq + i``; keys at or past
``cache_seqlens[b]`` do not exist; ``is_causal`` hides keys after a query's position, ``window_size = (left,
right)`` keys outside ``[pos - left, pos + right]``; ALiBi adds ``-slope * |pos - j|``. The oracle gathers each
sequence's keys itself and hands the reference explicit masks.

Routes: masks per key (and none) take the fused kernels on packed variable-length sequences; a mask that varies by
query takes the decode kernels 16 queries at a time.
"""

import pytest
import torch
from helpers import TOL, assert_close_to_ref

import sparse_attn._validation as validation
from sparse_attn import BlockSparseMask
from sparse_attn.attn.masks import block_keep
from sparse_attn.decode import entmax_decode
from sparse_attn.reference import entmax_attention_reference

EPS = TOL["eps_attention_kernel"]

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _problem(seed, B=3, Hq=4, Hk=2, N=48, D=16, Dv=16, Nq=20, page=None, dtype=torch.float32):
    """q ``(B, Hq, Nq, D)``, the cache as given to ``entmax_decode`` (contiguous, or a shuffled page pool with its
    block table when ``page``) and the contiguous ``(B, Hk, N, D)`` copies the oracle reads."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hk, N, D, generator=gen).to(dtype)
    v = torch.randn(B, Hk, N, Dv, generator=gen).to(dtype)
    if page is None:
        return q, k, v, None, k, v
    n_pages = N // page
    order = torch.randperm(B * n_pages + 2, generator=gen)[:B * n_pages].view(B, n_pages)
    pools = []
    for t in (k, v):
        pool = torch.full((B * n_pages + 2, page, Hk, t.shape[-1]), float("nan"), dtype=dtype)
        pool[order.flatten()] = t.transpose(1, 2).reshape(B * n_pages, page, Hk, t.shape[-1])
        pools.append(pool)
    return q, pools[0], pools[1], order.to(torch.int32), k, v


def _oracle(q, k, v, lengths, alpha, dtype=torch.float64, causal=False, window=None, slopes=None, mask=None,
            blocks=None, **variants):
    """The reference, one sequence at a time on its own keys, with the kvcache positions as explicit masks."""
    n_q = q.shape[2]
    outs, taus = [], []
    for b, n in enumerate(lengths.tolist()):
        pos = torch.arange(n_q)[:, None] + n - n_q
        j = torch.arange(n)[None, :]
        keep = torch.ones(n_q, n, dtype=torch.bool)
        if causal:
            keep &= j <= pos
        if window is not None:
            keep &= ((window[0] < 0) | (j >= pos - window[0])) & ((window[1] < 0) | (j <= pos + window[1]))
        bias = torch.zeros(q.shape[1], n_q, n, dtype=dtype)
        if slopes is not None:
            bias = bias - slopes.to(dtype)[:, None, None] * (pos - j).abs()
        if mask is not None:
            m = mask.expand(q.shape[0], q.shape[1], n_q, mask.shape[-1])[b, :, :, :n]
            bias = bias + m.to(dtype) if m.is_floating_point() else bias.masked_fill(~m, float("-inf"))
        if blocks is not None:
            grid = BlockSparseMask(blocks.mask[b:b + 1] if blocks.mask.shape[0] > 1 else blocks.mask, blocks.block_size)
            keep = keep & block_keep(grid, n_q, blocks.mask.shape[-1] * blocks.block_size[1])[0, :, :, :n]
        bias = bias.masked_fill(~keep, float("-inf"))
        out, st = entmax_attention_reference(
            q[b:b + 1].to(dtype), k[b:b + 1, :, :n].to(dtype), v[b:b + 1, :, :n].to(dtype), alpha,
            attn_mask=bias[None], enable_gqa=True, return_stats=True, **variants)
        outs.append(out)
        taus.append(st.tau)
    return torch.cat(outs), torch.cat(taus)


def _alpha64(alpha):
    return alpha.double() if isinstance(alpha, torch.Tensor) else alpha


MIXED = torch.tensor([1.0, 1.5, 2.0, 1.25])

CASES = {
    "contiguous-causal": dict(),
    "paged-causal-page8": dict(page=8),
    "paged-not-causal": dict(page=16, causal=False),
    "mixed-window-alibi-sinks-softcap-dv": dict(page=8, alpha=MIXED, window=(9, 0), slopes=True, sinks=True,
                                                softcap=3.0, Dv=32),
    "key-padding-mask": dict(page=16, mask="keys"),
    "float-mask-per-query": dict(mask="queries", slopes=True),
    "bool-mask-per-query-not-causal": dict(page=8, mask="queries-bool", causal=False, alpha=2.0),
    "block-mask": dict(page=8, blocks=True),
    "nq-33-softmax": dict(Nq=33, alpha=1.0, window=(12, 0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_matches_the_kvcache_oracle(name):
    """Ragged lengths (the whole cache, none, fewer keys than queries), GQA, paged and contiguous caches, every
    variant the decode route supports; output, threshold and valid keys against the float64 oracle."""
    case = dict(CASES[name])
    gen = torch.Generator().manual_seed(5)
    nq, alpha, causal = case.pop("Nq", 20), case.pop("alpha", 1.5), case.pop("causal", True)
    q, k_in, v_in, table, k, v = _problem(7, Nq=nq, page=case.pop("page", None), Dv=case.pop("Dv", 16))
    lengths = torch.tensor([48, 0, 13], dtype=torch.int32)
    kw = dict(is_causal=causal, window_size=case.pop("window", None), softcap=case.pop("softcap", None))
    if case.pop("slopes", False):
        kw["alibi_slopes"] = torch.rand(4, generator=gen) / 4
    if case.pop("sinks", False):
        kw["sinks"] = torch.randn(4, generator=gen)
    mask = case.pop("mask", None)
    if mask == "keys":
        kw["attn_mask"] = torch.rand(3, 1, 1, 48, generator=gen) > 0.2
    elif mask == "queries":
        kw["attn_mask"] = torch.randn(3, 4, nq, 48, generator=gen).masked_fill(
            torch.rand(3, 1, nq, 48, generator=gen) < 0.1, float("-inf"))
    elif mask == "queries-bool":
        kw["attn_mask"] = torch.rand(3, 1, nq, 48, generator=gen) > 0.3
    if case.pop("blocks", False):
        kw["block_mask"] = BlockSparseMask(torch.rand(3, 1, -(-nq // 16), 3, generator=gen) > 0.3, (16, 16))
    assert not case
    out, st = entmax_decode(q, k_in, v_in, lengths, alpha, block_table=table, backend="triton", return_stats=True,
                            **kw)
    oracle_kw = dict(causal=causal, window=kw["window_size"], slopes=kw.get("alibi_slopes"),
                     mask=kw.get("attn_mask"), blocks=kw.get("block_mask"), softcap=kw["softcap"],
                     sinks=None if kw.get("sinks") is None else kw["sinks"].double())
    out64, tau64 = _oracle(q, k, v, lengths, _alpha64(alpha), **oracle_kw)
    oracle_kw["sinks"] = kw.get("sinks")
    out32, tau32 = _oracle(q, k, v, lengths, alpha, dtype=torch.float32, **oracle_kw)
    assert_close_to_ref(out, out64, out32, eps=EPS[torch.float32], name="out")
    assert_close_to_ref(st.tau, tau64, tau32, eps=EPS[torch.float32], name="tau")


def test_prefill_half_precision_paged():
    """bf16, a paged cache, causal, 1.5-entmax and a window: the tolerance rule against the float64 oracle."""
    q, k_in, v_in, table, k, v = _problem(8, page=8, dtype=torch.bfloat16)
    lengths = torch.tensor([40, 20, 47], dtype=torch.int32)
    out = entmax_decode(q, k_in, v_in, lengths, 1.5, block_table=table, backend="triton", is_causal=True,
                        window_size=(15, 0))
    out64, _ = _oracle(q, k, v, lengths, 1.5, causal=True, window=(15, 0))
    out_lp, _ = _oracle(q, k, v, lengths, 1.5, dtype=torch.float32, causal=True, window=(15, 0))
    assert_close_to_ref(out, out64, out_lp.to(torch.bfloat16), eps=EPS[torch.bfloat16], name="out")


def test_prefill_without_reading_values(monkeypatch):
    """As on a GPU (values not read back), the packed route takes room for every sequence's capacity and reads no
    length: the same results, no host read."""
    monkeypatch.setattr(validation, "_FREE_READ_DEVICES", frozenset())
    q, k_in, v_in, table, k, v = _problem(9, page=16)
    lengths = torch.tensor([30, 5, 48], dtype=torch.int32)
    reads = []
    for name in ("item", "tolist", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: reads.append(_n) or _r(self, *a))
    with torch.no_grad():
        out = entmax_decode(q, k_in, v_in, lengths, 1.5, block_table=table, backend="triton", is_causal=True)
    monkeypatch.undo()
    assert reads == []
    out64, _ = _oracle(q, k, v, lengths, 1.5, causal=True)
    assert_close_to_ref(out, out64, eps=2 * EPS[torch.float32], name="out")


@pytest.mark.parametrize("kw,match", [
    (dict(window_size=(5, 0)), "window_size or alibi_slopes without is_causal"),
    (dict(is_causal=True, block_mask=BlockSparseMask(torch.ones(1, 1, 2, 3, dtype=torch.bool), (16, 16))),
     "a block_mask"),
])
def test_prefill_refuses_what_query_chunks_cannot_align(kw, match):
    """A mask that varies by query goes 16 queries at a time through the decode kernels, which cannot align a window
    or ALiBi without causality, nor a block mask: refused by name (never computed wrong)."""
    q, k, v, _, _, _ = _problem(10)
    with pytest.raises(ValueError, match=match):
        entmax_decode(q, k, v, torch.tensor([48, 0, 13], dtype=torch.int32), 1.5, backend="triton",
                      attn_mask=torch.zeros(1, 1, 20, 48), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_gpu_prefill_long_chunk_paged(alpha):
    """On a GPU: a 300-query chunk over a paged cache of up to 3000 keys (bf16, GQA, causal, a window), against the
    float64 oracle."""
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hk, N, D, page = 2, 8, 2, 3072, 64, 64
    q = torch.randn(B, Hq, 300, D, generator=gen).bfloat16()
    k = torch.randn(B, Hk, N, D, generator=gen).bfloat16()
    v = torch.randn(B, Hk, N, D, generator=gen).bfloat16()
    n_pages = N // page
    order = torch.randperm(B * n_pages, generator=gen).view(B, n_pages)
    pool_k, pool_v = (torch.empty(B * n_pages, page, Hk, D, dtype=torch.bfloat16) for _ in range(2))
    pool_k[order.flatten()] = k.transpose(1, 2).reshape(B * n_pages, page, Hk, D)
    pool_v[order.flatten()] = v.transpose(1, 2).reshape(B * n_pages, page, Hk, D)
    lengths = torch.tensor([3000, 700], dtype=torch.int32)
    out = entmax_decode(q.cuda(), pool_k.cuda(), pool_v.cuda(), lengths.cuda(), alpha,
                        block_table=order.to(torch.int32).cuda(), is_causal=True, window_size=(1000, 0))
    out64, _ = _oracle(q, k, v, lengths, alpha, causal=True, window=(1000, 0))
    out_lp, _ = _oracle(q, k, v, lengths, alpha, dtype=torch.float32, causal=True, window=(1000, 0))
    assert_close_to_ref(out.cpu(), out64, out_lp.to(torch.bfloat16), eps=EPS[torch.bfloat16], name="out")
