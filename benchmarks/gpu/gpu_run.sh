#!/usr/bin/env bash
# The one script a GPU run needs, one call per MODE:
#
#   bash benchmarks/gpu/gpu_run.sh [OUT_DIR]                # MODE=headline (default): smoke tests + headline cases
#   MODE=tests bash benchmarks/gpu/gpu_run.sh [OUT_DIR]     # the gpu-marked tests only (make test-gpu), logged
#   MODE=isolated bash benchmarks/gpu/gpu_run.sh [OUT_DIR]  # gpu and gpu_smoke tests, one process each (isolated_tests.py)
#   MODE=bench bash benchmarks/gpu/gpu_run.sh [OUT_DIR]     # gpu-marked tests, then the full grid
#   MODE=tune bash benchmarks/gpu/gpu_run.sh [OUT_DIR]      # launch-config sweep (benchmarks/gpu/tune_tiles.py)
#   MODE=profile bash benchmarks/gpu/gpu_run.sh [OUT_DIR]   # one forward case under Nsight Compute (profile_ncu.sh)
#   MODE=decode bash benchmarks/gpu/gpu_run.sh [OUT_DIR]    # decode steps vs SDPA (benchmarks/offline/decode.py --gpu), host time by stage (decode_host.py --device cuda)
#
# OUT_DIR defaults to $OUT (the device tool's return folder), else benchmarks/results/<gpu-name>/ (bench),
# .../<gpu-name>/<mode>/ (headline, tune, profile, decode). It receives:
#   headline: env.txt, pytest_smoke.log, headline.log, headline.md, headline.csv, headline.png and, when it fits
#            in 15 MB, triton-cache.tgz (the kernels built there, to start the next run warm); a cache built offline
#            in .triton-sm90/ (benchmarks/gpu/precompile.py) is installed into TRITON_CACHE_DIR first, and headline.log
#            says how many kernels the warm-up loaded from it and how many it compiled
#   tests:   pytest_gpu.log (the GPU, versions and commit first, then pytest's output with --durations=25)
#   isolated: env.txt, isolated.log, summary.md, summary.tsv, logs.tgz (logs/<n>.log, one per test, packed: a
#            remote run's output folder may come back as a few files only; see isolated_tests.py)
#   bench:   pytest_gpu.log, bench.log, results.md, results.csv and three plot_*.png (7 files)
#   tune:    tune.log, tune.md, tune.csv
#   profile: profile.md, profile.log; with ncu also ncu.log, ncu_details.csv, ncu_raw.csv, profile.ncu-rep
#   decode:  decode.md (GPU, driver, commit, command, then one table per dtype)
# Environment knobs:
#   MODE            headline, tests, isolated, bench, tune, profile or decode (default headline)
#   ISOLATED_ARGS   extra arguments for benchmarks/gpu/isolated_tests.py (e.g. "--jobs 14 -m gpu")
#   SMOKE_TIMEOUT_S cap on the gpu_smoke tests of MODE=headline (default 150), run while the kernels build
#                   (SKIP_TESTS=1 skips them)
#   HEADLINE_ARGS   extra arguments for benchmarks/gpu/headline.py (e.g. "--seqs 4096 --groups headline")
#   PYTHON          interpreter holding a CUDA torch (default python3)
#   TOTAL_S         wall-clock budget of the whole script in seconds (default 570, under a 600 s call)
#   TEST_TIMEOUT_S  cap on the gpu-marked tests (default 200); SKIP_TESTS=1 skips them
#   PYTEST_WORKERS  pytest-xdist workers for the tests (default 4; MODE=tests 8)
#   PYTEST_SELECT   what pytest runs (default "-m gpu tests"; "tests" runs the whole suite on the GPU)
#   BENCH_ARGS      extra arguments for benchmarks/harness/bench_attention.py (e.g. "--groups flash")
#   RESUME_FROM     results.csv (tune: tune.csv) of a run cut short by the budget: its rows are kept, the rest is run
#   TUNE_ARGS       extra arguments for benchmarks/gpu/tune_tiles.py (e.g. "--head-dims 64 --modes fwd")
#   CASE_ARGS       extra arguments for benchmarks/gpu/profile_case.py (e.g. "--config 128x64w8s2"; profile_ncu.sh)
#   DECODE_ARGS     arguments for benchmarks/offline/decode.py --gpu (default "--dtype bf16")
#   BENCH_COMMIT    commit to stamp when the copy has no .git (e.g. the output of git rev-parse HEAD)
# Wheels found in .whl/ (entmax, adasplash; see benchmarks/README.md) are installed to /tmp first (.whl/ is
# ignored by git: a device call carries it only when named, carry: [".whl"]).
# AdaSplash side by side (its causal alpha 1.5 sweep, benchmarks/README.md):
#   MODE=headline SKIP_TESTS=1 TOTAL_S=420 WARM_JOBS=12 HEADLINE_ARGS="--groups adasplash" bash benchmarks/gpu/gpu_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-570}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bench_site .whl/*.whl \
    && export PYTHONPATH=/tmp/bench_site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import sparse_attn.kernels" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "gpu_run: editable install failed"
fi
if ! "$PY" -c "import sparse_attn.kernels" 2>/dev/null; then
  # this machine's copy of the checkout only: make the package-dir mapping a real subpackage
  ln -sfn ../kernels sparse_attn/kernels && echo "gpu_run: linked sparse_attn/kernels -> kernels"
fi

MODE=${MODE:-headline}
OUT_DIR=${1:-${OUT:-}}
if [ -z "$OUT_DIR" ]; then
  slug=$("$PY" -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
  OUT_DIR=benchmarks/results/$slug
  if [ "$MODE" != "bench" ]; then
    OUT_DIR=$OUT_DIR/$MODE
  fi
fi
mkdir -p "$OUT_DIR"
resume=()
if [ -n "${RESUME_FROM:-}" ]; then
  resume=(--resume-from "$RESUME_FROM")
fi

case "$MODE" in
  bench) ;;
  headline)
    # one build per kernel (the pinned launch configs, no autotuning), into a cache that can travel back
    export SPARSE_ATTN_PINNED=${SPARSE_ATTN_PINNED:-1}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
    mkdir -p "$TRITON_CACHE_DIR"
    {
      # the kernels built offline (benchmarks/gpu/precompile.py), copied with their paths rewritten: Triton's cache
      # names its files by absolute path, so a folder used where it was not built misses
      if [ -d .triton-sm90 ]; then "$PY" benchmarks/gpu/precompile.py --out .triton-sm90 --install "$TRITON_CACHE_DIR"; fi
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      "$PY" -c "import sys, torch, triton, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
      echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
      echo "TRITON_CACHE_DIR=$TRITON_CACHE_DIR ($(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels) SPARSE_ATTN_PINNED=$SPARSE_ATTN_PINNED"
      nproc
    } 2>&1 | tee "$OUT_DIR/env.txt"
    # the kernels of the timed cases build in parallel processes while the smoke tests run; no timing starts
    # before both are done (the smoke tests use the GPU too)
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu/headline.py --out "$OUT_DIR" --warm-only --jobs "${WARM_JOBS:-10}" ${HEADLINE_ARGS:-} \
      > "$OUT_DIR/headline.log" 2>&1 &
    warm_pid=$!
    if [ "${SKIP_TESTS:-0}" != "1" ]; then
      timeout "${SMOKE_TIMEOUT_S:-150}" "$PY" -m pytest -q -n "${PYTEST_WORKERS:-6}" -p no:cacheprovider -m gpu_smoke \
        tests/test_gpu_smoke.py 2>&1 | tee "$OUT_DIR/pytest_smoke.log"
      echo "gpu_run: smoke tests exit status ${PIPESTATUS[0]} (124 = hit SMOKE_TIMEOUT_S) after $(( SECONDS - START )) s" \
        | tee -a "$OUT_DIR/pytest_smoke.log"
    fi
    wait "$warm_pid"
    echo "gpu_run: warm-up exit status $? after $(( SECONDS - START )) s" | tee -a "$OUT_DIR/headline.log"
    grep -h "^shipped cache\|^Triton cache" "$OUT_DIR/headline.log"
    left=$(( TOTAL_S - (SECONDS - START) ))
    {
      # shellcheck disable=SC2086
      timeout $(( left - 20 )) "$PY" benchmarks/gpu/headline.py --out "$OUT_DIR" ${HEADLINE_ARGS:-} --jobs 0 \
        --budget-s $(( left > 90 ? left - 45 : left / 2 ))
      echo "gpu_run: headline exit status $? after $(( SECONDS - START )) s"
    } 2>&1 | tee -a "$OUT_DIR/headline.log"
    size=$(du -sm "$TRITON_CACHE_DIR" | cut -f1)
    if [ "$size" -lt 60 ]; then
      tar czf /tmp/triton-cache.tgz -C "$TRITON_CACHE_DIR" . && \
        if [ "$(du -m /tmp/triton-cache.tgz | cut -f1)" -lt 15 ]; then cp /tmp/triton-cache.tgz "$OUT_DIR/"; fi
    fi
    exit 0
    ;;
  tune)
    left=$(( TOTAL_S - (SECONDS - START) ))
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      # shellcheck disable=SC2086
      timeout $(( left - 10 )) "$PY" benchmarks/gpu/tune_tiles.py --out "$OUT_DIR" --budget-s $(( left - 60 )) \
        ${resume[@]+"${resume[@]}"} ${TUNE_ARGS:-}
      echo "gpu_run: tune exit status $? (124 = killed at the time limit; tune.csv holds every finished row)"
    } 2>&1 | tee "$OUT_DIR/tune.log"
    exit "${PIPESTATUS[0]}"
    ;;
  tests)
    left=$(( TOTAL_S - (SECONDS - START) ))
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      "$PY" -c "import sys, torch, triton, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
      echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
      echo "command: pytest -q -n ${PYTEST_WORKERS:-8} -m gpu --durations=25 tests"
      timeout $(( left - 10 )) "$PY" -m pytest -q -n "${PYTEST_WORKERS:-8}" -p no:cacheprovider -m gpu --durations=25 tests
      echo "gpu_run: pytest exit status $? (124 = killed at the time limit) after $(( SECONDS - START )) s"
    } 2>&1 | tee "$OUT_DIR/pytest_gpu.log"
    exit "${PIPESTATUS[0]}"
    ;;
  isolated)
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
    # one build per kernel, the pinned config (autotuning builds three: at 01466f6, with 14 tests at a time, 6 tests
    # ran past 440 s in two runs and 37 of 119 did not finish; SPARSE_ATTN_PINNED=0 tests the autotuned launches)
    export SPARSE_ATTN_PINNED=${SPARSE_ATTN_PINNED:-1}
    mkdir -p "$TRITON_CACHE_DIR"
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      "$PY" -c "import sys, torch, triton, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
      echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
      echo "command: python benchmarks/gpu/isolated_tests.py ${ISOLATED_ARGS:-}"
      echo "SPARSE_ATTN_PINNED=$SPARSE_ATTN_PINNED"
      nproc
    } 2>&1 | tee "$OUT_DIR/env.txt"
    left=$(( TOTAL_S - (SECONDS - START) ))
    # shellcheck disable=SC2086
    timeout $(( left - 5 )) "$PY" benchmarks/gpu/isolated_tests.py --out "$OUT_DIR" --budget-s $(( left - 40 )) \
      ${ISOLATED_ARGS:-} 2>&1 | tee "$OUT_DIR/isolated.log"
    status=${PIPESTATUS[0]}
    tar czf "$OUT_DIR/logs.tgz" -C "$OUT_DIR" logs && rm -rf "$OUT_DIR/logs"
    exit "$status"
    ;;
  profile)
    left=$(( TOTAL_S - (SECONDS - START) ))
    BUDGET_S=$(( left - 10 )) timeout "$left" bash benchmarks/gpu/profile_ncu.sh "$OUT_DIR"
    exit $?
    ;;
  decode)
    left=$(( TOTAL_S - (SECONDS - START) ))
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      echo "commit: ${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
      echo "command: python benchmarks/offline/decode.py --gpu ${DECODE_ARGS:---dtype bf16}"
      # shellcheck disable=SC2086
      timeout $(( left - 10 )) "$PY" benchmarks/offline/decode.py --gpu ${DECODE_ARGS:---dtype bf16}
      echo "gpu_run: decode exit status $?"
      echo "command: python benchmarks/harness/decode_host.py --device cuda --steps 200"
      timeout $(( TOTAL_S - (SECONDS - START) - 5 )) "$PY" benchmarks/harness/decode_host.py --device cuda --steps 200
      echo "gpu_run: decode_host exit status $?"
    } 2>&1 | tee "$OUT_DIR/decode.md"
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "gpu_run: MODE must be headline, tests, isolated, bench, tune, profile or decode, got '$MODE'" >&2
    exit 2
    ;;
esac

if [ "${SKIP_TESTS:-0}" != "1" ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT_S:-200}" "$PY" -m pytest -q -n "${PYTEST_WORKERS:-4}" -p no:cacheprovider ${PYTEST_SELECT:--m gpu tests} \
    2>&1 | tee "$OUT_DIR/pytest_gpu.log"
  echo "gpu_run: pytest exit status ${PIPESTATUS[0]} (124 = hit TEST_TIMEOUT_S)" | tee -a "$OUT_DIR/pytest_gpu.log"
fi

left=$(( TOTAL_S - (SECONDS - START) ))
budget=$(( left - 90 ))
if [ "$budget" -lt 30 ]; then
  echo "gpu_run: only ${left}s left, not starting the benchmark" | tee "$OUT_DIR/bench.log"
  exit 1
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  # shellcheck disable=SC2086
  timeout $(( left - 10 )) "$PY" benchmarks/harness/bench_attention.py --out "$OUT_DIR" --budget-s "$budget" ${resume[@]+"${resume[@]}"} ${BENCH_ARGS:-}
  echo "gpu_run: benchmark exit status $?"
} 2>&1 | tee "$OUT_DIR/bench.log"
