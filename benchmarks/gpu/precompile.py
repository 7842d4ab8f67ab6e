"""Fill a Triton cache for sm_90 (H100 / H200) on a machine without a GPU, with every kernel the GPU headline run
builds, so that the GPU's minutes are not spent compiling.

What is built: every launch of the fused kernels that ``headline.py`` makes with the same arguments (its defaults, or
the ones given here: ``--seqs``, ``--head-dims``, ``--groups``, ...): per (case, method) of ``sparse_attn`` the
training forward, forward + backward and the statistics' forward (``headline.run_case_once``; at alpha 1.5 and 2 the
forward is the split forward's two launches, the kernel's ``STAGE`` 1 and 2, as the launcher's default), with the
pinned launch configs (``SPARSE_ATTN_PINNED=1``, as ``gpu_run.sh`` MODE=headline runs); ``--methods`` and
``--forward-only`` take a subset (the CPU tests'). The launchers run on the headline's own inputs, on the CPU (no
kernel reads them), against a stand-in driver that names the target ``GPUTarget("cuda", 90, 32)``; each
``kernel[grid](...)`` goes through the JIT's own path (binder, specialization of stride-1 / 16-divisible arguments,
options, cache lookup) as a ``warmup``, which compiles into ``TRITON_CACHE_DIR`` and launches nothing. So the cache
keys are the ones the JIT computes at launch on the GPU, provided the GPU's Triton computes the same ``triton_key()``:
the same version, and the same ``_C/libtriton.so``, which differs between the wheels of two Python versions. The GPU
machine runs Python 3.12 with triton 3.6.0; build with triton 3.6.0 importable and pass its cp312 wheel with
``--device-wheel``: the key then uses that wheel's ``libtriton.so`` hash (from its RECORD, after checking that every
other file the key hashes is identical here). The GPU's own key is compared with the manifest's at the start of
``headline.py``.

A venv with the device's Triton (torch from the project's venv serves)::

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    pip download triton==3.6.0 --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d /tmp/wheels312
    PYTHONPATH=/tmp/t36/lib/python3.11/site-packages .venv/bin/python benchmarks/gpu/precompile.py \\
        --device-wheel /tmp/wheels312/triton-3.6.0-cp312-*.whl

Writes into ``--out`` (default ``.triton-sm90/`` in the repo root, git-ignored): the cache entries, only the
``.cubin`` and metadata ``.json`` of each (``--keep-ir`` keeps the IRs), and ``manifest.json``: the Triton version and
key, the commit, a hash of ``kernels/**/*.py``, the headline arguments, and per kernel its name, cache hash, warps,
stages, shared memory, constexprs and 16-divisible arguments. The build is additive while the kernel sources and the
Triton key stay the same (``--fresh`` empties the folder first); a manifest of other sources or another key is
replaced. ``--jobs`` processes compile (each kernel once: a kernel belongs to the process its JIT key hashes to), then
one process replays every launch against the cache and must compile nothing; it prints the number of kernels and the
folder's size. Under triton 3.6 a kernel's cache key also depends on the JIT functions its process hashed before it
(a callee's ``tl.constexpr`` globals enter the caller's key only if the callee was hashed first; 3.9 fixed it): every
process here hashes the kernels in launch order (forward, dQ, dK/dV), as each headline process on the GPU does.

Triton's cache groups name their files by absolute path, so a cache moved to another folder misses. On the GPU,
``--install DEST`` copies the folder to ``DEST`` with the paths rewritten (``gpu_run.sh`` does it). ``--check``
replays the launches against ``--out`` and prints ``{"kernels": n, "compiled": m, ...}`` (the CPU test's probe).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder (triton_cache, headline) and the timing harness headline.py runs with (benchmarks/harness/)
sys.path[:0] = [str(HERE), str(HERE.parent / "harness")]

from triton_cache import (  # noqa: E402
    DEFAULT_OUT,
    MANIFEST,
    ROOT,
    folder_mib,
    install,
    kernels_digest,
    key_digest,
    prune,
    read_manifest,
    record_compiles,
    summarize,
    summary_line,
)


class OfflineDriver:
    """Stands in for Triton's CUDA driver without a GPU: it names the target and device 0, and launches nothing
    (the JIT runs every launch as a ``warmup``)."""

    def __init__(self, target):
        self.target = target

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass

    def get_current_stream(self, device=None) -> int:
        return 0


def use_device_triton_key(wheel: Path) -> str:
    """Make this process's ``triton_key()`` the one the device's Triton computes: the same, with the hash of the
    wheel's ``_C/libtriton.so`` (the only file the key hashes that differs between the wheels of two Python versions;
    the others are checked against the wheel's RECORD). Returns the wheel's Python tag."""
    import triton
    import triton.runtime.cache as cache

    root = Path(triton.__file__).resolve().parent
    with zipfile.ZipFile(wheel) as z:
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        record = z.read(record_name).decode()
    version = record_name.split("/")[0][len("triton-"):-len(".dist-info")]
    if version != triton.__version__:
        raise SystemExit(f"--device-wheel: triton {version} in {wheel.name}, but triton {triton.__version__} here")
    digests = {}
    for line in record.splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            b64 = digest[len("sha256="):]
            digests[path] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    keyed = [p for p in digests if p == "triton/runtime/cache.py" or (
        p.startswith(("triton/compiler/", "triton/backends/", "triton/language/")) and p.endswith(".py"))]
    keyed.append("triton/backends/nvidia/bin/ptxas")
    differ = [p for p in keyed if hashlib.sha256((root.parent / p).read_bytes()).hexdigest() != digests.get(p)]
    if differ:
        raise SystemExit(f"--device-wheel: files the cache key hashes differ from {wheel.name}: {differ[:5]}")
    lib = "triton/_C/libtriton.so"
    h = hashlib.sha256()
    with open(root.parent / lib, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    key = cache.triton_key()
    if key.count(h.hexdigest()) != 1:
        raise SystemExit("--device-wheel: this triton_key() does not hold the libtriton.so hash once")
    device_key = key.replace(h.hexdigest(), digests[lib])
    cache.triton_key = lambda: device_key
    return wheel.name.split("-")[2]


def set_up_offline(out: Path) -> None:
    """Environment of a build or check process, before anything imports Triton: compiled kernels (not the
    interpreter), the pinned launch configs, ``out`` as the cache."""
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["SPARSE_ATTN_PINNED"] = "1"
    os.environ["TRITON_CACHE_DIR"] = str(out.resolve())


def offline_sm90(args) -> str:
    """Route every JIT launch of this process to an sm_90 ``warmup`` (compile or load, no launch); returns what the
    build is for (the device wheel's Python tag or this interpreter's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    import sparse_attn.attn.attn_inputs as attn_inputs
    from sparse_attn.kernels import _args

    built_for = f"cp{sys.version_info.major}{sys.version_info.minor} (this interpreter)"
    if args.device_wheel is not None:
        built_for = use_device_triton_key(args.device_wheel) + f" (from {args.device_wheel.name})"
    driver.set_active(OfflineDriver(GPUTarget("cuda", 90, 32)))
    run = JITFunction.run

    def warmup_run(self, *a, grid, warmup, **kw):
        return run(self, *a, grid=grid, warmup=True, **kw)

    JITFunction.run = warmup_run
    # backend="triton" takes CPU tensors only under the interpreter; here they only carry shapes and strides
    attn_inputs.interpreting = lambda: True
    # the launchers ask the tensors' device whether it has TMA (here the CPU's: no); sm_90 has
    _args.tma_device = lambda device: True
    assert not triton.knobs.runtime.interpret
    return built_for


def replay(args, hargs) -> None:
    """Every launch of the fused kernels that ``headline.py`` makes for ``hargs``, on CPU tensors: one (case, method)
    per distinct build (``headline.warm_pairs``; AdaSplash's kernels are not prebuilt: its launches go through
    ``triton.autotune``, whose benchmarking needs a GPU, so they compile in the GPU run's warm-up)."""
    import headline
    from bench_methods import fused_forward_launcher

    fwd, missing = fused_forward_launcher()
    if missing:
        raise SystemExit(f"precompile: {missing}")
    cases = headline.cases_of(hargs)
    inputs, last = None, None
    for ci, mi in headline.warm_pairs(cases, peers=False):
        case, method = cases[ci], headline.methods_of(cases[ci], peers=False)[mi]
        if args.methods and method.alpha not in args.methods:
            continue
        if ci != last:
            inputs, last = headline.inputs_of(case, "cpu"), ci
        if args.forward_only:
            method.build(inputs)()
        else:
            headline.run_case_once(case, method, inputs, fwd)


def worker(args, hargs, index: int) -> int:
    """Compile the kernels whose JIT key hashes to ``index`` (of ``args.jobs``); skip the others."""
    import triton

    offline_sm90(args)

    def mine(*, key, fn, **_):
        # under triton 3.6 a kernel's key depends on which JIT functions the process hashed before it (a callee's
        # constexpr globals are merged before its hash is computed): hash in launch order, as the GPU's processes do
        _ = fn.jit_function.cache_key
        return zlib.crc32(str(key).encode()) % args.jobs != index  # True: not compiled here

    triton.knobs.runtime.jit_cache_hook = mine
    replay(args, hargs)
    return 0


def check(args, hargs) -> dict:
    """Replay every launch against the cache; returns the compile summary and what the manifest needs."""
    import triton

    built_for = offline_sm90(args)
    events: list[dict] = []
    record_compiles(events.append)
    replay(args, hargs)
    summary = summarize(events, read_manifest(args.out))
    return {**summary, "events": events, "triton": triton.__version__, "built_for": built_for,
            "triton_key_sha256": key_digest()}


def sub_run(args, extra: list[str], capture: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--jobs", str(args.jobs)]
    if args.device_wheel is not None:
        cmd += ["--device-wheel", str(args.device_wheel)]
    if args.methods:
        cmd += ["--methods", ",".join(args.methods)]
    if args.forward_only:
        cmd.append("--forward-only")
    return subprocess.Popen(cmd + extra + args.headline_args, cwd=ROOT,
                            stdout=subprocess.PIPE if capture else None, text=True)


def git_commit() -> str:
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "kernels"], cwd=ROOT, capture_output=True, text=True)
    return res.stdout.strip() + (" (kernels/ modified)" if dirty.stdout.strip() else "") if res.returncode == 0 else "?"


def build(args) -> int:
    """Compile in ``args.jobs`` processes, replay once more (it must compile nothing), write the manifest, prune."""
    begin = time.monotonic()
    old = read_manifest(args.out)
    digest = kernels_digest()
    if args.fresh or (old is not None and old.get("kernels_sha256") != digest):
        shutil.rmtree(args.out, ignore_errors=True)  # other kernel sources: none of its entries is hit
        old = None
    args.out.mkdir(parents=True, exist_ok=True)
    workers = [sub_run(args, [f"--worker={i}"]) for i in range(args.jobs)]
    failed = [i for i, p in enumerate(workers) if p.wait() != 0]
    if failed:
        raise SystemExit(f"precompile: worker(s) {failed} failed")
    built_s = time.monotonic() - begin
    p = sub_run(args, ["--check", "--events"], capture=True)
    out, _ = p.communicate()
    if p.returncode != 0:
        raise SystemExit("precompile: the check run failed")
    if kernels_digest() != digest:
        raise SystemExit("precompile: kernels/**/*.py changed during the build: its keys may be stale, rerun it")
    result = json.loads(out.strip().splitlines()[-1])
    kernels = {e["hash"]: {k: v for k, v in e.items() if k not in ("cache_hit", "compile_s")}
               for e in result["events"]}
    if old is not None and old.get("triton_key_sha256") != result["triton_key_sha256"]:
        for k in old.get("kernels", []):  # another Triton's: never hit
            if k["hash"] not in kernels:
                shutil.rmtree(args.out / k["dir"], ignore_errors=True)
        old = None
    kernels = {**{k["hash"]: k for k in (old or {}).get("kernels", [])}, **kernels}
    manifest = {
        "triton": result["triton"], "built_for": result["built_for"], "target": "cuda sm_90 (warp 32)",
        "triton_key_sha256": result["triton_key_sha256"], "commit": git_commit(), "kernels_sha256": digest,
        "pinned": True, "headline_args": sorted({*(old or {}).get("headline_args", []),
                                                 " ".join(args.headline_args) or "(defaults)"}),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "build_s": round(built_s, 1),
        "kernels": sorted(kernels.values(), key=lambda k: (k["kernel"], k["hash"])),
    }
    (args.out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if not args.keep_ir:
        prune(args.out)
    total = time.monotonic() - begin
    print(f"precompile: {len(kernels)} kernels for sm_90 ({result['built_for']}, triton {result['triton']}) in "
          f"{args.out}: {folder_mib(args.out):.1f} MiB; built in {built_s:.0f} s by {args.jobs} processes, checked "
          f"in {total - built_s:.0f} s (the check compiled {result['compiled']})", flush=True)
    if result["compiled"]:
        print("precompile: the check run compiled kernels the build did not: " + summary_line(result), flush=True)
        return 1
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other arguments are headline.py's (e.g. --seqs 4096 --groups headline).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the cache folder (default .triton-sm90/)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: cores)")
    p.add_argument("--device-wheel", type=Path, default=None,
                   help="the device's triton wheel (its Python tag), whose libtriton.so the cache key must hash")
    p.add_argument("--methods", default="", help="comma list of alphas among 1, 1.5, 2, learnable (default all)")
    p.add_argument("--forward-only", action="store_true", help="only the training forward of each (case, method)")
    p.add_argument("--fresh", action="store_true", help="empty the folder first")
    p.add_argument("--keep-ir", action="store_true", help="keep every IR of each entry (default: cubin and json)")
    p.add_argument("--check", action="store_true", help="replay against --out, print the compile summary as JSON")
    p.add_argument("--install", type=Path, default=None, metavar="DEST",
                   help="copy --out to DEST with the paths of its entries rewritten (on the GPU machine)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.headline_args = rest
    args.jobs = max(1, args.jobs)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.install is not None:
        n = install(args.out, args.install)
        print(f"precompile: installed {n} kernels from {args.out} into {args.install}", flush=True)
        return 0
    if args.worker is None and not args.check:
        return build(args)
    set_up_offline(args.out)
    import headline

    hargs = headline.parse_args(args.headline_args)
    if args.worker is not None:
        return worker(args, hargs, args.worker)
    result = check(args, hargs)
    if not args.events:
        result.pop("events")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
