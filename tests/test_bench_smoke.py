"""The benchmark harness (benchmarks/bench_attention.py) in its CPU smoke mode, so it never rots.

One smoke run (tiny float32 shapes, Triton interpreter) writes the tables, CSV and plots into a
temporary folder; the tests check the files, the stamp, the columns, that every benchmarked
call computes the right thing (max error against the float64 reference), that the derived
numbers follow from the raw ones, and the helpers that count tiles.
"""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_attn.reference import causal_keep

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
FP32_OUTPUT_TOL = 1e-3
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
OUTPUT_FILES = ("results.md", "results.csv", "plot_grid.png", "plot_sparsity.png", "plot_mixed.png")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention"] = module
    spec.loader.exec_module(module)
    return module


def _fused_missing(bench) -> str:
    return bench.fused_forward_launcher()[1]


def _case_key(row):
    return tuple(str(row[c]) for c in ("group", "dtype", "batch", "heads", "seq_q", "seq_k", "head_dim",
                                       "causal", "score_mult", "target_density", "mode"))


def check_files_stamp_and_columns(bench, out, rows):
    for name in OUTPUT_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in OUTPUT_FILES[2:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = (out / "results.csv").read_text().splitlines()
    stamp = {ln[2:].split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in text if ln.startswith("# ")}
    for key in ("gpu", "driver", "torch", "triton", "commit", "date", "command"):
        assert stamp.get(key), key
    assert stamp["torch"] == torch.__version__
    assert "--smoke" in stamp["command"]
    header = next(ln for ln in text if not ln.startswith("#"))
    assert tuple(header.split(",")) == bench.COLUMNS
    md = (out / "results.md").read_text()
    for key in ("gpu", "driver", "torch", "triton", "commit", "date", "command"):
        assert f"**{key}**" in md
    for title in bench.GROUP_TITLES.values():
        assert f"## {title}" in md
    assert "## Summary: time / SDPA flash" in md and "sparse_attn α=1.5" in md
    assert {r["group"] for r in rows} == {"flash", "sparsity", "mixed"}


def check_every_method_and_mode_has_a_row(bench, rows):
    for group in ("flash", "sparsity", "mixed"):
        for mode in bench.MODES:
            sel = [r for r in rows if r["group"] == group and r["mode"] == mode]
            assert any(r["method"] == "sdpa" and r["backend"] == "flash" and r["status"] == "ok" for r in sel)
            assert any(r["method"] == "sparse_attn" for r in sel)
    flash = [r for r in rows if r["group"] == "flash"]
    assert {r["alpha"] for r in flash if r["method"] == "sparse_attn"} == {"1", "1.5", "2", "1.25"}
    assert {r["alpha"] for r in flash if r["method"] == "torch_recipe"} == {"1", "1.5", "2", "1.25"}
    assert {r["alpha"] for r in rows if r["group"] == "mixed" and r["method"] == "sparse_attn"} == {
        "mixed", "learnable", "1.5"}
    cudnn = [r for r in rows if r["backend"] == "cudnn"]
    assert cudnn and all(r["status"] in ("ok", "unavailable") for r in cudnn)
    if not torch.cuda.is_available():
        assert all(r["status"] == "unavailable" for r in cudnn)
    recipe_backends = {r["backend"] for r in rows if r["method"] == "torch_recipe"}
    assert len(recipe_backends) == 1
    assert recipe_backends.pop().split(" ")[0] in ("entmax", "sparse_attn.mappings")
    for r in rows:
        if r["method"] == "sparse_attn" and r["status"] == "skipped":
            assert r["note"] == _fused_missing(bench)


def check_timings_and_derived_numbers(rows):
    flash_ms = {_case_key(r): r["ms"] for r in rows if r["backend"] == "flash" and r["status"] == "ok"}
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok
    for r in ok:
        assert 0 < r["ms_q20"] <= r["ms"] <= r["ms_q80"] < math.inf
        flops = 4.0 * r["batch"] * r["heads"] * r["seq_q"] * r["seq_k"] * r["head_dim"] * MODE_FACTOR[r["mode"]]
        if r["causal"]:
            flops /= 2
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-4)
        assert r["time_vs_sdpa_flash"] == pytest.approx(r["ms"] / flash_ms[_case_key(r)], rel=1e-4)
    for r in rows:
        if r["status"] != "ok":
            assert r["ms"] is None and r["tflops"] is None and r["time_vs_sdpa_flash"] is None


def check_every_benchmarked_call_matches_the_float64_reference(rows):
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        if r["method"] == "torch_recipe" and r["backend"].startswith("entmax "):
            continue  # the third-party package itself gives NaN at alpha = 1 (GUIDE section 3)
        assert "extras failed" not in r["note"] and "NaN" not in r["note"], r
        assert r["max_abs_err"] <= FP32_OUTPUT_TOL, r


def check_fused_rows_report_density_tiles_and_passes(rows):
    fused = [r for r in rows if r["method"] == "sparse_attn"]
    assert fused and all(r["status"] == "ok" for r in fused), [r["note"] for r in fused if r["status"] != "ok"]
    for r in fused:
        assert 0 < r["density"] <= 1
        assert 0 <= r["tiles_skipped"] <= 1
        assert 1 <= r["passes_mean"] <= r["passes_max"] and r["visits_mean"] >= r["passes_mean"]
        if r["alpha"] == "1":
            assert r["density"] == 1.0 and r["tiles_skipped"] == 0.0 and r["passes_max"] == 1
    sweep = sorted((r["target_density"], r["density"]) for r in fused
                   if r["group"] == "sparsity" and r["mode"] == "fwd")
    assert len(sweep) >= 2
    (few_target, few), (most_target, most) = sweep[0], sweep[-1]
    assert few < 4 * few_target and most > 0.5 * most_target and few < most


def check_resume_keeps_rows_and_budget_skips(bench, out, rows, tmp_path):
    again = bench.run(["--smoke", "--groups", "mixed", "--modes", "fwd", "--resume-from", str(out / "results.csv"),
                       "--out", str(tmp_path / "resumed")])
    resumed = bench.read_csv(again / "results.csv")
    before = {(r["method"], r["alpha"], r["causal"]): r["ms"] for r in rows
              if r["group"] == "mixed" and r["mode"] == "fwd" and r["status"] == "ok"}
    after = {(r["method"], r["alpha"], r["causal"]): r["ms"] for r in resumed if r["status"] == "ok"}
    assert before and after == before
    cut = bench.run(["--smoke", "--groups", "mixed", "--budget-s", "0", "--out", str(tmp_path / "cut")])
    cut_rows = bench.read_csv(cut / "results.csv")
    assert cut_rows and all(r["status"] == "skipped" and r["note"] == "time budget reached" for r in cut_rows)
    assert "incomplete" in (cut / "results.md").read_text()


def test_smoke_run(bench, tmp_path):
    """One smoke run (the expensive part, so a single test) and every check of its output."""
    out = tmp_path / "smoke"
    bench.run(["--smoke", "--out", str(out)])
    rows = bench.read_csv(out / "results.csv")
    check_files_stamp_and_columns(bench, out, rows)
    check_every_method_and_mode_has_a_row(bench, rows)
    check_timings_and_derived_numbers(rows)
    check_every_benchmarked_call_matches_the_float64_reference(rows)
    check_resume_keeps_rows_and_budget_skips(bench, out, rows, tmp_path)
    missing = _fused_missing(bench)
    if missing:
        pytest.skip(f"fused-kernel columns not checked: {missing}")
    check_fused_rows_report_density_tiles_and_passes(rows)


@pytest.mark.parametrize("seq_q,seq_k,block_m,block_n", [(64, 64, 16, 16), (50, 70, 16, 32), (70, 33, 32, 16),
                                                          (1, 40, 16, 16), (40, 1, 16, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_visitable_tiles_counts_tiles_with_an_unmasked_pair(bench, seq_q, seq_k, block_m, block_n, causal):
    keep = causal_keep(seq_q, seq_k, "cpu") if causal else torch.ones(seq_q, seq_k, dtype=torch.bool)
    expected = sum(
        bool(keep[i:i + block_m, j:j + block_n].any())
        for i in range(0, seq_q, block_m) for j in range(0, seq_k, block_n)
    )
    assert bench.visitable_tiles(seq_q, seq_k, block_m, block_n, causal) == expected


def test_count_live_tiles_reads_the_bitmap_layout(bench):
    gen = torch.Generator().manual_seed(3)
    for n_key_tiles in (1, 31, 32, 33, 70):
        words = -(-n_key_tiles // 32)
        live = torch.randint(-2**31, 2**31 - 1, (2, 3, 4, words), generator=gen, dtype=torch.int64).to(torch.int32)
        expected = 0
        for w in live.reshape(-1, words).tolist():
            expected += sum((w[kt // 32] >> (kt % 32)) & 1 for kt in range(n_key_tiles))
        assert bench.count_live_tiles(live, n_key_tiles) == expected


def test_measure_reports_oom_unavailable_and_errors(bench):
    timing = bench.Timing("cpu")
    x = torch.ones(3, requires_grad=True)

    def raiser(exc):
        def fn():
            raise exc
        return fn

    oom = bench.measure(raiser(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")), "fwd",
                        torch.ones(3), [x], timing)
    assert oom["status"] == "OOM" and "out of memory" in oom["note"]
    gone = bench.measure(raiser(bench.Unavailable("no kernel")), "fwd+bwd", torch.ones(3), [x], timing)
    assert gone == {"status": "unavailable", "note": "no kernel"}
    bad = bench.measure(raiser(ValueError("q must be 4-d\nmore")), "bwd", torch.ones(3), [x], timing)
    assert bad == {"status": "error", "note": "ValueError: q must be 4-d"}
    good = bench.measure(lambda: (x * 2).sum(), "fwd+bwd", torch.ones(()), [x], timing)
    assert good["status"] == "ok" and good["ms"] > 0 and x.grad is None


def test_runs_as_a_script_from_another_folder(tmp_path):
    """The entry point finds its sibling modules (bench_cases, bench_report, ...) whatever the working directory."""
    done = subprocess.run([sys.executable, str(HARNESS), "--groups", "nonsense"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "--groups takes flash, sparsity, mixed; got 'nonsense'" in done.stderr


def test_median_and_quantiles_match_numpy(bench):
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 7, 20):
        times = (torch.rand(n, generator=gen, dtype=torch.float64) * 10).tolist()
        med, q20, q80 = bench.median_q20_q80(times)
        assert (med, q20, q80) == pytest.approx((np.median(times), *np.quantile(times, [0.2, 0.8])), rel=1e-12)
