"""The host side of a decoding step (``sparse_attn.decode.entmax_decode``): the cached argument gate, the launch
plans and the reused scratch memory must never change a result, and a step reads no tensor value back.

CPU tensors have their values read for checks (the non-finite and range checks run on every call there), which turns
the gate's cache off; tests that exercise the cache make CPU tensors behave as CUDA tensors do
(``device_semantics``: values not read). Results are compared with the float64 reference backend of the same call,
and with the custom op where a test needs both paths.
"""

import gc
import weakref

import pytest
import torch
from helpers import EXACT, TOL, OpLog

import sparse_attn._validation as validation
import sparse_attn.attn.decode as decode_mod
import sparse_attn.kernels.entmax_decode as dec
from sparse_attn.decode import entmax_decode
from sparse_attn.kernels.attn import _decode_launch

EPS = TOL["eps_attention_kernel"][torch.float32]

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


@pytest.fixture
def device_semantics(monkeypatch):
    """CPU tensors treated as device tensors: their values are not read for checks (as CUDA tensors without
    ``set_checks``), so the gate of ``entmax_decode`` caches."""
    monkeypatch.setattr(validation, "_FREE_READ_DEVICES", frozenset())
    decode_mod._GATE.clear()
    yield
    decode_mod._GATE.clear()


def _inputs(seed, B=2, Hq=4, Hk=2, N=40, D=16, Dv=16, lengths=(40, 23)):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k = torch.randn(B, Hk, N, D, generator=gen)
    v = torch.randn(B, Hk, N, Dv, generator=gen)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def _check(q, k, v, seqlens, alpha, **kw):
    """The triton backend's output and statistics against the float64 reference backend."""
    out, st = entmax_decode(q, k, v, seqlens, alpha, backend="triton", return_stats=True, **kw)
    a64 = alpha.double() if isinstance(alpha, torch.Tensor) else alpha
    ref, st64 = entmax_decode(q.double(), k.double(), v.double(), seqlens, a64, backend="reference",
                              return_stats=True, **{n: x.double() if isinstance(x, torch.Tensor) and
                                                    x.is_floating_point() else x for n, x in kw.items()})
    torch.testing.assert_close(out.double(), ref, atol=EPS, rtol=0)
    assert torch.equal(st.n_valid, st64.n_valid)
    return out, st


def test_gate_caches_by_metadata_and_never_keeps_a_call_s_tensors(device_semantics):
    """A second step with new tensors of the same metadata reuses the checked spec (one cache entry) and computes
    on its own tensors; the entry holds none of the first call's tensors (they are freed)."""
    q, k, v, seqlens = _inputs(0)
    first, _ = _check(q, k, v, seqlens, 1.5)
    entries = len(decode_mod._GATE)  # the triton and the reference calls
    k_ref = weakref.ref(k)
    q2, k2, v2, seqlens2 = _inputs(1, lengths=(12, 40))
    second, _ = _check(q2, k2, v2, seqlens2, 1.5)
    assert len(decode_mod._GATE) == entries == 2 and not torch.equal(first, second)
    del q, k, v, seqlens, first
    gc.collect()
    assert k_ref() is None, "the gate's cache keeps a call's cache tensor alive"


def test_gate_rechecks_what_changed(device_semantics):
    """Any change the checks could see is a new entry, checked again: a shape, a dtype, requires_grad under grad
    mode, the type of an argument, a Python alpha's value, an int length's value."""
    q, k, v, seqlens = _inputs(2)
    _check(q, k, v, seqlens, 1.5)
    with pytest.raises(ValueError, match="head_dim"):
        entmax_decode(q, k[..., :8], v, seqlens, 1.5, backend="triton")
    with pytest.raises(TypeError, match="one dtype"):
        entmax_decode(q, k.double(), v, seqlens, 1.5, backend="triton")
    with pytest.raises(ValueError, match="gradients"):
        entmax_decode(q.clone().requires_grad_(), k, v, seqlens, 1.5, backend="triton")
    with pytest.raises(TypeError, match="is_causal"):
        entmax_decode(q, k, v, seqlens, 1.5, backend="triton", is_causal=1)
    with pytest.raises(TypeError, match="cache_seqlens"):
        entmax_decode(q, k, v, seqlens.float(), 1.5, backend="triton")
    _check(q, k, v, seqlens, 2.0)
    _check(q, k, v, 17, 1.5)
    _check(q, k, v, 30, 1.5)
    _check(q, k, v, seqlens, torch.tensor([1.0, 1.5, 2.0, 1.25]))
    _check(q, k, v, seqlens, torch.tensor([2.0, 2.0, 1.5, 1.0]))


def test_lengths_changed_in_place_are_read_on_every_step(device_semantics):
    """The cache keys on metadata only: lengths updated in place (a static cache's counter) take effect."""
    q, k, v, seqlens = _inputs(3, lengths=(5, 9))
    outs = []
    for step in range(3):
        out, st = _check(q, k, v, seqlens, 1.5)
        assert st.n_valid.flatten().tolist() == [5 + step] * 4 + [9 + step] * 4
        outs.append(out)
        seqlens += 1
    assert len(decode_mod._GATE) == 2 and not torch.equal(outs[0], outs[1])


def test_scratch_reused_across_problems_gives_the_fresh_results():
    """Steps of different configurations share one scratch buffer; each result equals that of the same step on
    freshly allocated scratch, bitwise, and the returned tensors are never shared between calls."""
    q, k, v, seqlens = _inputs(4)
    qm, km, vm, sm = _inputs(5, B=1, Hq=8, Hk=2, N=70, D=32, Dv=16, lengths=(61,))
    mixed = torch.tensor([1.0, 1.5, 2.0, 1.25] * 2)
    _decode_launch.release_workspaces()
    fresh = [dec.entmax_decode_fwd(q, k, v, seqlens, 1.5, 0.25, is_causal=True),
             dec.entmax_decode_fwd(qm, km, vm, sm, mixed, 0.2, window_size=(30, 0))]
    for _ in range(2):
        again = [dec.entmax_decode_fwd(q, k, v, seqlens, 1.5, 0.25, is_causal=True),
                 dec.entmax_decode_fwd(qm, km, vm, sm, mixed, 0.2, window_size=(30, 0))]
        for a, b in zip(fresh, again, strict=True):
            for name in ("out", "tau", "nnz", "n_valid", "n_passes", "blocks_read"):
                torch.testing.assert_close(getattr(b, name), getattr(a, name), **EXACT)
                assert getattr(b, name).data_ptr() != getattr(a, name).data_ptr()


def test_direct_path_equals_the_custom_op():
    """Eager steps run the launcher without the custom op; under a dispatch mode (fake tensors, op counters) the op
    runs, with the same results."""
    q, k, v, seqlens = _inputs(6)
    direct = entmax_decode(q, k, v, seqlens, 2.0, backend="triton", return_stats=True)
    with OpLog() as log:
        through_op = entmax_decode(q, k, v, seqlens, 2.0, backend="triton", return_stats=True)
    assert "sparse_attn::entmax_decode" in log.ops
    torch.testing.assert_close(through_op[0], direct[0], **EXACT)
    for a, b in zip(through_op[1], direct[1], strict=True):
        torch.testing.assert_close(a, b, **EXACT)


class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda **kwargs: self.log.append((self.name, len(kwargs)))


@pytest.mark.parametrize("alpha,launches", [(1.0, 1), (1.5, 2), (2.0, 2)])
def test_a_step_reads_no_value_and_allocates_only_its_output(device_semantics, monkeypatch, alpha, launches):
    """With the kernel stubbed and tensors treated as on a GPU, a repeated decoding step reads no tensor value back
    (no host sync), allocates its output only and makes one launch at alpha = 1, two above (score and value pass,
    each finished by the last program of a row tile)."""
    log = []
    monkeypatch.setattr(dec, "_entmax_decode_split_kernel", _Recorder(log, "split"))
    q, k, v, seqlens = (t.bfloat16() if t.is_floating_point() else t for t in _inputs(7))
    with torch.no_grad():
        entmax_decode(q, k, v, seqlens, alpha, backend="triton")
    reads, allocs = [], []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: reads.append(_n) or _r(self, *a))
    for name in ("empty", "zeros", "full", "empty_like", "zeros_like", "full_like", "tensor"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _r=real, **kw: allocs.append(_n) or _r(*a, **kw))
    log.clear()
    with torch.no_grad():
        entmax_decode(q, k, v, seqlens, alpha, backend="triton")
    assert reads == [] and allocs == ["empty"]
    assert [name for name, _ in log] == ["split"] * launches

