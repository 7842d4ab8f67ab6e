"""End-to-end test of the demo (examples/seq2seq/): a tiny configuration of all three variants trains,
writes its reports and figures and a checkpoint that inference loads."""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "seq2seq"
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES.parent)]  # the demo's modules and examples/run_folders.py

import demo  # noqa: E402
import inference  # noqa: E402
import train_sparse_transformer as T  # noqa: E402
from helpers import F32, TOL  # noqa: E402

from sparse_attn.stats import record_head_stats  # noqa: E402

# One worker runs this module under `make test` (-n 2 --dist loadgroup), so the module's demo training runs once.
pytestmark = pytest.mark.xdist_group("test_demo")

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
    metrics = _strict_json((out / "metrics.json").read_text())["variants"]
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


def _strict_json(text: str):
    def reject(constant):
        raise AssertionError(f"metrics.json holds {constant}, not strict JSON")

    return json.loads(text, parse_constant=reject)


def test_heads_counted_from_zero_like_the_recorder(run):
    out, result = run
    adaptive = next(r for r in result["results"] if r.variant == "adaptive")
    model, cfg, _ = T.load_checkpoint(adaptive.checkpoint)
    with torch.no_grad(), record_head_stats(model) as rec:
        for src, tgt_in, _ in T.validation_batches(cfg):
            model(src, tgt_in)
    rows = {(r["layer"], r["head"]): r for r in rec.rows()}
    assert {h for _, h in rows} == {0, 1}

    summary = (out / "summary.txt").read_text()
    found = re.search(r"sparsest head (\S+) head (\d+) \(alpha ([\d.]+), density ([\d.]+)\)", summary)
    assert found, summary
    row = rows[(found[1], int(found[2]))]
    assert float(found[3]) == pytest.approx(row["alpha"], abs=0.0051)
    assert float(found[4]) == pytest.approx(row["density"], abs=0.0051)
    assert row["density"] == pytest.approx(min(r["density"] for r in rows.values()), abs=1e-9)

    def key(name):
        return T.block_of(name), int(name.split(".")[1])

    with open(out / "head_stats.csv") as f:
        csv_rows = [r for r in csv.DictReader(f) if r["variant"] == "adaptive"]
    assert len(csv_rows) == len(rows)
    for r in csv_rows:
        name = next(n for n, _ in rows if key(n) == (r["block"], int(r["layer"])))
        want = rows[(name, int(r["head"]))]
        assert float(r["alpha"]) == pytest.approx(want["alpha"], abs=1e-5)
        assert float(r["density"]) == pytest.approx(want["density"], abs=1e-5)
    with open(out / "alpha_trajectories.csv") as f:
        traj = [r for r in csv.DictReader(f)
                if r["variant"] == "adaptive" and int(r["step"]) == adaptive.alpha_steps[-1]]
    assert len(traj) == len(rows)
    for r in traj:
        name = next(n for n, _ in rows if key(n) == (r["block"], int(r["layer"])))
        assert float(r["alpha"]) == pytest.approx(rows[(name, int(r["head"]))]["alpha"], abs=1e-5)


def test_length_one_writes_null_diversity(tmp_path):
    T.main(["--variant", "adaptive", "--out", str(tmp_path), "--no-figures", "--device", "cpu",
            *TINY, "--length", "1", "--steps", "2", "--val-size", "8"])
    report = _strict_json((tmp_path / "metrics.json").read_text())
    heads = report["heads"]["adaptive"]
    assert len(heads["diversity"]) == 3 and all(d is None for d in heads["diversity"])
    assert all(0.0 < d <= 1.0 for row in heads["density"] for d in row)
    assert np.isfinite(report["variants"]["adaptive"]["val_loss"])


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
    np.testing.assert_allclose(T.current_alphas(model), adaptive.alpha_history[-1],
                               atol=TOL["same_values"][F32], rtol=0)
    info = inference.main(["--checkpoint", adaptive.checkpoint, "--device", "cpu", "--n", "16", "--out", str(out),
                           "--module", "encoder.0.self_attn"])
    printed = capsys.readouterr().out
    assert info["table"] and str(info["table"]) in printed
    assert 0.0 <= info["seq_acc"] <= info["token_acc"] <= 1.0
    assert Path(info["attention_map"]).is_file()
    # another inference command draws into its own file, next to the demo's map (never over it)
    assert Path(info["attention_map"]).name == "attention_map_adaptive-n=16,module=encoder.0.self_attn.png"
    assert (out / "attention_map_adaptive.png").is_file()


def test_commands_get_run_folders_of_their_own():
    """Without --out, each command writes to runs/<script>[-<options that differ from their defaults>]: the demo and
    a training run, or two runs that differ in an option, never share a folder."""
    from run_folders import run_folder

    def train(*argv):
        parser = T.build_parser()
        return run_folder("train", parser, parser.parse_args(list(argv)))

    assert demo.default_out(["--variant", "all", "--device", "auto"]) == Path("runs/demo")
    assert demo.default_out(["--variant", "all", "--device", "auto", "--steps", "2000", "--d-model", "128"]) == \
        Path("runs/demo-d-model=128,steps=2000")
    assert train() == Path("runs/train")
    assert train("--variant", "adaptive", "--task", "sort", "--seed", "1") == \
        Path("runs/train-variant=adaptive,task=sort,seed=1")
    assert train("--seed", str(T.Config().seed), "--no-progress") == Path("runs/train")  # same run, same folder
    assert train("--lr", "1e-2") != train("--lr", "2e-2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
@pytest.mark.parametrize("build", [T.build_parser, inference.build_parser])
def test_device_cuda_without_cuda_is_a_usage_error(build, capsys):
    with pytest.raises(SystemExit) as exc:
        build().parse_args(["--device", "cuda"])
    assert exc.value.code == 2
    assert "argument --device: 'cuda': CUDA is not available on this machine" in capsys.readouterr().err


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


@pytest.mark.parametrize("script,args,message", [
    ("train_sparse_transformer.py", ["--d-model", "30", "--heads", "4"], "must be divisible by --heads"),
    ("demo.py", ["--d-model", "30", "--heads", "4"], "must be divisible by --heads"),
    ("inference.py", ["--checkpoint", "missing.pt"], "--checkpoint must be a checkpoint"),
])
def test_scripts_run_from_another_folder(tmp_path, script, args, message):
    """Each script finds its sibling modules (seq2seq_*) whatever the working directory."""
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
