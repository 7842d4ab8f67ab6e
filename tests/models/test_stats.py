"""Head statistics against densities and Jensen-Shannon diversity computed from materialized weights."""

import math
import sys

import pytest
import torch
from helpers import EXACT, F64, TOL, host_reads_outside
from torch import nn

import sparse_attn.attention as attention_mod
import sparse_attn.reference as reference_mod
from sparse_attn.attention import entmax_attention
from sparse_attn.modules import EntmaxMultiheadAttention
from sparse_attn.stats import (
    HeadStatsRecorder,
    HeadStatsSink,
    head_stats_sink,
    js_head_diversity,
    record_head_stats,
    register_layer_type,
)

E, H = 16, 4


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.self_attn = EntmaxMultiheadAttention(E, H, batch_first=True, learnable=True,
                                                  alpha_init=torch.tensor([1.2, 1.5, 1.8, 1.95]), dtype=torch.float64)
        self.cross = EntmaxMultiheadAttention(E, H, batch_first=True, alpha=torch.tensor([1.0, 1.5, 2.0, 2.0]),
                                              dtype=torch.float64)
        for m in (self.self_attn, self.cross):
            nn.init.normal_(m.in_proj_weight, std=0.6)

    def forward(self, x, mem, kpm, need_weights=False):
        y, w1 = self.self_attn(x, x, x, is_causal=True, need_weights=need_weights, average_attn_weights=False)
        z, w2 = self.cross(y, mem, mem, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False)
        return z, (w1, w2)


def _batch(seed, n=2, l_q=6, s=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, l_q, E, generator=g, dtype=torch.float64)
    mem = torch.randn(n, s, E, generator=g, dtype=torch.float64)
    kpm = torch.zeros(n, s, dtype=torch.bool)
    kpm[0, -4:] = True
    return x, mem, kpm


def _valid_keys(l_q, s, kpm):
    causal = torch.ones(l_q, l_q, dtype=torch.bool).tril()
    return causal.expand(kpm.shape[0], H, l_q, l_q), (~kpm)[:, None, None, :].expand(-1, H, l_q, s)


def _entropy(d):
    return -sum(float(x) * math.log(float(x)) for x in d if x > 0)


def _js_rows(p, n_keys):
    """Per-row JS diversity by a direct loop: p (B, H, L, S), n_keys (B, L)."""
    vals = []
    for b in range(p.shape[0]):
        for i in range(p.shape[2]):
            n = int(n_keys[b, i])
            if n < 2:
                continue
            heads = p[b, :, i]
            mean = heads.mean(0)
            vals.append((_entropy(mean) - sum(_entropy(h) for h in heads) / heads.shape[0]) / math.log(n))
    return vals


def test_density_alpha_and_diversity_match_materialized_weights():
    model = TwoLayers()
    batches = [_batch(1), _batch(2, n=3, l_q=4, s=5)]
    dens_num = torch.zeros(2, H, dtype=torch.float64)
    dens_den = torch.zeros(2, H, dtype=torch.float64)
    js_vals = [[], []]
    with torch.no_grad():
        for x, mem, kpm in batches:
            _, weights = model(x, mem, kpm, need_weights=True)
            valids = _valid_keys(x.shape[1], mem.shape[1], kpm)
            for layer, (w, valid) in enumerate(zip(weights, valids)):
                assert (w[~valid] == 0).all()
                frac = (w > 0).sum(-1).double() / valid.sum(-1).double()
                dens_num[layer] += frac.sum((0, 2))
                dens_den[layer] += frac.shape[0] * frac.shape[2]
                js_vals[layer] += _js_rows(w, valid[:, 0].sum(-1))
    expected = dens_num / dens_den
    assert (expected < 1).any() and (expected[1, 0] == 1)
    with record_head_stats(model, diversity=True) as rec:
        for x, mem, kpm in batches:
            model(x, mem, kpm)
    assert rec.layer_names == ["self_attn", "cross"]
    torch.testing.assert_close(rec.density(), expected, atol=TOL["same_values"][F64], rtol=0)
    torch.testing.assert_close(rec.alphas(), torch.stack([model.self_attn.alpha, model.cross.alpha]).detach().double())
    div = rec.diversity()
    for layer, name in enumerate(rec.layer_names):
        assert div[name] == pytest.approx(sum(js_vals[layer]) / len(js_vals[layer]), abs=1e-10)
        assert 0 < div[name] < 1

    with record_head_stats(model) as fast:
        for x, mem, kpm in batches:
            model(x, mem, kpm)
    torch.testing.assert_close(fast.density(), expected, atol=TOL["same_values"][F64], rtol=0)
    with pytest.raises(RuntimeError, match="diversity=True"):
        fast.diversity()


def test_query_mask_leaves_padded_rows_out():
    """Densities and diversity over the rows a query mask keeps (from materialized weights), per call via
    set_query_mask; without the mask the padded rows count (the numbers differ); a mismatched mask raises."""
    model = TwoLayers()
    batches = [_batch(1), _batch(2, n=3, l_q=4, s=5)]
    row_masks = [torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]), torch.tensor([[1, 0, 0, 0]] * 2 + [[1] * 4])]
    num, den = torch.zeros(2, H, dtype=torch.float64), torch.zeros(2, H, dtype=torch.float64)
    js_vals = [[], []]
    with torch.no_grad():
        for (x, mem, kpm), rows in zip(batches, row_masks):
            _, weights = model(x, mem, kpm, need_weights=True)
            for layer, (w, valid) in enumerate(zip(weights, _valid_keys(x.shape[1], mem.shape[1], kpm))):
                frac = (w > 0).sum(-1).double() / valid.sum(-1).double()
                keep = rows.bool()[:, None, :].expand_as(frac)
                num[layer] += torch.where(keep, frac, 0.0).sum((0, 2))
                den[layer] += keep.sum((0, 2))
                n_keys = valid[:, 0].sum(-1) * rows
                js_vals[layer] += _js_rows(w, n_keys)
    with record_head_stats(model, diversity=True, query_mask=row_masks[0]) as rec:
        for (x, mem, kpm), rows in zip(batches, row_masks):
            rec.set_query_mask(rows.bool() if x.shape[0] == 3 else rows)
            model(x, mem, kpm)
    torch.testing.assert_close(rec.density(), num / den, atol=TOL["same_values"][F64], rtol=0)
    for layer, name in enumerate(rec.layer_names):
        assert rec.diversity()[name] == pytest.approx(sum(js_vals[layer]) / len(js_vals[layer]), abs=1e-10)
    with record_head_stats(model) as plain:
        for x, mem, kpm in batches:
            model(x, mem, kpm)
    assert (plain.density() - rec.density()).abs().max() > 1e-3
    with record_head_stats(model, query_mask=row_masks[1]), pytest.raises(ValueError, match="query_mask has shape"):
        model(*batches[0])


def test_density_history_per_call():
    """history=True keeps each call's per-head density (computed here from materialized weights), NaN for a layer
    that made fewer calls; the accumulated density is unchanged; without history it raises."""
    model = TwoLayers()
    batches = [_batch(1), _batch(2, n=3, l_q=4, s=5), _batch(3, l_q=1)]
    want = torch.full((3, 2, H), math.nan, dtype=torch.float64)
    with torch.no_grad():
        for c, (x, mem, kpm) in enumerate(batches):
            _, weights = model(x, mem, kpm, need_weights=True)
            for layer, (w, valid) in enumerate(zip(weights, _valid_keys(x.shape[1], mem.shape[1], kpm))):
                want[c, layer] = ((w > 0).sum(-1).double() / valid.sum(-1).double()).mean((0, 2))
    with record_head_stats(model, history=True) as rec:
        for x, mem, kpm in batches:
            model(x, mem, kpm)
        model.self_attn(batches[0][0], batches[0][0], batches[0][0], is_causal=True)
    torch.testing.assert_close(rec.density_history()[:3], want, atol=TOL["same_values"][F64], rtol=0)
    assert rec.density_history().shape == (4, 2, H) and torch.isnan(rec.density_history()[3, 1]).all()
    with record_head_stats(model) as plain:
        model(*batches[0])
    with pytest.raises(RuntimeError, match="history=True"):
        plain.density_history()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_records_each_call_once(use_reentrant):
    """A checkpointed layer's forward recomputed in the backward is not another call: one history entry per step and
    the densities of the plain run."""
    from torch.utils.checkpoint import checkpoint

    model = TwoLayers()
    batches = [_batch(1), _batch(2, n=3, l_q=4, s=5)]
    with record_head_stats(model, history=True) as plain:
        for x, mem, kpm in batches:
            model(x.requires_grad_(), mem, kpm)[0].sum().backward()
    with record_head_stats(model, history=True) as rec:
        for x, mem, kpm in batches:
            checkpoint(model, x.requires_grad_(), mem, kpm, use_reentrant=use_reentrant)[0].sum().backward()
    assert [sink.calls for sink in rec._sinks] == [2, 2]
    torch.testing.assert_close(rec.density_history(), plain.density_history(), **EXACT)
    torch.testing.assert_close(rec.density(), plain.density(), **EXACT)


def test_density_path_does_not_materialize(monkeypatch):
    model = TwoLayers()

    real = attention_mod.reference_forward

    def boom(*a, **k):
        if k.get("with_weights"):
            raise AssertionError("weights were materialized")
        return real(*a, **k)

    monkeypatch.setattr(attention_mod, "reference_forward", boom)
    with record_head_stats(model) as rec:
        model(*_batch(3))
    assert torch.isfinite(rec.density()).all()
    with record_head_stats(model, diversity=True), pytest.raises(AssertionError, match="materialized"):
        model(*_batch(3))


def test_recording_adds_no_host_sync(monkeypatch):
    """The per-layer accumulators stay on the device: recording reads nothing back during the forward."""
    model = TwoLayers()
    x, mem, kpm = _batch(6)
    with record_head_stats(model) as rec:
        assert host_reads_outside(monkeypatch, reference_mod, "entmax", lambda: model(x, mem, kpm)) == []
    assert torch.isfinite(rec.density()).all()


def test_softmax_density_is_one_and_sink_removed_on_exit():
    mha = EntmaxMultiheadAttention(E, H, alpha=1.0)
    model = nn.Sequential()
    model.add_module("attn", mha)
    x = torch.randn(5, 2, E)
    with record_head_stats(model) as rec:
        mha(x, x, x, need_weights=False)
    torch.testing.assert_close(rec.density(), torch.ones(1, H, dtype=torch.float64))
    assert mha._head_stats_sink is None
    mha(x, x, x, need_weights=False)
    assert rec.rows()[0] == {"layer": "attn", "head": 0, "alpha": 1.0, "density": 1.0}
    rec.reset()
    assert torch.isnan(rec.density()).all()
    torch.testing.assert_close(rec.alphas(), torch.ones(1, H, dtype=torch.float64))


def test_js_head_diversity_extremes():
    n = 4
    same = torch.softmax(torch.randn(1, 1, 3, n), -1).expand(1, n, 3, n)
    distinct = torch.eye(n).reshape(1, n, 1, n).expand(1, n, 3, n)
    valid = torch.full((1, n, 3), n)
    js, rows = js_head_diversity(same, valid)
    assert rows == 3 and abs(float(js)) < 1e-12
    js, rows = js_head_diversity(distinct, valid)
    assert float(js) / float(rows) == pytest.approx(1.0)
    js, rows = js_head_diversity(distinct, torch.ones(1, n, 3, dtype=torch.int64))
    assert rows == 0 and js == 0


def test_table_rows_and_plot(tmp_path):
    model = TwoLayers()
    with record_head_stats(model, diversity=True) as rec:
        model(*_batch(4))
    text = str(rec)
    assert text == rec.table()
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "head", "alpha", "density", "diversity"]
    assert len(lines) == 2 + 2 * H
    assert len(rec.rows()) == 2 * H and set(rec.rows()[0]) == {"layer", "head", "alpha", "density"}
    pytest.importorskip("matplotlib")
    fig = rec.plot(tmp_path / "heads.png")
    assert (tmp_path / "heads.png").stat().st_size > 0
    assert fig is not None


def test_plot_without_matplotlib(monkeypatch):
    model = TwoLayers()
    rec = record_head_stats(model)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="needs matplotlib"):
        rec.plot()


def test_recorder_errors():
    no_layer = r"Linear contains no entmax attention layer.*swap_attention.*attn_implementation"
    with pytest.raises(ValueError, match=no_layer):
        record_head_stats(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        record_head_stats("model")
    with pytest.raises(TypeError, match="diversity must be a bool"):
        HeadStatsRecorder(TwoLayers(), diversity=1)
    model = TwoLayers()
    with record_head_stats(model) as outer:
        inner = HeadStatsRecorder(nn.ModuleDict({"c": model.cross, "s": model.self_attn}))
        with pytest.raises(RuntimeError, match="already being recorded"):
            inner.__enter__()
        model(*_batch(5))
    assert torch.isfinite(outer.density()).all()
    assert model.self_attn._head_stats_sink is None


def test_density_from_fused_kernel_counts(kernel_device):
    torch.manual_seed(8)
    mod = EntmaxMultiheadAttention(32, 2, batch_first=True, alpha=torch.tensor([1.5, 2.0]), backend="triton",
                                   device=kernel_device)
    nn.init.normal_(mod.in_proj_weight, std=0.6)
    model = nn.ModuleDict({"attn": mod})
    x = torch.randn(2, 20, 32, device=kernel_device)
    pad = torch.zeros(2, 20, dtype=torch.bool, device=kernel_device)
    pad[1, -6:] = True
    with torch.no_grad(), record_head_stats(model) as rec:
        mod(x, x, x, key_padding_mask=pad, need_weights=False, is_causal=True)
    mod.backend = "reference"  # the weights exist only on the materialized path
    with torch.no_grad():
        _, w = mod(x, x, x, key_padding_mask=pad, is_causal=True, average_attn_weights=False)
    keep = torch.ones(20, 20, dtype=torch.bool, device=kernel_device).tril() & ~pad[:, None, None, :]
    n_valid = keep.sum(-1).double()
    frac = (w > 0).sum(-1).double() / n_valid.clamp_min(1)
    rows = (n_valid > 0).expand_as(frac)
    expected = (frac * rows).sum((0, 2)) / rows.sum((0, 2))
    torch.testing.assert_close(rec.density()[0], expected.cpu(), atol=TOL["same_values"][F64], rtol=0)


class _DotAttention(nn.Module):
    """A layer of another kind: reports to the sink it gets through head_stats_sink."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.alpha = torch.tensor([1.5, 2.0])

    def forward(self, q, k, v):
        out, stats = entmax_attention(q, k, v, self.alpha, return_stats=True)
        sink = head_stats_sink(self)
        if sink is not None:
            sink(stats.nnz, stats.n_valid, self.alpha, None)
        return out


def test_register_layer_type_makes_another_layer_recordable():
    layer = _DotAttention()
    model = nn.ModuleDict({"dot": layer})
    with pytest.raises(ValueError, match="no entmax attention layer"):
        record_head_stats(model)
    register_layer_type(lambda m: isinstance(m, _DotAttention), lambda m: m.alpha)
    register_layer_type(lambda m: isinstance(m, _DotAttention), lambda m: m.alpha)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) * 3 for _ in range(3))
    with record_head_stats(model) as rec:
        assert head_stats_sink(layer) is not None
        layer(q, k, v)
    assert head_stats_sink(layer) is None
    _, stats = entmax_attention(q, k, v, layer.alpha, return_stats=True)
    torch.testing.assert_close(rec.density()[0], (stats.nnz / stats.n_valid).double().mean((0, 2)))
    torch.testing.assert_close(rec.alphas()[0], layer.alpha.double())


def test_register_layer_type_errors():
    with pytest.raises(TypeError, match="is_layer and head_alpha must be callables"):
        register_layer_type("EntmaxMultiheadAttention", lambda m: m.alpha)
    with pytest.raises(TypeError, match="is_layer and head_alpha must be callables"):
        register_layer_type(lambda m: True, None)


def test_stats_module_names_no_integration():
    """The recorder learns layer types through register_layer_type, not by importing integrations by name."""
    import inspect

    import sparse_attn.stats as stats_mod

    source = inspect.getsource(stats_mod)
    assert "sys.modules" not in source and "integrations.hf\"" not in source
    sink: HeadStatsSink = stats_mod._LayerSink(False)
    assert sink.wants_weights is False and callable(sink)
