#!/usr/bin/env bash
# The device check for a lent GPU machine (one GPU, no network; torch 2.11 cu130, Python 3.12):
# one command of at most 600 s that ends within 480 s in the worst case. Stages run in priority
# order, each under its own timeout; a stage that runs out of time is stopped with SIGINT (then a
# KILL 15 s later), so pytest still prints its failures, tracebacks and summary. It leaves at most
# 8 files under $OUT:
#   summary.md       per stage: passed / failed / timed out / skipped, its time and its log's tail;
#                    the machine; the experiments' verdicts
#   build.log        the extension built against the machine's torch (never one built elsewhere)
#   tests.log        every test stage (-v --tb=short -rfE, durations)
#   experiments.log  the proof that the CUDA backend is on, then E1-E12, one verdict line each
#   bench.log        the benchmarks' own output
#   gpu-DATE.json / gpu-DATE.md   benchmark results, rewritten after every section
#
#   OUT=/tmp/out bash scripts/gpu_check.sh           # part 1: experiments G, the CUDA tests
#   OUT=/tmp/out bash scripts/gpu_check.sh compile   # part 2: compile/models, piecewise,
#                                                    # expandable segments, experiments E
#
# Stages, in priority order (the limits add up to the 480 s deadline; each is cut to what is left),
# as the fourth CUDA review advised (experiments right after the proof, the behaviour suite before
# the failure paths, the slow compile stages in a second command):
#   part 1: build 110 | CUDA backend on 20 | experiments G 75 | priority tests 45 | CUDA tests:
#           behaviour 60, hardening 45, backend 40, ops and memory 35 | benchmarks 40
#   part 2: build 110 (ninja reuses part 1's objects on a warm machine) | CUDA backend on 20 |
#           compile and models 100 | piecewise 70 | expandable segments 60 | experiments E 120 |
#           CUDA tests: fidelity and OpInfo 50 (the last, cut to what is left)
#
# Without a GPU (or with GPU_CHECK_REHEARSAL=1) it rehearses: the CUDA stages are reported as
# skipped and everything else (build, summary, result files, the experiments' and benchmarks'
# plumbing) runs for real. GPU_CHECK_SKIP_BUILD=1 uses the installed build (rehearsals only).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-main}
if [[ $PART != main && $PART != compile ]]; then
  echo "usage: bash scripts/gpu_check.sh [main|compile]" >&2
  exit 2
fi
OUT=${OUT:-/tmp/graphtrees-gpu-check}
mkdir -p "$OUT"
export GRAPHTREES_CUDA=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TORCH_SHOW_CPP_STACKTRACES=1
export MAX_JOBS=${MAX_JOBS:-16} PIP_NO_INPUT=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
DEADLINE=${GPU_CHECK_DEADLINE:-480}  # seconds from the start; every stage's timeout fits inside
T0=$(date +%s)
SUMMARY="$OUT/summary.md"
TAILS="$OUT/.tails"
STATUS=0
: > "$TAILS"

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
  local start_line
  start_line=$(( $(wc -l < "$log" 2>/dev/null || echo 0) + 1 ))
  echo "== $name (limit ${limit} s)" >> "$log"
  timeout -s INT --kill-after=15 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t ))
  local verdict=passed
  if (( rc == 124 || rc == 137 || took >= limit )); then verdict="timed out"; elif (( rc != 0 )); then verdict="failed (rc $rc)"; fi
  echo "| $name | $verdict | $took s |" >> "$SUMMARY"
  echo "$name: $verdict in $took s"
  { echo; echo "### $name: $verdict"; echo; echo '```'
    tail -n +"$start_line" "$log" | grep -v -E '^(tests/\S+ (PASSED|SKIPPED)|\s*$)' | tail -25
    echo '```'; } >> "$TAILS"
  [[ $verdict == passed ]] || STATUS=1
  return $rc
}

skip() { echo "| $1 | skipped ($2) | 0 s |" >> "$SUMMARY"; echo "$1: skipped ($2)"; }

HAVE_GPU=0
if [[ ${GPU_CHECK_REHEARSAL:-0} != 1 ]] && timeout 60 $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  HAVE_GPU=1
fi

{
  echo "# graphtrees GPU check ($PART), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
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

finish() {
  grep -h -E "^(PROOF|EXP )" "$OUT/experiments.log" 2>/dev/null | sed 's/^/    /' > "$OUT/.verdicts"
  if [[ -s "$OUT/.verdicts" ]]; then
    { echo; echo "Experiments:"; echo; cat "$OUT/.verdicts"; } >> "$SUMMARY"
  fi
  rm -f "$OUT/.verdicts"
  { echo; echo "## Stage logs (tails)"; cat "$TAILS"; } >> "$SUMMARY"
  rm -f "$TAILS"
  echo >> "$SUMMARY"
  echo "Total: $(elapsed) s (deadline $DEADLINE s); exit status $1" >> "$SUMMARY"
  cat "$SUMMARY"
  exit "$1"
}

# 1. Build against this machine's torch (a build from another torch must never be reused).
if [[ ${GPU_CHECK_SKIP_BUILD:-0} == 1 && $HAVE_GPU == 0 ]]; then
  skip build "GPU_CHECK_SKIP_BUILD=1"
else
  stage build 110 "$OUT/build.log" $PY -m pip install --no-build-isolation --no-deps -e . || finish 1
fi

PYTEST=($PY -m pytest -v --tb=short -rfE -p no:cacheprovider -o faulthandler_timeout=40)
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 45)

if [[ $HAVE_GPU == 1 ]]; then
  # 2. Proof that the CUDA backend is on: a silent eager fallback would make every check vacuous.
  if ! stage "CUDA backend on" 20 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --proof-only; then
    echo; echo "**The CUDA backend is not on: later stages were not run.**" >> "$SUMMARY"
    finish 2
  fi
  if [[ $PART == main ]]; then
    # 3. The fourth review's experiments, the most diagnostic per second (each in its own process).
    stage "experiments G" 75 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --budget 70 \
      G1 G2 G3 G4 G7 G8 G9 G12 G14
    # 4. The seed story and the regression tests of the reviews' defects.
    stage "priority tests" 45 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 \
      tests/test_seed_story.py tests/test_cuda.py -m needs_cuda \
      -k "seed or transformer or generator or rejected or first_capture or evicted or host_syncs or two_threads or dropout or abort or budget or instantiation or random_numbers or stream"
    # 5. The behaviour suite first, then the failure paths.
    stage "CUDA tests: behaviour" 60 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 -m needs_cuda \
      tests/test_tree_behaviour.py
    stage "CUDA tests: hardening" 45 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 -m needs_cuda \
      tests/test_hardening.py tests/test_overwrite_policy.py
    stage "CUDA tests: backend" 40 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 tests/test_cuda.py \
      -k "not expandable and not seed and not transformer and not generator and not rejected and not first_capture and not evicted and not host_syncs and not two_threads and not dropout and not abort and not budget and not instantiation and not random_numbers and not stream"
    GRAPHTREES_HYPOTHESIS_EXAMPLES=20 stage "CUDA tests: ops and memory" 35 "$OUT/tests.log" \
      "${PYTEST[@]}" --durations=10 -m needs_cuda tests/test_buckets.py tests/test_ops.py \
      tests/test_pytree.py tests/test_memory.py tests/test_property.py
    # 6. Benchmarks: results are rewritten after every section, so a timeout keeps what finished.
    stage benchmarks 40 "$OUT/bench.log" $PY benchmarks/bench_gpu.py --out "$OUT" --iters 300
  else
    # The slow stages (cold Inductor and Triton compiles), in a second command.
    stage "CUDA tests: compile and models" 100 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 \
      -m needs_cuda tests/test_compile.py tests/integration
    stage "CUDA tests: piecewise" 70 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 -m needs_cuda \
      tests/test_piecewise.py
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage "expandable segments" 60 "$OUT/tests.log" \
      "${PYTEST[@]}" -x -m needs_cuda tests/test_seed_story.py tests/test_tree_behaviour.py
    stage "experiments E" 120 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --budget 115 \
      E1 E2 E3 E4 E5 E6 E7 E8 E9 E10 E11 E12 G6 G10
    # Issue 28's classes of wrong results and the OpInfo selection, with values compared.
    stage "CUDA tests: fidelity and OpInfo" 50 "$OUT/tests.log" "${PYTEST[@]}" --durations=10 \
      -m needs_cuda tests/test_fidelity.py tests/test_pytree.py tests/test_opinfo.py
  fi
else
  skip "CUDA backend on" "no GPU"
  skip "priority tests" "no GPU"
  skip "CUDA tests" "no GPU"
  skip "expandable segments" "no GPU"
  stage "experiments (dry run)" 60 "$OUT/experiments.log" $PY scripts/gpu_experiments.py --dry-run
  stage "benchmarks (dry run)" 60 "$OUT/bench.log" $PY benchmarks/bench_gpu.py --out "$OUT" --dry-run
fi

finish $STATUS
