"""End-to-end test of the demo (examples/): a tiny configuration of all three variants trains,
writes its reports and figures and a checkpoint that inference loads."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402
import inference  # noqa: E402
import train_sparse_transformer as T  # noqa: E402

TINY = ["--length", "5", "--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "32", "--steps", "40",
        "--batch-size", "32", "--lr", "1e-2", "--warmup", "5", "--val-size", "64", "--log-every", "5", "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = demo.main(["--out", str(out), "--device", "cpu", *TINY])
    return out, result


def test_loss_falls_and_metrics_written(run):
    out, result = run
    assert [r.variant for r in result["results"]] == list(T.VARIANTS)
    metrics = json.loads((out / "metrics.json").read_text())["variants"]
    for r in result["results"]:
        first, last = np.mean(r.losses[:5]), np.mean(r.losses[-5:])
        assert last < 0.9 * first, (r.variant, first, last)
        m = metrics[r.variant]
        assert 0.0 <= m["token_acc"] <= 1.0 and 0.0 <= m["seq_acc"] <= m["token_acc"] + 1e-9
        assert np.isfinite(m["val_loss"]) and m["val_loss"] < np.log(10)
    with open(out / "metrics.csv") as f:
        assert [row["variant"] for row in csv.DictReader(f)] == list(T.VARIANTS)


def test_reports_and_figures_written(run):
    out, result = run
    for name in ("summary.txt", "head_stats.csv", "alpha_trajectories.csv", *T.FIGURES,
                 "attention_map_adaptive.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
    for name in (*T.FIGURES, "attention_map_adaptive.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (out / "summary.txt").read_text()
    assert all(v in summary for v in T.VARIANTS)
    with open(out / "head_stats.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 3 * 1 * 2  # variants x blocks x layers x heads
    for row in rows:
        density = float(row["density"])
        assert 0.0 < density <= 1.0
        if row["variant"] == "softmax":
            assert density == pytest.approx(1.0)
            assert float(row["alpha"]) == pytest.approx(1.0)
        if row["variant"] == "entmax15":
            assert float(row["alpha"]) == pytest.approx(1.5)


def test_learnable_alphas_changed_and_fixed_did_not(run):
    _, result = run
    by_variant = {r.variant: r for r in result["results"]}
    for variant, r in by_variant.items():
        hist = np.asarray(r.alpha_history)
        assert hist.shape == (len(r.alpha_steps), 3, 2)
        change = np.abs(hist[-1] - hist[0])
        if variant == "adaptive":
            assert (hist > 1.0).all() and (hist < 2.0).all()
            assert change.max() > 1e-3 and len(np.unique(hist[0].round(6))) > 1
        else:
            assert change.max() == 0.0


def test_inference_loads_checkpoint(run, capsys):
    out, result = run
    adaptive = next(r for r in result["results"] if r.variant == "adaptive")
    model, cfg, metrics = T.load_checkpoint(adaptive.checkpoint)
    assert cfg.variant == "adaptive" and cfg.length == 5
    np.testing.assert_allclose(T.current_alphas(model), adaptive.alpha_history[-1], rtol=0, atol=1e-6)
    info = inference.main(["--checkpoint", adaptive.checkpoint, "--device", "cpu", "--n", "16", "--out", str(out),
                           "--module", "encoder.0.self_attn"])
    printed = capsys.readouterr().out
    assert info["table"] and str(info["table"]) in printed
    assert 0.0 <= info["seq_acc"] <= info["token_acc"] <= 1.0
    assert Path(info["attention_map"]).is_file()


def test_tasks_targets():
    gen = torch.Generator().manual_seed(3)
    src, tgt_in, tgt = T.make_batch("reverse", 7, 6, 4, gen)
    assert torch.equal(tgt, src.flip(1)) and (tgt_in[:, 0] == 4).all() and torch.equal(tgt_in[:, 1:], tgt[:, :-1])
    src, _, tgt = T.make_batch("sort", 7, 6, 4, gen)
    assert torch.equal(tgt, src.sort(1).values)
    with pytest.raises(ValueError, match="task"):
        T.make_batch("copy", 2, 3, 4, gen)


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        T.main(["--variant", "sparsemax", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="divisible"):
        T.main(["--d-model", "30", "--heads", "4", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="checkpoint"):
        inference.main(["--checkpoint", str(tmp_path / "missing.pt")])
