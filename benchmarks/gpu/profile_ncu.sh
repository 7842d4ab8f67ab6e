#!/usr/bin/env bash
# Profile one case of the fused forward (alpha 1.5, N = 8192, head dim 128, bf16, 16k tokens; benchmarks/gpu/profile_case.py)
# with Nsight Compute; where ncu is missing or refused (ERR_NVGPUCTRPERM in containers), fall back to torch.profiler
# and the compiled kernel's registers / spills / shared memory. profile.md says which path ran and why.
#
#   bash benchmarks/gpu/profile_ncu.sh [OUT_DIR]
#
# OUT_DIR defaults to $OUT (the device tool's return folder), else benchmarks/results/<gpu-name>/profile/. It receives
# profile.md (the summary for docs/kernels.md) and profile.log; with ncu also ncu.log, ncu_details.csv
# (--csv --page details), ncu_raw.csv (--csv --page raw) and profile.ncu-rep (open it in Nsight Compute).
# The package must be importable (benchmarks/gpu/gpu_run.sh MODE=profile sets that up, then runs this script).
# Environment knobs:
#   PYTHON         interpreter holding a CUDA torch (default python3)
#   NCU            path of ncu (default: PATH, then /usr/local/cuda*/bin, /opt/nvidia/nsight-compute/*)
#   CASE_ARGS      extra profile_case.py arguments, e.g. "--config 128x64w8s2", "--inference", "--smoke" (CPU)
#   NCU_TIMEOUT_S  cap on each ncu attempt in seconds (default 240)
#   BUDGET_S       wall-clock budget of the whole script (default 540): no ncu attempt starts without 120 s left
#                  for it and the report
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
WARMUP=3
# shellcheck disable=SC2206
CASE=(${CASE_ARGS:-})

OUT_DIR=${1:-${OUT:-}}
if [ -z "$OUT_DIR" ]; then
  slug=$("$PY" -c "import re, torch; print(re.sub('[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
  OUT_DIR=benchmarks/results/$slug/profile
fi
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/profile.log"
: > "$LOG"

find_ncu() {
  if [ -n "${NCU:-}" ]; then
    echo "$NCU"
    return
  fi
  command -v ncu && return
  local c
  for c in /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu /opt/nvidia/*/ncu /usr/local/NVIDIA-Nsight-Compute*/ncu; do
    if [ -x "$c" ]; then
      echo "$c"
      return
    fi
  done
}

ncu_bin=$(find_ncu)
why=""
version=""
report_args=()
if [ -z "$ncu_bin" ]; then
  why="ncu not found (PATH, /usr/local/cuda*/bin, /opt/nvidia)"
elif [ ! -x "$ncu_bin" ]; then
  why="NCU=$ncu_bin is not an executable"
else
  version=$("$ncu_bin" --version 2>/dev/null | tail -n 1)
  echo "profile_ncu: $ncu_bin ($version)" | tee -a "$LOG"
  sections=(--section WarpStateStats --section Occupancy --section SpeedOfLight --section LaunchStats
            --section SchedulerStats --section MemoryWorkloadAnalysis)
  stall_metrics=(--metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio')
  # three ways to pick the one launch: the NVTX range, else the launch count (the config is forced: no autotuning
  # launches), each first with the per-reason stall metrics and last without them
  attempts=("nvtx metrics" "skip metrics" "skip")
  rm -f "$OUT_DIR/profile.ncu-rep"
  for attempt in "${attempts[@]}"; do
    left=$(( ${BUDGET_S:-540} - SECONDS - 90 ))
    if [ "$left" -lt 30 ]; then
      why="no time left for another ncu attempt (BUDGET_S=${BUDGET_S:-540}; see ncu.log)"
      break
    fi
    cap=${NCU_TIMEOUT_S:-240}
    if [ "$left" -lt "$cap" ]; then
      cap=$left
    fi
    select=(--launch-skip "$WARMUP" --launch-count 1)
    extra=()
    case "$attempt" in
      nvtx*) select=(--nvtx --nvtx-include "profiled/" --launch-count 1) ;;
    esac
    case "$attempt" in
      *metrics) extra=("${stall_metrics[@]}") ;;
    esac
    echo "profile_ncu: attempt '$attempt'" | tee -a "$LOG"
    timeout "$cap" "$ncu_bin" --target-processes all --clock-control none --kernel-name regex:entmax_attn_fwd "${select[@]}" \
      "${sections[@]}" ${extra[@]+"${extra[@]}"} --export "$OUT_DIR/profile" --force-overwrite \
      "$PY" benchmarks/gpu/profile_case.py launch --warmup "$WARMUP" ${CASE[@]+"${CASE[@]}"} > "$OUT_DIR/ncu.log" 2>&1
    status=$?
    tail -n 30 "$OUT_DIR/ncu.log" | tee -a "$LOG"
    if grep -q "ERR_NVGPUCTRPERM" "$OUT_DIR/ncu.log"; then
      why="ncu refused: ERR_NVGPUCTRPERM (no permission to read the GPU performance counters in this container)"
      break
    fi
    if [ -s "$OUT_DIR/profile.ncu-rep" ] && ! grep -q "No kernels were profiled" "$OUT_DIR/ncu.log"; then
      why=""
      break
    fi
    why="ncu exit status $status without a report (attempts: ${attempts[*]}; see ncu.log)"
    rm -f "$OUT_DIR/profile.ncu-rep"
  done
  if [ -z "$why" ]; then
    "$ncu_bin" --import "$OUT_DIR/profile.ncu-rep" --csv --page details --print-units base > "$OUT_DIR/ncu_details.csv" 2>>"$LOG" \
      || "$ncu_bin" --import "$OUT_DIR/profile.ncu-rep" --csv --page details > "$OUT_DIR/ncu_details.csv" 2>>"$LOG"
    "$ncu_bin" --import "$OUT_DIR/profile.ncu-rep" --csv --page raw > "$OUT_DIR/ncu_raw.csv" 2>>"$LOG"
    report_args=(--ncu-csv "$OUT_DIR/ncu_details.csv" --ncu-raw "$OUT_DIR/ncu_raw.csv" --ncu-version "$version")
  fi
fi
if [ -n "$why" ]; then
  echo "profile_ncu: fallback path: $why" | tee -a "$LOG"
  report_args=(--why "$why")
fi
"$PY" benchmarks/gpu/profile_case.py report --out "$OUT_DIR" "${report_args[@]}" ${CASE[@]+"${CASE[@]}"} 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
