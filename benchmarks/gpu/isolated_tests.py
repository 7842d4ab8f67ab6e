"""Run the GPU-marked tests one pytest process per test, several at a time, each result written as it ends.

One CUDA "illegal memory access" poisons the whole process that met it, so under ``pytest -n 8`` one bad kernel
fails every later test of its worker and the log cannot say which test was first. Here every test owns its
process (``CUDA_LAUNCH_BLOCKING=1`` by default, so the error is raised at the launch that caused it), the tests of
different files run side by side (so parallel processes rarely compile the same kernel at once; the Triton disk
cache is shared), and each test's log and a summary row are written the moment it ends, so a run cut by a time
limit still names every test that finished. A test that fails with a CUDA error runs once more, next, with
``SPARSE_ATTN_TMA=0`` (every kernel on pointer loads instead of TMA descriptors; its row says so), which tells a TMA
fault from any other (``--no-tma-retry`` skips that).

    python benchmarks/gpu/isolated_tests.py --out DIR [--jobs 12] [--budget-s 420] [--per-test-s 240] [-m EXPR]
                                            [--first PATTERN ...] [--no-tma-retry] [--skip-passed-in TSV ...]
                                            [--root DIR] [nodeid ...]

``--skip-passed-in`` leaves out the tests an earlier run's ``summary.tsv`` files record as passed or skipped (a run
that continues one its budget cut short, or reruns what failed).

DIR receives ``summary.tsv`` (nodeid, outcome, exit status, seconds, first error, log), ``logs/<n>.log`` (pytest's
-q --tb=short output of test n; ``<n>-notma.log`` its rerun without TMA) and ``summary.md`` (counts, then the failed
tests with their first error line).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def collect(select: str, nodeids: list[str], root: Path = ROOT) -> list[str]:
    """Node ids pytest would run from ``root`` for ``-m select`` (or the given ids), in collection order."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", select,
           *(nodeids or ["tests"])]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def interleave(ids: list[str], first: list[str]) -> list[str]:
    """Round-robin over test files (files matching a ``first`` pattern lead), so neighbours differ in file."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for nodeid in ids:
        by_file[nodeid.split("::")[0]].append(nodeid)
    files = sorted(by_file, key=lambda f: (not any(p in f for p in first), f))
    order = []
    for group in itertools.zip_longest(*(by_file[f] for f in files)):
        order.extend(n for n in group if n is not None)
    return order


# a failure the GPU raised (not an assertion): torch's "CUDA error: ...", Triton's "Triton Error [CUDA]: ..." (an
# "unspecified launch failure" is what a bad tensor map or barrier gives), Triton's "out of resource: shared memory";
# such a test, or one that timed out (a hung barrier), runs again without TMA descriptors (log ``NNN-notma.log``)
CUDA_ERROR = re.compile(r"illegal memory access|CUDA error|Triton Error \[CUDA\]|unspecified launch failure|"
                        r"misaligned address|out of resource|illegal instruction")


# a timed-out test whose stack dump shows Triton or ptxas compiling ran out of time building kernels: no TMA rerun
COMPILING = re.compile(r"triton/compiler/|triton/backends/nvidia/compiler\.py|ptxas")


def passed_in(summaries: list[Path]) -> set[str]:
    """Node ids that the ``summary.tsv`` files of earlier runs record as passed or skipped (reruns without TMA
    aside)."""
    done = set()
    for path in summaries:
        for line in path.read_text().splitlines()[1:]:
            cols = line.split("\t")
            if len(cols) > 2 and cols[2] in ("passed", "skipped") and " [" not in cols[1]:
                done.add(cols[1])
    return done


def first_error(log: str) -> str:
    """The most telling line of a failed test's log: a CUDA error, else the first ``E   `` line, else (a timeout's
    stack dump) whether it was compiling, else the innermost frame of the dump's first thread."""
    for pattern in (CUDA_ERROR, re.compile(r"^E\s+\S")):
        for line in log.splitlines():
            if pattern.search(line):
                return line.strip()[:240]
    if "Timeout (" in log:
        if COMPILING.search(log):
            return "timeout while compiling kernels (stack dump)"
        dump = log.split("Timeout (", 1)[1].splitlines()
        frames = [line.strip() for line in dump if line.strip().startswith("File ")]
        return ("timeout in " + frames[0])[:240] if frames else "timeout (stack dump)"
    tail = [line for line in log.splitlines() if line.strip()]
    return tail[-1].strip()[:240] if tail else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no test after this; kill all at it + 20 s")
    ap.add_argument("--per-test-s", type=float, default=240.0)
    ap.add_argument("-m", dest="select", default="gpu or gpu_smoke")
    ap.add_argument("--first", nargs="*", default=[], help="test files (substrings) to start first")
    ap.add_argument("--no-launch-blocking", action="store_true")
    ap.add_argument("--no-tma-retry", action="store_true",
                    help="do not rerun a test that met a CUDA error with SPARSE_ATTN_TMA=0")
    ap.add_argument("--skip-passed-in", nargs="*", type=Path, default=[],
                    help="summary.tsv files of earlier runs: leave out the tests they record as passed or skipped")
    ap.add_argument("--root", type=Path, default=ROOT, help="run pytest from here (default: the repository)")
    ap.add_argument("nodeids", nargs="*")
    args = ap.parse_args()

    start = time.monotonic()
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    done = passed_in(args.skip_passed_in)
    ids = interleave([n for n in collect(args.select, args.nodeids, args.root) if n not in done], args.first)
    print(f"isolated_tests: {len(ids)} tests, {args.jobs} at a time, budget {args.budget_s:.0f} s", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    if not args.no_launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    summary = open(out / "summary.tsv", "w", buffering=1)
    summary.write("n\tnodeid\toutcome\trc\tseconds\tfirst_error\tlog\n")
    lock = threading.Lock()
    queue = [(n, nodeid, {}) for n, nodeid in enumerate(ids)]
    rows: list[tuple[int, str, str, int, float, str, str]] = []
    procs: set[subprocess.Popen] = set()

    def worker():
        while True:
            with lock:
                if not queue or time.monotonic() - start > args.budget_s:
                    return
                n, nodeid, extra = queue.pop(0)
            t0 = time.monotonic()
            log_path = out / "logs" / (f"{n:03d}-notma.log" if extra else f"{n:03d}.log")
            label = nodeid + "".join(f" [{k}={v}]" for k, v in extra.items())
            limit = min(args.per_test_s, args.budget_s + 20 - (time.monotonic() - start))
            with open(log_path, "w") as log:
                log.write(f"# {label}\n")
                log.flush()
                # a test still running 15 s before its limit writes every thread's stack into its log (pytest's
                # faulthandler_timeout): compiling, waiting on the GPU or hung
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                     "-p", "no:randomly", "--tb=short", "-rfE", "-o", f"faulthandler_timeout={max(int(limit) - 15, 5)}",
                     nodeid],
                    cwd=args.root, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT)
                with lock:
                    procs.add(proc)
                try:
                    rc = proc.wait(timeout=max(limit, 1))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                    rc = 124 if rc != 0 else rc
                with lock:
                    procs.discard(proc)
            text = log_path.read_text(errors="replace")
            outcome = {0: "passed", 1: "FAILED", 5: "none-run", 124: "TIMEOUT"}.get(rc, f"ERROR{rc}")
            if rc == 0 and re.search(r"\bskipped\b", text) and not re.search(r"\bpassed\b", text):
                outcome = "skipped"
            row = (n, label, outcome, rc, round(time.monotonic() - t0, 1), first_error(text) if rc else "",
                   log_path.name)
            with lock:
                if rc and not extra and not args.no_tma_retry and (CUDA_ERROR.search(text) or (
                        rc == 124 and not COMPILING.search(text))):
                    queue.insert(0, (n, nodeid, {"SPARSE_ATTN_TMA": "0"}))
                rows.append(row)
                summary.write("\t".join(map(str, row)) + "\n")
                print(f"[{time.monotonic() - start:6.0f}s] {outcome:8s} {row[4]:6.1f}s {label}", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary.close()
    counts = defaultdict(int)
    for row in rows:
        counts[row[2]] += 1
    not_run = [nodeid + "".join(f" [{k}={v}]" for k, v in extra.items()) for _, nodeid, extra in queue]
    with open(out / "summary.md", "w") as md:
        retried = sum(1 for row in rows if "[SPARSE_ATTN_TMA=0]" in row[1])
        md.write(f"{len(ids)} tests selected ({args.select!r}), {len(rows) - retried} run and {retried} rerun without "
                 f"TMA in {time.monotonic() - start:.0f} s, "
                 f"{len(not_run)} not started (budget); "
                 + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + "\n\n")
        for row in sorted(rows):
            if row[2] not in ("passed", "skipped"):
                md.write(f"- `{row[1]}` {row[2]} ({row[4]} s, logs/{row[6]}): {row[5]}\n")
        if not_run:
            md.write("\nNot started:\n" + "".join(f"- `{n}`\n" for n in not_run))
    print((out / "summary.md").read_text(), flush=True)
    return 0 if all(r[2] in ("passed", "skipped") for r in rows) and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
