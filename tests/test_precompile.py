"""``benchmarks/gpu/precompile.py``: the sm_90 cache it fills offline is the one the JIT looks up at launch.

One headline case (bf16, N 64, head dim 32, not causal), the softmax class's forward and backward (three kernels:
the forward with ``out_u``, which the statistics' forward shares, dQ, dK/dV), built by two processes into a folder
and installed (copied, paths rewritten) into another: the same launches replayed against the stand-in sm_90 driver
compile nothing; the forward with another constexpr (causal) compiles, and so does the forward against the built
folder moved without the install (Triton's cache names its files by absolute path). The script builds real sm_90
kernels (``TRITON_INTERPRET=0``), so each step is a subprocess: the test session runs the kernels under the
interpreter (tests/conftest.py).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu", "precompile.py")
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
# the script builds this checkout's kernels, whichever copy of the package is installed
_ENV = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
            PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
_ENV.pop("SPARSE_ATTN_FWD_SPLIT", None)  # the launcher's default forward per alpha class, as a GPU run has it
_SUBSET = ["--seqs", "64", "--head-dims", "32", "--tokens", "64", "--hidden", "64", "--groups", "headline", "--causal",
           "false", "--methods", "1"]


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, _SCRIPT, *args], env=_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=300)
    if "ptxas" in stderr and "not found" in stderr:
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return stdout


def _run(*args) -> str:
    return _finish(_start(*args))


def _replays(*runs) -> list[dict]:
    """The compile summaries (``--check``) of the subset's launches, one per ``(cache, *args)``, run side by side."""
    procs = [_start("--out", str(cache), "--check", *_SUBSET, *args) for cache, *args in runs]
    return [json.loads(_finish(p).strip().splitlines()[-1]) for p in procs]


def test_the_jit_loads_the_offline_build_and_compiles_nothing(tmp_path):
    built, installed, moved = tmp_path / "built", tmp_path / "installed", tmp_path / "moved"
    out = _run("--out", str(built), "--jobs", "2", *_SUBSET)
    manifest = json.loads((built / "manifest.json").read_text())
    kernels = {k["kernel"]: k for k in manifest["kernels"]}
    n = len(manifest["kernels"])
    assert n == 3 and f"precompile: {n} kernels for sm_90" in out and "(the check compiled 0)" in out, out
    assert set(kernels) == {"_entmax_attn_fwd_kernel", "_entmax_attn_bwd_dq_kernel", "_entmax_attn_bwd_dkdv_kernel"}
    assert kernels["_entmax_attn_fwd_kernel"]["constexprs"]["ALPHA_CLASS"] == 0
    assert manifest["kernels_sha256"] and manifest["triton_key_sha256"]
    for k in kernels.values():  # binary, metadata, group
        assert sorted(p.suffix for p in (built / k["dir"]).iterdir()) == [".cubin", ".json", ".json"]

    _run("--out", str(built), "--install", str(installed))
    shutil.move(built, moved)  # the groups still name the files under built/
    hit, causal, missed = _replays((installed,), (installed, "--forward-only", "--causal", "true"),
                                   (moved, "--forward-only"))
    assert (hit["kernels"], hit["compiled"], hit["loaded"]) == (n, 0, n), hit
    assert (hit["shipped"], hit["shipped_used"]) == (n, n)
    # MASK differs: another kernel
    assert (causal["kernels"], causal["compiled"], causal["shipped_used"]) == (1, 1, 0), causal
    assert missed["compiled"] == 1, missed


def test_the_split_forward_stages_are_built_and_found(tmp_path):
    """The split forward's two launches (alpha 1.5 by default: a threshold kernel, then a value kernel, the forward
    kernel's ``STAGE`` 1 and 2) are what the cache holds for the alpha = 1.5 training forward, and replaying the
    launches against it compiles nothing."""
    from sparse_attn.kernels._args import ALPHA_CLASSES
    from sparse_attn.kernels.attn.entmax_attn_fwd import SPLIT_CLASSES

    assert "entmax15" in SPLIT_CLASSES and _SUBSET[-2:] == ["--methods", "1"]
    built = tmp_path / "built"
    subset = _SUBSET[:-2] + ["--methods", "1.5", "--forward-only"]
    out = _run("--out", str(built), "--jobs", "1", *subset)
    assert "(the check compiled 0)" in out, out
    manifest = json.loads((built / "manifest.json").read_text())
    stages = sorted((k["kernel"], k["constexprs"]["STAGE"], k["constexprs"]["ALPHA_CLASS"])
                    for k in manifest["kernels"])
    assert stages == [("_entmax_attn_fwd_kernel", s, ALPHA_CLASSES["entmax15"]) for s in (1, 2)], stages
    hit = json.loads(_run("--out", str(built), "--check", *subset).strip().splitlines()[-1])
    assert (hit["kernels"], hit["compiled"], hit["loaded"]) == (2, 0, 2), hit
