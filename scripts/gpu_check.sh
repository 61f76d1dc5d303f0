#!/usr/bin/env bash
# The device check for a lent GPU machine (one GPU, 16 cores, no network; torch 2.11 cu130,
# Python 3.12; cuda-gdb there, gdb not): ONE command of the device tool (at most 600 s) that ends
# within 540 s in the worst case, so that the machine's minutes always turn into answers. Every
# stage runs under its own timeout, cut to what is left before the deadline (GPU_CHECK_DEADLINE,
# 520 s, plus 15 s for a stopped stage to die); a stage that runs out of time is stopped with
# SIGINT (a KILL 15 s later), so pytest still prints its failures and summary. What comes back is
# at most 8 files under $OUT (the device tool returns no more):
#   summary.md     the machine, the toolchain facts, one row per stage (passed / failed / crashed
#                  by a signal / timed out / skipped, and its time), the build's facts, the
#                  anchors' numbers, the sanity verdict and tree_info(), the native backtraces of
#                  crashes, the experiments' verdicts, and each stage's log tail
#   build.log      the extension built here against this machine's torch, with -g
#   tests.log      the sanity, the CUDA suite (pytest -v --tb=short -rfE, durations)
#   bench.log      the anchors and the benchmarks (their own output)
#   anchors.json   the anchors' numbers (PyTorch alone, measured before graphtrees is built)
#   gdb.log        each crash's rerun under cuda-gdb (or gdb)
#   gpu-DATE.json / gpu-DATE.md   the benchmarks' results, rewritten after every section
# (part `extra` leaves summary.md, build.log, tests.log, experiments.log and gdb.log.)
#
#   OUT=/tmp/out bash scripts/gpu_check.sh          # part 1, stages below, about 6 minutes
#   OUT=/tmp/out bash scripts/gpu_check.sh extra    # part 2: experiments, expandable segments
#
# Part 1 (main), in this order; the budgets are worst cases, each cut to what is left:
#   machine and toolchain facts (60: one torch import, then g++ queries; nothing built yet)
#   anchors, each in its own process, graphtrees neither built nor imported: eager 25,
#     hand-written torch.cuda.CUDAGraph 25, PyTorch's trees (cudagraphify_impl, reduce-overhead) 60
#   build 120 with GRAPHTREES_EXTRA_CFLAGS=-g (a failed build is retried once with /usr/bin/g++),
#     then the built _C.so checked: no std::locale or ostream code of its own, its NEEDED entries
#   sanity 30: record, replay, values compared with eager, tree_info() (its own process)
#   CUDA suite 180: pytest -n 8 (xdist replaces a crashed worker) --timeout -m needs_cuda tests
#   benchmarks 60 (benchmarks/bench_gpu.py)
# Part 2 (extra): facts, build (ninja reuses part 1's objects on a warm machine), sanity,
#   experiments G 75, the behaviour suite with expandable segments 150, experiments E 125.
# Any stage that dies by a signal (rc > 128, or pytest reporting a crashed worker) has its first
# crashing test (or its command) rerun once under `cuda-gdb -batch -ex run -ex bt` (gdb where there
# is no cuda-gdb), 90 s at most; the native frames go into summary.md.
#
# Without a GPU (or with GPU_CHECK_REHEARSAL=1) it rehearses all of it on CPU: the facts for real,
# the anchors and benchmarks as dry runs, the sanity on the CPU backend, the suite stage on a small
# CPU selection. GPU_CHECK_SKIP_BUILD=1 uses the installed build instead of building (for the
# rehearsals and the CUDA stand-in; never on a GPU machine, whose build must be its own).
# GPU_CHECK_CRASH=1 adds a stage that crashes on purpose (a hidden test reading address 0), to
# rehearse the backtrace path; its crash does not count in the exit status. GPU_CHECK_DEBUGGER: see
# below.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PART=${1:-main}
if [[ $PART != main && $PART != extra ]]; then
  echo "usage: bash scripts/gpu_check.sh [main|extra]" >&2
  exit 2
fi
OUT=${OUT:-/tmp/graphtrees-gpu-check}
mkdir -p "$OUT"
export GRAPHTREES_CUDA=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TORCH_SHOW_CPP_STACKTRACES=1
export MAX_JOBS=${MAX_JOBS:-16} PIP_NO_INPUT=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
PYBIN=$(command -v "$PY" || echo "$PY")
DEADLINE=${GPU_CHECK_DEADLINE:-520}  # seconds from the start; every stage's timeout fits inside
T0=$(date +%s)
SUMMARY="$OUT/summary.md"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")  # the summary's sections until the end
trap 'rm -rf "$WORK"' EXIT
STATUS=0
: > "$WORK/tails"; : > "$WORK/backtraces"

elapsed() { echo $(( $(date +%s) - T0 )); }

# The outcome of the last stage, for the backtrace: LAST_CMD (its command), CRASHED (1 when it
# died by a signal or a pytest worker crashed), CRASH_TEST (the first crashing test's node id).
LAST_CMD=()
CRASHED=0
CRASH_TEST=

# stage NAME BUDGET KEEP LOG CMD...: runs CMD under min(BUDGET, time left - KEEP), KEEP being the
# seconds kept for the stages after it, and records the outcome (a row, the log's tail).
stage() {
  local name=$1 budget=$2 keep=$3 log=$4; shift 4
  LAST_CMD=("$@"); CRASHED=0; CRASH_TEST=
  local left=$(( DEADLINE - $(elapsed) - keep ))
  local limit=$(( budget < left ? budget : left ))
  if (( limit < 5 )); then
    echo "| $name | not run (no time left) | 0 s |" >> "$SUMMARY"; STATUS=1; return 1
  fi
  local t start_line
  t=$(date +%s)
  touch "$log"
  start_line=$(( $(wc -l < "$log") + 1 ))
  echo "== $name (limit ${limit} s): $*" >> "$log"
  timeout -s INT --kill-after=15 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t ))
  tail -n +"$start_line" "$log" > "$WORK/section"
  local verdict=passed
  if (( rc == 124 || (rc == 137 && took >= limit) )); then
    verdict="timed out"
  elif (( rc > 128 )); then
    verdict="crashed (SIG$(kill -l $(( rc - 128 )) 2>/dev/null || echo $(( rc - 128 ))))"
    CRASHED=1
  elif (( rc != 0 )); then
    verdict="failed (rc $rc)"
  fi
  local workers
  workers=$(grep -o "crashed while running '[^']*'" "$WORK/section" | sort -u | wc -l)
  if (( workers > 0 )); then
    CRASHED=1
    verdict="$verdict, pytest workers crashed in $workers tests"
    CRASH_TEST=$(grep -o -m1 "crashed while running '[^']*'" "$WORK/section" \
      | sed "s/^crashed while running '//; s/'\$//")
  elif (( CRASHED )) && [[ " $* " == *" pytest "* ]]; then
    # pytest -v names each test before running it: the last one named is the one that crashed.
    CRASH_TEST=$(grep -o -E '^tests/[^ ]+::[^ ]+' "$WORK/section" | tail -1)
  fi
  local counts  # pytest's own summary line, e.g. "250 passed, 3 failed, 12 skipped"
  counts=$(grep -E '^=+ .*\b(passed|failed|errors?|skipped|deselected|no tests ran)\b.* in [0-9.]+s' \
    "$WORK/section" | tail -1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*//')
  echo "| $name | $verdict${counts:+: $counts} | $took s |" >> "$SUMMARY"
  echo "$name: $verdict${counts:+ ($counts)} in $took s"
  { echo; echo "### $name: $verdict"; echo; echo '```'
    if (( CRASHED && $(wc -l < "$WORK/section") > 30 )) && grep -q 'Fatal Python error' "$WORK/section"; then
      grep -m1 -A14 'Fatal Python error' "$WORK/section" | cut -c1-300  # the innermost frames
      echo "[...]"
    fi
    grep -v -E '^(tests/\S+ (PASSED|SKIPPED)|\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|SKIPPED) |\s*$)' \
      "$WORK/section" | tail -25
    echo '```'; } >> "$WORK/tails"
  [[ $verdict == passed ]] || STATUS=1
  return $rc
}

skip() { echo "| $1 | skipped ($2) | 0 s |" >> "$SUMMARY"; echo "$1: skipped ($2)"; }

# The debugger for native backtraces: cuda-gdb (on the GPU machine), else gdb;
# GPU_CHECK_DEBUGGER=PATH chooses one, GPU_CHECK_DEBUGGER=none takes no backtrace.
DEBUGGER=$(command -v cuda-gdb 2>/dev/null)
for d in /usr/local/cuda*/bin/cuda-gdb; do [[ -z $DEBUGGER && -x $d ]] && DEBUGGER=$d; done
[[ -n $DEBUGGER ]] || DEBUGGER=$(command -v gdb 2>/dev/null || true)
[[ -n ${GPU_CHECK_DEBUGGER:-} ]] && DEBUGGER=$GPU_CHECK_DEBUGGER
[[ $DEBUGGER == none ]] && DEBUGGER=

# backtrace NAME KEEP: when the last stage crashed, reruns its first crashing test (or its command)
# once under the debugger and puts the native frames into the summary.
backtrace() {
  local name=$1 keep=$2
  (( CRASHED )) || return 0
  local rerun=()
  if [[ -n $CRASH_TEST ]]; then
    # The stage's environment comes too (`env PYTORCH_CUDA_ALLOC_CONF=... pytest ...`): a crash
    # that needs expandable segments does not happen without them.
    local k=0
    if [[ ${LAST_CMD[0]} == env ]]; then
      rerun=(env)
      for (( k = 1; k < ${#LAST_CMD[@]}; k++ )); do
        [[ ${LAST_CMD[k]} == *=* ]] || break
        rerun+=("${LAST_CMD[k]}")
      done
    fi
    rerun+=("$PYBIN" -m pytest -v --tb=short -p no:cacheprovider -p no:xdist -p no:timeout
      "$CRASH_TEST")
  else
    rerun=("${LAST_CMD[@]}")
    [[ ${rerun[0]} == "$PY" ]] && rerun[0]=$PYBIN
  fi
  local row="backtrace: $name"
  if [[ -z $DEBUGGER ]]; then
    echo "| $row | not taken (neither cuda-gdb nor gdb on this machine) | 0 s |" >> "$SUMMARY"
    printf '\n### %s: no debugger (neither cuda-gdb nor gdb): no native backtrace\n' "$name" \
      >> "$WORK/backtraces"
    return 0
  fi
  local left=$(( DEADLINE - $(elapsed) - keep ))
  local limit=$(( 90 < left ? 90 : left ))
  if (( limit < 15 )); then
    echo "| $row | not taken (no time left) | 0 s |" >> "$SUMMARY"; return 0
  fi
  local dbg=(-batch -nx -iex 'set debuginfod enabled off' -iex 'set pagination off')
  [[ $DEBUGGER == *cuda-gdb ]] && dbg+=(-iex 'set cuda api_failures ignore')
  # shellcheck disable=SC2016  # $pc is the debugger's
  dbg+=(-ex run -ex 'bt 40' -ex 'x/i $pc' --args "${rerun[@]}")
  local log="$OUT/gdb.log" t start_line
  t=$(date +%s)
  touch "$log"
  start_line=$(( $(wc -l < "$log") + 1 ))
  echo "== $row (limit ${limit} s): $DEBUGGER ${dbg[*]}" >> "$log"
  # SIGINT stops the program under the debugger, which then prints where it was (a hang's frames).
  timeout -s INT --kill-after=15 "$limit" "$DEBUGGER" "${dbg[@]}" < /dev/null >> "$log" 2>&1
  local took=$(( $(date +%s) - t ))
  tail -n +"$start_line" "$log" > "$WORK/section"
  local frames
  frames=$(grep -c -E '^#[0-9]+ ' "$WORK/section")
  local what="$frames frames"
  grep -q -E 'received signal' "$WORK/section" || what="$what; the rerun did not stop on a signal"
  echo "| $row | $what ($(basename "$DEBUGGER")) | $took s |" >> "$SUMMARY"
  echo "$row: $what in $took s"
  { echo; echo "### $name, rerun under $(basename "$DEBUGGER")"; echo
    echo "\`$(printf '%q ' "${rerun[@]}")\`"; echo; echo '```'
    grep -E 'received signal|^\[Inferior .* exited|No stack|^Program terminated' "$WORK/section"
    grep -E '^#[0-9]+ ' "$WORK/section" | cut -c1-240 | head -30  # the innermost frames
    grep -E '^=> ' "$WORK/section"  # the faulting instruction
    echo '```'; } >> "$WORK/backtraces"
}

# --- The machine and the toolchain, before anything is built -----------------------------------
HAVE_GPU=0
timeout 60 "$PY" - > "$WORK/probe" 2>&1 <<'EOF'
import importlib.metadata, os, sys, sysconfig, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libstdc++" in line}
cfg = [repr(sysconfig.get_config_var(k)) for k in ("CC", "CXX", "LDSHARED")]
print("sysconfig CC / CXX / LDSHARED:", " / ".join(cfg))
def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
print("pytest plugins: xdist", version("pytest-xdist"), "/ timeout", version("pytest-timeout"))
for p in sorted(maps) or ["none"]:
    print("libstdc++ loaded after import torch:", p, "->", os.path.realpath(p))
EOF
if [[ ${GPU_CHECK_REHEARSAL:-0} != 1 ]] && grep -q '^gpu ' "$WORK/probe" \
    && ! grep -q '^gpu none' "$WORK/probe"; then
  HAVE_GPU=1
fi
DEV=cpu; [[ $HAVE_GPU == 1 ]] && DEV=cuda

# Each compiler's facts: what it is, its libstdc++ (shared and static), and the C++ runtime its
# shared-library link line names (-### prints the commands without running them).
compiler_facts() {
  local c=$1
  echo "$c --version: $(timeout 10 "$c" --version 2>&1 | head -1)"
  echo "$c -print-file-name=libstdc++.so: $(timeout 10 "$c" -print-file-name=libstdc++.so 2>&1)"
  echo "$c -print-file-name=libstdc++.a: $(timeout 10 "$c" -print-file-name=libstdc++.a 2>&1)"
  echo "$c -shared link line's runtime: $(timeout 10 "$c" -### -shared -o "$WORK/x.so" -x c++ /dev/null 2>&1 \
    | grep -E 'collect2|/ld"? ' | tail -1 | tr ' ' '\n' | tr -d '"' \
    | grep -E 'stdc\+\+|static|Bsymbolic|^-lgcc|libgcc' | tr '\n' ' ')"
  echo "$c -dumpspecs lines naming libstdc++ or -static: $(timeout 10 "$c" -dumpspecs 2>/dev/null \
    | grep -c -E 'stdc\+\+|static-lib')"
}

toolchain_facts() {
  local gxx
  gxx=$(command -v g++ || true)
  echo "command -v g++: ${gxx:-none}"
  if [[ -n $gxx ]]; then
    echo "readlink -f: $(readlink -f "$gxx")"
    echo "file: $(file -b "$gxx" 2>&1)"
    [[ -L $gxx ]] && echo "file -L: $(file -b -L "$gxx" 2>&1)"
    if [[ $(head -c 2 "$gxx") == '#!' ]] || file -b -L "$gxx" 2>/dev/null | grep -q -i -E 'text|script'; then
      echo "its text (a script):"
      head -c 3000 "$gxx" | sed 's/^/    /'
    fi
    compiler_facts "$gxx"
  fi
  if [[ ! -x /usr/bin/g++ ]]; then
    echo "/usr/bin/g++: absent"
  elif [[ $(readlink -f /usr/bin/g++) != $(readlink -f "${gxx:-/none}") ]]; then
    compiler_facts /usr/bin/g++
  else
    echo "/usr/bin/g++: the same compiler as g++ on PATH"
  fi
  # torch's ninja compiles with $CXX (else c++), setuptools links with Python's CXX/LDSHARED.
  local c
  for c in c++ cc gcc x86_64-linux-gnu-g++ x86_64-linux-gnu-gcc; do
    command -v "$c" > /dev/null && echo "command -v $c: $(command -v "$c") -> $(readlink -f "$(command -v "$c")")"
  done
  echo "environment CC=${CC:-} CXX=${CXX:-} LDSHARED=${LDSHARED:-}"
  grep -E '^(sysconfig|libstdc\+\+)' "$WORK/probe"
  echo "debugger: ${DEBUGGER:-none (neither cuda-gdb nor gdb)}"
  grep '^pytest plugins' "$WORK/probe"
}

{
  echo "# graphtrees GPU check ($PART), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo '```'
  if command -v nvidia-smi > /dev/null; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  else
    echo "nvidia-smi: not available"
  fi
  grep -v -E '^(sysconfig|libstdc\+\+|pytest plugins)' "$WORK/probe"
  if git rev-parse --short HEAD > "$WORK/head" 2>/dev/null; then
    echo "git $(cat "$WORK/head")$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  fi
  [[ $HAVE_GPU == 1 ]] || echo "REHEARSAL: no GPU; anchors and benchmarks dry runs, sanity and suite on CPU"
  echo '```'
  echo
  echo "## Toolchain"
  echo
  echo '```'
  toolchain_facts
  echo '```'
  echo
  echo "## Stages"
  echo
  echo "| stage | result | time |"
  echo "|---|---|---|"
} > "$SUMMARY"

finish() {
  {
    if [[ -s $WORK/build_facts ]]; then
      echo; echo "## Build"; echo; echo '```'; cat "$WORK/build_facts"; echo '```'
    fi
    if grep -q '^ANCHOR ' "$OUT/bench.log" 2>/dev/null; then
      echo; echo "## Anchors (PyTorch alone, each in its own process, before graphtrees was built)"
      echo; echo '```'; grep -h '^ANCHOR ' "$OUT/bench.log" | cut -c1-400; echo '```'
    fi
    if grep -q -E '^(SANITY|TREE_INFO)' "$OUT/tests.log" 2>/dev/null; then
      echo; echo "## Sanity"; echo; echo '```'
      grep -h '^SANITY: ' "$OUT/tests.log"; grep -h '^TREE_INFO ' "$OUT/tests.log" | cut -c1-1500
      echo '```'
    fi
    if [[ -s $WORK/backtraces ]]; then
      echo; echo "## Native backtraces"; cat "$WORK/backtraces"
    fi
    if grep -q -E '^(PROOF|EXP )' "$OUT/experiments.log" 2>/dev/null; then
      echo; echo "## Experiments"; echo; grep -h -E '^(PROOF|EXP )' "$OUT/experiments.log" | sed 's/^/    /'
    fi
    echo; echo "## Stage logs (tails)"; cat "$WORK/tails"
    echo
    echo "Total: $(elapsed) s (deadline $DEADLINE s); exit status $1"
  } >> "$SUMMARY"
  cat "$SUMMARY"
  exit "$1"
}

# --- The anchors: PyTorch alone, before graphtrees is built or imported ------------------------
ANCHOR_FLAGS=(--out "$OUT" --iters 500)
DRY=
if [[ $HAVE_GPU == 0 ]]; then ANCHOR_FLAGS+=(--dry-run); DRY=" (dry run)"; fi
if [[ $PART == main ]]; then
  # anchor TITLE NAME BUDGET
  anchor() {
    stage "anchor: $1$DRY" "$3" 0 "$OUT/bench.log" "$PY" benchmarks/bench_gpu.py --anchor "$2" \
      "${ANCHOR_FLAGS[@]}"
    backtrace "anchor: $1" 0
  }
  anchor eager eager 25
  anchor "hand-written CUDAGraph" hand_written 25
  anchor "PyTorch's trees" pytorch_trees 60
fi

# --- Build against this machine's torch (a build from another torch must never be reused) -----
SO="graphtrees/_C$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
PRIVATE='_ZNSt6locale|_ZNSo9_M_insert'  # std::locale, std::ostream::_M_insert: a C++ runtime's own
private_symbols() { nm -D --defined-only "$SO" 2>/dev/null | grep -c -E "$PRIVATE"; }
# so_facts LABEL: the built extension's check (its own C++ runtime code, what it needs at load).
so_facts() {
  echo "-- $1"
  if [[ ! -f $SO ]]; then echo "$SO: not built"; return; fi
  echo "$SO: $(stat -c '%s bytes, %y' "$SO")"
  echo "nm -D --defined-only $SO | grep -c -E '$PRIVATE': $(private_symbols)" \
    "(0 expected: no private C++ runtime)"
  echo "readelf -d $SO (NEEDED, RPATH, RUNPATH):"
  readelf -d "$SO" 2>&1 | grep -E 'NEEDED|RPATH|RUNPATH' | sed 's/^ */    /'
  echo "ldd: $(ldd "$SO" 2>&1 | grep -E 'libstdc\+\+|libgcc_s' | tr -s ' \t' ' ' | tr '\n' ';')"
  echo "debug info (-g): $(readelf -S "$SO" 2>/dev/null | grep -q '\.debug_info' && echo yes || echo no)"
}
BUILT=1
if [[ ${GPU_CHECK_SKIP_BUILD:-0} == 1 ]]; then
  skip build "GPU_CHECK_SKIP_BUILD=1"
  so_facts "the installed build (GPU_CHECK_SKIP_BUILD=1)" >> "$WORK/build_facts"
else
  BUILD=("$PY" -m pip install -v --no-build-isolation --no-deps -e .)
  stage build 120 0 "$OUT/build.log" env GRAPHTREES_EXTRA_CFLAGS=-g "${BUILD[@]}"
  rc=$?
  so_facts "build" >> "$WORK/build_facts"
  # A failed build (not a timed-out one), or one whose _C.so carries its own C++ runtime (the first
  # GPU run's crash), is retried once with the system compiler.
  WHY=
  if (( rc != 0 )); then
    BUILT=0
    grep -q '^| build | timed out' "$SUMMARY" || WHY="the build failed"
  elif (( $(private_symbols) > 0 )); then
    WHY="the build's _C.so defines C++ runtime code"
  fi
  if [[ -n $WHY && -x /usr/bin/g++ && -x /usr/bin/gcc ]]; then
    stage "build with /usr/bin/g++ ($WHY)" 120 120 "$OUT/build.log" \
      env GRAPHTREES_EXTRA_CFLAGS=-g CC=/usr/bin/gcc CXX=/usr/bin/g++ "${BUILD[@]}" && BUILT=1
    so_facts "build with /usr/bin/g++" >> "$WORK/build_facts"
  fi
fi
{
  grep -h -E "^\s*graphtrees build:" "$OUT/build.log" 2>/dev/null | sed -E "s/^\s+//" | awk '!seen[$0]++'
  cat "$WORK/build_facts"
} > "$WORK/build_facts.md"
mv "$WORK/build_facts.md" "$WORK/build_facts"
if [[ $BUILT == 0 ]]; then
  echo; echo "**The build failed: graphtrees' stages were not run.**" >> "$SUMMARY"
  finish 1
fi

# --- Sanity: record, replay, values compared with eager, tree_info() ---------------------------
stage "sanity ($DEV)" 30 0 "$OUT/tests.log" "$PY" scripts/gpu_experiments.py --sanity "$DEV"
backtrace "sanity ($DEV)" 150

PYTEST=("$PY" -m pytest -v --tb=short -rfE -p no:cacheprovider --durations=15)
if "$PY" -c "import xdist" 2>/dev/null; then
  WORKERS=8; [[ $HAVE_GPU == 1 ]] || WORKERS=2
  PYTEST+=(-n "$WORKERS" --max-worker-restart 40)
else
  echo "| note | pytest-xdist absent: the suite runs in one process (a crash ends it) | 0 s |" >> "$SUMMARY"
fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  PYTEST+=(--timeout 150 --timeout-method signal)
else
  PYTEST+=(-o faulthandler_timeout=150)
fi

# --- A crash on purpose (GPU_CHECK_CRASH=1): rehearses the backtrace path ----------------------
if [[ ${GPU_CHECK_CRASH:-0} == 1 ]]; then
  SAVED=$STATUS
  # The variable goes in the stage's `env` prefix (read by that test alone), as the expandable
  # segments stage's do: the rerun under the debugger must carry it for the crash to happen again.
  stage "crash on purpose (GPU_CHECK_CRASH=1)" 60 150 "$OUT/tests.log" \
    env GPU_CHECK_CRASH_TEST=1 "${PYTEST[@]}" \
    tests/test_scripts.py::test_crashes_on_purpose_for_the_gpu_check
  backtrace "crash on purpose" 150
  STATUS=$SAVED  # its crash is the point: it does not count
fi

if [[ $PART == main ]]; then
  # --- The whole CUDA suite in one stage; then the benchmarks alone ----------------------------
  if [[ $HAVE_GPU == 1 ]]; then
    SELECTION=(-m needs_cuda -k "not test_behaviour_suite_with_expandable_segments" tests)
    SUITE_NAME="CUDA suite"
  else
    SELECTION=(-m "not needs_cuda" tests/test_buckets.py tests/test_pytree.py)
    SUITE_NAME="suite (CPU selection)"
  fi
  stage "$SUITE_NAME" 180 60 "$OUT/tests.log" env GRAPHTREES_HYPOTHESIS_EXAMPLES=20 "${PYTEST[@]}" "${SELECTION[@]}"
  backtrace "$SUITE_NAME" 40
  BENCH=("$PY" benchmarks/bench_gpu.py --out "$OUT" --iters 300)
  [[ $HAVE_GPU == 1 ]] || BENCH+=(--dry-run)
  stage "benchmarks$DRY" 60 0 "$OUT/bench.log" "${BENCH[@]}"
  backtrace benchmarks 0
else
  # --- Part 2: the reviews' experiments, the behaviour suite with expandable segments ----------
  if [[ $HAVE_GPU == 1 ]]; then
    stage "experiments G" 75 280 "$OUT/experiments.log" "$PY" scripts/gpu_experiments.py --budget 70 \
      G1 G2 G3 G4 G6 G7 G8 G9 G10 G12 G14
    stage "expandable segments" 150 130 "$OUT/tests.log" \
      env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True GRAPHTREES_HYPOTHESIS_EXAMPLES=20 \
      "${PYTEST[@]}" -m needs_cuda tests/test_tree_behaviour.py tests/test_seed_story.py \
      tests/test_property.py tests/test_hardening.py
    backtrace "expandable segments" 130
    stage "experiments E" 125 0 "$OUT/experiments.log" "$PY" scripts/gpu_experiments.py --budget 120 \
      E1 E2 E3 E4 E5 E6 E7 E8 E9 E10 E11 E12
  else
    stage "experiments (dry run)" 60 0 "$OUT/experiments.log" "$PY" scripts/gpu_experiments.py --dry-run
    skip "expandable segments" "no GPU"
  fi
fi

finish $STATUS
