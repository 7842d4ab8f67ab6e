"""Hugging Face architectures whose attention uses variants: gpt-oss (sinks, sliding windows), Gemma-2
(softcap, sliding windows), Mistral (sliding window), DeepSeek-V3 (value head dim != query/key head dim),
ModernBERT (bidirectional sliding window); and the architectures that bypass the attention interface.

Tiny configs built from transformers' config classes (no network). At alpha = 1 the entmax integration
equals eager attention (with padding); ``generate`` with a KV cache equals recomputation at alpha = 1.5;
the variants reach ``entmax_attention`` as arguments (never as a materialized mask) and change its result;
the padding-only mask route equals transformers' materialized masks; non-routing architectures raise.
transformers 5.23 has no ALiBi model that uses the attention interface (BLOOM, Falcon, MPT build their own
attention), so ``alibi_slopes`` is checked at the attention function.
"""

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import EXACT, TOL  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    BertConfig,
    BertModel,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    ModernBertConfig,
    ModernBertModel,
    T5Config,
    T5Model,
)
from transformers.masking_utils import (  # noqa: E402
    AttentionMaskInterface,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    or_masks,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from variants import ROWS, Problem, build  # noqa: E402

import sparse_attn.integrations.hf as entmax_hf  # noqa: E402
from sparse_attn.attention import run_attention  # noqa: E402
from sparse_attn.attn.attn_inputs import prepare_attention  # noqa: E402
from sparse_attn.reference import reference_forward  # noqa: E402
from sparse_attn.sdpa import swap_sdpa_attention  # noqa: E402

V = 64
DECODER = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)
ARCHS = {
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, dict(DECODER, num_local_experts=4, num_experts_per_tok=2,
                                                       sliding_window=4,
                                                       layer_types=["sliding_attention", "full_attention"])),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(DECODER, sliding_window=4, attn_logit_softcapping=1.0,
                                                     final_logit_softcapping=None)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(DECODER, sliding_window=4)),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=8)),
    "modernbert": (ModernBertConfig, ModernBertModel, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        local_attention=4, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2)),
}
DECODERS = ["gpt_oss", "gemma2", "mistral", "deepseek_v3"]


def _pair(name, implementation="entmax", alpha=1.0):
    """(eager model, model with ``implementation``), same weights, eval mode; gpt-oss sinks made large."""
    cfg_cls, model_cls, kwargs = ARCHS[name]
    torch.manual_seed(0)
    eager = model_cls._from_config(cfg_cls(**kwargs), attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in eager.model.layers if name in ("gpt_oss", "gemma2") else ():
            if name == "gpt_oss":
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * 2)
            else:
                layer.self_attn.q_proj.weight.mul_(30)  # scores large enough for the cap (1.0) to bind
    other = model_cls._from_config(copy.deepcopy(eager.config), attn_implementation=implementation).eval()
    other.load_state_dict(eager.state_dict())
    other.config.entmax_alpha = alpha
    return eager, other


def _inputs(n=10, pad=3):
    ids = torch.randint(3, V, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0  # left padding, as for generation
    return ids, mask


def _out(model, ids, mask):
    res = model(ids, attention_mask=mask)
    return res.logits if hasattr(res, "logits") else res.last_hidden_state


@pytest.fixture
def recorded(monkeypatch):
    """Every AttentionInputs the integration builds, in call order."""
    calls = []
    real = entmax_hf.prepare_attention

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(entmax_hf, "prepare_attention", spy)
    return calls


@pytest.mark.parametrize("name", list(ARCHS))
def test_alpha_one_equals_eager_attention(name):
    eager, ent = _pair(name)
    ids, mask = _inputs()
    with torch.no_grad():
        for m in (None, mask):
            valid = torch.ones(2, 10, dtype=torch.bool) if m is None else m.bool()
            torch.testing.assert_close(_out(ent, ids, m)[valid], _out(eager, ids, m)[valid], **TOL["same_model_f32"])


# per architecture: what the variant layers must receive, and the variant whose removal must change the result
EXPECTED = {
    "gpt_oss": ([dict(window_size=(3, 0), sinks=True), dict(window_size=None, sinks=True)],
                ["window_size", "sinks"]),
    "gemma2": ([dict(window_size=(3, 0), softcap=1.0), dict(window_size=None, softcap=1.0)],
               ["window_size", "softcap"]),
    "mistral": ([dict(window_size=(3, 0)), dict(window_size=(3, 0))], ["window_size"]),
    "deepseek_v3": ([dict(dv=8), dict(dv=8)], []),
    "modernbert": ([dict(window_size=None), dict(window_size=(2, 2)), dict(window_size=(2, 2))], ["window_size"]),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_variants_reach_entmax_attention_as_arguments(name, recorded):
    """Windows, sinks, softcap and Dv arrive as arguments; masks are None or padding-only (B, 1, 1, Nk); and
    dropping each variant from the recorded call changes the output (the configurations exercise them)."""
    _, ent = _pair(name, alpha=1.5)
    ids, mask = _inputs()
    per_layer, essential = EXPECTED[name]
    for m in (None, mask):
        recorded.clear()
        with torch.no_grad():
            _out(ent, ids, m)
        assert len(recorded) == len(per_layer)
        for inputs, want in zip(recorded, per_layer):
            assert inputs.window_size == want.get("window_size")
            assert (inputs.sinks is not None) == want.get("sinks", False)
            assert inputs.softcap == want.get("softcap")
            assert inputs.v.shape[-1] == want.get("dv", inputs.q.shape[-1])
            assert inputs.mask is None if m is None else tuple(inputs.mask.shape) == (2, 1, 1, 10)
            assert inputs.is_causal == (name != "modernbert")
    for inputs in recorded:
        full = reference_forward(inputs).out
        for field in essential:
            if getattr(inputs, field) is not None:
                assert not torch.allclose(reference_forward(dataclasses.replace(inputs, **{field: None})).out, full,
                                          atol=TOL["changed"])


@pytest.mark.parametrize("name", DECODERS)
def test_generate_with_a_kv_cache_equals_recomputation(name, recorded):
    """Greedy decoding past the sliding window, left-padded, at alpha = 1.5: the logits of every cached step
    equal a full forward over the final sequence; at alpha = 1 the tokens are eager's."""
    eager, ent = _pair(name, alpha=1.5)
    ids, mask = _inputs(n=7, pad=2)
    with torch.no_grad():
        res = ent.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, pad_token_id=0)
        seq = res.sequences
        full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - 7, dtype=mask.dtype)], dim=1)
        full = ent(seq, attention_mask=full_mask).logits
        for step, logits in enumerate(res.logits):
            torch.testing.assert_close(logits, full[:, 6 + step], **TOL["same_model_f32"])
        if name in ("mistral", "gpt_oss", "gemma2"):
            decode_steps = [i for i in recorded if i.q.shape[2] == 1 and i.window_size is not None]
            assert decode_steps and all(i.mask is None or i.mask.dim() == 4 and i.mask.shape[2] == 1
                                        for i in decode_steps)
        ent.config.entmax_alpha = 1.0
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(ent.generate(ids, **kw), eager.generate(ids, **kw), **EXACT)


@pytest.fixture(scope="module")
def materialized():
    """The entmax attention function with transformers' own materialized masks (the previous route)."""
    transformers.AttentionInterface.register("entmax_materialized_test", entmax_hf.entmax_attention_forward)
    AttentionMaskInterface.register("entmax_materialized_test", sdpa_mask)
    return "entmax_materialized_test"


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "mistral", "modernbert"])
def test_padding_only_masks_equal_materialized_masks_for_entmax(name, materialized):
    _, ent = _pair(name, alpha=1.5)
    _, mat = _pair(name, implementation=materialized, alpha=1.5)
    ids, mask = _inputs()
    with torch.no_grad():
        valid = mask.bool()
        torch.testing.assert_close(_out(ent, ids, mask)[valid], _out(mat, ids, mask)[valid], **TOL["same_model_f32"])


def _mask(**kwargs):
    args = dict(batch_size=2, q_length=4, kv_length=4, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                attention_mask=None, local_size=None, allow_is_causal_skip=True)
    args.update(kwargs)
    return entmax_hf.entmax_mask(**args)


def test_mask_builder_returns_padding_only_for_plain_patterns_and_materializes_the_rest():
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    sliding = sliding_window_causal_mask_function(3)
    assert _mask() is None
    assert _mask(q_length=1, kv_length=5, q_offset=4) is None
    assert _mask(q_length=2, kv_length=6, q_offset=4).tolist() == [[True] * 6] * 2  # aligned, chunked prefill
    assert torch.equal(_mask(q_length=2, kv_length=6, q_offset=4, attention_mask=pad), pad)
    assert torch.equal(_mask(kv_length=4, kv_offset=2, q_offset=2, mask_function=sliding, local_size=3,
                             attention_mask=pad), pad[:, 2:])
    for materialize in (dict(kv_length=8, q_offset=2, q_length=1, allow_is_causal_skip=False),  # static cache
                        dict(mask_function=sliding, local_size=4, kv_length=6, q_offset=2),  # window mismatch
                        dict(mask_function=chunked_causal_mask_function(2, torch.zeros(2, dtype=torch.long)),
                             local_size=2, attention_mask=pad[:, :4]),
                        dict(mask_function=and_masks(causal_mask_function, sliding), attention_mask=pad[:, :4]),
                        dict(mask_function=or_masks(causal_mask_function, bidirectional_mask_function),
                             attention_mask=pad[:, :4]),
                        dict(allow_is_causal_skip=False, attention_mask=pad[:, 2:])):
        out = _mask(**materialize)
        assert out is not None and out.dim() == 4, materialize
    assert _mask(mask_function=bidirectional_mask_function, allow_is_bidirectional_skip=True) is None
    assert torch.equal(_mask(mask_function=bidirectional_mask_function, allow_is_bidirectional_skip=True,
                             attention_mask=pad[:, :4], q_length=2), pad[:, :4])


def _llama_attention(head_dim=16, backend=None):
    config = LlamaConfig(vocab_size=V, hidden_size=4 * head_dim, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    model = LlamaForCausalLM._from_config(config, attn_implementation="entmax")
    model.config.entmax_backend = backend
    return model.model.layers[0].self_attn


def _qkv(n=6, dv=16):
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, 4, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g), torch.randn(2, 2, n, dv,
                                                                                                     generator=g)


def test_alibi_slopes_and_window_kwargs_at_the_attention_function():
    """A model passing ``alibi_slopes`` gets flash-attn's bias; ``sliding_window`` W is the window (W - 1, 0)."""
    attn = _llama_attention()
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    dist = (torch.arange(6)[None, :] - torch.arange(6)[:, None]).abs()
    bias = -slopes[:, None, None] * dist
    out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, None, alibi_slopes=slopes)
    ref, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, None, position_bias=bias[None])
    torch.testing.assert_close(out, ref)
    window = torch.tril(torch.ones(6, 6, dtype=torch.bool)) & ~torch.tril(torch.ones(6, 6, dtype=torch.bool), -3)
    out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, None, sliding_window=3)
    ref, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, window[None, None])
    torch.testing.assert_close(out, ref)
    # a complete 4-d mask is taken as it is: the window kwarg does not apply on top of it
    full = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, full, sliding_window=3)
    torch.testing.assert_close(out, entmax_hf.entmax_attention_forward(attn, q, k, v, full)[0])


# How the Hugging Face attention function spells each variant of the test table (tests/variants.py), from the
# table's keywords: ``(function keywords, the entmax_attention keywords they stand for)``; the function applies the
# layer's causal masking without a 4-d mask only, and a sliding window W is (W - 1, 0) on a causal layer.
HF_SPELLING = {
    "bool_mask": lambda kw: (dict(attention_mask=kw["attn_mask"]), dict(attn_mask=kw["attn_mask"], is_causal=False)),
    "float_mask": lambda kw: (dict(position_bias=kw["attn_mask"]), dict(attn_mask=kw["attn_mask"], is_causal=True)),
    "causal": lambda kw: (dict(is_causal=True), dict(is_causal=True)),
    "window": lambda kw: (dict(sliding_window=kw["window_size"][0] + 1, is_causal=True),
                          dict(window_size=(kw["window_size"][0], 0), is_causal=True)),
    "alibi": lambda kw: (dict(alibi_slopes=kw["alibi_slopes"]), dict(alibi_slopes=kw["alibi_slopes"])),
    "sinks": lambda kw: (dict(s_aux=kw["sinks"]), dict(sinks=kw["sinks"])),
    "softcap": lambda kw: (dict(softcap=kw["softcap"]), dict(softcap=kw["softcap"])),
    "gqa": lambda kw: ({}, dict(enable_gqa=True)),
    "dv": lambda kw: ({}, {}),
    "block_mask": lambda kw: (dict(block_mask=kw["block_mask"]), dict(block_mask=kw["block_mask"])),
}
# variants the attention function is not compared on here, each with its reason
HF_NOT_SPELLED = {
    "varlen": "the function takes no cu_seqlens: transformers' packed sequences reach it as a materialized 4-d mask",
    "dropout": "random weights: no result to compare with (the function passes dropout on as dropout_p)",
    "mask_grad": "a gradient row: the same call under autograd", "alibi_grad": "a gradient row",
    "grad": "a gradient row",
}


def test_every_variant_is_spelled_or_named():
    assert set(HF_SPELLING) | set(HF_NOT_SPELLED) == set(ROWS) and not set(HF_SPELLING) & set(HF_NOT_SPELLED)


@pytest.mark.parametrize("name", list(HF_SPELLING))
def test_each_variant_through_the_attention_function(name, recorded):
    """Each variant of the test table, in the attention function's own spelling (on a Llama layer: 4 query heads,
    2 kv heads, causal), reaches ``entmax_attention`` as that variant and gives its result."""
    attn = _llama_attention()
    q, k, v, kw = build({name, "gqa"}, Problem(b=2, hq=4, nq=6, nk=6, d=16, dtype=torch.float32, seed=3))
    hf_kw, lib_kw = {}, {}
    for n in {name, "gqa"}:
        h, lib = HF_SPELLING[n](kw)
        hf_kw.update(h)
        lib_kw.update(lib)
    mask = hf_kw.pop("attention_mask", None)
    lib_kw.setdefault("is_causal", True)
    with torch.no_grad():
        out = entmax_hf.entmax_attention_forward(attn, q, k, v, mask, **hf_kw)[0]
    spec = recorded[-1]
    want = prepare_attention(q, k, v, spec.alpha, scale=spec.scale, **lib_kw)
    assert name in spec.used() and spec.used() == want.used()
    torch.testing.assert_close(out.transpose(1, 2), run_attention(want), **EXACT)


# (kwargs of entmax_attention_forward, error, message)
HF_BAD = [
    (dict(sliding_window=0), ValueError, "sliding_window must be None or a positive int"),
    (dict(sliding_window="4"), ValueError, "sliding_window must be None or a positive int"),
    (dict(attention_mask=torch.ones(2, 6)), ValueError, "a 2-d attention_mask must be a boolean padding mask"),
    (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"\(batch, seq_k\) = \(2, 6\)"),
    (dict(s_aux=torch.zeros(2)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(softcap=-1.0), ValueError, "softcap must be None, 0 .off. or a finite positive number"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(4,\)"),
]


@pytest.mark.parametrize("row", range(len(HF_BAD)))
def test_bad_variant_arguments_raise_clear_errors(row):
    kwargs, err, match = HF_BAD[row]
    kwargs = dict(kwargs)
    mask = kwargs.pop("attention_mask", None)
    with pytest.raises(err, match=match):
        entmax_hf.entmax_attention_forward(_llama_attention(), *_qkv(), mask, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(dv=8)])
def test_fused_backend_refuses_variants_and_names_the_config_remedy(kwargs):
    kwargs = dict(kwargs)
    q, k, v = _qkv(dv=kwargs.pop("dv", 16))
    with pytest.raises(ValueError, match="not supported by the fused Triton kernels yet.*config.entmax_backend"):
        entmax_hf.entmax_attention_forward(_llama_attention(backend="triton"), q, k, v, None, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(sliding_window=5), dict(softcap=2.0), dict(sliding_window=7, softcap=1.5),
                                    dict(dv=24), dict(s_aux=torch.tensor([1.5, -0.5, 0.0, 3.0])),
                                    dict(sliding_window=4, s_aux=torch.tensor([0.5, 2.0, -1.0, 1.0]))])
def test_fused_backend_runs_windows_and_softcap_in_the_kernels(kwargs):
    """``sliding_window`` (as ``window_size``, no mask tensor), Gemma-2's ``softcap``, gpt-oss's sinks (``s_aux``)
    and a value head dim other than the query's (DeepSeek-V3) reach the kernels and match the reference."""
    kwargs = dict(kwargs)
    q, k, v = _qkv(n=40, dv=kwargs.pop("dv", 16))
    out = entmax_hf.entmax_attention_forward(_llama_attention(backend="triton"), q, k, v, None, is_causal=True,
                                             **kwargs)[0]
    ref = entmax_hf.entmax_attention_forward(_llama_attention(backend="reference"), q.double(), k.double(),
                                             v.double(), None, is_causal=True, **kwargs)[0]
    tol = TOL["fused_vs_reference_f32"]["out"]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# Architectures that did not route their attention through the interface in some transformers release (GPT-J and
# CodeGen moved to it in 5.x); which of them refuse entmax is asked of the installed transformers, not listed here.
ARCHITECTURES = {
    "falcon": dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, alibi=True),
    "gptj": dict(vocab_size=V, n_embd=32, n_layer=1, n_head=2, rotary_dim=8),
    "gpt_neo": dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2,
                    attention_types=[[["global", "local"], 1]]),
    "bloom": dict(vocab_size=V, hidden_size=32, n_layer=1, n_head=2),
    "mpt": dict(vocab_size=V, d_model=32, n_layers=1, n_heads=2),
    "codegen": dict(vocab_size=V, n_embd=32, n_layer=1, n_head=2, rotary_dim=8),
    "xglm": dict(vocab_size=V, d_model=32, num_layers=1, attention_heads=2, ffn_dim=64),
    "deberta-v2": dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
    "mpnet": dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
}


def _declares_the_interface(model_cls: type) -> bool:
    """transformers' own declaration that a model class dispatches through ``AttentionInterface``."""
    return bool(getattr(model_cls, "_supports_attention_backend", False))


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_entmax_is_refused_exactly_by_architectures_without_the_attention_interface(model_type):
    """Where the installed transformers routes an architecture through the interface, entmax loads and really runs
    (its outputs differ from softmax's); where it does not, loading with entmax raises."""
    config = AutoConfig.for_model(model_type, **ARCHITECTURES[model_type])
    eager = AutoModel.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    routes = entmax_hf.routes_attention(type(eager))
    if _declares_the_interface(type(eager)):
        assert routes, f"{type(eager).__name__} declares the attention interface but routes_attention says no"
    if not routes:
        with pytest.raises(ValueError, match=r"\w+Model \(model_type '[\w-]+'\) does not run its attention "
                                             r"through transformers' AttentionInterface.*use an architecture"):
            AutoModel.from_config(config, attn_implementation="entmax")
        return
    with torch.no_grad():  # unit-scale scores: the default init gives near-uniform ones (entmax = softmax there)
        gen = torch.Generator().manual_seed(1)
        for p in eager.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    # its own config: the models share theirs, and building with entmax sets its _attn_implementation
    model = AutoModel.from_config(copy.deepcopy(config), attn_implementation="entmax").eval()
    model.load_state_dict(eager.state_dict())
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        soft, sparse = eager(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state
    assert torch.isfinite(sparse).all()
    changed = not torch.allclose(soft, sparse, atol=TOL["changed"])
    assert changed, f"{model_type}: entmax attention did not change the output"


def test_some_installed_architectures_still_refuse_entmax():
    """The refusal path stays exercised: BLOOM has no attention interface in any tested transformers release."""
    config = AutoConfig.for_model("bloom", **ARCHITECTURES["bloom"])
    assert not entmax_hf.routes_attention(type(AutoModel.from_config(config, attn_implementation="eager")))


def test_loading_a_checkpoint_of_a_non_routing_architecture_refuses_entmax(tmp_path):
    config = AutoConfig.for_model("bloom", **ARCHITECTURES["bloom"])
    AutoModel.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomModel .* does not run its attention through"):
        AutoModel.from_pretrained(tmp_path, attn_implementation="entmax")


def test_routing_architectures_still_load():
    """Including T5, whose class does not declare _supports_attention_backend but calls the interface."""
    for cfg in (LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2),
                BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32),
                T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=32, num_layers=1, num_heads=2)):
        model = {LlamaConfig: LlamaForCausalLM, BertConfig: BertModel, T5Config: T5Model}[type(cfg)]
        assert model._from_config(cfg, attn_implementation="entmax").config._attn_implementation == "entmax"


@pytest.mark.parametrize("alibi", [False, True])
def test_falcon_runs_entmax_through_its_sdpa_calls(alibi):
    """The remedy the refusal names for Falcon: attn_implementation='sdpa' plus swap_sdpa_attention (ALiBi and
    causality reach entmax through SDPA's float mask); at alpha = 1 the same as Falcon's SDPA path."""
    config = FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=alibi,
                          new_decoder_architecture=False, multi_query=True)
    with pytest.raises(ValueError, match="FalconForCausalLM .*swap_sdpa_attention"):
        FalconForCausalLM._from_config(config, attn_implementation="entmax")
    torch.manual_seed(0)
    plain = FalconForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    swapped = copy.deepcopy(plain)
    names = swap_sdpa_attention(swapped, alpha=1.0)
    assert names == ["transformer.h.0.self_attention", "transformer.h.1.self_attention"]
    ids, mask = _inputs(n=8, pad=2)
    with torch.no_grad():
        torch.testing.assert_close(swapped(ids, attention_mask=mask).logits[mask.bool()],
                                   plain(ids, attention_mask=mask).logits[mask.bool()], **TOL["same_model_f32"])
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(swapped.generate(ids, **kw), plain.generate(ids, **kw), **EXACT)


def test_sliding_window_model_compiles_with_fullgraph():
    """While torch.compile traces, the mask builder hands over transformers' materialized masks (it does not
    read function closures then); the result equals the eager padding-only route. ``aot_eager``, as the other CPU
    compile tests: the whole graph is traced (Dynamo, then AOTAutograd on fake tensors) without Inductor's C++ build
    of a model, which tests nothing of ours."""
    _, ent = _pair("mistral", alpha=1.5)
    ids, mask = _inputs()
    with torch.no_grad():
        expected = _out(ent, ids, mask)
        compiled = torch.compile(ent, fullgraph=True, backend="aot_eager")(ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled[mask.bool()], expected[mask.bool()], **TOL["same_model_f32"])
