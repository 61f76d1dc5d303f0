#!/usr/bin/env bash
# The device check for a lent GPU machine (one GPU, no network; torch 2.11 cu130, Python 3.12):
# one command of at most 600 s that ends within 480 s in the worst case, each stage under its own
# timeout, and leaves at most 8 files under $OUT:
#   summary.md     per stage: passed / failed / timed out / skipped, and its time; the machine
#   build.log      the extension built against the machine's torch (never one built elsewhere)
#   tests.log      the CUDA tests (not the CPU half: CI ran it), per-test timeouts, durations
#   expandable.log the behaviour suite again with expandable segments
#   experiments.log  the proof that the CUDA backend is on, then one verdict line per experiment
#   bench.log      the benchmarks' own output
#   gpu-DATE.json / gpu-DATE.md   benchmark results, rewritten after every section
#
#   OUT=/tmp/out bash scripts/gpu_check.sh
#
# Without a GPU (or with GPU_CHECK_REHEARSAL=1) it rehearses: the CUDA stages are reported as
# skipped and everything else (build, summary, result files, the experiments' and benchmarks'
# plumbing) runs for real. GPU_CHECK_SKIP_BUILD=1 uses the installed build (rehearsals only).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/graphtrees-gpu-check}
mkdir -p "$OUT"
export GRAPHTREES_CUDA=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TORCH_SHOW_CPP_STACKTRACES=1
export MAX_JOBS=${MAX_JOBS:-16} PIP_NO_INPUT=1
PY=${PYTHON:-python3}
DEADLINE=${GPU_CHECK_DEADLINE:-470}  # seconds from the start; every stage's timeout fits inside
T0=$(date +%s)
SUMMARY="$OUT/summary.md"
STATUS=0

elapsed() { echo $(( $(date +%s) - T0 )); }

# stage NAME BUDGET LOG CMD...: runs CMD under min(BUDGET, time left) and records the outcome.
stage() {
  local name=$1 budget=$2 log=$3; shift 3
  local left=$(( DEADLINE - $(elapsed) ))
  local limit=$(( budget < left ? budget : left ))
  if (( limit < 5 )); then
    echo "| $name | not run (no time left) | 0 s |" >> "$SUMMARY"; STATUS=1; return 1
  fi
  local t=$(date +%s)
  echo "== $name (limit ${limit} s)" >> "$log"
  timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t ))
  local verdict=passed
  if (( rc == 124 || rc == 137 )); then verdict="timed out"; elif (( rc != 0 )); then verdict="failed (rc $rc)"; fi
  echo "| $name | $verdict | $took s |" >> "$SUMMARY"
  echo "$name: $verdict in $took s"
  [[ $verdict == passed ]] || STATUS=1
  return $rc
}

skip() { echo "| $1 | skipped ($2) | 0 s |" >> "$SUMMARY"; echo "$1: skipped ($2)"; }

HAVE_GPU=0
if [[ ${GPU_CHECK_REHEARSAL:-0} != 1 ]] && timeout 60 $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  HAVE_GPU=1
fi

{
  echo "# graphtrees GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo '```'
  if command -v nvidia-smi > /dev/null; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not available"
  fi
  timeout 60 $PY -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" 2>&1
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  [[ $HAVE_GPU == 1 ]] || echo "REHEARSAL: no GPU, the CUDA stages are skipped"
  echo '```'
  echo
  echo "| stage | result | time |"
  echo "|---|---|---|"
} > "$SUMMARY"

# 1. Build against this machine's torch (a build from another torch must never be reused).
if [[ ${GPU_CHECK_SKIP_BUILD:-0} == 1 && $HAVE_GPU == 0 ]]; then
  skip build "GPU_CHECK_SKIP_BUILD=1"
else
  stage build 110 "$OUT/build.log" $PY -m pip install --no-build-isolation --no-deps -e . || {
    tail -30 "$OUT/build.log"; echo; cat "$SUMMARY"; exit 1; }
fi

if [[ $HAVE_GPU == 1 ]]; then
  # 2. Proof that the CUDA backend is on: a silent eager fallback would make every check vacuous.
  if ! stage "CUDA backend on" 30 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --proof-only; then
    echo; echo "**The CUDA backend is not on: later stages were not run.**" >> "$SUMMARY"
    tail -20 "$OUT/experiments.log"; cat "$SUMMARY"; exit 2
  fi
  TIMEOUT_ARGS=()
  $PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout 60)
  # 3. The CUDA tests only, per-test timeouts, stacks on a hang, the slowest 25.
  GRAPHTREES_HYPOTHESIS_EXAMPLES=30 stage "CUDA tests" 140 "$OUT/tests.log" \
    $PY -m pytest tests -m needs_cuda -k "not expandable" "${TIMEOUT_ARGS[@]}" \
    -o faulthandler_timeout=55 --durations=25 -q -rs -p no:cacheprovider
  # 4. The behaviour suite with expandable segments, as its own short stage.
  GRAPHTREES_HYPOTHESIS_EXAMPLES=10 GRAPHTREES_EXPANDABLE_TIMEOUT=50 stage "expandable segments" 55 \
    "$OUT/expandable.log" $PY -m pytest tests/test_cuda.py -k expandable -q -rs -p no:cacheprovider
  # 5. The desk review's GPU-only experiments, one verdict line each.
  stage experiments 70 "$OUT/experiments.log" $PY scripts/gpu_experiments.py
  # 6. Benchmarks: results are rewritten after every section, so a timeout keeps what finished.
  stage benchmarks 60 "$OUT/bench.log" $PY benchmarks/bench_gpu.py --out "$OUT" --iters 1000
else
  skip "CUDA backend on" "no GPU"
  skip "CUDA tests" "no GPU"
  skip "expandable segments" "no GPU"
  stage "experiments (dry run)" 60 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --dry-run
  stage "benchmarks (dry run)" 60 "$OUT/bench.log" $PY benchmarks/bench_gpu.py --out "$OUT" --dry-run
fi

grep -h -E "^EXP " "$OUT/experiments.log" 2>/dev/null | sed 's/^/    /' > "$OUT/.verdicts"
if [[ -s "$OUT/.verdicts" ]]; then
  { echo; echo "Experiments:"; echo; cat "$OUT/.verdicts"; } >> "$SUMMARY"
fi
rm -f "$OUT/.verdicts"
tail -4 "$OUT/tests.log" 2>/dev/null | sed 's/^/    /' > "$OUT/.tail"
if [[ -s "$OUT/.tail" ]]; then { echo; echo "CUDA tests (last lines):"; echo; cat "$OUT/.tail"; } >> "$SUMMARY"; fi
rm -f "$OUT/.tail"
echo >> "$SUMMARY"
echo "Total: $(elapsed) s (deadline $DEADLINE s); exit status $STATUS" >> "$SUMMARY"
cat "$SUMMARY"
exit $STATUS
