"""Modules that call torch.nn.functional.scaled_dot_product_attention, made to use entmax attention.

Hand-written ViT-style modules (and a tiny timm ViT when timm is installed): at alpha = 1 the routed call is
SDPA's softmax; for alpha > 1 it equals entmax_attention on the same q, k, v; SDPA's mask, causal, scale,
GQA and broadcasting conventions; learnable per-head alphas that optimizers see; state dicts; head
statistics; detection of the modules to attach to; the context manager; torch.compile; and the warnings
of swap_sdpa_attention / swap_attention when they find nothing.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import EXACT, F32, TOL
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa

from sparse_attn import entmax_attention, record_head_stats, swap_attention
from sparse_attn.attn.masks import causal_keep
from sparse_attn.sdpa import (
    attach_entmax_sdpa,
    detach_entmax_sdpa,
    entmax_sdpa,
    sdpa_modules,
    swap_sdpa_attention,
)

DIM, HEADS = 32, 4


class Attention(nn.Module):
    """timm's ViT attention, written again: qkv projection, one SDPA call, output projection."""

    def __init__(self, dim=DIM, num_heads=HEADS):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def qkv_heads(self, x):
        b, n, c = x.shape
        return self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class CausalAttention(Attention):
    """Uses the directly imported function, a causal mask and a scale (decoder style)."""

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        out = imported_sdpa(q, k, v, is_causal=True, scale=0.3)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, attn_cls=Attention):
        super().__init__()
        self.attn = attn_cls()
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


def _model(seed=0, attn_cls=Attention):
    torch.manual_seed(seed)
    return nn.Sequential(Block(attn_cls), Block(attn_cls))


def _x(seed=1, n=6):
    return torch.randn(2, n, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn_cls", [Attention, CausalAttention])
def test_alpha_one_is_sdpa_and_alpha_above_one_is_entmax_attention(attn_cls):
    model, x = _model(attn_cls=attn_cls), _x()
    with torch.no_grad():
        softmax_out = model(x)
        assert swap_sdpa_attention(model, alpha=1.0) == ["0.attn", "1.attn"]
        torch.testing.assert_close(model(x), softmax_out, **TOL["same_model_f32"])
    attn = model[0].attn
    detach_entmax_sdpa(attn)
    attach_entmax_sdpa(attn, alpha=torch.tensor([1.2, 1.5, 1.8, 2.0]))
    with torch.no_grad():
        q, k, v = attn.qkv_heads(x)
        causal = attn_cls is CausalAttention
        expected = entmax_attention(q, k, v, torch.tensor([1.2, 1.5, 1.8, 2.0]), is_causal=causal,
                                    scale=0.3 if causal else None)
        expected = attn.proj(expected.transpose(1, 2).reshape(x.shape))
        torch.testing.assert_close(attn(x), expected, atol=TOL["same_values"][F32], rtol=0)
        assert not torch.allclose(attn(x), softmax_out)


def test_only_calls_inside_the_forward_are_routed_even_when_it_raises():
    attn, x = Attention(), _x()
    attach_entmax_sdpa(attn, alpha=2.0)
    q = torch.randn(1, 2, 5, 8)
    plain = imported_sdpa(q, q, q)
    attn(x)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), plain, **EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError):
            attn(torch.randn(2, 6, DIM + 1))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), plain, **EXACT)
    assert attn._entmax_sdpa.active == []


def test_learnable_alpha_is_a_parameter_the_optimizer_moves_and_the_state_dict_keeps():
    model, x = _model(), _x()
    keys_before = set(model.state_dict())
    swap_sdpa_attention(model, alpha=1.5, learnable=True, alpha_max=1.9)
    names = [n for n, _ in model.named_parameters() if "entmax_alpha" in n]
    assert names == ["0.attn.entmax_alpha.alpha_logit", "1.attn.entmax_alpha.alpha_logit"]
    assert set(model.state_dict()) == keys_before | set(names)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model[0].attn.entmax_alpha.alpha.detach().clone()
    model(x).square().sum().backward()
    assert model[0].attn.entmax_alpha.alpha_logit.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(model[0].attn.entmax_alpha.alpha.detach(), before)
    fresh = _model(seed=5)
    swap_sdpa_attention(fresh, alpha=1.5, learnable=True, alpha_max=1.9)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), **EXACT)


def test_sdpa_conventions_mask_causal_top_left_gqa_and_broadcasting():
    """At alpha = 1 the routed call equals SDPA itself on every row that has a key."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    keep = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    keep[..., 0] = True
    bias = torch.randn(1, 4, 5, 7, generator=g)
    calls = [
        dict(attn_mask=keep, enable_gqa=True),
        dict(attn_mask=bias, scale=0.5, enable_gqa=True),
        dict(is_causal=True, enable_gqa=True),  # Nq != Nk: top-left, j <= i
        dict(args=(q, k[:, :1], v[:, :1])),  # a single kv head broadcasts
        dict(args=(q, k[:1, :1], v[:1, :1]), attn_mask=keep),  # and a batch of one
    ]
    for call in calls:
        args = call.pop("args", (q, k, v))
        expected = F.scaled_dot_product_attention(*args, **call)
        with entmax_sdpa(alpha=1.0):
            out = F.scaled_dot_product_attention(*args, **call)
        torch.testing.assert_close(out, expected, **TOL["same_model_f32"])
    with entmax_sdpa(alpha=1.5):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)
    keep_all = keep & causal_keep(5, 7, bottom_right=False)
    torch.testing.assert_close(out, entmax_attention(q, k, v, 1.5, attn_mask=keep_all, enable_gqa=True))


def test_context_manager_per_head_alpha_is_differentiable_and_checked():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    alpha = torch.tensor([1.3, 1.7], requires_grad=True)
    with entmax_sdpa(alpha):
        out = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out, entmax_attention(q, q, q, alpha))
    out.sum().backward()
    assert alpha.grad is not None and torch.isfinite(alpha.grad).all()
    with pytest.raises(ValueError, match=r"alpha must be finite and in \[1, 2\]"), entmax_sdpa(2.5):
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(TypeError, match="alpha must be a float or a tensor"), entmax_sdpa("1.5"):
        pass
    with pytest.raises(ValueError, match="backend must be one of"), entmax_sdpa(1.5, backend="cuda"):
        pass
    with pytest.raises(ValueError, match="routes 4-d scaled_dot_product_attention calls"), entmax_sdpa(1.5):
        F.scaled_dot_product_attention(q[0], q[0], q[0])


def test_head_statistics_record_attached_modules():
    model, x = _model(), _x()
    swap_sdpa_attention(model, alpha=torch.tensor([1.0, 1.5, 2.0, 2.0]))
    with torch.no_grad(), record_head_stats(model, diversity=True) as rec:
        model(x)
    assert rec.layer_names == ["0.attn", "1.attn"]
    dens = rec.density()
    assert (dens[:, 0] == 1).all() and (dens[:, 2:] < 1).all()
    torch.testing.assert_close(rec.alphas()[0], torch.tensor([1.0, 1.5, 2.0, 2.0], dtype=torch.float64))
    assert all(0 <= d <= 1 for d in rec.diversity().values())


def test_detection_and_target_selection():
    model = nn.Sequential(Block(), nn.MultiheadAttention(DIM, HEADS), Block(CausalAttention))
    assert [n for n, _ in sdpa_modules(model)] == ["0.attn", "2.attn"]  # not the Blocks, not nn.MultiheadAttention
    assert swap_sdpa_attention(model, modules=CausalAttention) == ["2.attn"]
    assert swap_sdpa_attention(model, modules=lambda name, m: name == "0.attn", num_heads=4) == ["0.attn"]
    with pytest.warns(UserWarning, match="attached to no module of Sequential"):
        assert swap_sdpa_attention(model) == []
    detach_entmax_sdpa(model[0].attn)
    assert not hasattr(model[0].attn, "entmax_alpha") and swap_sdpa_attention(model) == ["0.attn"]


class Switchable(Attention):
    """Like timm's Attention: SDPA only when ``fused_attn``."""

    fused_attn = False

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        if self.fused_attn:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(x.shape))


def test_a_forward_that_makes_no_sdpa_call_warns_once():
    attn, x = Switchable(), _x()
    attach_entmax_sdpa(attn, alpha=1.5)
    with pytest.warns(UserWarning, match="Switchable routes .* its forward made no such call"):
        attn(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn(x)
        attn.fused_attn = True
        attn(x)


class NoHeadCount(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


def test_bad_arguments_raise_clear_errors():
    attn = Attention()
    attach_entmax_sdpa(attn)
    with pytest.raises(ValueError, match="already routes SDPA"):
        attach_entmax_sdpa(attn)
    with pytest.raises(ValueError, match="nothing to detach"):
        detach_entmax_sdpa(Attention())
    with pytest.raises(ValueError, match="cannot tell the number of heads of NoHeadCount.*pass num_heads="):
        attach_entmax_sdpa(NoHeadCount())
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        attach_entmax_sdpa(NoHeadCount(), num_heads=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        attach_entmax_sdpa(Attention(), backend="cuda")
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        attach_entmax_sdpa("attn")
    with pytest.raises(TypeError, match="modules must be None, a class"):
        swap_sdpa_attention(_model(), modules="Attention")
    with pytest.raises(ValueError, match=r"alpha must be a float or a tensor of shape \(\) or \(2,\)"):
        attach_entmax_sdpa(NoHeadCount(), alpha=torch.ones(3) * 1.5, num_heads=2)
    wrong = NoHeadCount()
    attach_entmax_sdpa(wrong, num_heads=3, alpha=torch.tensor([1.5, 1.5, 1.5]))
    with pytest.raises(ValueError, match=r"alpha must be a float or a tensor of shape \(\) or \(2,\)"):
        wrong(torch.randn(1, 2, 4, 8))


def test_swap_attention_warns_when_it_replaced_nothing_and_names_sdpa_modules():
    with pytest.warns(UserWarning, match=r"replaced nothing.*2 module\(s\) call .*'0.attn'.*swap_sdpa_attention"):
        assert swap_attention(_model()) == []
    with pytest.warns(UserWarning, match=r"replaced nothing.*\(1 EntmaxMultiheadAttention already\)"):
        model = nn.Sequential(nn.MultiheadAttention(DIM, HEADS))
        swap_attention(model)
        swap_attention(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap_attention(nn.Sequential(nn.MultiheadAttention(DIM, HEADS)))


def test_compiled_model_with_learnable_alphas_matches_eager():
    model, x = _model(), _x()
    swap_sdpa_attention(model, alpha=1.5, learnable=True)
    with torch.no_grad():
        model[1].attn.entmax_alpha.alpha_logit.fill_(2.0)
        expected = model(x)
        torch.testing.assert_close(torch.compile(model)(x), expected, **TOL["same_model_f32"])


def test_tiny_timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=16, depth=2,
                            num_classes=3)
    vit.eval()
    for m in vit.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        base = vit(x)
        names = swap_sdpa_attention(vit, alpha=1.0)
        assert names == ["blocks.0.attn", "blocks.1.attn"]
        torch.testing.assert_close(vit(x), base,
                                   rtol=1e-4, atol=1e-5)  # why: timm ViT, not installed here: not re-measured
        for _, m in sdpa_modules(vit):
            detach_entmax_sdpa(m)
        swap_sdpa_attention(vit, alpha=1.5, learnable=True)
        assert not torch.allclose(vit(x), base)


def test_triton_backend_refuses_a_diversity_recorder():
    """The weights a diversity recorder needs exist only on the reference: backend='triton' says so, 'auto' records."""
    model = nn.Sequential(Attention(dim=64, num_heads=4))  # head dim 16, in the kernels' range
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1))
    swap_sdpa_attention(model, alpha=1.5, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' cannot give the weights a record_head_stats"):
        with torch.no_grad(), record_head_stats(model, diversity=True):
            model(x)
    with torch.no_grad(), record_head_stats(model) as rec:  # densities come from the kernels' counts
        model(x)
    assert rec.density().shape == (1, 4)
