"""Shared test helpers: the tolerance table, the tolerance rule, input builders, float64 oracles.

Test modules import what they share from here (and the table of attention variants from ``tests/variants.py``)
and never from each other. Kernel and mapping outputs are checked against float64 computations on float64 copies
of the same (dtype-rounded) inputs; the rule is :func:`assert_close_to_ref`.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

F64 = torch.float64
F32 = torch.float32
F16 = torch.float16
BF16 = torch.bfloat16

# The project's one tolerance table. Absolute unless said otherwise; a dict is indexed by the
# dtype of the output under test. Where two tests used the same kind of bound, the stricter value
# is kept. Numbers quoted as measured come from the runs that set them.
TOL = {
    # Slack eps of the tolerance rule (assert_close_to_ref), by the baseline it is used with.
    # Mappings and their gradients (outputs computed in float32, baseline = float64 result rounded to
    # the output dtype; measured ratio 1.0 for fp16/bf16; tests/test_fuzz.py used at most half of it
    # over 3000 examples, fp32 entmax_bisect dX).
    "eps_mapping": 1e-6,
    # The attention reference in fp16/bf16 against PyTorch's SDPA / a FlashAttention-style pipeline
    # (measured reference errors at most 0.7x (fp16) and 1x (bf16) the baseline's).
    "eps_attention_lowp": {F16: 1e-4, BF16: 1e-3},
    # The fused Triton attention against the reference run in the kernel's dtype (the fused kernel
    # tests' forward slack: float32 outputs measured within 6e-6 of float64 at the default tol).
    "eps_attention_kernel": {F32: 2e-5, F16: 2e-3, BF16: 2e-2},
    # Attention (reference or fused, any dtype) against exact attention of its float32 scores, relative
    # to 1 + max|score| * max|v|: the float32 weights' own error (z - tau cancels at large scores).
    # Measured at most 7.9e-8 over 3000 fuzz examples of the reference backend.
    "eps_attention_f32": 2 * torch.finfo(F32).eps,
    # Attention gradients against float64 autograd, relative to max(1, largest |float64 gradient|) (the
    # fused tests' slack: fp32 kernels 5e-5; fp16/bf16 products on the GPU round P and dS to that dtype;
    # doubled for bf16 under the interpreter, whose bf16 stores round toward zero).
    "eps_attention_grad": {F32: 5e-5, F16: 2e-3, BF16: 2e-2},
    # Fenchel-Young losses (float32 values for fp16/bf16/fp32 logits) against float64, relative to
    # 1 + the largest finite |logit| (tests/test_fuzz.py used at most a quarter of it over 3000 examples).
    "eps_loss": {F64: 1e-12, F32: 1e-6, F16: 1e-6, BF16: 1e-6},
    # |sum p - 1| of a mapping's output: float64/float32 rows are renormalized in their dtype;
    # rounding a sum-one float32 row to fp16/bf16 moves the sum by at most eps/2, the table allows
    # eps (measured 2.9e-4 fp16, 2.4e-3 bf16, 1.7e-7 fp32, 8.9e-16 fp64).
    "sum": {F64: 1e-13, F32: 1e-6, F16: torch.finfo(F16).eps, BF16: torch.finfo(BF16).eps},
    # An output in a low-precision dtype against float64 on the same rounded inputs (Triton row
    # kernels, structured and constrained mappings): about twice the rounding of a probability near
    # 1 in that dtype.
    "lowp_vs_f64": {F32: 1e-6, F16: 5e-4, BF16: 4e-3},
    # Row-kernel gradients against float64, divided by the largest reference magnitude (>= 0.1).
    "rows_dx": {F32: 5e-6, F16: 1e-3, BF16: 1e-2},
    "rows_dalpha": {F32: 5e-6, F16: 2e-3, BF16: 2e-2},
    # Triton row kernels against the PyTorch path on the same input: about 2x the largest measured
    # difference over 6 seeds (fp32: 1.8e-7, 4.8e-7, 2.9e-6; fp16: 0 and 4.9e-4 = 1 ulp).
    "rows_triton_vs_torch": {F32: {"p": 4e-7, "dx": 1e-6, "dalpha": 6e-6}, F16: {"p": 1e-3, "dx": 1e-3}},
    # The mappings on CUDA (Triton row kernels for long rows) against the CPU path (PyTorch):
    # outputs, and gradients at 10x (GPU test).
    "rows_cuda_vs_cpu": {F32: 1e-5, BF16: 1e-2},
    "rows_cuda_vs_cpu_grad": {F32: 1e-4, BF16: 1e-1},
    # The same values computed another way (in a batch with other rows, or another path of the same
    # algorithm): up to the rounding of batched reductions.
    "same_values": {F64: 1e-12, F32: 1e-6, F16: 1e-3, BF16: 1e-2},
    # Values of size about 1 computed by the same arithmetic another way (compiled against eager, another memory
    # layout, a row alone, a constraint that does not bind or binds everywhere, a rescaling by the temperature): a
    # few ulps. Measured at most 1.7e-16 in float64 (csparsemax with tight bounds), 0 in float32.
    "ulps": {F64: 1e-15, F32: 1e-7},
    # float64 results against the float64 oracles of this file (reference_entmax: 200 bisection steps, and the
    # attention built on it) or an iterative solver against the closed form it reaches (fusedmax and oscarmax at a
    # small lam against sparsemax). Measured at most 3.1e-13 (entmax_bisect) and 1.3e-12 (fusedmax).
    "oracle_f64": 1e-10,
    # float64 solvers written in the tests against the library.
    "slow_solver": 1e-9,
    "jacobian": 1e-10,
    # Constraint invariants (fertility, bounds) of float64 decoding.
    "invariant": 1e-6,
    # The backward kernels (fed the reference's tau and lsum) against float64 autograd: max abs error relative to
    # the largest |float64 gradient| (at least 1e-3). Measured under the interpreter: float32 <= 2e-6 for every
    # alpha in [1, 2] (1.0001 included), float16 <= 5e-4 (arithmetic in float32). On a GPU fp16/bf16 products
    # round P and dS to that dtype, as FlashAttention's do ("bwd_kernel_rel_gpu").
    "bwd_kernel_rel": {F32: 2e-5, F16: 3e-3, BF16: 3e-2},
    # The public fused path (float32 kernels and inputs) end to end against float64: max abs error relative to
    # the largest |float64 value| of the same tensor (measured errors in test_attention_fwd.py / _bwd.py).
    "fused_rel_f32": {"out": 2e-5, "grad": 5e-5, "dalpha": 5e-4},
    # A sharded (context-parallel / Ulysses) computation against one process: the same arithmetic in another
    # order (outputs and gradients, atol = rtol).
    "sharded_vs_single": {F64: 1e-9, F32: 2e-5},
    "bwd_kernel_rel_gpu": {F32: 2e-5, F16: 1e-2, BF16: 5e-2},
    # The fused Triton path against the reference path, both float32, through a module or the HF
    # integration (atol = rtol), outputs and gradients.
    "fused_vs_reference_f32": {"out": 1e-4, "grad": 1e-3},
    # A float32 model through the library against the same float32 model computed another way (compiled, eager
    # attention fed the same weights, a manual composition, a cached decoding step): same_values' atol plus a relative
    # part for logits and gradients larger than 1 (pass as **TOL["same_model_f32"]). Measured at most 6.0e-7 abs
    # (tests/models/test_modules.py), 4.2e-8 beyond the rtol part (cached decoding,
    # tests/integrations/test_hf_variants.py); atol about 8x that, since other torch / transformers versions may
    # reorder the float32 sums.
    "same_model_f32": {"atol": 5e-6, "rtol": 1e-5},
    # The fused kernel's float32 tau (the threshold on (alpha - 1) * scores) against the float64 reference's.
    # Measured at most 4.7e-7 under the interpreter (tests/attn/test_attention_fused.py).
    "tau": {F32: 1e-4},
    # torch.autograd.gradcheck in float64 (pass as **TOL["gradcheck"]): central differences with step eps.
    "gradcheck": {"eps": 1e-7, "atol": 1e-6},
    # ``assert not allclose(a, b, atol=...)``: a difference above this counts as a change (a larger value is the
    # stricter test). Gemma-2's softcap of 1.0 changes the reference's output by less than 1e-3.
    "changed": 1e-4,
    # Modules under CPU autocast against float32 (outputs, per-head weights): about 2.5x the
    # measured maxima (bf16: 3.8e-3 on outputs up to 0.53, 3.0e-3 on weights; fp16: 4.4e-4, 4.3e-4).
    "autocast_out": {BF16: 1e-2, F16: 1e-3},
    "autocast_weights": {BF16: 8e-3, F16: 1e-3},
}


# An exact comparison through torch.testing.assert_close (its shape, dtype and NaN checks and its message):
# ``assert_close(a, b, **EXACT)``.
EXACT = {"atol": 0, "rtol": 0}


def max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref|`` in float64 (0 for empty tensors)."""
    if got.numel() == 0:
        return 0.0
    return float((got.detach().double().cpu() - ref.detach().double().cpu()).abs().max())


def scaled_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the largest reference magnitude (at least 0.1)."""
    ref = ref.detach().double().cpu()
    return float((got.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(0.1))


def assert_close_to_ref(out: torch.Tensor, ref64: torch.Tensor, low_precision_ref=None,
                        dtype: torch.dtype | None = None, *, eps: float, name: str = "output") -> None:
    """The tolerance rule: ``err(out) <= 2 * err(low_precision_ref) + eps``.

    Both errors are ``max |. - ref64|``, with ``ref64`` the float64 result on float64 copies of
    the same (dtype-rounded) inputs. ``low_precision_ref`` is the reference computed in the
    kernel's dtype, or a sequence of such references (the largest error counts); None means
    ``ref64`` rounded to ``dtype`` (the best any ``dtype`` output can do). ``dtype`` defaults to
    ``out.dtype``. Non-finite values: ``out`` must be NaN exactly where ``ref64`` is (the
    non-finite policy) and equal it where ``ref64`` is infinite; the rule covers the finite entries.
    """
    dtype = out.dtype if dtype is None else dtype
    got = out.detach().double().cpu()
    want = ref64.detach().double().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), (
        f"{name}: NaN at {int((nan_got & ~nan_want).sum())} entries where the float64 reference is not, "
        f"missing at {int((nan_want & ~nan_got).sum())} where it is NaN")
    inf_want = torch.isinf(want)
    assert torch.equal(got[inf_want], want[inf_want]), f"{name}: infinite reference entries differ"
    finite = ~(nan_want | inf_want)
    if low_precision_ref is None:
        low_precision_ref = want.to(dtype)
    bases = [low_precision_ref] if isinstance(low_precision_ref, torch.Tensor) else list(low_precision_ref)
    err_ref = 0.0
    for base in bases:
        base = base.detach().double().cpu()
        assert torch.isfinite(base[finite]).all(), f"{name}: a low-precision baseline is not finite where ref64 is"
        err_ref = max(err_ref, max_abs_err(base[finite], want[finite]))
    err = max_abs_err(got[finite], want[finite])
    bound = 2 * err_ref + eps
    assert err <= bound, f"{name}: max err {err:.3g} > {bound:.3g} (baseline in {dtype}: {err_ref:.3g}, eps {eps:.3g})"


def bf16_toward_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16 toward zero, as the Triton interpreter (triton 3.9) stores float32 values
    into bfloat16 (torch and the GPU round to nearest): the rounding baseline of a bf16 kernel output on CPU."""
    bits = t.detach().to(F32).contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(F32).to(BF16)


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype: torch.dtype = F64, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    """``scale * N(0, 1)`` drawn in float64 from ``seed``, then rounded to ``dtype``."""
    return (torch.randn(*shape, generator=gen(seed), dtype=F64) * scale).to(dtype)


def qkv(b: int = 2, hq: int = 4, hk: int = 4, nq: int = 9, nk: int = 11, d: int = 8, dtype: torch.dtype = F64,
        seed: int = 0, dv: int | None = None, device="cpu", requires_grad: bool = False):
    """Attention inputs ``q (b, hq, nq, d)``, ``k (b, hk, nk, d)``, ``v (b, hk, nk, dv)``, drawn in ``dtype``.

    ``dv`` defaults to ``d``. q, k and v are drawn in that order from one generator.
    """
    g = gen(seed)
    shapes = ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d if dv is None else dv))
    return tuple(torch.randn(*s, generator=g, dtype=dtype).to(device).requires_grad_(requires_grad) for s in shapes)


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 offsets ``(len(lengths) + 1,)`` of packed sequences of the given lengths."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def random_mask(shape, kind: str, seed: int = 0, p_keep: float = 0.7, empty_rows: int = 0,
                scale: float = 2.0) -> torch.Tensor:
    """A mask of ``shape`` (broadcastable to the scores): ``kind="bool"`` (True = attend) or ``"float"``.

    A float mask is additive, ``scale * N(0, 1)`` with ``-inf`` where the boolean draw excludes
    the key. The first ``empty_rows`` rows (second-to-last dim) exclude every key.
    """
    g = gen(seed)
    keep = torch.rand(*shape, generator=g) < p_keep
    if empty_rows and len(shape) >= 2:
        keep[..., :empty_rows, :] = False
    if kind == "bool":
        return keep
    if kind != "float":
        raise ValueError(f"kind must be 'bool' or 'float', got {kind!r}")
    bias = torch.randn(*shape, generator=g, dtype=F64) * scale
    return bias.masked_fill(~keep, -math.inf)


def reference_entmax(x: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """Textbook alpha-entmax in float64: ``p = [(alpha-1) x - tau]_+^(1/(alpha-1))``.

    ``tau`` by 200 bisection steps on its bracket, all rows at once; alpha = 1 is softmax.
    ``alpha`` is a float or a tensor broadcastable to ``x`` with size 1 at ``dim``.
    Rows that are all ``-inf`` give 0. (Independent of the library: the oracle of the mappings.)
    """
    x = x.to(F64).movedim(dim, -1).contiguous()
    a = torch.as_tensor(alpha, dtype=F64)
    a = a.reshape((1,) * (x.ndim - a.ndim) + tuple(a.shape)).movedim(dim, -1)
    a = torch.broadcast_to(a, x.shape[:-1] + (1,)).reshape(-1, 1)
    rows = x.reshape(-1, x.shape[-1])
    finite = rows > -math.inf
    n = finite.sum(-1, keepdim=True).clamp(min=1).double()
    e = torch.where(a == 1, torch.ones_like(a), a - 1)
    z = torch.where(finite, e * rows, torch.zeros_like(rows))
    zmax = torch.where(finite, z, torch.full_like(z, -math.inf)).amax(-1, keepdim=True)
    zmin = torch.where(finite, z, torch.full_like(z, math.inf)).amin(-1, keepdim=True)
    pos = e > 0
    lo = torch.where(pos, zmax - 1, zmin - n ** (-e))
    hi = torch.where(pos, zmax - n ** (-e), zmin - 1)

    def probs(tau):
        base = z - tau
        p = torch.where(pos, torch.clamp(base, min=0), base.clamp(min=1e-300)) ** (1 / e)
        return torch.where(finite, p, torch.zeros_like(p))

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        big = probs(mid).sum(-1, keepdim=True) > 1
        go_right = big == pos
        lo, hi = torch.where(go_right, mid, lo), torch.where(go_right, hi, mid)
    p = probs(0.5 * (lo + hi))
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    soft = torch.softmax(rows, -1).nan_to_num(0.0)
    p = torch.where(a == 1, soft, p)
    p = torch.where(finite.any(-1, keepdim=True), p, torch.zeros_like(p))
    return p.reshape(x.shape).movedim(-1, dim)


def entmax_vjp(p: torch.Tensor, grad: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """float64 ``d/dx <grad, entmax(x)>`` from the output ``p``: ``U (grad - sum(U grad) / sum U)``.

    ``U = p^(2 - alpha)`` on the support (``p`` at alpha = 1), 0 elsewhere (docs/backward.md);
    ``alpha`` a float or a tensor broadcastable to ``p`` with size 1 at ``dim``. Rows without
    support give 0.
    """
    p, grad = p.to(F64), grad.to(F64)
    a = torch.as_tensor(alpha, dtype=F64)
    u = torch.where(p > 0, p.clamp(min=1e-300) ** (2 - a), torch.zeros_like(p))
    total = u.sum(dim, keepdim=True)
    mean = (u * grad).sum(dim, keepdim=True) / total.clamp(min=1e-300)
    return u * (grad - mean)


class OpLog(TorchDispatchMode):
    """Records the name of every op dispatched inside it, except while ``paused`` is positive."""

    HOST_READS = ("aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero")

    def __init__(self):
        super().__init__()
        self.ops = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> list[str]:
        """The recorded ops that read a tensor value back to the host (a device sync on CUDA)."""
        return [op for op in self.ops if op.split(".")[0] in self.HOST_READS]


def host_reads_outside(monkeypatch, owner, name, fn) -> list[str]:
    """Host reads of ``fn()`` outside calls to ``owner.<name>`` (a function keeping its own input checks)."""
    log = OpLog()
    real = getattr(owner, name)

    def paused(*args, **kwargs):
        log.paused += 1
        try:
            return real(*args, **kwargs)
        finally:
            log.paused -= 1

    monkeypatch.setattr(owner, name, paused)
    with log:
        fn()
    assert log.ops, "nothing was dispatched: the op log is not recording"
    return log.host_reads()


@contextlib.contextmanager
def count_tma_descriptors():
    """Counts ``{"make": n, "load": n}`` of the TMA tensor descriptors the interpreted kernels make and load from
    inside the block (the interpreter's builder; on a GPU nothing is counted)."""
    from triton.runtime import interpreter

    counts = {"make": 0, "load": 0}
    builder = interpreter.InterpreterBuilder
    make, load = builder.create_make_tensor_descriptor, builder.create_descriptor_load

    def counted(name, fn):
        def run(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)

        return run

    builder.create_make_tensor_descriptor = counted("make", make)
    builder.create_descriptor_load = counted("load", load)
    try:
        yield counts
    finally:
        builder.create_make_tensor_descriptor, builder.create_descriptor_load = make, load
