"""The benchmark harness (benchmarks/harness/bench_attention.py) in its CPU smoke mode, so it never rots.

One smoke run (tiny float32 shapes, Triton interpreter) writes the tables, CSV and plots into a
temporary folder; the tests check the files, the stamp, the columns, that every benchmarked
call computes the right thing (max error against the float64 reference), that the derived
numbers follow from the raw ones, and the helpers that count tiles. The launch-config sweep
(benchmarks/gpu/tune_tiles.py) and the profiling scripts (benchmarks/gpu/profile_case.py, profile_ncu.sh, with a
stand-in ncu) run the same way.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_attn.mappings import entmax15 as sparse_entmax15
from sparse_attn.reference import causal_keep

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HARNESS = BENCHMARKS / "harness" / "bench_attention.py"
GPU = BENCHMARKS / "gpu"
FP32_OUTPUT_TOL = 1e-3
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
OUTPUT_FILES = ("results.md", "results.csv", "plot_grid.png", "plot_sparsity.png", "plot_mixed.png")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load(HARNESS, "bench_attention")


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
            continue  # the entmax package itself gives NaN at alpha = 1 (its entmax_bisect)
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


TUNER = GPU / "tune_tiles.py"
PROFILER = GPU / "profile_case.py"
NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
              '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
# what `ncu --import <rep> --csv --page details` prints (a hand-written sample in ncu's layout): the section tables and
# the per-reason stall metrics requested with --metrics (section "Command line profiler metrics"); the numbers are
# made up for the test
NCU_DETAILS = [
    ("GPU Speed Of Light Throughput", "Duration", "nsecond", "1,234,567"),
    ("Occupancy", "Theoretical Occupancy", "%", "12.50"),
    ("Occupancy", "Achieved Occupancy", "%", "12.31"),
    ("Launch Statistics", "Registers Per Thread", "register/thread", "252"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block", "byte/block", "65,568"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", "10.00"),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "",
     "1.5"),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
     "", "4.5"),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "", "1"),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "", "3"),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio", "", "n/a"),
]


def _ncu_details_csv(kernel="_entmax_attn_fwd_kernel") -> str:
    lead = f'"0","4242","python3","127.0.0.1","{kernel}","1","7","(256, 1, 1)","(64, 16, 2)","0","9.0"'
    rows = [lead + "," + ",".join(f'"{c}"' for c in row) for row in NCU_DETAILS]
    return "\n".join(["==PROF== Connected to process 4242", NCU_HEADER, *rows]) + "\n"


@pytest.fixture(scope="module")
def tune(bench):
    return _load(TUNER, "tune_tiles")


@pytest.fixture(scope="module")
def profile(tune):
    return _load(PROFILER, "profile_case")


def test_tune_smoke(tune, tmp_path):
    """The launch-config sweep on CPU: the pinned config and one other, every row ok and equal to the pinned output,
    speedups and TFLOP/s derived from the raw times, the winner table, resume and the time budget."""
    out = tune.run(["--smoke", "--out", str(tmp_path / "tune")])
    rows = tune.read_tune_csv(out / "tune.csv")
    pinned = tune.pinned_config(32).label
    assert {r["config"] for r in rows} == {pinned, "64x64 w4 s1"}
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"} and {r["alpha_class"] for r in rows} == {"mixed"}
    by_key = {(r["seq"], r["mode"], r["config"]): r for r in rows}
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["pinned"] == "True") == (r["config"] == pinned)
        assert 0 < r["ms_q20"] <= r["ms"] <= r["ms_q80"]
        assert r["rel_diff_vs_pinned"] <= tune.DIFF_TOL["fp32"]
        base = by_key[(r["seq"], r["mode"], pinned)]["ms"]
        assert r["speedup_vs_pinned"] == pytest.approx(base / r["ms"], rel=1e-4)
        flops = 4.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] * MODE_FACTOR[r["mode"]] / 2  # causal
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-4)
    md = (out / "tune.md").read_text()
    assert "**commit**" in md and "--smoke" in md and "## Best config per case" in md
    assert md.count(" -> ") >= 2 and f"| {pinned} |" in md
    again = tune.run(["--smoke", "--resume-from", str(out / "tune.csv"), "--out", str(tmp_path / "again")])
    assert [r["ms"] for r in tune.read_tune_csv(again / "tune.csv")] == [r["ms"] for r in rows]
    cut = tune.run(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "cut")])
    cut_rows = tune.read_tune_csv(cut / "tune.csv")
    assert cut_rows and all(r["status"] == "skipped" for r in cut_rows)
    assert "incomplete" in (cut / "tune.md").read_text()


def test_tune_smoke_backward_configs(tune, tmp_path):
    """The backward's sweep on CPU: the pinned backward, then one kernel's config replaced at a time, deterministic and
    with the atomic dQ; every row ok, its gradients equal to the pinned backward's within the tolerance."""
    out = tune.run(["--smoke", "--modes", "bwd,bwd-atomic", "--out", str(tmp_path / "tune")])
    rows = tune.read_tune_csv(out / "tune.csv")
    labels = {r["config"] for r in rows}
    assert labels == {tune.PINNED_BWD, "dq 32x16 w4 s1", "dkdv 16x32 w4 s1"}, labels
    assert {r["mode"] for r in rows} == {"bwd", "bwd-atomic"}
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["pinned"] == "True") == (r["config"] == tune.PINNED_BWD)
        assert r["rel_diff_vs_pinned"] <= tune.DIFF_TOL["fp32"]
        flops = 4.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] * MODE_FACTOR["bwd"] / 2  # causal
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12, rel=1e-4)
    assert tune.parse_bwd_config("dkdv:32x128w8s2") == ("dkdv", (32, 128, 8, 2))
    with pytest.raises(ValueError, match="--bwd-configs: expected"):
        tune.parse_bwd_config("dv:32x128w8s2")
    with pytest.raises(SystemExit):
        tune.parse_args(["--modes", "fwd,bwd"])


def test_tune_statuses_configs_and_winners(tune, bench):
    from triton.runtime.errors import OutOfResources

    def raiser(exc):
        def fn():
            raise exc
        return fn

    timing = bench.Timing("cpu")
    smem = tune.classify(bench.measure(raiser(OutOfResources(300000, 232448, "shared memory")), "fwd", None, [],
                                       timing))
    assert smem["status"] == "out of resources" and "shared memory" in smem["note"]
    other = tune.classify(bench.measure(raiser(RuntimeError("boom")), "fwd", None, [], timing))
    assert other == {"status": "error", "note": "RuntimeError: boom"}
    assert tune.parse_config(" 128x64 w8 s3") == (128, 64, 8, 3)
    with pytest.raises(ValueError, match="--configs: expected .* got 'x64w8'"):
        tune.parse_config("x64w8")

    def row(config, seq, ms, status="ok"):
        return {"head_dim": 128, "dtype": "bf16", "alpha_class": "entmax15", "causal": False, "seq": seq,
                "mode": "fwd", "config": config, "pinned": config == "P", "status": status, "ms": ms}

    rows = [row("P", 2048, 2.0), row("P", 8192, 8.0), row("A", 2048, 1.0), row("A", 8192, 9.0, "out of resources"),
            row("B", 2048, 1.9), row("B", 8192, 7.0)]
    tune.add_speedups(rows)
    (win,) = tune.winners(rows)
    assert win["best"] == "B" and win["speedup"] == pytest.approx(math.sqrt(2.0 / 1.9 * 8.0 / 7.0))
    assert win["per_seq"] == [(2048, 2.0, 1.9, None), (8192, 8.0, 7.0, None)]
    summary = tune.config_summary(rows)[(128, "bf16")]
    assert summary["A"]["fwd"][3] == 1 and summary["P"]["fwd"][:3] == (1.0, 1.0, 2)


def test_profile_parses_ncu_details_and_raw_csv(profile):
    summary = profile.ncu_summary(profile.parse_ncu_csv(_ncu_details_csv()), [])
    assert summary["kernel"] == "_entmax_attn_fwd_kernel" and summary["grid"] == "(64, 16, 2)"
    metrics = {label: (value, unit) for label, value, unit in summary["metrics"]}
    assert metrics["Achieved occupancy"] == ("12.31", "%") and metrics["Theoretical occupancy"] == ("12.50", "%")
    assert metrics["Duration"] == ("1,234,567", "nsecond") and metrics["Registers per thread"][0] == "252"
    assert [(r, s) for r, _, s in summary["stalls"]] == [("math_pipe_throttle", 0.45), ("wait", 0.3),
                                                          ("long_scoreboard", 0.15), ("selected", 0.1)]
    raw = "\n".join([
        '"ID","Process ID","Kernel Name","launch__registers_per_thread",'
        '"smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_wait_not_issued",'
        '"smsp__pcsamp_warps_issue_stalled_barrier","sm__warps_active.avg.pct_of_peak_sustained_active"',
        '"","","","register/thread","","","","%"',
        '"0","4242","other_kernel","32","9","9","1","50"',
        '"1","4242","_entmax_attn_fwd_kernel","255","30","99","10","11.5"',
    ])
    summary = profile.ncu_summary([], profile.parse_ncu_csv(raw))
    metrics = {label: (value, unit) for label, value, unit in summary["metrics"]}
    assert metrics["Registers per thread"] == ("255", "register/thread") and metrics["Achieved occupancy"][0] == "11.5"
    assert [(r, s) for r, _, s in summary["stalls"]] == [("wait", 0.75), ("barrier", 0.25)]
    assert profile.parse_ncu_csv("no csv here") == []


@pytest.mark.parametrize("fake", ["ok", "perm"])
def test_profile_script_ncu_and_fallback_paths(tmp_path, fake):
    """benchmarks/gpu/profile_ncu.sh with a stand-in ncu: a report imported and summarized, or the permission error
    (ERR_NVGPUCTRPERM) sending it to the fallback path, which says why; both write profile.md."""
    (tmp_path / "details.csv").write_text(_ncu_details_csv())
    profiled = ('while [ $# -gt 0 ]; do [ "$1" = --export ] && echo rep > "$2.ncu-rep"; shift; done\n'
                if fake == "ok" else 'echo "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission"; exit 1\n')
    ncu = tmp_path / "ncu"
    ncu.write_text('#!/usr/bin/env bash\ncase " $* " in\n'
                   '  *" --version "*) echo "Version 2099.1 (stand-in)" ;;\n'
                   f'  *"--page details"*) cat "{tmp_path}/details.csv" ;;\n'
                   '  *" --import "*) ;;\n'
                   f'  *) {profiled}  ;;\nesac\n')
    ncu.chmod(0o755)
    script = GPU / "profile_ncu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert subprocess.run(["bash", "-n", str(GPU / "gpu_run.sh")]).returncode == 0
    env = dict(os.environ, NCU=str(ncu), PYTHON=sys.executable, CASE_ARGS="--smoke --reps 1")
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = (tmp_path / "out" / "profile.md").read_text()
    assert "## torch.profiler" in md and "## Compiled kernel" in md
    if fake == "ok":
        assert "path: Nsight Compute (Version 2099.1 (stand-in))" in md
        assert "| math_pipe_throttle | 4.5 | 45.0% |" in md and "| Achieved occupancy | 12.31 | % |" in md
        assert (tmp_path / "out" / "profile.ncu-rep").exists()
    else:
        assert "path: fallback" in md and "ERR_NVGPUCTRPERM" in md and "## Nsight Compute" not in md


FAKE_ADASPLASH = """# A stand-in for AdaSplash: its two entry points, computing the float64 reference.
import math

import torch

from sparse_attn import mappings

__version__ = "0.0-stub"


def _attend(q, k, v, alpha, is_causal):
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and q.shape == k.shape == v.shape
    n = q.shape[2]
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return (mappings.entmax(s, alpha=alpha, dim=-1) @ v.double()).to(q.dtype)


def adasplash_v1(q, k, v, alpha=1.5, is_causal=False, varlen=None, niter=10):
    return _attend(q, k, v, alpha, is_causal)


def adasplash_v2(q, k, v, niter=1, varlen=None):
    return _attend(q, k, v, 1.5, True)
"""


def test_headline_dry_run_of_the_first_gpu_call(tmp_path):
    """The GPU headline run rehearsed on the CPU: ``gpu_run.sh`` MODE=headline with the smoke shapes (one causal case
    of one sequence, two heads; the smoke tests skipped, the parallel warm-up in subprocesses, the timings with the
    interpreter), every file written, every timed path within the check's bound, and no kernel built after the
    warm-up (none at all here). The kernels' numbers are tested elsewhere: one sequence of two heads is enough to run
    every alpha class's forward and backward through the script. AdaSplash is a stand-in module on ``PYTHONPATH``
    (the float64 reference under its two entry points): its rows are built in the warm-up and checked like ours, and
    the one it cannot run (AdaSplash-2 below N = 64) says why; the adasplash group's case at this size shares every
    build with the headline case, and its unreachable block-sparsity target is reported as missed."""
    out = tmp_path / "out"
    fake = tmp_path / "site" / "adasplash"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_ADASPLASH)
    env = dict(os.environ, PYTHON=sys.executable, SKIP_TESTS="1", TOTAL_S="600", WARM_JOBS="2", BENCH_COMMIT="dry-run",
               PYTHONPATH=os.pathsep.join([str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]),
               HEADLINE_ARGS="--smoke --seqs 32 --head-dims 16 --tokens 32 --hidden 32 --causal true "
                             "--groups headline,adasplash --sweep-seqs 32 --block-sparsity 0.5")
    root = BENCHMARKS.parent
    res = subprocess.run(["bash", str(GPU / "gpu_run.sh"), str(out)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for name in ("env.txt", "headline.log", "headline.md", "headline.csv", "headline.png"):
        assert (out / name).stat().st_size > 0, name
    log = (out / "headline.log").read_text()
    assert "warm-up: 6 (case, method) pairs in 2 processes" in log and "warm-up processes failed" not in log
    assert "kernels built during the timings: 0" in log
    assert "block sparsity: target 0.5, realized 0.0000" in log and "more than 3 points from the target" in log
    lines = [ln for ln in (out / "headline.csv").read_text().splitlines() if not ln.startswith("#")]
    import csv

    rows = list(csv.DictReader(lines))
    ours = [r for r in rows if r["method"] == "sparse_attn" and r["group"] == "headline"]
    assert {r["alpha"] for r in ours} == {"1", "1.5", "2", "learnable"}
    assert all(r["status"] == "ok" and r["check"] in ("ok", "ok (tol)") for r in ours), ours
    assert all(float(r["passes_mean"]) >= 1 for r in ours)
    flash = [r for r in rows if r["backend"] == "flash" and r["status"] == "ok" and not r["target_density"]]
    assert flash and all(r["check"] == "ok" for r in flash)
    v1 = [r for r in rows if r["method"] == "adasplash_v1"]
    assert {(r["group"], r["alpha"]) for r in v1} == {("headline", "1.5"), ("headline", "2"), ("adasplash", "1.5")}
    assert all(r["status"] == "ok" and r["backend"] == "0.0-stub" for r in v1), v1
    # (at the strength of an unreachable target, scores ~1e3, float32 rounding of the scores exceeds the check's bound)
    assert all(r["check"] == "ok" for r in v1 if not r["target_density"]), v1
    v2 = [r for r in rows if r["method"] == "adasplash_v2"]
    assert v2 and all(r["status"] == "unavailable" and "N >= 64" in r["note"] for r in v2), v2
    swept = [r for r in rows if r["group"] == "adasplash"]
    assert {r["target_density"] for r in swept} == {"", "0.5"}
    assert all(float(r["block_sparsity"]) == 0 for r in swept) and all(r["block_sparsity_with_mask"] for r in swept)
    assert "commit: dry-run" in (out / "env.txt").read_text()


def test_decode_gpu_timings_run_the_compiled_kernels():
    """``decode.py --gpu`` must not inherit passes.py's interpreter default (it did on the first GPU run)."""
    root = BENCHMARKS.parent
    code = ("import os, sys; sys.argv = ['decode.py', '--gpu']; sys.path.insert(0, 'benchmarks/offline'); "
            "os.environ.pop('TRITON_INTERPRET', None); import decode; print(os.environ['TRITON_INTERPRET'])")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "0"


@pytest.mark.parametrize("causal, target", [(True, 0.5), (True, 0.64), (False, 0.6)])
def test_headline_local_scores_reach_the_block_sparsity_target(causal, target):
    """The local scores' calibration: the strength it returns gives inputs whose realized 64 x 64 block sparsity,
    counted by brute force on every head from the float64 weights, is within 3 points of the target."""
    sys.path.insert(0, str(HARNESS.parent))
    headline = _load(GPU / "headline.py", "headline")
    from bench_cases import Case, make_inputs

    case = Case("adasplash", 1, 2, 1024, 1024, 16, causal, "fp32", target_density=target, alpha="1.5")
    inputs = make_inputs(case, "cpu")
    strength = headline.calibrate_local(case, inputs, heads=1, tol=0.01)
    headline.add_positions(inputs, strength)
    q, k = inputs.q.detach()[0].double(), inputs.k.detach()[0].double()
    keep = causal_keep(1024, 1024, "cpu") if causal else torch.ones(1024, 1024, dtype=torch.bool)
    p = sparse_entmax15(((q @ k.transpose(-1, -2)) * 16 ** -0.5).masked_fill(~keep, -math.inf))
    tiles = (p > 0).reshape(2, 16, 64, 16, 64).any(4).any(2)
    region = keep.reshape(16, 64, 16, 64).any(3).any(1).expand(2, 16, 16)
    realized = int((region & ~tiles).sum()) / int(region.sum())
    assert abs(realized - target) <= 0.03, (strength, realized)
    measured = headline.block_sparsity(inputs.q.detach()[0], inputs.k.detach()[0], 1.5, causal)
    assert measured["block_sparsity"] == pytest.approx(realized, abs=1e-12)
    masked = int((~region).sum())
    assert measured["block_sparsity_with_mask"] == pytest.approx(
        (float((region & ~tiles).sum()) + masked) / region.numel(), abs=1e-12)


def test_isolated_tests_rerun_a_cuda_error_without_tma(tmp_path):
    """``isolated_tests.py`` runs each selected test in its own process and writes a row as each ends; a test that
    failed with a CUDA error or timed out (a hung barrier) runs once more with ``SPARSE_ATTN_TMA=0`` (here it then
    passes: a TMA fault), a plain assertion failure does not, nor a test that timed out compiling (its stack dump,
    written before the limit, shows Triton's compiler); each timeout's row says where its stack stood."""
    slow = tmp_path / "site" / "triton" / "compiler" / "slow_build.py"
    slow.parent.mkdir(parents=True)
    slow.write_text("import time\n\n\ndef build():\n    time.sleep(60)\n")
    fake = tmp_path / "test_fake_gpu.py"
    fake.write_text(
        "import os\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_tma_fault():\n"
        "    if os.environ.get('SPARSE_ATTN_TMA') != '0':\n"
        "        raise RuntimeError('CUDA error: an illegal memory access was encountered')\n\n\n"
        "@pytest.mark.gpu\ndef test_wrong():\n    assert 1 == 2\n\n\n"
        "@pytest.mark.gpu\ndef test_hang():\n    import time\n"
        "    time.sleep(0 if os.environ.get('SPARSE_ATTN_TMA') == '0' else 60)\n\n\n"
        "@pytest.mark.gpu\ndef test_build():\n    import importlib.util\n"
        f"    spec = importlib.util.spec_from_file_location('slow_build', {str(slow)!r})\n"
        "    module = importlib.util.module_from_spec(spec)\n    spec.loader.exec_module(module)\n"
        "    module.build()\n")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(GPU / "isolated_tests.py"), "--out", str(out), "--jobs", "1",
                          "--no-launch-blocking", "--per-test-s", "8", "--root", str(tmp_path), fake.name],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.split("\t") for line in (out / "summary.tsv").read_text().splitlines()[1:]]
    outcomes = {row[1].split("::")[-1]: row[2] for row in rows}
    assert outcomes == {"test_tma_fault": "FAILED", "test_tma_fault [SPARSE_ATTN_TMA=0]": "passed",
                        "test_wrong": "FAILED", "test_hang": "TIMEOUT", "test_hang [SPARSE_ATTN_TMA=0]": "passed",
                        "test_build": "TIMEOUT"}, rows
    fault = next(row for row in rows if row[1].endswith("test_tma_fault"))
    assert "illegal memory access" in fault[5] and fault[6] == f"{int(fault[0]):03d}.log"
    assert "test_tma_fault [SPARSE_ATTN_TMA=0]" in (out / "logs" / f"{int(fault[0]):03d}-notma.log").read_text()
    assert "4 run and 2 rerun without TMA" in (out / "summary.md").read_text()
    first = {row[1].split("::")[-1]: row[5] for row in rows}
    assert first["test_build"] == "timeout while compiling kernels (stack dump)", first
    assert first["test_hang"].startswith("timeout in File") and "test_fake_gpu.py" in first["test_hang"], first
    # a continuation leaves out what this run passed: only the failures and time-outs are selected again
    isolated = _load(GPU / "isolated_tests.py", "isolated_tests")
    assert isolated.passed_in([out / "summary.tsv"]) == set()
    (out / "later.tsv").write_text("n\tnodeid\toutcome\n0\ttest_fake_gpu.py::test_wrong\tpassed\n"
                                   "1\ttest_fake_gpu.py::test_hang [SPARSE_ATTN_TMA=0]\tpassed\n")
    assert isolated.passed_in([out / "summary.tsv", out / "later.tsv"]) == {"test_fake_gpu.py::test_wrong"}
