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
import sparse_attn.kernels.attn.entmax_decode as dec
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


@pytest.mark.parametrize("hint", [False, True], ids=["", "tau_hint"])
@pytest.mark.parametrize("alpha,launches", [(1.0, 1), (1.5, 2), (2.0, 2)])
def test_a_step_reads_no_value_and_allocates_only_its_output(device_semantics, monkeypatch, alpha, launches, hint):
    """With the kernel stubbed and tensors treated as on a GPU, a repeated decoding step reads no tensor value back
    (no host sync), allocates its output only and makes one launch at alpha = 1, two above (score and value pass,
    each finished by the last program of a row tile); a threshold hint (a tensor, broadcast) changes none of it."""
    log = []
    monkeypatch.setattr(dec, "_entmax_decode_split_kernel", _Recorder(log, "split"))
    q, k, v, seqlens = (t.bfloat16() if t.is_floating_point() else t for t in _inputs(7))
    kw = dict(tau_hint=torch.zeros(2, 4, 1)[:, :1]) if hint else {}
    with torch.no_grad():
        entmax_decode(q, k, v, seqlens, alpha, backend="triton", **kw)
    reads, allocs = [], []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real: reads.append(_n) or _r(self, *a))
    for name in ("empty", "zeros", "full", "empty_like", "zeros_like", "full_like", "tensor"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _n=name, _r=real, **kw: allocs.append(_n) or _r(*a, **kw))
    log.clear()
    with torch.no_grad():
        entmax_decode(q, k, v, seqlens, alpha, backend="triton", **kw)
    assert reads == [] and allocs == ["empty"]
    assert [name for name, _ in log] == ["split"] * launches


def _paged(seed, B=2, Hq=4, Hk=2, D=16, page=8, pages_per_seq=5, lengths=(33, 12)):
    """A paged step's inputs: q, the page pools, a shuffled block table and lengths."""
    gen = torch.Generator().manual_seed(seed)
    n_pages = B * pages_per_seq + 3
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k_pool, v_pool = (torch.randn(n_pages, page, Hk, D, generator=gen) for _ in range(2))
    table = torch.randperm(n_pages, generator=gen)[:B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    return q, k_pool, v_pool, table, torch.tensor(lengths, dtype=torch.int32)


def _paged_step(q, k_pool, v_pool, table, seqlens):
    return entmax_decode(q, k_pool, v_pool, seqlens, 1.5, block_table=table, backend="triton", return_stats=True,
                         is_causal=True)


def test_paged_step_compiles_fullgraph_and_equals_eager(monkeypatch):
    """A paged decoding step of ``entmax_decode`` compiles with ``fullgraph=True`` (through the custom op, whose fake
    implementation gives the shapes), runs the kernels once per call and equals the eager step, on two steps of new
    values through the same compiled graph."""
    calls = []
    real = dec.launch_decode
    monkeypatch.setattr(dec, "launch_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    compiled = torch.compile(_paged_step, fullgraph=True, backend="aot_eager")
    for seed, lengths in ((8, (33, 12)), (9, (34, 13))):
        inputs = _paged(seed, lengths=lengths)
        with torch.no_grad():
            eager = _paged_step(*inputs)
            got = compiled(*inputs)
        torch.testing.assert_close(got[0], eager[0], **EXACT)
        for a, b in zip(got[1], eager[1], strict=True):
            torch.testing.assert_close(a, b, **EXACT)
    assert len(calls) == 4


def test_fake_tensor_trace_of_a_decode_step(device_semantics):
    """Traced with fake tensors (``make_fx``; values not read, as for CUDA tensors), a decoding step is one
    ``sparse_attn.entmax_decode`` node with the output shapes and dtypes of the real call, and no value read."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _paged(10)
    with torch.no_grad():
        graph = make_fx(_paged_step, tracing_mode="fake")(*inputs)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("sparse_attn.entmax_decode.default") == 1, targets
    assert not [t for t in targets if "_local_scalar_dense" in t or t.startswith("aten.item")], targets
    with torch.no_grad():
        out, st = graph(*inputs)
    assert out.shape == (2, 4, 1, 16) and st.tau.dtype == torch.float32 and st.nnz.dtype == torch.int32


def _hinted_step(q, k_pool, v_pool, table, seqlens, tau_hint):
    return entmax_decode(q, k_pool, v_pool, seqlens, 1.5, block_table=table, backend="triton", return_stats=True,
                         is_causal=True, tau_hint=tau_hint)


def test_hinted_steps_compile_fullgraph_and_trace_without_reads(device_semantics):
    """A decoding loop that feeds each step's tau to the next as ``tau_hint`` compiles with ``fullgraph=True`` and
    equals the eager loop bitwise; traced with fake tensors a hinted step is one ``sparse_attn.entmax_decode`` node and
    reads no value (the hint is a tensor, as a CUDA graph needs)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    compiled = torch.compile(_hinted_step, fullgraph=True, backend="aot_eager")
    hints = [torch.full((2, 4, 1), float("nan"))] * 2
    for seed, lengths in ((12, (33, 12)), (13, (34, 13))):
        inputs = _paged(seed, lengths=lengths)
        with torch.no_grad():
            eager = _hinted_step(*inputs, hints[0])
            got = compiled(*inputs, hints[1])
        torch.testing.assert_close(got[0], eager[0], **EXACT)
        for a, b in zip(got[1], eager[1], strict=True):
            torch.testing.assert_close(a, b, **EXACT)
        hints = [eager[1].tau, got[1].tau]
    with torch.no_grad():
        graph = make_fx(_hinted_step, tracing_mode="fake")(*_paged(14), hints[0])
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("sparse_attn.entmax_decode.default") == 1, targets
    assert not [t for t in targets if "_local_scalar_dense" in t or t.startswith("aten.item")], targets


def test_hf_generate_with_a_static_cache_takes_the_decode_path(monkeypatch):
    """``generate`` with ``cache_implementation="static"`` (the cache a CUDA-graph decode loop needs: fixed shapes,
    the unfilled slots masked) runs every step after the prompt on the decode kernels and generates what a dynamic
    cache generates."""
    transformers = pytest.importorskip("transformers")
    import sparse_attn.integrations.hf as entmax_hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, num_hidden_layers=1, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="entmax").eval()
    for name, p in model.named_parameters():
        if "q_proj" in name or "k_proj" in name:
            torch.nn.init.normal_(p, std=0.5)
    entmax_hf.attach_entmax_alpha(model, alpha=[1.5, 2.0], learnable=False)
    model.config.entmax_backend = "triton"
    calls = []
    real = dec.launch_decode
    monkeypatch.setattr(dec, "launch_decode",
                        lambda spec, *a, **kw: calls.append(spec.q.shape[2]) or real(spec, *a, **kw))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (2, 6), generator=gen)
    mask = torch.ones(2, 6, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        static = model.generate(ids, cache_implementation="static", **kw)
        assert calls == [6, 1, 1]  # the prompt too: 6 queries against the 9 slots of the static cache
        dynamic = model.generate(ids, **kw)
    assert torch.equal(static, dynamic)


def _static_paged_cuda(seed, alpha):
    q, k_pool, v_pool, table, seqlens = (t.cuda() for t in _paged(seed, B=3, Hq=8, Hk=2, D=64, page=16,
                                                                     pages_per_seq=40, lengths=(600, 37, 311)))
    return [q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), table, seqlens], alpha


def _advance(inputs, seed):
    """One decoding step's in-place update of static inputs: new queries, a new key and value per sequence written
    at its length, the lengths one longer."""
    q, k_pool, v_pool, table, seqlens = inputs
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
    page, slot = table.gather(1, (seqlens // k_pool.shape[1]).long()[:, None])[:, 0].long(), seqlens % k_pool.shape[1]
    k_pool[page, slot.long()] = torch.randn(k_pool[page, slot.long()].shape, generator=gen, device="cuda").bfloat16()
    v_pool[page, slot.long()] = torch.randn(v_pool[page, slot.long()].shape, generator=gen, device="cuda").bfloat16()
    seqlens += 1


def _capture(step):
    """``step`` warmed up on a side stream, then captured in a CUDA graph: ``(graph, the captured outputs)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def _replay_equals_eager(graph, captured, step, inputs, seed):
    """One step of new values (:func:`_advance`): the graph's replay gives bitwise the eager step's results."""
    _advance(inputs, seed)
    graph.replay()
    eager = step()
    torch.testing.assert_close(captured[0], eager[0], **EXACT)
    for a, b in zip(captured[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [1.0, 1.5, [1.0, 1.5, 2.0, 1.25] * 2], ids=["softmax", "entmax15", "mixed"])
def test_gpu_cuda_graph_replay_equals_eager(alpha):
    """A decoding step captured in a CUDA graph (``torch.cuda.graph``) and replayed after in-place updates of its
    static inputs (queries, a new key per sequence, lengths) gives bitwise the eager step's output and statistics."""
    inputs, alpha = _static_paged_cuda(11, alpha)
    alpha = torch.tensor(alpha, device="cuda") if isinstance(alpha, list) else alpha

    def step():
        return entmax_decode(inputs[0], inputs[1], inputs[2], inputs[4], alpha, block_table=inputs[3],
                             return_stats=True)

    graph, captured = _capture(step)
    for seed in range(3):
        _replay_equals_eager(graph, captured, step, inputs, seed)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_a_hint_equals_eager():
    """A captured step whose ``tau_hint`` is a static tensor, refilled from the previous replay's ``tau`` before each
    replay, gives bitwise the eager step with the same hint."""
    inputs, alpha = _static_paged_cuda(12, 1.5)
    hint = torch.full(inputs[0].shape[:3], float("nan"), device="cuda")

    def step():
        return entmax_decode(inputs[0], inputs[1], inputs[2], inputs[4], alpha, block_table=inputs[3],
                             return_stats=True, tau_hint=hint)

    graph, captured = _capture(step)
    for seed in range(3):
        _replay_equals_eager(graph, captured, step, inputs, seed)
        hint.copy_(captured[1].tau)  # the next step's hint: this one's thresholds


@pytest.mark.gpu
def test_gpu_compile_reduce_overhead_equals_eager():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs through the custom op) of a paged decoding step equals
    the eager step over several steps of in-place updated inputs."""
    inputs, _ = _static_paged_cuda(12, 1.5)
    compiled = torch.compile(_paged_step, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        _advance(inputs, seed)
        with torch.no_grad():
            got = compiled(*inputs)
            eager = _paged_step(*inputs)
        torch.testing.assert_close(got[0], eager[0], **EXACT)
        torch.testing.assert_close(got[1].tau, eager[1].tau, **EXACT)


@pytest.mark.gpu
def test_gpu_hf_generate_static_cache_compiled():
    """On a GPU, ``generate`` with a static cache and the model's forward compiled with
    ``mode="reduce-overhead"`` (Hugging Face's CUDA-graph recipe) generates what eager generation does."""
    transformers = pytest.importorskip("transformers")
    import sparse_attn.integrations.hf as entmax_hf

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_attention_heads=8,
                                      num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="entmax").cuda().eval()
    entmax_hf.attach_entmax_alpha(model, alpha=[1.5, 2.0] * 4, learnable=False)
    ids = torch.randint(3, 128, (2, 20), device="cuda")
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        compiled = model.generate(ids, **kw)
    assert torch.equal(compiled, eager)
