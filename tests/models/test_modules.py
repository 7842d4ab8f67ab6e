"""EntmaxMultiheadAttention against nn.MultiheadAttention (alpha = 1) and a float64 oracle, and swap_attention."""

import itertools
import math
import re
import warnings

import pytest
import torch
from helpers import EXACT, F32, F64, TOL, OpLog, host_reads_outside, reference_entmax
from torch import nn

import sparse_attn.modules as modules_mod
import sparse_attn.reference as reference_mod
from sparse_attn.modules import EntmaxAlpha, EntmaxMultiheadAttention, swap_attention
from sparse_attn.stats import record_head_stats

E, H = 16, 4


def _pair(alpha=1.0, seed=0, **kw):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, **kw).double()
    ent = EntmaxMultiheadAttention(E, H, alpha=alpha, **kw).double()
    ent.load_state_dict(mha.state_dict())
    return mha, ent


def _inputs(n, l_q, s, kdim, vdim, batch_first, batched=True):
    def mk(length, dim):
        if not batched:
            return torch.randn(length, dim, dtype=torch.float64)
        shape = (n, length, dim) if batch_first else (length, n, dim)
        return torch.randn(*shape, dtype=torch.float64)

    return mk(l_q, E), mk(s, kdim), mk(s, vdim)


def _masks(kind, n, l_q, s):
    """(key_padding_mask, attn_mask) in nn.MultiheadAttention's convention; no row fully masked."""
    kpm = am = None
    if "kpm_bool" in kind:
        kpm = torch.zeros(n, s, dtype=torch.bool)
        kpm[0, -2:] = True
    if "kpm_float" in kind:
        kpm = torch.randn(n, s, dtype=torch.float64)
        kpm[-1, 1] = float("-inf")
    if "am_bool2" in kind:
        am = torch.rand(l_q, s) < 0.4
        am[:, 0] = False
    if "am_float3" in kind:
        am = torch.randn(n * H, l_q, s, dtype=torch.float64)
        am[:, :, 2] = float("-inf")
    if "am_bool3" in kind:
        am = torch.rand(n * H, l_q, s) < 0.4
        am[..., 0] = False
    return kpm, am


MASK_KINDS = ["none", "kpm_bool", "kpm_float", "am_bool2", "am_float3", "am_bool3+kpm_bool", "am_float3+kpm_float",
              "am_bool2+kpm_float"]
STRUCTURES = list(itertools.product([False, True], [None, (6, 5)], [True, False], [False, True], [False, True]))


@pytest.mark.parametrize("case", range(len(STRUCTURES)))
def test_matches_mha_at_alpha_one(case):
    batch_first, kv, bias, add_bias_kv, add_zero_attn = STRUCTURES[case]
    kdim, vdim = kv if kv else (E, E)
    mha, ent = _pair(batch_first=batch_first, kdim=kdim, vdim=vdim, bias=bias,
                     add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    n, l_q, s = 3, 5, 7
    for kind in MASK_KINDS[case % 2::2]:
        q, k, v = _inputs(n, l_q, s, kdim, vdim, batch_first)
        kpm, am = _masks(kind, n, l_q, s)
        for need_weights, average in ((False, True), (True, True), (True, False)):
            args = dict(key_padding_mask=kpm, attn_mask=am, need_weights=need_weights, average_attn_weights=average)
            mixed = kpm is not None and am is not None and kpm.dtype != am.dtype
            with pytest.warns(UserWarning) if mixed else _no_warn():
                o_ref, w_ref = mha(q, k, v, **args)
            o, w = ent(q, k, v, **args)
            torch.testing.assert_close(o, o_ref, atol=TOL["same_values"][F64], rtol=0,
                                       msg=f"{kind} need_weights={need_weights}")
            if need_weights:
                torch.testing.assert_close(w, w_ref, atol=TOL["same_values"][F64], rtol=0)
            else:
                assert w is None


class _no_warn:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_unbatched_and_causal_match_mha(batch_first):
    mha, ent = _pair(batch_first=batch_first)
    x = _inputs(2, 6, 6, E, E, batch_first)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    causal_bool = torch.ones(6, 6, dtype=torch.bool).triu(1)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 3] = True
    for mask, need_weights, pad in itertools.product([causal, causal_bool], [False, True], [None, kpm]):
        o_ref, w_ref = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights, key_padding_mask=pad)
        o, w = ent(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights, key_padding_mask=pad)
        torch.testing.assert_close(o, o_ref, atol=TOL["same_values"][F64], rtol=0)
        if need_weights:
            torch.testing.assert_close(w, w_ref, atol=TOL["same_values"][F64], rtol=0)
    o_ref, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
    o, _ = ent(x, x, x, is_causal=True, need_weights=False)
    torch.testing.assert_close(o, o_ref, atol=TOL["same_values"][F64], rtol=0)
    xu = torch.randn(5, E, dtype=torch.float64)
    ku = torch.randn(7, E, dtype=torch.float64)
    kpm_u = torch.tensor([False, False, True, False, False, False, True])
    am_u = torch.randn(H, 5, 7, dtype=torch.float64)
    for average in (True, False):
        o_ref, w_ref = mha(xu, ku, ku, key_padding_mask=kpm_u, attn_mask=am_u, average_attn_weights=average)
        o, w = ent(xu, ku, ku, key_padding_mask=kpm_u, attn_mask=am_u, average_attn_weights=average)
        torch.testing.assert_close(o, o_ref, atol=TOL["same_values"][F64], rtol=0)
        torch.testing.assert_close(w, w_ref, atol=TOL["same_values"][F64], rtol=0)


def _oracle(ent, q_in, k_in, v_in, alpha, keep):
    """float64 materialized forward of ent (batch_first inputs (N, L, E)) with the bisection entmax."""
    w = ent.in_proj_weight.chunk(3)
    b = ent.in_proj_bias.chunk(3)
    n, l_q = q_in.shape[0], q_in.shape[1]
    split = lambda t: t.reshape(t.shape[0], t.shape[1], H, E // H).transpose(1, 2)  # noqa: E731
    q, k, v = (split(x @ wi.T + bi) for x, wi, bi in zip((q_in, k_in, v_in), w, b))
    scores = q @ k.transpose(-1, -2) / math.sqrt(E // H)
    scores = scores.masked_fill(~keep, float("-inf"))
    p = reference_entmax(scores, alpha.reshape(1, H, 1, 1))
    out = (p @ v).transpose(1, 2).reshape(n, l_q, E)
    return out @ ent.out_proj.weight.T + ent.out_proj.bias, p


@pytest.mark.parametrize("alpha", [1.5, 2.0, "per_head", "learnable"])
def test_sparse_alpha_matches_float64_oracle(alpha):
    torch.manual_seed(1)
    if alpha == "per_head":
        ent = EntmaxMultiheadAttention(E, H, batch_first=True, alpha=torch.tensor([1.1, 1.5, 1.8, 2.0]),
                                       dtype=torch.float64)
    elif alpha == "learnable":
        ent = EntmaxMultiheadAttention(E, H, batch_first=True, learnable=True,
                                       alpha_init=torch.tensor([1.2, 1.4, 1.6, 1.9]), dtype=torch.float64)
    else:
        ent = EntmaxMultiheadAttention(E, H, batch_first=True, alpha=alpha, dtype=torch.float64)
    nn.init.normal_(ent.in_proj_bias)
    n, l_q, s = 2, 5, 9
    q = torch.randn(n, l_q, E, dtype=torch.float64) * 2
    k = torch.randn(n, s, E, dtype=torch.float64) * 2
    kpm = torch.zeros(n, s, dtype=torch.bool)
    kpm[1, -3:] = True
    keep = ~kpm[:, None, None, :]
    ref, p_ref = _oracle(ent, q, k, k, ent.alpha.detach(), keep)
    out, _ = ent(q, k, k, key_padding_mask=kpm, need_weights=False)
    out_w, w = ent(q, k, k, key_padding_mask=kpm, average_attn_weights=False)
    torch.testing.assert_close(out, ref, atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(out_w, ref, atol=TOL["oracle_f64"], rtol=0)
    torch.testing.assert_close(w, p_ref, atol=TOL["oracle_f64"], rtol=0)
    if alpha != "per_head" and alpha != 1.5:
        assert (w == 0).any(), "expected some exactly-zero weights"


def test_learnable_alpha_gradient_matches_finite_differences():
    torch.manual_seed(2)
    ent = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=torch.tensor([1.2, 1.45, 1.7, 1.9]),
                                   dtype=torch.float64)
    x = torch.randn(6, 2, E, dtype=torch.float64) * 2
    for need_weights in (False, True):
        ent.zero_grad()
        loss = ent(x, x, x, need_weights=need_weights)[0].square().sum()
        loss.backward()
        g = ent.alpha_logit.grad.clone()
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        eps = 1e-6
        fd = torch.empty(H, dtype=torch.float64)
        with torch.no_grad():
            for h in range(H):
                ent.alpha_logit[h] += eps
                up = ent(x, x, x, need_weights=False)[0].square().sum()
                ent.alpha_logit[h] -= 2 * eps
                down = ent(x, x, x, need_weights=False)[0].square().sum()
                ent.alpha_logit[h] += eps
                fd[h] = (up - down) / (2 * eps)
        torch.testing.assert_close(g, fd, atol=TOL["gradcheck"]["atol"], rtol=0)


def test_alpha_property_state_dict_and_repr():
    mha = nn.MultiheadAttention(E, H)
    ent = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=1.3, alpha_min=1.1, alpha_max=1.9)
    torch.testing.assert_close(ent.alpha, torch.full((H,), 1.3), atol=TOL["same_values"][F32], rtol=0)
    ent.load_state_dict(mha.state_dict())
    torch.testing.assert_close(ent.alpha, torch.full((H,), 1.3), atol=TOL["same_values"][F32], rtol=0)
    for name, p in mha.state_dict().items():
        assert torch.equal(ent.state_dict()[name], p)
    with torch.no_grad():
        ent.alpha_logit.copy_(torch.tensor([-3.0, 0.0, 1.0, 5.0]))
    expected = 1.1 + 0.8 * torch.sigmoid(torch.tensor([-3.0, 0.0, 1.0, 5.0]))
    torch.testing.assert_close(ent.alpha, expected)
    other = EntmaxMultiheadAttention(E, H, learnable=True)
    other.load_state_dict(ent.state_dict())
    torch.testing.assert_close(other.alpha_logit, ent.alpha_logit)
    assert "alpha_logit" in ent.state_dict()
    fixed = EntmaxMultiheadAttention(E, H, alpha=torch.tensor([1.0, 1.5, 2.0, 1.2]))
    assert "alpha_fixed" not in fixed.state_dict()
    fixed.load_state_dict(mha.state_dict())
    torch.testing.assert_close(fixed.alpha, torch.tensor([1.0, 1.5, 2.0, 1.2]))
    assert torch.equal(EntmaxMultiheadAttention(E, H, alpha=1.7).alpha, torch.full((H,), 1.7))
    with pytest.raises(AttributeError):
        ent.alpha = torch.ones(H)
    assert "learnable" in repr(ent) and "1.7" in repr(EntmaxMultiheadAttention(E, H, alpha=1.7))
    assert isinstance(ent, nn.MultiheadAttention)


def test_double_module_has_float64_alpha():
    ent = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=1.4).double()
    assert ent.alpha.dtype == torch.float64 and ent.alpha_logit.dtype == torch.float64
    x = torch.randn(3, 2, E, dtype=torch.float64)
    out, _ = ent(x, x, x)
    assert out.dtype == torch.float64


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to", "double_then_half"])
def test_low_precision_casts_keep_alpha_float32(cast):
    """Module casts to float16/bfloat16 move alpha but keep it float32, with its value before the cast."""
    per_head = torch.tensor([1.0, 1.5, 2.0, 1.2])
    fixed = EntmaxMultiheadAttention(E, H, alpha=per_head, batch_first=True)
    learn = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=torch.tensor([1.2, 1.3, 1.7, 1.9]),
                                     batch_first=True)
    holder = EntmaxAlpha(H, learnable=True, alpha_init=1.2)
    logit_param = learn.alpha_logit
    (learn.alpha * torch.tensor([1.0, 1e-3, 1.1, 0.3])).sum().backward()
    grad = learn.alpha_logit.grad.clone()
    before = [m.alpha.detach().clone() for m in (fixed, learn, holder)]
    logits = [learn.alpha_logit.detach().clone(), holder.alpha_logit.detach().clone()]
    dtype = torch.bfloat16 if cast == "bfloat16" else torch.float16
    for m in (fixed, learn, holder):
        if cast == "to":
            m.to(device="cpu", dtype=dtype)
        elif cast == "double_then_half":
            m.double().half()
        else:
            getattr(m, cast)()
    assert fixed.alpha_fixed.dtype == learn.alpha_logit.dtype == holder.alpha_logit.dtype == torch.float32
    assert learn.alpha_logit is logit_param and torch.equal(learn.alpha_logit.grad, grad)
    for m, b in zip((fixed, learn, holder), before):
        assert torch.equal(m.alpha, b), (m.alpha, b)
    assert torch.equal(learn.alpha_logit, logits[0]) and torch.equal(holder.alpha_logit, logits[1])
    assert learn.in_proj_weight.dtype == dtype
    x = torch.randn(2, 5, E, dtype=dtype)
    for need_weights in (False, True):
        out, _ = learn(x, x, x, need_weights=need_weights)
        assert out.dtype == dtype and torch.isfinite(out).all()
    learn.zero_grad()
    learn(x, x, x, need_weights=False)[0].float().square().sum().backward()
    assert learn.alpha_logit.grad.dtype == torch.float32 and torch.isfinite(learn.alpha_logit.grad).all()
    learn.float()
    assert torch.equal(learn.alpha_logit, logits[0])


@pytest.mark.parametrize("alpha", ["learnable", "per_head"])
def test_forward_adds_no_host_sync(monkeypatch, alpha):
    """Forward and backward read nothing back to the host outside the row mapping ``entmax`` (whose own
    argument checks read a tensor alpha): the module's alpha is in range by construction, never checked."""
    if alpha == "learnable":
        ent = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=1.3, batch_first=True)
    else:
        ent = EntmaxMultiheadAttention(E, H, alpha=torch.tensor([1.1, 1.5, 1.8, 2.0]), batch_first=True)
    x = torch.randn(2, 5, E)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, -1] = True

    def step(need_weights):
        ent(x, x, x, key_padding_mask=kpm, need_weights=need_weights, is_causal=not need_weights)[0].sum().backward()

    assert host_reads_outside(monkeypatch, reference_mod, "entmax", lambda: step(False)) == []
    assert host_reads_outside(monkeypatch, reference_mod, "entmax", lambda: step(True)) == []
    log = OpLog()
    with log:
        step(False)
    assert log.host_reads(), "the op log does not see the mapping's own alpha check"


def test_empty_rows_give_zeros_not_nan():
    _, ent = _pair(alpha=1.5)
    x = torch.randn(4, 2, E, dtype=torch.float64, requires_grad=True)
    am = torch.zeros(4, 4, dtype=torch.bool)
    am[1] = True
    for need_weights in (False, True):
        out, w = ent(x, x, x, attn_mask=am, need_weights=need_weights)
        assert torch.isfinite(out).all()
        proj_bias = ent.out_proj.bias
        torch.testing.assert_close(out[1], proj_bias.expand(2, E).detach(), atol=TOL["same_values"][F64], rtol=0)
        if need_weights:
            assert torch.equal(w[:, 1], torch.zeros_like(w[:, 1]))
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        x.grad = None


def test_dropout_on_weights():
    _, ent = _pair(alpha=1.5, dropout=0.5)
    x = torch.randn(6, 2, E, dtype=torch.float64)
    ent.eval()
    out_eval, w_eval = ent(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(ent(x, x, x, need_weights=False)[0], out_eval)
    ent.train()
    torch.manual_seed(3)
    _, w_train = ent(x, x, x, average_attn_weights=False)
    kept = w_train != 0
    torch.testing.assert_close(w_train[kept], 2 * w_eval[kept])
    assert (w_eval[~kept] != 0).any()
    out_a = ent(x, x, x, need_weights=False)[0]
    out_b = ent(x, x, x, need_weights=False)[0]
    assert not torch.allclose(out_a, out_b)


def test_learnable_is_the_keyword_and_learnable_alpha_a_deprecated_alias():
    mha = nn.MultiheadAttention(E, H)
    for make in (
        lambda **kw: EntmaxMultiheadAttention(E, H, **kw),
        lambda **kw: EntmaxAlpha(H, **kw),
        lambda **kw: EntmaxMultiheadAttention.from_mha(mha, **kw),
        lambda **kw: swap_attention(nn.ModuleDict({"a": nn.MultiheadAttention(E, H)}), **kw)[0][1] and None,
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = make(learnable=True)
        with pytest.warns(DeprecationWarning, match="learnable_alpha= is deprecated, use learnable="):
            old = make(learnable_alpha=True)
        if new is not None:
            assert new.learnable_alpha and old.learnable_alpha and new.alpha_logit is not None
            assert not make().learnable_alpha
    model = nn.ModuleDict({"a": nn.MultiheadAttention(E, H)})
    with pytest.warns(DeprecationWarning):
        swap_attention(model, learnable_alpha=True)
    assert model["a"].learnable_alpha


@pytest.mark.parametrize("where", ["key_padding_mask", "attn_mask"])
def test_nan_in_a_float_mask_gives_nan_rows_on_the_reference(where):
    """The reference path follows the non-finite policy: the rows that see the NaN are NaN, no error."""
    torch.manual_seed(12)
    ent = EntmaxMultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    kpm = torch.zeros(2, 5, dtype=torch.float64)
    am = torch.zeros(5, 5, dtype=torch.float64)
    if where == "key_padding_mask":
        kpm[1, 2] = float("nan")
        bad = torch.zeros(2, 5, dtype=torch.bool)
        bad[1] = True
    else:
        am[3, 0] = float("nan")
        bad = torch.zeros(2, 5, dtype=torch.bool)
        bad[:, 3] = True
    for need_weights in (False, True):
        out, _ = ent(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights)
        assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()


def test_empty_inputs_give_empty_or_bias_outputs_and_gradients():
    torch.manual_seed(13)
    ent = EntmaxMultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    nn.init.normal_(ent.out_proj.bias)
    for n, l_q, s in ((0, 4, 5), (2, 0, 5), (2, 4, 0)):
        q = torch.randn(n, l_q, E, dtype=torch.float64, requires_grad=True)
        kv = torch.randn(n, s, E, dtype=torch.float64, requires_grad=True)
        for need_weights in (False, True):
            out, w = ent(q, kv, kv, need_weights=need_weights)
            assert out.shape == (n, l_q, E)
            torch.testing.assert_close(out, ent.out_proj.bias.detach().expand(n, l_q, E))
            if need_weights:
                assert w.shape == (n, l_q, s)
            out.sum().backward()
            assert q.grad.shape == q.shape and (q.grad == 0).all() and (kv.grad == 0).all()
            q.grad = kv.grad = None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cpu(dtype):
    """Autocast against float32 (tolerances: TOL["autocast_out"], TOL["autocast_weights"])."""
    atol_out, atol_w = TOL["autocast_out"][dtype], TOL["autocast_weights"][dtype]
    torch.manual_seed(4)
    ent = EntmaxMultiheadAttention(E, H, alpha=1.5, batch_first=True)
    x = torch.randn(2, 9, E)
    ref, w_ref = ent(x, x, x, average_attn_weights=False)
    with torch.autocast("cpu", dtype=dtype):
        out, _ = ent(x, x, x, need_weights=False)
        out_w, w = ent(x, x, x, average_attn_weights=False)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol_out, rtol=0)
    torch.testing.assert_close(out_w.float(), ref, atol=atol_out, rtol=0)
    torch.testing.assert_close(w.float(), w_ref, atol=atol_w, rtol=0)
    torch.testing.assert_close(w.float().sum(-1), torch.ones(2, H, 9), atol=atol_w, rtol=0)


def _tiny_transformer(batch_first=True):
    torch.manual_seed(5)
    return nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32, dropout=0.0,
                          batch_first=batch_first)


def test_swap_attention_keeps_weights_and_defeats_fast_paths():
    model = _tiny_transformer().eval()
    src, tgt = torch.randn(3, 7, E), torch.randn(3, 5, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, -2:] = True
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    masks = dict(src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_mask=tgt_mask, tgt_is_causal=True)
    with torch.no_grad():
        ref = model(src, tgt, **masks)
    old = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    replaced = swap_attention(model, alpha=1.0)
    assert [n for n, _ in replaced] == list(old)
    assert all(m is old[n] for n, m in replaced)
    assert all(isinstance(model.get_submodule(n), EntmaxMultiheadAttention) for n in old)
    assert not model.encoder.use_nested_tensor
    assert not model.training
    with torch.no_grad():
        out = model(src, tgt, **masks)
    valid = ~pad[:, :, None].expand(-1, -1, E)
    torch.testing.assert_close(out, ref, **TOL["same_model_f32"])
    assert valid.any()
    for m in model.modules():
        if isinstance(m, EntmaxMultiheadAttention):
            m._alpha_float = 2.0
    with torch.no_grad():
        sparse = model(src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)
    assert not torch.allclose(sparse, ref, atol=1e-3)  # why: alpha 2 against softmax: stricter than TOL["changed"]


def test_encoder_layer_fast_path_is_bypassed():
    torch.manual_seed(6)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, E)
    with torch.no_grad():
        ref = layer(x)
    layer.self_attn = EntmaxMultiheadAttention.from_mha(layer.self_attn, alpha=1.0)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref, **TOL["same_model_f32"])
        layer.self_attn._alpha_float = 2.0
        manual = layer.norm2(_ff(layer, layer.norm1(x + layer.self_attn(x, x, x, need_weights=False)[0])))
        torch.testing.assert_close(layer(x), manual, atol=TOL["same_values"][F32], rtol=0)


def _ff(layer, x):
    return x + layer.linear2(layer.activation(layer.linear1(x)))


def test_swap_shared_module_and_errors():
    shared = nn.MultiheadAttention(E, H)
    shared.in_proj_weight.requires_grad_(False)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    replaced = swap_attention(model, alpha=1.5, learnable=True, alpha_max=1.9)
    assert len(replaced) == 1
    assert model["a"] is model["b"][0]
    assert model["a"].learnable_alpha and model["a"].alpha_max == 1.9
    assert not model["a"].in_proj_weight.requires_grad and model["a"].out_proj.weight.requires_grad
    assert swap_attention(model) == []
    with pytest.raises(ValueError, match="from_mha"):
        swap_attention(nn.MultiheadAttention(E, H))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        swap_attention("model")
    with pytest.raises(TypeError, match="mha must be an nn.MultiheadAttention"):
        EntmaxMultiheadAttention.from_mha(nn.Linear(2, 2))


def test_swapped_transformer_trains_and_alphas_move():
    torch.manual_seed(7)
    model = nn.Transformer(E, H, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0,
                           batch_first=True)
    swap_attention(model, alpha=1.5, learnable=True)
    head = nn.Linear(E, 8)
    emb = nn.Embedding(8, E)
    params = list(model.parameters()) + list(head.parameters()) + list(emb.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    alpha0 = [m.alpha.detach().clone() for m in model.modules() if isinstance(m, EntmaxMultiheadAttention)]
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(6)
    losses = []
    for _ in range(25):
        seq = torch.randint(0, 8, (8, 6))
        logits = head(model(emb(seq), emb(seq), tgt_mask=tgt_mask, tgt_is_causal=True))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 8), seq.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    alpha1 = [m.alpha.detach() for m in model.modules() if isinstance(m, EntmaxMultiheadAttention)]
    assert len(alpha1) == 3
    assert all((a1 - a0).abs().max() > 1e-3 for a0, a1 in zip(alpha0, alpha1))


def test_no_shared_state_between_copies():
    import copy
    import io

    a = EntmaxMultiheadAttention(E, H, learnable=True, alpha_init=1.3)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.alpha_logit.add_(1.0)
    assert not torch.allclose(a.alpha, b.alpha)
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    c = torch.load(buf, weights_only=False)
    torch.testing.assert_close(c.alpha, a.alpha)
    x = torch.randn(5, 2, E)
    torch.testing.assert_close(c(x, x, x)[0], a(x, x, x)[0])
    assert c._qkv_same_embed_dim is False


@pytest.mark.parametrize("deterministic", [True, False])
def test_fused_backend_matches_reference(deterministic, kernel_device, monkeypatch):
    """Also with ``deterministic=False`` (the fused backward's atomic dQ), which the module hands to the kernels."""
    import sparse_attn.attn._attn_autograd as autograd_mod

    asked = []
    real = autograd_mod.launch_bwd
    monkeypatch.setattr(autograd_mod, "launch_bwd", lambda *a, **kw: asked.append(kw["deterministic"]) or
                        real(*a, **kw))
    torch.manual_seed(9)
    ref = EntmaxMultiheadAttention(32, 2, learnable=True, alpha_init=torch.tensor([1.3, 1.9]), batch_first=True,
                                   backend="reference", device=kernel_device)
    fused = EntmaxMultiheadAttention(32, 2, learnable=True, batch_first=True, backend="triton", device=kernel_device,
                                     deterministic=deterministic)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 18, 32, device=kernel_device)
    pad = torch.zeros(2, 18, dtype=torch.bool, device=kernel_device)
    pad[0, -5:] = True
    outs, grads = [], []
    for mod in (ref, fused):
        out = mod(x, x, x, key_padding_mask=pad, need_weights=False, is_causal=True)[0]
        out.square().sum().backward()
        outs.append(out)
        grads.append([p.grad for p in (mod.in_proj_weight, mod.alpha_logit)])
    out_tol, grad_tol = TOL["fused_vs_reference_f32"]["out"], TOL["fused_vs_reference_f32"]["grad"]
    torch.testing.assert_close(outs[1], outs[0], atol=out_tol, rtol=out_tol)
    for g_f, g_r in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_f, g_r, atol=grad_tol, rtol=grad_tol)
    assert asked == [deterministic]


@pytest.mark.parametrize("add_bias_kv", [False, True])
def test_causal_hint_without_mask_is_top_left_for_rectangular_and_extra_keys(add_bias_kv):
    """``is_causal`` without ``attn_mask``: query i sees key j iff j <= i (and any add_bias_kv key)."""
    _, ent = _pair(alpha=1.5, add_bias_kv=add_bias_kv)
    q, k, v = _inputs(2, 4, 7, E, E, batch_first=False)
    explicit = torch.ones(4, 7, dtype=torch.bool).triu(1)
    for need_weights in (False, True):
        out, _ = ent(q, k, v, is_causal=True, need_weights=need_weights)
        ref, _ = ent(q, k, v, attn_mask=explicit, need_weights=need_weights)
        torch.testing.assert_close(out, ref, **EXACT)


@pytest.mark.gpu
def test_cuda_forward_with_learnable_alpha_does_not_synchronize():
    """The module's alpha is in range by construction: a fused forward reads nothing back to the host."""
    torch.manual_seed(14)
    ent = EntmaxMultiheadAttention(64, 4, learnable=True, batch_first=True, device="cuda")
    x = torch.randn(2, 40, 64, device="cuda")
    pad = torch.zeros(2, 40, dtype=torch.bool, device="cuda")
    pad[1, -5:] = True
    ent(x, x, x, key_padding_mask=pad, need_weights=False, is_causal=True)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ent(x, x, x, key_padding_mask=pad, need_weights=False, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --- the backend an explicit request gets: backend="triton" never falls back silently -------------------------------


def _fused_module(device="cpu", **kw):
    """Head dim 16 (the kernels' smallest), batch_first."""
    torch.manual_seed(21)
    return EntmaxMultiheadAttention(32, 2, batch_first=True, device=device, **kw)


def test_triton_backend_refuses_need_weights_true_the_default(kernel_device):
    """need_weights=True (torch's default) needs the materialized weights: backend='triton' raises, naming the fix;
    need_weights=False runs the kernels."""
    mod = _fused_module(kernel_device, backend="triton")
    x = torch.randn(2, 6, 32, device=kernel_device)
    with pytest.raises(ValueError, match=r"backend='triton'\).*need_weights=True.*pass need_weights=False"):
        mod(x, x, x)
    with pytest.raises(ValueError, match="need_weights=False for the fused path"):
        mod(x, x, x, need_weights=True, average_attn_weights=False)
    log = OpLog()
    with log:
        out, w = mod(x, x, x, need_weights=False)
    assert w is None and out.shape == x.shape
    assert "sparse_attn::entmax_attn_fwd" in log.ops


def test_triton_backend_refuses_a_weights_recorder(kernel_device):
    mod = _fused_module(kernel_device, backend="triton")
    x = torch.randn(2, 6, 32, device=kernel_device)
    with record_head_stats(nn.ModuleDict({"attn": mod}), diversity=True), \
            pytest.raises(ValueError, match=r"diversity=True\) recorder.*record with diversity=False"):
        mod(x, x, x, need_weights=False)


def test_triton_backend_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mod = _fused_module(backend="triton")
    x = torch.randn(2, 6, 32)
    with pytest.raises(ValueError, match=r"tensors are on cpu: the fused kernels need CUDA tensors.*TRITON_INTERPRET"):
        mod(x, x, x, need_weights=False)
    with pytest.raises(ValueError, match="need_weights=True.*; the tensors are on cpu"):  # every reason, at once
        mod(x, x, x)


def test_triton_backend_refuses_float64_and_names_the_dtypes(kernel_device):
    mod = _fused_module(kernel_device, backend="triton").double()
    x = torch.randn(2, 6, 32, device=kernel_device, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dtype is torch.float64: the fused kernels take float16, bfloat16 or "):
        mod(x, x, x, need_weights=False)


def test_triton_backend_refuses_head_dims_outside_the_kernels_range(kernel_device):
    with pytest.raises(ValueError, match=r"backend='triton' needs head_dim = embed_dim // num_heads in \[16, 256\].*"
                                         r"32 // 4 = 8"):
        EntmaxMultiheadAttention(32, 4, backend="triton")
    mod = EntmaxMultiheadAttention(32, 4, batch_first=True, device=kernel_device)  # head dim 8
    mod.backend = "triton"  # set after construction: the forward refuses it too
    x = torch.randn(2, 6, 32, device=kernel_device)
    with pytest.raises(ValueError, match=r"head_dim \(embed_dim // num_heads\) is 8"):
        mod(x, x, x, need_weights=False)
    mod.backend = "fused"
    with pytest.raises(ValueError, match="backend must be one of"):
        mod(x, x, x, need_weights=False)


# (backend, need_weights, recorder_weights, on_cuda, dtype, head_dim) -> (backend passed on, warning pattern or None)
_AUTO_CASES = [
    ("auto", True, False, True, torch.float32, 16, "reference", r"need_weights=True.*pass need_weights=False"),
    ("auto", False, True, True, torch.float16, 64, "reference", r"diversity=True"),
    ("auto", False, False, True, torch.float64, 16, "auto", r"dtype is torch.float64"),
    ("auto", False, False, True, torch.bfloat16, 8, "auto", r"head_dim \(embed_dim // num_heads\) is 8"),
    ("auto", False, False, True, torch.bfloat16, 128, "auto", None),  # the kernels run: nothing to say
    ("auto", True, False, False, torch.float32, 16, "reference", None),  # CPU: no fused path to miss
    ("auto", False, False, False, torch.float64, 8, "auto", None),
    ("reference", True, False, True, torch.float32, 16, "reference", None),
    ("reference", False, False, True, torch.float32, 16, "reference", None),
    ("triton", False, False, True, torch.float16, 256, "triton", None),
]


@pytest.mark.parametrize("row", range(len(_AUTO_CASES)))
def test_module_backend_decision(row):
    """The decision, with the device as a flag: on CUDA (simulated) backend='auto' says why it leaves the kernels."""
    backend, need_weights, recorder, on_cuda, dtype, head_dim, passed, warning = _AUTO_CASES[row]
    got, message = modules_mod.module_backend(
        backend, "EntmaxMultiheadAttention", need_weights=need_weights, recorder_weights=recorder, on_cuda=on_cuda,
        device="cuda:0" if on_cuda else "cpu", dtype=dtype, head_dim=head_dim)
    assert got == passed
    if warning is None:
        assert message is None
    else:
        assert message.startswith("EntmaxMultiheadAttention(backend='auto') runs on the materialized reference")
        assert "on cuda:0" in message and "once per module" in message
        assert re.search(warning, message)


def test_module_backend_triton_on_cuda_raises_for_weights_dtype_and_head_dim():
    with pytest.raises(ValueError, match=r"need_weights=True.*; the dtype is torch.float64.*; head_dim .* is 300"):
        modules_mod.module_backend("triton", "M", need_weights=True, recorder_weights=False, on_cuda=True,
                                   device="cuda:0", dtype=torch.float64, head_dim=300)


def test_auto_backend_warns_once_per_module_when_cuda_falls_back(monkeypatch):
    """backend='auto' with need_weights=True on a (simulated) CUDA tensor: one UserWarning per module, whatever the
    number of calls; need_weights=False, where the kernels would run, says nothing."""
    monkeypatch.setattr(modules_mod, "_kernel_device", lambda t: True)
    a, b = _fused_module(), _fused_module()
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a(x, x, x, need_weights=False)
        for _ in range(3):
            a(x, x, x)
        b(x, x, x, need_weights=True)
        b(x, x, x)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 2, messages
    assert all("backend='auto') runs on the materialized reference" in m and "pass need_weights=False" in m
               for m in messages)


def test_auto_backend_on_cpu_with_need_weights_does_not_warn():
    mod = _fused_module()
    x = torch.randn(2, 6, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, w = mod(x, x, x)
    assert w.shape == (2, 6, 6)


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_module_on_meta_tensors_infers_shapes(learnable, need_weights):
    """A module built on the meta device (e.g. to size a model before loading weights) runs a forward that gives the
    output and weight shapes of a real call, general and learnable alphas included."""
    alpha = torch.tensor([1.2, 1.5, 1.7, 1.9])
    for device in ("cpu", "meta"):
        mha = EntmaxMultiheadAttention(16, 4, alpha=alpha, learnable=learnable, batch_first=True, device=device)
        x = torch.randn(2, 7, 16, device=device)
        out, weights = mha(x, x, x, need_weights=need_weights)
        shapes = (out.shape, None if weights is None else weights.shape)
        if device == "cpu":
            want = shapes
    assert out.device.type == "meta" and shapes == want
