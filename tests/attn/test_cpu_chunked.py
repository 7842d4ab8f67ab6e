"""The query-chunked CPU path of entmax_attention (sparse_attn.attn._cpu_chunked) against the unchunked reference.

The chunked path must compute the reference's function (the float64 reference is the oracle; in float32 both
compute the same arithmetic, in another order where a row sum or the value product runs over the block's key
range only): outputs, statistics and every gradient (q, k, v, a learnable alpha, a float mask, sinks, ALiBi
slopes), for every option, with dropout drawing the reference's masks from the same seed. Small blocks are forced
with ``block_bytes`` so that every test crosses block boundaries. Its memory must not grow with ``Nq * Nk``: no
operation makes a tensor of the whole score matrix, the autograd graph keeps only the inputs, and the peak
resident memory of a 4096-token call stays far below one score matrix (a subprocess).
"""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import TOL, cu_seqlens, gen, max_abs_err, random_mask, scaled_err
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_attn.attn._cpu_chunked as chunked_mod
from sparse_attn.attention import entmax_attention, run_layer_attention
from sparse_attn.attn.attn_inputs import prepare_attention
from sparse_attn.mappings import _threshold_from_sorted
from sparse_attn.reference import entmax_attention_reference, reference_forward

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16

# option sets: keyword arguments of entmax_attention plus the builder's own keys (shapes, which mask, leaves)
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal_more_queries": {"is_causal": True, "nq": 50, "nk": 30},   # the first 20 rows see no key
    "causal_more_queries_sinks": {"is_causal": True, "nq": 50, "nk": 30, "sinks": True},
    "causal_more_keys": {"is_causal": True, "nq": 20, "nk": 47},
    "window": {"window_size": (6, 3)},
    "window_left_causal": {"window_size": (9, -1), "is_causal": True},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float"},
    "row_bias_causal": {"mask": "row", "is_causal": True},
    "alibi_causal": {"alibi": True, "is_causal": True},
    "softcap_bool_mask": {"softcap": 4.0, "mask": "bool"},
    "sinks_causal": {"sinks": True, "is_causal": True},
    "gqa_value_dim": {"hk": 2, "dv": 12},
    "strided": {"strided": True, "is_causal": True},
    "varlen": {"varlen": [7, 0, 19, 11], "is_causal": True, "mask": "float", "alibi": True},
    "varlen_window_sinks": {"varlen": [13, 21, 3], "window_size": (4, 2), "sinks": True, "hk": 2},
    "everything": {"is_causal": True, "window_size": (12, 0), "mask": "float", "alibi": True, "softcap": 3.0,
                   "sinks": True, "hk": 2},
}
ALPHAS = [1.0, 1.25, 1.5, 2.0, "per_head"]


def _build(case: dict, alpha, dtype, seed: int = 0, grad: bool = True):
    """``(q, k, v, alpha, kwargs, leaves)`` for one case; ``leaves`` are the tensors whose gradients are checked."""
    case = dict(case)
    varlen = case.pop("varlen", None)
    b, hq, hk = (1 if varlen else 2), 4, case.pop("hk", 4)
    nq, nk = case.pop("nq", 37), case.pop("nk", 45)
    if varlen:
        nq = nk = sum(varlen)
    d, dv = 16, case.pop("dv", 16)
    g = gen(seed)
    scale = 1.5 if dtype in (F16, BF16) else 2.0

    def draw(*shape):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    if case.pop("strided", False):   # (B, N, H, D) storage, as models hold it
        q = draw(b, nq, hq, d).transpose(1, 2)
        k = draw(b, nk, hk, d).transpose(1, 2)
        v = draw(b, nk, hk, dv).transpose(1, 2)
    else:
        q, k, v = draw(b, hq, nq, d), draw(b, hk, nk, d), draw(b, hk, nk, dv)
    leaves = [q, k, v]
    kwargs = {"enable_gqa": hk != hq}
    mask = case.pop("mask", None)
    if mask == "bool":
        kwargs["attn_mask"] = random_mask((b, 1, nq, nk), "bool", seed=seed + 1, empty_rows=2)
    elif mask == "float":
        kwargs["attn_mask"] = random_mask((1, hq, nq, nk), "float", seed=seed + 1, empty_rows=1).to(dtype)
    elif mask == "row":
        kwargs["attn_mask"] = random_mask((b, 1, 1, nk), "float", seed=seed + 1).to(dtype)
    if kwargs.get("attn_mask") is not None and kwargs["attn_mask"].is_floating_point():
        leaves.append(kwargs["attn_mask"])
    if case.pop("alibi", False):
        rows = len(varlen) if varlen else b
        kwargs["alibi_slopes"] = torch.rand(rows, hq, generator=g, dtype=F64).mul(0.4).to(F64 if dtype == F64 else F32)
        leaves.append(kwargs["alibi_slopes"])
    if case.pop("sinks", False):
        kwargs["sinks"] = torch.randn(hq, generator=g, dtype=F64).add(1.0).to(F64 if dtype == F64 else F32)
        leaves.append(kwargs["sinks"])
    if varlen:
        kwargs["cu_seqlens_q"] = kwargs["cu_seqlens_k"] = cu_seqlens(varlen)
    if alpha == "per_head":
        alpha = torch.tensor([1.0, 1.5, 2.0, 1.3], dtype=F64 if dtype == F64 else F32)
        leaves.append(alpha)
    kwargs.update(case)
    for t in leaves:
        t.requires_grad_(grad)
    return q, k, v, alpha, kwargs, leaves


def _block_bytes(rows: int, q, k, dtype) -> int:
    """A budget that gives blocks of about ``rows`` query rows of every (batch, head) (half as many for the row
    mapping's solver)."""
    itemsize = 8 if dtype == F64 else 4
    return rows * q.shape[0] * q.shape[1] * k.shape[2] * itemsize * chunked_mod._BLOCK_TEMPS


def _run(fn, leaves, seed: int = 0):
    """``(out, stats, grads)`` of ``fn() -> (out, stats)`` with the gradients of a fixed random loss."""
    torch.manual_seed(1234)
    out, stats = fn()
    w = torch.randn(out.shape, generator=gen(seed + 99), dtype=F64).to(out.dtype)
    wanted = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad((out * w).sum(), wanted, allow_unused=True) if wanted else []
    return out.detach(), stats, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wanted)]


def _unchunked(inputs):
    """``(out, stats)`` of the unchunked reference."""
    res = reference_forward(inputs, with_stats=True)
    return res.out, res.stats


def _both(q, k, v, alpha, kwargs, leaves, rows: int = 5, dtype=F64):
    """``_run`` of the chunked path (blocks of about ``rows`` rows) and of the unchunked reference."""
    inputs = prepare_attention(q, k, v, alpha, **kwargs)
    block_bytes = _block_bytes(rows, q, k, dtype)
    return (_run(lambda: chunked_mod.chunked_attention(inputs, with_stats=True, block_bytes=block_bytes), leaves),
            _run(lambda: _unchunked(inputs), leaves))


def _assert_same(got, want, dtype, what):
    tol = TOL["sharded_vs_single"][F64 if dtype == F64 else F32]
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN positions differ"
    assert scaled_err(got.nan_to_num(0.0), want.nan_to_num(0.0)) <= tol, f"{what}: {scaled_err(got, want):.3g}"


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("alpha", ALPHAS, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_unchunked_reference(name, alpha, dtype):
    q, k, v, alpha, kwargs, leaves = _build(CASES[name], alpha, dtype)
    (out, stats, grads), (out_r, stats_r, grads_r) = _both(q, k, v, alpha, kwargs, leaves, dtype=dtype)
    _assert_same(out, out_r, dtype, "out")
    assert torch.equal(stats.n_valid, stats_r.n_valid)
    assert (stats.nnz - stats_r.nnz).abs().max() <= (0 if dtype == F64 else 1), "support sizes differ"
    assert torch.equal(torch.isinf(stats.tau), torch.isinf(stats_r.tau))
    finite = torch.isfinite(stats_r.tau)
    _assert_same(stats.tau[finite], stats_r.tau[finite], dtype, "tau")
    for got, want, leaf in zip(grads, grads_r, leaves):
        _assert_same(got, want, dtype, f"gradient of a {tuple(leaf.shape)} input")


@pytest.mark.parametrize("split", ["rows_1", "rows_3", "rows_64", "per_batch", "per_head"])
def test_block_size_changes_nothing_but_rounding(split):
    """Blocks of 1, 3 or 64 rows of every (batch, head), and budgets too small for one row of all of them: blocks
    of one batch entry, or of one (batch, head)."""
    q, k, v, alpha, kwargs, leaves = _build(CASES["everything"], "per_head", F64, seed=3)
    inputs = prepare_attention(q, k, v, alpha, **kwargs)
    b, h, n_k = q.shape[0], q.shape[1], k.shape[2]
    elems = {"per_batch": h * n_k, "per_head": 2 * n_k}.get(split)
    elems = elems or int(split.split("_")[1]) * b * h * n_k
    block_bytes = elems * 8 * chunked_mod._SOLVER_TEMPS
    blocks = chunked_mod._State(inputs, F64, block_bytes).blocks()
    assert max((blk.b.stop or b) - (blk.b.start or 0) for blk in blocks) == (b if split.startswith("rows") else 1)
    out, stats, grads = _run(lambda: chunked_mod.chunked_attention(inputs, with_stats=True, block_bytes=block_bytes),
                             leaves)
    out_r, stats_r, grads_r = _run(lambda: _unchunked(inputs), leaves)
    _assert_same(out, out_r, F64, "out")
    assert torch.equal(stats.nnz, stats_r.nnz)
    for got, want in zip(grads, grads_r):
        _assert_same(got, want, F64, "gradient")


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_precision_inputs(dtype):
    q, k, v, alpha, kwargs, leaves = _build(CASES["alibi_causal"], 1.5, dtype, seed=5)
    (out, _, grads), (out_r, _, grads_r) = _both(q, k, v, alpha, kwargs, leaves, dtype=F32)
    assert out.dtype == dtype
    # float32 arithmetic in both; the float32 results may round to neighbouring half-precision values
    assert max_abs_err(out, out_r) <= TOL["same_values"][dtype]
    for got, want in zip(grads, grads_r):
        assert got.dtype == want.dtype
        assert scaled_err(got, want) <= TOL["same_values"][dtype]


def _rows(kind: str, n: int, dtype, beta2: bool) -> torch.Tensor:
    """Rows in the threshold's z-scale (shifted to max 0, clamped as the exact mappings do)."""
    g = gen(n)
    if kind == "gauss":
        x = torch.randn(64, n, generator=g, dtype=F64)
    elif kind == "wide":
        x = torch.randn(64, n, generator=g, dtype=F64) * 8
    elif kind == "flat":   # nearly uniform rows: most entries are candidates (the full-sort fallback)
        x = torch.randn(64, n, generator=g, dtype=F64) * 1e-3
    elif kind == "mixed":   # flat rows (sorted whole) among ordinary ones
        x = torch.randn(64, n, generator=g, dtype=F64)
        x[::3] *= 1e-3
    elif kind == "ties":
        x = torch.randint(0, 4, (64, n), generator=g).to(F64)
    elif kind == "masked":   # causal-like rows with -inf tails, one row entirely -inf
        x = torch.randn(64, n, generator=g, dtype=F64)
        x = x.masked_fill(torch.arange(n)[None, :] > torch.arange(64)[:, None] * (n // 64), -math.inf)
        x[5] = -math.inf
    else:
        raise ValueError(kind)
    x = x.to(dtype)
    rmax = x.amax(-1, keepdim=True)
    empty = rmax == -math.inf
    z = (x - rmax.masked_fill(empty, 0.0)).clamp(min=-4.0)
    return (z * 0.5 if beta2 else z), empty


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("beta2", [True, False], ids=["entmax15", "sparsemax"])
@pytest.mark.parametrize("kind", ["gauss", "wide", "flat", "mixed", "ties", "masked"])
@pytest.mark.parametrize("n", [100, 257, 2048])
def test_exact_threshold_is_the_full_sorts_bitwise(kind, n, beta2, dtype):
    """The candidate search gives the threshold of the mapping's full sort bit for bit (rows of -inf excepted:
    their weights are zeroed)."""
    z, empty = _rows(kind, n, dtype, beta2)
    got = chunked_mod._exact_threshold(z, beta2, empty if bool(empty.any()) else None)
    want = _threshold_from_sorted(torch.sort(z, dim=-1, descending=True).values, beta2)[0]
    rows = ~empty.squeeze(-1)
    assert torch.equal(got[rows], want[rows])


def test_dropout_draws_the_references_masks():
    """Same seed, same masks (the blocks draw in the reference's order), same generator state afterwards; the
    backward replays them."""
    for name in ("causal", "varlen_window_sinks"):
        q, k, v, alpha, kwargs, leaves = _build(CASES[name], 1.5, F64, seed=7)
        kwargs["dropout_p"] = 0.3
        inputs = prepare_attention(q, k, v, alpha, **kwargs)
        results = []
        for chunked in (True, False):
            torch.manual_seed(2024)
            if chunked:
                out, _ = chunked_mod.chunked_attention(inputs, block_bytes=_block_bytes(4, q, k, F64))
            else:
                out = reference_forward(inputs).out
            after = torch.random.get_rng_state()
            results.append((out, after, torch.autograd.grad(out.square().sum(), [q, k, v])))
        (out, after, grads), (out_r, after_r, grads_r) = results
        assert torch.equal(after, after_r), "the generator advanced differently"
        _assert_same(out, out_r, F64, f"{name}: out")
        for got, want in zip(grads, grads_r):
            _assert_same(got, want, F64, f"{name}: gradient")


@pytest.mark.parametrize("alpha", [1.5, "per_head"], ids=str)
def test_double_backward_matches_the_reference(alpha):
    q, k, v, alpha, kwargs, leaves = _build(CASES["float_mask"], alpha, F64, seed=2)
    inputs = prepare_attention(q, k, v, alpha, **kwargs)
    results = []
    for fn in (lambda: chunked_mod.chunked_attention(inputs, block_bytes=_block_bytes(6, q, k, F64))[0],
               lambda: reference_forward(inputs).out):
        (gq,) = torch.autograd.grad(fn().square().sum(), [q], create_graph=True)
        results.append(torch.autograd.grad(gq.square().sum(), leaves))
    for got, want in zip(*results):
        _assert_same(got, want, F64, "second-order gradient")


@pytest.mark.parametrize("alpha", [1.5, 1.25, "per_head"], ids=str)
def test_non_finite_rows_follow_the_policy(alpha):
    """NaN or +inf scores make their rows NaN (gradients too), rows with no key give zeros, as on the reference."""
    q, k, v, alpha, kwargs, leaves = _build(CASES["float_mask"], alpha, F64, seed=4)
    with torch.no_grad():
        q[0, 1, 3, 0] = math.nan
        kwargs["attn_mask"][0, 2, 5, 7] = math.inf
        kwargs["attn_mask"][0, :, 9] = -math.inf
    (out, stats, grads), (out_r, stats_r, grads_r) = _both(q, k, v, alpha, kwargs, leaves)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isnan(out[:, 2, 5]).all()
    assert torch.equal(out[:, :, 9], torch.zeros_like(out[:, :, 9]))
    _assert_same(out, out_r, F64, "out")
    assert torch.equal(torch.isnan(stats.tau), torch.isnan(stats_r.tau))
    assert torch.equal(stats.nnz, stats_r.nnz)
    for got, want in zip(grads, grads_r):
        _assert_same(got, want, F64, "gradient")


class _Sizes(TorchDispatchMode):
    """The largest number of elements of any tensor an operation returns inside it."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_operation_makes_the_score_matrix():
    """Forward and backward of the public CPU path at N = 2048 (the default budget gives blocks of 2.8M scores):
    no tensor with as many elements as the (B, H, N, N) scores, and the forward's graph keeps only O(N) tensors
    (the backward recomputes one block at a time)."""
    b, h, n, d = 1, 4, 2048, 32
    q, k, v = (torch.randn(b, h, n, d, generator=gen(i), requires_grad=True) for i in range(3))
    saved = []
    sizes = _Sizes()
    with sizes:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = entmax_attention(q, k, v, 1.5, is_causal=True)
        out.square().sum().backward()
    scores = b * h * n * n
    assert sizes.largest <= scores // 3, f"an operation made a tensor of {sizes.largest} elements ({scores} scores)"
    assert sum(saved) <= 8 * q.numel(), f"the graph keeps {sum(saved)} elements (q has {q.numel()})"
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()


_RSS_SCRIPT = """
import sys, torch
from sparse_attn import entmax_attention
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
torch.manual_seed(0)
grad = sys.argv[1] == "grad"
q, k, v = (torch.randn(1, 8, 4096, 64, requires_grad=grad) for _ in range(3))
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
if grad:
    entmax_attention(q, k, v, 1.5, is_causal=True).sum().backward()
else:
    with torch.no_grad():
        entmax_attention(q, k, v, 1.5, is_causal=True)
print((kib("VmHWM") - base) / 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_peak_memory_stays_far_below_one_score_matrix(mode):
    """1 x 8 x 4096 x 64 causal: one float32 score matrix is 512 MiB (the unchunked reference's peak grew by 6.8
    GB); the chunked path's blocks are budgeted at 256 MiB of block-sized tensors."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pytest.skip("resetting the peak resident set is not allowed here")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    peak_mib = float(res.stdout.strip().splitlines()[-1])
    assert peak_mib < 400, f"peak resident memory grew by {peak_mib:.0f} MiB"


def test_dispatch(monkeypatch):
    """CPU calls with at least MIN_SCORES scores run the chunked path, smaller ones and the weights (need_weights)
    the reference; the chunked path then gives the reference's results through the public function."""
    calls = []
    real = chunked_mod.chunked_attention

    def spy(*args, **kwargs):
        calls.append(args[0].q.shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked_mod, "chunked_attention", spy)
    monkeypatch.setattr("sparse_attn.attention.chunked_attention", spy)
    q, k, v, alpha, kwargs, _ = _build(CASES["sinks_causal"], 1.5, F64, grad=False)
    inputs = prepare_attention(q, k, v, alpha, **kwargs)
    small = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] < chunked_mod.MIN_SCORES
    assert small and not chunked_mod.chunked_fits(inputs)
    entmax_attention(q, k, v, alpha, **kwargs)
    assert calls == []
    monkeypatch.setattr(chunked_mod, "MIN_SCORES", 0)
    monkeypatch.setattr(chunked_mod, "BLOCK_BYTES", _block_bytes(4, q, k, F64))
    assert chunked_mod.chunked_fits(inputs)
    out, stats = entmax_attention(q, k, v, alpha, return_stats=True, **kwargs)
    assert len(calls) == 1
    out_r, stats_r = entmax_attention_reference(q, k, v, alpha, return_stats=True, **kwargs)
    _assert_same(out, out_r, F64, "out")
    assert torch.equal(stats.nnz, stats_r.nnz)
    out_w, weights = run_layer_attention(inputs, dense=True)
    assert len(calls) == 1 and weights.shape == (*q.shape[:3], k.shape[2])
    _assert_same(out_w, out_r, F64, "out with weights")
    assert not chunked_mod.chunked_fits(dataclasses.replace(inputs, backend="triton"))


def test_backward_reuses_the_forwards_thresholds(monkeypatch):
    """At alpha 1.5 the forward keeps one threshold per row; the backward recomputes the weights from them (no new
    search) and still gives the reference's gradients."""
    calls = []
    real = chunked_mod._exact_threshold
    monkeypatch.setattr(chunked_mod, "_exact_threshold", lambda *args: calls.append(1) or real(*args))
    g = gen(6)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    inputs = prepare_attention(q, k, v, 1.5, is_causal=True)
    block_bytes = _block_bytes(40, q, k, F64)
    out, _ = chunked_mod.chunked_attention(inputs, block_bytes=block_bytes)
    n_blocks = len(chunked_mod._State(inputs, F64, block_bytes).blocks())
    assert n_blocks > 1 and len(calls) == n_blocks
    grads = torch.autograd.grad(out.square().sum(), [q, k, v])
    assert len(calls) == n_blocks
    grads_r = torch.autograd.grad(reference_forward(inputs).out.square().sum(), [q, k, v])
    for got, want in zip(grads, grads_r):
        _assert_same(got, want, F64, "gradient")
