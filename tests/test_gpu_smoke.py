"""GPU smoke subset: every kernel family once, against float64, in well under 90 s on one H100/H200.

Run by ``benchmarks/gpu/gpu_run.sh`` as ``pytest -m gpu_smoke -n 12 tests/test_gpu_smoke.py``, before the full
``gpu``-marked tests and the benchmarks: one shape per test, few distinct kernel builds (each costs seconds of
Triton compilation), launch configs pinned (``SPARSE_ATTN_PINNED=1`` unless set: no autotuning runs). On CUDA the
inputs are bf16 (one test fp16) at GPU-sized shapes; on a CPU-only machine the same tests run the same kernels on
float32 CPU tensors under the Triton interpreter (tests/conftest.py), at smaller shapes. Families: the fused
forward per alpha class (softmax, sparsemax, 1.5-entmax, general, mixed per head), its backward (dQ, dK, dV,
d alpha), varlen, sliding windows, ALiBi + soft cap + sinks, Dv != D, GQA, split-K decode (contiguous and paged
caches), the alpha-entmax row kernels and the structured (TV / isotonic) kernels. References are the library's
float64 ``backend="reference"`` (PyTorch path for the mappings) on float64 copies of the same rounded inputs;
tolerances follow tests/helpers.py (``assert_close_to_ref`` and ``TOL``).
"""

import math
import os

import pytest
import torch
from helpers import BF16, F16, F32, F64, TOL, assert_close_to_ref, cu_seqlens, gen, max_abs_err, scaled_err

import sparse_attn.kernels.rows.structured as structured_kernels
import sparse_attn.mappings as mappings
import sparse_attn.rows._structured_rows as structured_rows
import sparse_attn.rows._triton_rows as triton_rows
from sparse_attn import entmax15, entmax_attention, fusedmax, oscarmax, sparsemax
from sparse_attn.decode import entmax_decode

# Kernel outputs are allocated filled with NaN / the int max (conftest.py): an element a kernel fails to write fails.
pytestmark = [pytest.mark.gpu_smoke, pytest.mark.usefixtures("poison_uninitialized")]


@pytest.fixture(autouse=True)
def _pinned_launch_configs(monkeypatch):
    if "SPARSE_ATTN_PINNED" not in os.environ:
        monkeypatch.setenv("SPARSE_ATTN_PINNED", "1")


def _pick(device, gpu, cpu):
    """The GPU-sized value on CUDA, the interpreter-sized one on CPU."""
    return gpu if device == "cuda" else cpu


def _dtype(device):
    return BF16 if device == "cuda" else F32


def _grad_eps(dtype, g64):
    """``TOL["eps_attention_grad"]`` is relative to max(1, largest |float64 gradient|)."""
    return TOL["eps_attention_grad"][dtype] * max(1.0, g64.detach().abs().max().item())


def _attention(device, dtype, shapes, alpha, *, grad=(), seed=0, q_mult=1.0, **kw):
    """Run ``entmax_attention`` on the Triton kernels (``dtype`` on ``device``), on the float64 reference and on the
    float32 reference (the baseline in the kernel's dtype), all on the same ``dtype``-rounded inputs, and check the
    output, the valid-key counts and, for ``grad`` (names among q, k, v, alpha, sinks, attn_mask), the gradients of
    ``sum(out * do)``. ``alpha`` and tensor keyword arguments are given on CPU; float ones are parameters (float32
    on the kernel path)."""
    g = gen(seed)
    base = [(torch.randn(*s, generator=g, dtype=F64) * (q_mult if i == 0 else 1.0)).to(dtype)
            for i, s in enumerate(shapes)]
    do = torch.randn(*shapes[0][:3], shapes[2][-1], generator=g, dtype=F64).to(dtype)
    params = dict(alpha=alpha, **kw)

    def run(work, backend):
        pdt = F64 if work == F64 else F32
        qkv = [t.to(device=device, dtype=work).requires_grad_(name in grad) for t, name in zip(base, "qkv")]
        p = {n: (t.to(device=device, dtype=pdt) if t.is_floating_point() else t.to(device)).requires_grad_(n in grad)
             if isinstance(t, torch.Tensor) else t for n, t in params.items()}
        out, st = entmax_attention(*qkv, backend=backend, return_stats=True, **p)
        leaves = [t for t, n in zip(qkv, "qkv") if n in grad] + [p[n] for n in grad if n in p]
        names = [n for n in "qkv" if n in grad] + [n for n in grad if n in p]
        grads = torch.autograd.grad((out.double() * do.to(device, F64)).sum(), leaves) if leaves else []
        return out, st, dict(zip(names, grads, strict=True))

    out, st, grads = run(dtype, "triton")
    out64, st64, grads64 = run(F64, "reference")
    out32, _, grads32 = run(F32, "reference")
    assert out.dtype == dtype and out.shape == out64.shape
    assert_close_to_ref(out, out64, out32.to(dtype), eps=TOL["eps_attention_kernel"][dtype], name="out")
    assert torch.equal(st.n_valid.cpu(), st64.n_valid.cpu())
    a = torch.as_tensor(alpha, dtype=F64).expand(shapes[0][1]).view(1, -1, 1).expand(st.nnz.shape)
    assert torch.equal(st.nnz.cpu()[a == 1], st.n_valid.cpu()[a == 1])  # softmax rows: every valid key
    # a sparsemax row's gradient jumps where a key's score crosses tau, and the kernel stops refining tau within the
    # dtype's tolerance (kernels/attn/_threshold.TOLERANCE): a key closer to tau than that may fall on the other side
    # (an H200 run met one 4.5e-5 from tau: nnz 4 for 5, dq off by 3.1), where the float64 gradient is not the one
    # to compare with. The inputs are drawn free of such keys, and this says so if one is met.
    flips = (st.nnz.cpu() != st64.nnz.cpu()) & (a == 2)
    assert not (grads and flips.any()), (f"{int(flips.sum())} sparsemax rows whose support differs from float64's (a "
                                         "key within the kernel's tolerance of tau): draw other inputs")
    assert set(grads) == set(grad)
    for name, g64 in grads64.items():
        got, base32 = grads[name], grads32[name]
        assert torch.isfinite(got).all(), name
        lowp = base32.to(dtype) if name in ("q", "k", "v") else base32  # alpha / sinks / mask gradients are float32
        assert_close_to_ref(got, g64, lowp, eps=_grad_eps(dtype, g64), name="d" + name)
    return out, st


# ---------------------------------------------------------------- fused forward, each alpha class


# name: (alpha, is_causal, (Nq, Nk) on CUDA, on CPU); lengths are not multiples of any tile
FWD_CASES = {
    "softmax": (1.0, False, (300, 300), (45, 45)),
    "entmax15_causal": (1.5, True, (300, 300), (45, 45)),
    "sparsemax_cross": (2.0, False, (213, 300), (37, 50)),
    "general_causal_cross": (1.25, True, (300, 213), (50, 37)),
}


@pytest.mark.parametrize("name", list(FWD_CASES))
def test_forward_alpha_class(name, kernel_device):
    alpha, causal, gpu, cpu = FWD_CASES[name]
    nq, nk = _pick(kernel_device, gpu, cpu)
    b, h, d = _pick(kernel_device, (2, 4, 64), (1, 2, 16))
    _attention(kernel_device, _dtype(kernel_device), [(b, h, nq, d), (b, h, nk, d), (b, h, nk, d)], alpha,
               is_causal=causal, seed=len(name))


def test_forward_mixed_alpha_per_head(kernel_device):
    """alpha = linspace(1, 2, 5): one head of each class (softmax, 1.25, 1.5-entmax, 1.75, sparsemax)."""
    n, d = _pick(kernel_device, (300, 64), (45, 16))
    _attention(kernel_device, _dtype(kernel_device), [(1, 5, n, d)] * 3, torch.linspace(1.0, 2.0, 5), seed=1)


def test_forward_fp16_head_dim_128(kernel_device):
    """The one fp16 case (fp16 under the interpreter too), with the GPU's largest 128-row tiles."""
    n, d = _pick(kernel_device, (300, 128), (45, 32))
    _attention(kernel_device, F16, [(1, 2, n, d)] * 3, 1.5, is_causal=True, seed=2)


# ---------------------------------------------------------------- backward and the variants


def test_backward_learnable_alpha_per_head(kernel_device):
    """dQ, dK, dV and d alpha of a learnable alpha per head (every class), causal, against float64 autograd."""
    n, d = _pick(kernel_device, (300, 64), (45, 16))
    _attention(kernel_device, _dtype(kernel_device), [(2, 4, n, d)] * 3, torch.tensor([1.0, 1.25, 1.5, 2.0]),
               grad=("q", "k", "v", "alpha"), is_causal=True, seed=3)


def test_backward_sparsemax_float_mask_gradient(kernel_device):
    """A float key-bias mask with -inf entries and its gradient, Nq != Nk."""
    nq, nk, d = _pick(kernel_device, (213, 300, 64), (37, 50, 16))
    mask = 0.5 * torch.randn(2, 1, 1, nk, generator=gen(4), dtype=F64)
    mask[:, :, :, ::7] = -math.inf
    _attention(kernel_device, _dtype(kernel_device), [(2, 2, nq, d), (2, 2, nk, d), (2, 2, nk, d)], 2.0,
               grad=("q", "k", "v", "attn_mask"), attn_mask=mask, seed=4)


def test_varlen_packed_sequences(kernel_device):
    """cu_seqlens with an empty query sequence and Nq != Nk per sequence, causal, max_seqlen given (no host read)."""
    lq, lk = _pick(kernel_device, ([130, 0, 257], [150, 20, 300]), ([17, 0, 23], [20, 5, 25]))
    d = _pick(kernel_device, 64, 16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    _attention(kernel_device, _dtype(kernel_device), [(1, 2, sum(lq), d), (1, 2, sum(lk), d), (1, 2, sum(lk), d)],
               1.5, grad=("q", "k", "v"), is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_q=max(lq), max_seqlen_k=max(lk), seed=5)


def test_sliding_window(kernel_device):
    """A causal window narrower than the sequence (Mistral-style), forward and backward, general alpha."""
    n, d, left = _pick(kernel_device, (300, 64, 63), (70, 16, 9))
    _attention(kernel_device, _dtype(kernel_device), [(1, 2, n, d)] * 3, 1.25, grad=("q", "k", "v"),
               is_causal=True, window_size=(left, 0), seed=6)


def test_alibi_softcap_and_sinks(kernel_device):
    """ALiBi slopes per head, a soft cap that bends the (doubled) scores and learnable sinks, mixed alpha."""
    n, d = _pick(kernel_device, (300, 64), (40, 16))
    slopes = torch.rand(4, generator=gen(7), dtype=F64) / 4
    sinks = torch.tensor([0.5, -1.0, 2.0, 1.0], dtype=F64)
    _attention(kernel_device, _dtype(kernel_device), [(1, 4, n, d)] * 3, 1.5, grad=("q", "k", "v", "sinks"),
               is_causal=True, alibi_slopes=slopes, softcap=3.0, sinks=sinks, q_mult=2.0, seed=7)


def test_value_head_dim_differs(kernel_device):
    """v of head dim Dv != D (DeepSeek-V3 style), forward and backward."""
    n, d, dv = _pick(kernel_device, (300, 128, 64), (41, 32, 16))
    out, _ = _attention(kernel_device, _dtype(kernel_device), [(1, 2, n, d), (1, 2, n, d), (1, 2, n, dv)], 1.5,
                        grad=("q", "k", "v"), is_causal=True, seed=8)
    assert out.shape[-1] == dv


def test_grouped_query_attention(kernel_device):
    """8 query heads over 2 kv heads (dK, dV summed over each group), sparsemax, Nq != Nk."""
    nq, nk, d = _pick(kernel_device, (257, 300, 64), (37, 45, 16))
    _attention(kernel_device, _dtype(kernel_device), [(1, 8, nq, d), (1, 2, nk, d), (1, 2, nk, d)], 2.0,
               grad=("q", "k", "v"), enable_gqa=True, is_causal=True, seed=10)


# ---------------------------------------------------------------- split-K decode


def _decode(device, dtype, alpha, *, b, hq, hk, nq, n, d, seqlens, page_size=None, seed=0, **kw):
    """``entmax_decode`` on the kernels against the float64 reference backend on the contiguous cache (the kernel's
    copy holds NaN past each sequence: never read); a paged cache is a shuffled page pool built from it."""
    g = gen(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=F64).to(dtype) for s in ((b, hq, nq, d), (b, hk, n, d),
                                                                           (b, hk, n, d)))
    lens = torch.tensor(seqlens, dtype=torch.int32)
    past = torch.arange(n) >= lens.view(b, 1, 1, 1).long()
    caches = [x.masked_fill(past.view(b, 1, n, 1), math.nan) for x in (k, v)]
    table = None
    if page_size is not None:
        per_seq = -(-n // page_size)
        table = torch.randperm(b * per_seq + 3, generator=g)[: b * per_seq].view(b, per_seq).to(torch.int32)
        pools = []
        for x in caches:
            pages = torch.nn.functional.pad(x, (0, 0, 0, per_seq * page_size - n), value=math.nan)
            pages = pages.view(b, hk, per_seq, page_size, d).permute(0, 2, 3, 1, 4).reshape(-1, page_size, hk, d)
            pool = torch.full((b * per_seq + 3, page_size, hk, d), math.nan, dtype=dtype)
            pool[table.view(-1).long()] = pages
            pools.append(pool)
        caches = pools
    def dev(t, param_dtype=F32):
        """``t`` on ``device`` (float parameters in ``param_dtype``); numbers and None as they are."""
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device, param_dtype if t.is_floating_point() else t.dtype)

    extra = {name: dev(t) for name, t in kw.items()}
    out, st = entmax_decode(q.to(device), *(x.to(device) for x in caches), lens.to(device), dev(alpha),
                            block_table=dev(table), return_stats=True, backend="triton", **extra)

    def ref(work):
        pdt = F64 if work == F64 else F32
        return entmax_decode(*(x.to(device, work) for x in (q, k, v)), lens.to(device), dev(alpha, pdt),
                             return_stats=True, backend="reference", **{name: dev(t, pdt) for name, t in kw.items()})

    out64, st64 = ref(F64)
    out32, _ = ref(F32)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert_close_to_ref(out, out64, out32.to(dtype), eps=TOL["eps_attention_kernel"][dtype], name="out")
    assert torch.equal(st.n_valid.cpu(), st64.n_valid.cpu())
    assert (out.cpu()[st64.n_valid.cpu() == 0] == 0).all()


def test_decode_contiguous_cache(kernel_device):
    """One query per sequence, GQA (8 over 2 heads), mixed alpha per head, ragged and empty sequences."""
    n, d = _pick(kernel_device, (2000, 128), (40, 16))
    _decode(kernel_device, _dtype(kernel_device), torch.tensor([1.0, 1.25, 1.5, 2.0] * 2), b=3, hq=8, hk=2, nq=1,
            n=n, d=d, seqlens=[n, n // 3, 0], seed=10)


def test_decode_paged_cache(kernel_device):
    """Two causal queries per sequence over a shuffled page pool (page size 16), 1.5-entmax."""
    n, d = _pick(kernel_device, (2000, 128), (45, 16))
    _decode(kernel_device, _dtype(kernel_device), 1.5, b=2, hq=4, hk=2, nq=2, n=n, d=d, seqlens=[n, n // 2 + 3],
            page_size=16, is_causal=True, seed=11)


def test_decode_paged_variants(kernel_device):
    """A window, ALiBi, a soft cap and sinks on the decode kernels, paged, general alpha."""
    n, d, left = _pick(kernel_device, (2000, 64, 500), (60, 16, 20))
    _decode(kernel_device, _dtype(kernel_device), 1.25, b=2, hq=4, hk=4, nq=1, n=n, d=d, seqlens=[n, n // 2],
            page_size=16, window_size=(left, 0), alibi_slopes=torch.tensor([0.02, 0.01, 0.005, 0.001]),
            softcap=2.0, sinks=torch.tensor([0.5, 2.0, -1.0, 1.0]), seed=12)


# ---------------------------------------------------------------- row kernels (the mappings on long rows)


ROW_CASES = {
    "sparsemax": lambda x, a: sparsemax(x),
    "entmax15": lambda x, a: entmax15(x),
    "entmax_general": lambda x, a: mappings.entmax(x, 1.3),
    "entmax_alpha_per_row": lambda x, a: mappings.entmax(x, a),
}


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_row_kernels_forward_backward(name, kernel_device, monkeypatch):
    """The public mappings on rows long enough for the Triton row kernels (CUDA: the auto rule; CPU: the rule is
    forced, so the interpreter runs them), output, dX and d alpha against the float64 PyTorch path."""
    if kernel_device == "cpu":
        monkeypatch.setattr(mappings, "_use_triton_rows", lambda *args: True)
    calls = []
    kernel = triton_rows.entmax_rows_triton
    monkeypatch.setattr(triton_rows, "entmax_rows_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    dtype, n = _dtype(kernel_device), _pick(kernel_device, 4096, 701)
    assert kernel_device == "cpu" or n >= mappings.TRITON_MIN_ROW
    g = gen(13 + len(name))
    x = (3 * torch.randn(6, n, generator=g, dtype=F64)).to(dtype)
    dy = torch.randn(6, n, generator=g, dtype=F64).to(dtype)
    alpha = torch.tensor([1.0, 1.1, 1.5, 1.5, 1.8, 2.0]).view(6, 1)
    xk, ak = (t.clone().to(kernel_device).requires_grad_() for t in (x, alpha))
    y = ROW_CASES[name](xk, ak)
    y.backward(dy.to(kernel_device))
    assert calls, "the Triton row kernels did not run"
    monkeypatch.undo()  # the reference: the PyTorch path
    xr, ar = (t.to(F64).requires_grad_() for t in (x, alpha))
    ref = ROW_CASES[name](xr, ar)
    ref.backward(dy.to(F64))
    assert y.dtype == dtype and max_abs_err(y, ref) <= TOL["lowp_vs_f64"][dtype]
    assert float((y.detach().double().sum(-1) - 1).abs().max()) <= TOL["sum"][dtype]
    assert scaled_err(xk.grad, xr.grad) <= TOL["rows_dx"][dtype]
    if "per_row" in name:
        assert scaled_err(ak.grad, ar.grad) <= TOL["rows_dalpha"][dtype]


# ---------------------------------------------------------------- structured kernels (TV prox, isotonic regression)


@pytest.mark.parametrize("name", ["fusedmax", "oscarmax"])
def test_structured_kernels_forward_backward(name, kernel_device, monkeypatch):
    """fusedmax (Triton TV prox) and oscarmax (Triton isotonic regression) with a mask, output and gradient against
    the float64 PyTorch path (CPU: the kernels are forced, so the interpreter runs them)."""
    if kernel_device == "cpu":
        monkeypatch.setattr(structured_rows, "use_kernels", lambda x: True)
    kname = "tv_prox_rows" if name == "fusedmax" else "isotonic_nonincreasing_rows"
    calls = []
    kernel = getattr(structured_kernels, kname)
    monkeypatch.setattr(structured_kernels, kname, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    fn = {"fusedmax": lambda x, m: fusedmax(x, lam=0.3, mask=m), "oscarmax": lambda x, m: oscarmax(x, lam=0.05,
                                                                                                    mask=m)}[name]
    dtype, (rows, n) = _dtype(kernel_device), _pick(kernel_device, (64, 300), (6, 40))
    g = gen(20 + len(name))
    x = (2 * torch.randn(rows, n, generator=g, dtype=F64)).to(dtype)
    x[0, 5:15] = x[0, 5]  # a run of ties: one group
    dy = torch.randn(rows, n, generator=g, dtype=F64).to(dtype)
    mask = torch.rand(rows, n, generator=g) > 0.2
    mask[1] = False  # a row with no valid entry: zeros
    xk = x.clone().to(kernel_device).requires_grad_()
    y = fn(xk, mask.to(kernel_device))
    y.backward(dy.to(kernel_device))
    assert calls, f"the Triton {kname} kernel did not run"
    monkeypatch.undo()  # the reference: the PyTorch path
    xr = x.to(F64).requires_grad_()
    ref = fn(xr, mask)
    ref.backward(dy.to(F64))
    assert y.dtype == dtype and (y.detach().cpu()[1] == 0).all()
    assert_close_to_ref(y, ref, eps=TOL["eps_mapping"], name="out")
    assert_close_to_ref(xk.grad, xr.grad, eps=TOL["eps_mapping"], name="dX")
