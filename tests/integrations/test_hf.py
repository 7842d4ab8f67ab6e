"""Hugging Face integration: tiny Llama-style (causal, GQA, padding, KV cache) and BERT-style models from configs."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import EXACT, F32, F64, TOL, OpLog, host_reads_outside, qkv  # noqa: E402
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import sparse_attn.integrations.hf as entmax_hf  # noqa: E402
import sparse_attn.reference as reference_mod  # noqa: E402
from sparse_attn.modules import EntmaxAlpha  # noqa: E402
from sparse_attn.stats import record_head_stats  # noqa: E402

H, H_KV = 4, 2


def _llama_config(**overrides):
    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
              num_key_value_heads=H_KV, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaConfig(**{**kw, **overrides})


def _sharpen(model):
    """Larger query/key weights than the default init, so that entmax weights are actually sparse."""
    torch.manual_seed(11)
    for name, p in model.named_parameters():
        if any(s in name for s in ("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
            torch.nn.init.normal_(p, std=0.5)


def _pair(model_cls, config, **kw):
    """(eager model, entmax model) with the same weights; configs are copied so they do not share state."""
    torch.manual_seed(0)
    eager = model_cls._from_config(copy.deepcopy(config), attn_implementation="eager", **kw).eval()
    _sharpen(eager)
    ent = model_cls._from_config(copy.deepcopy(config), attn_implementation="entmax", **kw).eval()
    ent.load_state_dict(eager.state_dict())
    return eager, ent


def _ids_and_padding():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def test_registration():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert "entmax" in AttentionInterface._global_mapping
    assert "entmax" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        entmax_hf.register_entmax_attention("")


def test_llama_alpha_one_matches_eager_with_gqa_and_padding():
    eager, ent = _pair(LlamaForCausalLM, _llama_config())
    assert ent.config._attn_implementation == "entmax"
    names = entmax_hf.attach_entmax_alpha(ent, alpha=1.0, learnable=False)
    assert names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    ids, mask = _ids_and_padding()
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, output_attentions=True)
        out = ent(ids, attention_mask=mask, output_attentions=True)
    valid = mask.bool()
    torch.testing.assert_close(out.logits[valid], ref.logits[valid], **TOL["same_model_f32"])
    for a_ref, a in zip(ref.attentions, out.attentions):
        torch.testing.assert_close(a[0], a_ref[0], **TOL["same_model_f32"])
        torch.testing.assert_close(a[1][:, 3:], a_ref[1][:, 3:], **TOL["same_model_f32"])
    with torch.no_grad():
        torch.testing.assert_close(ent(ids).logits, eager(ids).logits, **TOL["same_model_f32"])


def test_llama_sparse_cache_consistency_and_generate():
    _, ent = _pair(LlamaForCausalLM, _llama_config())
    entmax_hf.attach_entmax_alpha(ent, alpha=[1.3, 1.5, 1.8, 1.95], learnable=True)
    ids, mask = _ids_and_padding()
    with torch.no_grad():
        full = ent(ids, attention_mask=mask, output_attentions=True)
        pre = ent(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        step = ent(ids[:, 6:], attention_mask=mask, past_key_values=pre.past_key_values, use_cache=True)
    assert any((a[mask.bool()[:, None, :, None].expand_as(a)] == 0).any() for a in full.attentions)
    valid = mask.bool()[:, 6:]
    torch.testing.assert_close(step.logits[valid], full.logits[:, 6:][valid], **TOL["same_model_f32"])

    gen = ent.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True)
    assert gen.shape == (2, 13)
    seq, m = ids, mask
    with torch.no_grad():
        for _ in range(4):
            nxt = ent(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            m = torch.cat([m, torch.ones_like(nxt)], dim=1)
    assert torch.equal(gen, seq)
    static = ent.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(static, gen)
    no_pad = ent.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(ent.generate(ids[:1], max_new_tokens=3, do_sample=False, cache_implementation="static"), no_pad)


def test_llama_learnable_alpha_trains_saves_and_reloads(tmp_path):
    _, ent = _pair(LlamaForCausalLM, _llama_config())
    ent.train()
    entmax_hf.attach_entmax_alpha(ent, alpha=1.5, learnable=True)
    holders = [m.entmax_alpha for m in ent.modules() if isinstance(getattr(m, "entmax_alpha", None), EntmaxAlpha)]
    assert len(holders) == 2
    logits = [n for n, _ in ent.named_parameters() if n.endswith("entmax_alpha.alpha_logit")]
    assert len(logits) == 2
    ids, mask = _ids_and_padding()
    loss = ent(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    for h in holders:
        assert h.alpha_logit.grad is not None and h.alpha_logit.grad.abs().sum() > 0
    with torch.no_grad():
        for i, h in enumerate(holders):
            h.alpha_logit.copy_(torch.linspace(-1.0, 1.0, H) * (i + 1))
    ent.eval()
    ent.save_pretrained(tmp_path)
    loaded = entmax_hf.from_pretrained(LlamaForCausalLM, str(tmp_path))
    assert loaded.config._attn_implementation == "entmax"
    for name, p in ent.named_parameters():
        torch.testing.assert_close(dict(loaded.named_parameters())[name], p)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, ent(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="local directory"):
        entmax_hf.from_pretrained(LlamaForCausalLM, str(tmp_path / "missing"))


ATTACH_OPTIONS = [
    dict(alpha=1.0, learnable=True, alpha_init=1.3),
    dict(alpha=[1.2, 1.4, 1.6, 1.8], learnable=True, alpha_min=1.1, alpha_max=1.9,
         alpha_init=torch.tensor([1.15, 1.3, 1.5, 1.85])),
    dict(alpha=torch.tensor([1.0, 1.25, 1.5, 2.0]), learnable=False),
    dict(alpha=1.7, learnable=False, alpha_min=1.2),
]


@pytest.mark.parametrize("options", range(len(ATTACH_OPTIONS)))
def test_save_and_reload_round_trip_every_attach_option(tmp_path, options):
    kw = ATTACH_OPTIONS[options]
    _, ent = _pair(LlamaForCausalLM, _llama_config(num_hidden_layers=1))
    entmax_hf.attach_entmax_alpha(ent, **kw)
    holder = ent.model.layers[0].self_attn.entmax_alpha
    if kw["learnable"]:
        with torch.no_grad():
            holder.alpha_logit.add_(torch.linspace(-0.5, 0.5, H))
    ent.save_pretrained(tmp_path)
    loaded = entmax_hf.from_pretrained(LlamaForCausalLM, str(tmp_path))
    assert loaded.config.entmax == ent.config.entmax
    loaded_holder = loaded.model.layers[0].self_attn.entmax_alpha
    assert loaded_holder.learnable_alpha == kw["learnable"]
    assert (loaded_holder.alpha_min, loaded_holder.alpha_max) == (holder.alpha_min, holder.alpha_max)
    assert torch.equal(loaded_holder.alpha, holder.alpha)
    ids, mask = _ids_and_padding()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, ent(ids, attention_mask=mask).logits,
                                   **EXACT)


def test_record_stats_without_attached_alpha():
    """A model loaded with attn_implementation='entmax' alone is recorded with config.entmax_alpha."""
    config = _llama_config(num_hidden_layers=1)
    eager, ent = _pair(LlamaForCausalLM, config)
    ent.config.entmax_alpha = 1.6
    ids = _ids_and_padding()[0]
    with record_head_stats(ent) as rec, torch.no_grad():
        ent(ids)
    with torch.no_grad():
        weights = ent(ids, output_attentions=True).attentions[0]
    assert rec.layer_names == ["model.layers.0.self_attn"]
    n_valid = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)
    expected = ((weights > 0).sum(-1).double() / n_valid).mean((0, 2))
    torch.testing.assert_close(rec.density()[0], expected, atol=TOL["same_values"][F64], rtol=0)
    assert (rec.density() < 1).any()
    torch.testing.assert_close(rec.alphas(), torch.full((1, H), 1.6, dtype=torch.float64))
    assert "1.600" in rec.table()

    no_layer = r"LlamaForCausalLM contains no entmax attention layer.*attn_implementation='entmax'"
    with pytest.raises(ValueError, match=no_layer):
        record_head_stats(eager)
    entmax_hf.attach_entmax_alpha(eager, alpha=1.5)
    with pytest.raises(ValueError, match="no entmax attention layer"):
        record_head_stats(eager)
    eager.set_attn_implementation("entmax")
    with record_head_stats(eager) as rec, torch.no_grad():
        eager(ids)
    assert torch.isfinite(rec.density()).all()
    torch.testing.assert_close(rec.alphas(), torch.full((1, H), 1.5, dtype=torch.float64))


def test_attention_forward_adds_no_host_sync(monkeypatch):
    """Learnable alphas add no host read to the attention call (outside the row mapping's own checks)."""
    _, ent = _pair(LlamaForCausalLM, _llama_config(num_hidden_layers=1))
    entmax_hf.attach_entmax_alpha(ent, alpha=[1.3, 1.5, 1.8, 1.95], learnable=True)
    attn = ent.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, H, 5, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, H_KV, 5, 16, generator=g, requires_grad=True) for _ in range(2))
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    keep[1, ..., :2] = False

    def step():
        for mask in (None, keep):
            out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, mask, is_causal=True)
            out.sum().backward()

    assert host_reads_outside(monkeypatch, reference_mod, "entmax", step) == []
    with record_head_stats(ent):
        assert host_reads_outside(monkeypatch, reference_mod, "entmax", step) == []
    assert attn.entmax_alpha.alpha_logit.grad.abs().sum() > 0


def _bert_config():
    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, intermediate_size=48,
                      max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_bert_alpha_one_matches_eager_and_sparse_stats():
    eager, ent = _pair(BertModel, _bert_config(), add_pooling_layer=False)
    ids, mask = _ids_and_padding()
    entmax_hf.attach_entmax_alpha(ent, alpha=1.0, learnable=False)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).last_hidden_state
        out = ent(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], **TOL["same_model_f32"])
    entmax_hf.attach_entmax_alpha(ent, alpha=torch.tensor([1.25, 1.5, 1.75, 1.9]), learnable=True)
    with record_head_stats(ent) as rec, torch.no_grad():
        ent(ids, attention_mask=mask)
    with torch.no_grad():
        attn = ent(ids, attention_mask=mask, output_attentions=True).attentions
    keys = mask.bool()[:, None, None, :]
    for layer, a in enumerate(attn):
        assert (a[~keys.expand_as(a)] == 0).all()
        expected = ((a > 0).sum(-1).double() / keys.sum(-1).double()).mean((0, 2))
        torch.testing.assert_close(rec.density()[layer], expected, atol=TOL["same_values"][F64], rtol=0)
    assert (rec.density() < 1).any()
    expected = torch.tensor([1.25, 1.5, 1.75, 1.9], dtype=torch.float64)
    torch.testing.assert_close(rec.alphas()[0], expected, atol=TOL["same_values"][F32], rtol=0)


def _attn_module(**config):
    model = LlamaForCausalLM._from_config(_llama_config(num_hidden_layers=1, **config), attn_implementation="entmax")
    return model, model.model.layers[0].self_attn


def _qkv(device="cpu"):
    return qkv(b=2, hq=H, hk=H_KV, nq=5, nk=5, d=16, dtype=torch.float32, seed=6, device=device)


_NAN_MASK = torch.zeros(2, 1, 5, 5).index_fill(3, torch.tensor([1]), float("nan"))
# (function, arguments, error, message); "forward" = entmax_attention_forward(attention module, q, k, v, mask, ...).
HF_BAD = [
    ("forward", dict(query="q"), ValueError, "query must be a tensor of shape"),
    ("forward", dict(key=torch.zeros(2, 5, 16)), ValueError, "key must be a tensor of shape"),
    ("forward", dict(dropout=1.0), ValueError, "dropout must be finite and in"),
    ("forward", dict(scaling=float("nan")), ValueError, "scale must be None or a finite number"),
    ("forward", dict(attention_mask=torch.zeros(2, 1, 5, 4, dtype=torch.bool)), ValueError,
     "attention_mask must be broadcastable"),
    ("forward", dict(attention_mask=torch.zeros(2, 1, 5, 5, dtype=torch.int64)), TypeError,
     "attention_mask must be boolean"),
    ("forward", dict(attention_mask=torch.zeros(2, 1, 5, 5, device="meta")), ValueError,
     "attention_mask must be on the device"),
    ("forward", dict(position_bias=torch.zeros(1, H, 5, 5, dtype=torch.bool)), TypeError,
     "position_bias must be a floating"),
    ("forward", dict(position_bias=torch.zeros(1, 3, 5, 5)), ValueError, "position_bias must be broadcastable"),
    ("forward", dict(entmax_alpha=2.5), ValueError, r"alpha must be finite and in \[1, 2\]"),
    ("forward", dict(entmax_backend="cuda"), ValueError, "backend must be one of"),
    ("forward_triton", dict(output_attentions=True), ValueError,
     "entmax_backend='triton' cannot run.*output_attentions=True.*'auto' or 'reference'"),
    ("attach", dict(model=torch.nn.Linear(2, 2)), ValueError, "no attention module"),
    ("attach", dict(alpha=2.0, learnable=True), ValueError, "strictly between"),
    ("attach", dict(alpha=[1.5, 1.5]), ValueError, "alpha must be a float or a tensor of shape"),
    ("attach", dict(alpha=0.5, learnable=False), ValueError, "alpha must be finite and in"),
    ("attach", dict(learnable="no"), TypeError, "learnable must be a bool"),
    ("attach", dict(learnable=True, learnable_alpha=True), TypeError, "got both"),
    ("attention_modules", dict(model=None), TypeError, "model must be an nn.Module"),
    ("register", dict(name=""), ValueError, "name must be a non-empty string"),
    ("from_pretrained", dict(path="/nonexistent/dir"), ValueError, "local directory"),
]


@pytest.mark.parametrize("row", range(len(HF_BAD)))
def test_bad_arguments_raise_clear_errors(row, kernel_device):
    kind, kwargs, err, match = HF_BAD[row]
    kwargs = dict(kwargs)
    if kind.startswith("forward"):
        fused = kind == "forward_triton"
        model, attn = _attn_module(head_dim=16) if fused else _attn_module()
        model.config.entmax_backend = "triton" if fused else kwargs.pop("entmax_backend", None)
        if "entmax_alpha" in kwargs:
            model.config.entmax_alpha = kwargs.pop("entmax_alpha")
        device = kernel_device if fused else "cpu"
        q, k, v = _qkv(device=device)
        args = [kwargs.pop(name, t) for name, t in (("query", q), ("key", k), ("value", v))]
        mask = kwargs.pop("attention_mask", None)
        mask = mask.to(device) if isinstance(mask, torch.Tensor) and mask.device.type != "meta" else mask
        kwargs = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
        call = lambda: entmax_hf.entmax_attention_forward(attn, *args, mask, is_causal=False, **kwargs)  # noqa: E731
    elif kind == "attach":
        model = kwargs.pop("model", None) or _attn_module()[0]
        call = lambda: entmax_hf.attach_entmax_alpha(model, **kwargs)  # noqa: E731
    elif kind == "attention_modules":
        call = lambda: entmax_hf.attention_modules(kwargs["model"])  # noqa: E731
    elif kind == "register":
        call = lambda: entmax_hf.register_entmax_attention(kwargs["name"])  # noqa: E731
    else:
        call = lambda: entmax_hf.from_pretrained(LlamaForCausalLM, kwargs["path"])  # noqa: E731
    with pytest.raises(err, match=match):
        call()


def test_attach_learnable_alias_and_default():
    model, attn = _attn_module()
    entmax_hf.attach_entmax_alpha(model)
    assert attn.entmax_alpha.learnable_alpha
    with pytest.warns(DeprecationWarning, match="learnable_alpha= is deprecated"):
        entmax_hf.attach_entmax_alpha(model, learnable_alpha=False)
    assert not attn.entmax_alpha.learnable_alpha and model.config.entmax["learnable"] is False


def test_nan_attention_mask_gives_nan_rows_on_the_reference():
    _, attn = _attn_module()
    q, k, v = _qkv()
    for output_attentions in (False, True):
        out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, _NAN_MASK, output_attentions=output_attentions)
        assert torch.isnan(out).all()  # every row of every head sees key 1
        mask = _NAN_MASK.clone()
        mask[0] = 0.0
        out, _ = entmax_hf.entmax_attention_forward(attn, q, k, v, mask, output_attentions=output_attentions)
        assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_llama_fused_backend_matches_reference(kernel_device):
    """The fused custom ops through the attention interface: padded forward and backward (GQA, learnable
    per-head alpha), a mask-free causal forward and one cached decoding step, against the reference backend.
    One layer, two heads sharing one key/value head, one sequence: a few kernel launches under the interpreter."""
    config = _llama_config(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1)
    _, ent = _pair(LlamaForCausalLM, config)
    ent.to(kernel_device)
    entmax_hf.attach_entmax_alpha(ent, alpha=[1.3, 1.8], learnable=True)
    ids, mask = (t[1:].to(kernel_device) for t in _ids_and_padding())
    valid = mask.bool()
    params = [ent.model.layers[0].self_attn.q_proj.weight, ent.model.layers[0].self_attn.entmax_alpha.alpha_logit]
    results = {}
    for backend in ("reference", "triton"):
        ent.config.entmax_backend = backend
        ent.zero_grad()
        log = OpLog()
        with log:
            logits = ent(ids, attention_mask=mask).logits
            logits[valid].square().sum().backward()
        with torch.no_grad():
            plain = ent(ids[:, 3:]).logits
            pre = ent(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
            step = ent(ids[:, -1:], attention_mask=mask, past_key_values=pre.past_key_values, use_cache=True).logits
        fused_ops = {op for op in log.ops if op.startswith("sparse_attn::")}
        expected = {"sparse_attn::entmax_attn_fwd", "sparse_attn::entmax_attn_bwd"} if backend == "triton" else set()
        assert fused_ops == expected
        results[backend] = (logits[valid].detach(), plain, step, [p.grad.clone() for p in params])
    ref, out = results["reference"], results["triton"]
    out_tol, grad_tol = TOL["fused_vs_reference_f32"]["out"], TOL["fused_vs_reference_f32"]["grad"]
    for o, r in zip(out[:3], ref[:3]):
        torch.testing.assert_close(o, r, atol=out_tol, rtol=out_tol)
    for g_f, g_r in zip(out[3], ref[3]):
        assert g_r.abs().sum() > 0
        torch.testing.assert_close(g_f, g_r, atol=grad_tol, rtol=grad_tol)
