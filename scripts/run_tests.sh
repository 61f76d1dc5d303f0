#!/usr/bin/env bash
# README's test command (and what .ci/run runs): installs what the tests need (torchvision,
# transformers and diffusers included: tests/integration builds their models from configs, random
# weights, nothing downloaded), builds the extension, and for torch 2.14.1 and then torch 2.11.0
# (the GPU machine's, in .venv-torch211) runs
#   - the suite on CPU (the CUDA tests skipped: no GPU), and
#   - the suite's CUDA tests on the CUDA stand-in (tests/cuda_standin: a fake CUDA runtime under
#     real torch) in its value mode (a value engine built per torch computes every aten op's
#     values on the host, so the CUDA tests compare values, not only shapes), with
#     GRAPHTREES_CUDA=1 -- a stand-in run, not a GPU run; what the engine cannot compute (device
#     asserts, NCCL, cuFFT, Triton kernels) is skipped there with its reason, and the stage's last
#     line counts the comparisons of values (on torch 2.11, the files of VALUES_211 in the value
#     mode and the others without it);
# and, after the torch 2.14.1 CPU suite, the sanitizer stage: the extension built with
# -fsanitize=address,undefined against torch 2.11.0 (2.14.1 when 2.11 is skipped), running the
# tree's tests (CUDA ones on the stand-in without its value mode, CPU ones too) with 0 findings
# allowed; the host cost per compiled call on the stand-in against PyTorch's trees
# (benchmarks/bench_standin.py, without the value mode: it measures graphtrees' own cost); and
# the ThreadSanitizer stage: the extension built with -fsanitize=thread against torch 2.14.1
# (after the sanitizer stage), running the tests that start threads (CPU and stand-in; beside the
# torch 2.11 CPU files) with 0 reports allowed in graphtrees' own code (scripts/tsan.supp: what is
# suppressed, and why). torch 2.11.0 is installed beside the torch 2.14.1 build.
#   GRAPHTREES_SKIP_TORCH211=1   only torch 2.14.1
#   GRAPHTREES_FULL_TORCH211=1   the whole CPU suite on torch 2.11 too (not only its API-facing files)
#   GRAPHTREES_SKIP_STANDIN=1    no CUDA stand-in stages
#   GRAPHTREES_SKIP_SANITIZER=1  no sanitizer stage
#   GRAPHTREES_SKIP_TSAN=1       no ThreadSanitizer stage
#   GRAPHTREES_ALLOW_SYSTEM_PYTHON=1   install into a Python that is not a virtual environment
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python}
DEPS=(ninja "setuptools>=70" pytest hypothesis numpy expecttest transformers diffusers==0.42.1 clang-format==23.1.5 ruff==0.17.6)
t_all=$(date +%s)
stamp() { echo "[run_tests] $1: $(( $(date +%s) - $2 )) s"; }
PYTEST_OPTS=(-q -p no:cacheprovider --durations=12)  # each stage prints its slowest tests

# Installing into a system or global interpreter changes it for everything else on the machine.
if ! "$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' \
    && [[ ${GRAPHTREES_ALLOW_SYSTEM_PYTHON:-0} != 1 && ${CI:-} != true ]]; then
  echo "[run_tests] $("$PY" -c 'import sys; print(sys.executable)') is not a virtual environment;"
  echo "[run_tests] make one first (python3 -m venv .venv && . .venv/bin/activate), or set"
  echo "[run_tests] GRAPHTREES_ALLOW_SYSTEM_PYTHON=1 to install torch and the test tools into it."
  exit 2
fi

# The CUDA stand-in: built once for both torches (it is C++ against the CUDA headers, not
# against torch), or its stages are skipped with the reason.
STANDIN_ENV=()
standin_build() {
  if [[ ${GRAPHTREES_SKIP_STANDIN:-0} == 1 ]]; then
    echo "[run_tests] GRAPHTREES_SKIP_STANDIN=1: the CUDA stand-in stages are skipped"
    return
  fi
  local t dir
  t=$(date +%s)
  if dir=$("$PY" tests/cuda_standin/standin.py build); then
    mapfile -t STANDIN_ENV < <(CUDA_STANDIN_DIR="$dir" "$PY" tests/cuda_standin/standin.py env \
      | sed 's/^export //')
    STANDIN_ENV+=("CUDA_STANDIN_DIR=$dir" "GRAPHTREES_CUDA=1")
    # Its value engine for this torch (built by `build` too, which only warns if it fails): a
    # failure stops the run here rather than leave the CUDA tests comparing shapes alone.
    if [[ ${CUDA_STANDIN_VALUES:-1} != 0 ]] \
      && ! CUDA_STANDIN_DIR="$dir" "$PY" tests/cuda_standin/standin.py build-values > /dev/null; then
      echo "[run_tests] the CUDA stand-in's value engine did not build (above);"
      echo "[run_tests] CUDA_STANDIN_VALUES=0 runs the stand-in stages without it"
      exit 1
    fi
    stamp "build the CUDA stand-in" "$t"
  else
    echo "[run_tests] the CUDA stand-in stages are skipped (see the reason above)"
  fi
}

# A second lane: a job in the background (its own process group of commands, beside the CPU
# stage in the foreground: the two take about as long, and each mostly keeps one core busy),
# logged to a file; lane_wait prints that log and fails if the job failed.
LANE_PID=
LANE_LOG=
# The job is a process group of its own (job control on while it starts), so that a run that
# stops early stops what the lane started too (a pip install, a build), not only its subshell.
trap '[[ -z $LANE_PID ]] || kill -- "-$LANE_PID" 2> /dev/null || kill "$LANE_PID" 2> /dev/null || true' EXIT
lane_start() {
  LANE_LOG=$(mktemp)
  set -m
  ("$@") > "$LANE_LOG" 2>&1 &
  LANE_PID=$!
  set +m
}
lane_wait() {
  [[ -n $LANE_PID ]] || return 0
  local rc=0
  wait "$LANE_PID" || rc=$?
  cat "$LANE_LOG"
  rm -f "$LANE_LOG"
  LANE_PID=
  return $rc
}

# standin_tests PYTHON LABEL [FILE...]: the suite's CUDA tests on the stand-in, in its value mode;
# with FILEs, only those in the value mode and the others without it (CUDA_STANDIN_VALUES=0): the
# stated subset on torch 2.11 (docs/testing.md), which keeps the run within its time.
standin_tests() {
  local python=$1 label=$2
  shift 2
  [[ ${#STANDIN_ENV[@]} -gt 0 ]] || return 0
  local t rc=0
  t=$(date +%s)
  if [[ $# -eq 0 ]]; then
    echo "[run_tests] CUDA tests on the CUDA stand-in ($label; values computed on the host by its value engine)"
    env "${STANDIN_ENV[@]}" PYTHON="$python" "$python" -m pytest tests "${PYTEST_OPTS[@]}" \
      -m needs_cuda < /dev/null || rc=$?
  else
    echo "[run_tests] CUDA tests on the CUDA stand-in ($label): $* in its value mode"
    env "${STANDIN_ENV[@]}" PYTHON="$python" "$python" -m pytest "$@" "${PYTEST_OPTS[@]}" \
      -m needs_cuda < /dev/null || rc=$?
    local ignore=() f
    for f in "$@"; do ignore+=("--ignore=$f"); done
    echo "[run_tests] CUDA tests on the CUDA stand-in ($label): the other files without its value mode"
    env "${STANDIN_ENV[@]}" CUDA_STANDIN_VALUES=0 PYTHON="$python" "$python" -m pytest tests \
      "${ignore[@]}" "${PYTEST_OPTS[@]}" -m needs_cuda < /dev/null || rc=$?
  fi
  stamp "tests on the CUDA stand-in ($label)" "$t"
  return $rc
}

# What the two sanitizer stages share. instrumented_build SRC PYTHON LABEL FLAGS SYMBOL WHAT
# [JOBS]: a copy of the sources in SRC (only changed files written, its build folder kept), built
# in place with FLAGS against PYTHON's torch, and checked for SYMBOL (an instrumented build).
instrumented_build() {
  local src=$1 python=$2 label=$3 flags=$4 symbol=$5 what=$6 jobs=()
  [[ -z ${7:-} ]] || jobs=(MAX_JOBS="$7")
  "$PY" scripts/sync_tree.py "$src" || return 1
  echo "[run_tests] building graphtrees with $flags against $label"
  (cd "$src" && env "${jobs[@]}" GRAPHTREES_EXTRA_CFLAGS="$flags" \
    "$python" setup.py -q build_ext --inplace) || return 1
  if [[ $(nm -D "$src"/graphtrees/_C*.so | grep -c "$symbol") == 0 ]]; then
    echo "[run_tests] $src/graphtrees/_C*.so is not $what build"
    return 1
  fi
}
# The compiler's runtime library LIB (libasan.so, libtsan.so), or nothing when it has none.
sanitizer_runtime() {
  local lib
  lib=$(readlink -f "$(${CXX:-c++} -print-file-name="$1")")
  if [[ -f $lib ]]; then echo "$lib"; fi
}
# dlopen() called through a sanitizer runtime's interceptor searches the interceptor's paths, not
# the caller's RUNPATH: cuDNN then cannot find its sub-libraries (SDPA's backend choice asks for
# its version). The wheel's NVIDIA library folders are named instead, after the stand-in's.
nvidia_libdirs() {
  "$1" -c "import glob, os, torch; print(':'.join(glob.glob(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia', '*', 'lib'))))"
}
# Adds the stand-in's environment to the calling stage's `env`, `preload` (after the runtime)
# and `ld_path`; its CUDA_STANDIN_VALUES is left out (the stages run without the value mode).
add_standin_env() {
  local kv
  for kv in "${STANDIN_ENV[@]}"; do
    case $kv in
      LD_PRELOAD=*) preload="$preload:${kv#LD_PRELOAD=}" ;;
      LD_LIBRARY_PATH=*) ld_path="${kv#LD_LIBRARY_PATH=}:$ld_path" ;;
      CUDA_STANDIN_VALUES=*) ;;
      *) env+=("$kv") ;;
    esac
  done
}

# sanitizer_stage PYTHON LABEL: Issue 37's sanitizer stage. A copy of the sources (its own build
# folder, kept between runs) built in place with -fsanitize=address,undefined, then the tree's
# tests under it: the CUDA ones on the stand-in (the seed story, the CUDA backend, the tree's
# behaviour, hardening, memory) and the same files' CPU cases, with AddressSanitizer's runtime
# preloaded first. Any report (written to files, also from the tests' subprocesses) fails it.
# -O1 -g1, as AddressSanitizer's documentation advises: line tables for the reports, and about
# half the compile time of the default -O2 -g (-fno-gnu-unique: as for the ThreadSanitizer stage,
# below, at -O1 a TU keeps std::piecewise_construct as a unique global).
SAN_FLAGS="-fsanitize=address,undefined -O1 -g1 -fno-gnu-unique -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
SAN_TESTS=(tests/test_seed_story.py tests/test_cuda.py tests/test_tree_behaviour.py
  tests/test_hardening.py tests/test_memory.py)
sanitizer_stage() {
  local python=$1 label=$2 src=$ROOT/build/sanitizer-src t rc=0
  if [[ ${GRAPHTREES_SKIP_SANITIZER:-0} == 1 ]]; then
    echo "[run_tests] GRAPHTREES_SKIP_SANITIZER=1: the sanitizer stage is skipped"
    return 0
  fi
  local asan
  asan=$(sanitizer_runtime libasan.so)
  if [[ -z $asan ]]; then
    echo "[run_tests] the sanitizer stage is skipped: the compiler has no libasan.so"
    return 0
  fi
  t=$(date +%s)
  instrumented_build "$src" "$python" "$label" "$SAN_FLAGS" __asan_report "an AddressSanitizer" \
    || return 1
  stamp "sanitizer build ($label)" "$t"
  t=$(date +%s)
  local reports=$src/build/sanitizer-reports
  rm -rf "$reports" && mkdir -p "$reports"
  # AddressSanitizer's runtime comes first; the process's libstdc++.so.6 right after it, so that
  # its __cxa_throw interceptor finds the real one at start-up (Python itself is C: without it,
  # the first C++ exception torch throws ends the process in a CHECK of the runtime).
  local cxx_runtime libdirs
  cxx_runtime=$("$python" -c "import sys, torch; sys.path.insert(0, '$ROOT/graphtrees'); import _toolchain; print(_toolchain.process_cxx_runtime())")
  libdirs=$(nvidia_libdirs "$python")
  # Without the stand-in's value mode (CUDA_STANDIN_VALUES=0): the stage looks for memory errors
  # of graphtrees' own code, which the value engine (not instrumented) does not add to, and the
  # value stage above compares the same tests' values.
  local env=(PYTHON="$python" CUDA_STANDIN_VALUES=0 ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0:log_path=$reports/asan"
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan")
  local preload=$asan:$cxx_runtime ld_path=$libdirs
  if [[ ${#STANDIN_ENV[@]} -gt 0 ]]; then
    add_standin_env
    echo "[run_tests] the tree's tests under the sanitizers ($label; CUDA ones on the CUDA stand-in)"
  else
    echo "[run_tests] the tree's tests under the sanitizers ($label; CPU ones only: no stand-in)"
  fi
  (cd "$src" && env "${env[@]}" LD_PRELOAD="$preload" LD_LIBRARY_PATH="$ld_path" \
    "$python" -m pytest "${SAN_TESTS[@]}" \
    "${PYTEST_OPTS[@]}" < /dev/null) || rc=$?
  local n
  n=$(find "$reports" -type f | wc -l)
  if (( n > 0 )); then
    echo "[run_tests] sanitizer findings: $n report(s)"
    cat "$reports"/* | head -200
    rc=1
  else
    echo "[run_tests] sanitizer findings: 0"
  fi
  stamp "tests under the sanitizers ($label)" "$t"
  return $rc
}

# The ThreadSanitizer stage. A copy of the sources (build/tsan-src, its
# build folder kept between runs) built in place with -fsanitize=thread (-O1 -g1: line tables for
# the reports, about half the compile time of the default -O2 -g), then the tests that start
# threads under it, their CPU cases and their CUDA ones on the stand-in (without its value mode),
# with TSan's runtime preloaded into the uninstrumented Python. Reports go to files, also from the
# tests' subprocesses; scripts/tsan_reports.py fails the stage on any report with a frame of
# graphtrees' own code and summarises the others and what scripts/tsan.supp suppressed (its
# comments say why). OMP_NUM_THREADS=1: TSan cannot see libgomp's barriers, and the tests are about
# Python threads sharing trees, not intra-op parallelism. -fno-gnu-unique: at -O1 a TU keeps
# std::piecewise_construct as a unique global, which setup.py's check takes for libstdc++ code.
TSAN_FLAGS="-fsanitize=thread -O1 -g1 -fno-gnu-unique"
TSAN_TESTS=(tests/test_threads.py tests/test_locks.py
  tests/test_tree_behaviour.py::test_threads_have_their_own_trees_and_steps
  tests/test_tree_behaviour.py::test_trees_of_exited_threads_are_freed_once_their_outputs_die
  tests/test_tree_behaviour.py::test_backward_on_another_thread_runs_in_its_forwards_tree
  tests/test_tree_behaviour.py::test_concurrent_first_calls_of_a_module
  tests/test_cuda.py::test_two_threads_record_and_replay_at_once
  tests/test_cuda.py::test_replays_drawing_random_numbers_wait_for_another_threads_capture
  tests/test_hardening.py::test_overlapping_captures_of_two_threads_keep_the_collector_paused
  tests/test_cpu_graphs.py::test_threads_replay_their_programs_at_once
  tests/test_fidelity.py::test_threads_sharing_one_wrapped_module_keep_one_recording_each
  tests/test_observer.py::test_the_shared_fork_slot_forgets_a_fork_once_its_observers_are_gone
  tests/test_cpu_backend.py::test_routing_is_confined_to_the_calling_thread
  tests/test_streams.py::test_a_blocking_stream_capturing_in_another_thread_is_left_alone)
# tsan_build PYTHON LABEL [JOBS] builds it (TSAN_BUILT=1 once built), tsan_tests PYTHON LABEL
# runs its tests: the build fills lane A's time left after the sanitizer stage, the tests run in
# a lane beside the torch 2.11 CPU files.
TSAN_BUILT=0
tsan_build() {
  local python=$1 label=$2 t
  if [[ ${GRAPHTREES_SKIP_TSAN:-0} == 1 ]]; then
    echo "[run_tests] GRAPHTREES_SKIP_TSAN=1: the ThreadSanitizer stage is skipped"
    return 0
  fi
  if [[ -z $(sanitizer_runtime libtsan.so) ]]; then
    echo "[run_tests] the ThreadSanitizer stage is skipped: the compiler has no libtsan.so"
    return 0
  fi
  t=$(date +%s)
  instrumented_build "$ROOT/build/tsan-src" "$python" "$label" "$TSAN_FLAGS" __tsan_func_entry \
    "a ThreadSanitizer" "${3:-}" || return 1
  stamp "ThreadSanitizer build ($label)" "$t"
  TSAN_BUILT=1
}
tsan_tests() {
  local python=$1 label=$2 src=$ROOT/build/tsan-src t rc=0
  [[ $TSAN_BUILT == 1 ]] || return 0
  local tsan
  tsan=$(sanitizer_runtime libtsan.so)
  t=$(date +%s)
  local reports=$src/build/tsan-reports
  rm -rf "$reports" && mkdir -p "$reports"
  # The interpreter itself, not a wrapper script (pyenv's shim, a shell script, crashes under
  # the runtime); the NVIDIA library folders as in the sanitizer stage (nvidia_libdirs).
  local exe libdirs
  exe=$("$python" -c "import sys; print(sys.executable)")
  libdirs=$(nvidia_libdirs "$python")
  # halt_on_error=0 and exitcode=0: every report is written and the tests pass or fail on their
  # own; the logs decide. history_size=4: the earlier access of a race keeps its stack.
  local env=(PYTHON="$exe" CUDA_STANDIN_VALUES=0 OMP_NUM_THREADS=1
    TSAN_OPTIONS="suppressions=$ROOT/scripts/tsan.supp:print_suppressions=1:halt_on_error=0:exitcode=0:second_deadlock_stack=1:history_size=4:log_path=$reports/tsan")
  local preload=$tsan ld_path=$libdirs
  if [[ ${#STANDIN_ENV[@]} -gt 0 ]]; then
    add_standin_env
    echo "[run_tests] the thread tests under ThreadSanitizer ($label; CUDA ones on the CUDA stand-in)"
  else
    echo "[run_tests] the thread tests under ThreadSanitizer ($label; CPU ones only: no stand-in)"
  fi
  (cd "$src" && env "${env[@]}" LD_PRELOAD="$preload" LD_LIBRARY_PATH="$ld_path" \
    "$exe" -m pytest "${TSAN_TESTS[@]}" "${PYTEST_OPTS[@]}" < /dev/null) || rc=$?
  "$PY" scripts/tsan_reports.py "$reports" > "$reports.txt" || rc=1
  head -n 400 "$reports.txt"
  stamp "tests under ThreadSanitizer ($label)" "$t"
  return $rc
}

# Graphviz's `dot`, for graphtrees.tree_to_svg and its test (tests/test_observability.py), which
# is skipped without it: installed with apt-get when this runs as root and apt-get is there.
graphviz_install() {
  command -v dot > /dev/null && return 0
  if [[ $(id -u) == 0 ]] && command -v apt-get > /dev/null; then
    echo "[run_tests] Graphviz's dot is missing: apt-get install graphviz"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends graphviz \
        || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
          --no-install-recommends graphviz; }; } > /dev/null 2>&1 || true
  fi
  command -v dot > /dev/null \
    || echo "[run_tests] Graphviz's dot is not installed and could not be (not root, or no" \
      "apt-get): the SVG test of tests/test_observability.py is skipped"
}

t=$(date +%s)
"$PY" -m pip install torch==2.14.1 torchvision==0.29.1 "${DEPS[@]}"
graphviz_install
stamp "install (torch 2.14.1)" "$t"

# torch 2.11.0 is installed before the suite runs (the sanitizer stage builds against it), in a
# lane beside the torch 2.14.1 build: the one mostly waits on the network and the disk, the
# other on the compiler.
VENV=$ROOT/.venv-torch211
install_211() {
  local t
  t=$(date +%s)
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install torch==2.11.0 torchvision==0.26.0 "${DEPS[@]}"
  stamp "install (torch 2.11.0, beside the build)" "$t"
}
if [[ ${GRAPHTREES_SKIP_TORCH211:-0} != 1 ]]; then
  echo "[run_tests] beside the torch 2.14.1 build: the torch 2.11.0 install (logged below when done)"
  lane_start install_211
fi
t=$(date +%s)
echo "[run_tests] building graphtrees against torch 2.14.1 (build/temp-torch2.14.1*: only what changed)"
"$PY" -m pip install --no-build-isolation --no-deps -e .
"$PY" -c "import graphtrees._ext as e; print('[run_tests] backends compiled in:', e.get_ext().backends)"
stamp "build (torch 2.14.1)" "$t"
standin_build
lane_wait || exit 1

SAN_PY=$PY
SAN_LABEL="torch 2.14.1"
if [[ ${GRAPHTREES_SKIP_TORCH211:-0} != 1 ]]; then
  if [[ ${#STANDIN_ENV[@]} -gt 0 && ${CUDA_STANDIN_VALUES:-1} != 0 ]]; then
    # The stand-in's value engine for torch 2.11 (a torch extension: one per torch), built here
    # so that its time is printed and a failure stops the run instead of turning the mode off.
    t=$(date +%s)
    env "${STANDIN_ENV[@]}" CUDA_STANDIN_VALUES=0 "$VENV/bin/python" tests/cuda_standin/standin.py \
      build-values > /dev/null
    stamp "build the CUDA stand-in's value engine (torch 2.11.0)" "$t"
  fi
  SAN_PY=$VENV/bin/python
  SAN_LABEL="torch 2.11.0"
fi

# The second torch builds a copy of the sources, so that its extension never replaces the first
# one's (an extension only loads with the torch it was compiled against). The copy keeps its own
# build folder between runs; only files whose content changed are written (scripts/sync_tree.py).
SRC=$VENV/src
build_211() {
  local t
  t=$(date +%s)
  "$PY" scripts/sync_tree.py "$SRC" || return 1
  echo "[run_tests] building graphtrees against torch 2.11.0"
  (cd "$SRC" && "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e .) || return 1
  stamp "build (torch 2.11.0)" "$t"
}
# On torch 2.11 (the GPU machine's) every CUDA test runs on the stand-in; these files in its value
# mode, the others without it: the full value run is torch 2.14.1's.
VALUES_211=(tests/test_standin.py tests/test_seed_story.py tests/test_tree_behaviour.py
  tests/test_write_back.py tests/test_cuda.py tests/test_control_flow.py)
# The control-flow tests with a driver that has no conditional nodes (the stand-in says CUDA 12.3):
# a cond takes the tree-branch form, a loop runs eagerly with the reason (Note [A wrapper's cond
# split into tree branches] in csrc/ThreadState.h). About 45 s.
old_driver_tests() {
  [[ ${#STANDIN_ENV[@]} -gt 0 ]] || return 0
  local t rc=0
  t=$(date +%s)
  echo "[run_tests] control-flow tests on the CUDA stand-in with a CUDA 12.3 driver (torch 2.14.1)"
  env "${STANDIN_ENV[@]}" CUDA_STANDIN_DRIVER_VERSION=12030 PYTHON="$PY" "$PY" -m pytest \
    tests/test_control_flow.py "${PYTEST_OPTS[@]}" -m needs_cuda < /dev/null || rc=$?
  stamp "control-flow tests on the CUDA stand-in, CUDA 12.3 driver (torch 2.14.1)" "$t"
  return $rc
}
# Lane B: the stand-in's CUDA tests on torch 2.14.1, then the torch 2.11 build and the stand-in's
# tests on it; lane A (the foreground): the CPU suite on torch 2.14.1, then the sanitizer stage.
# The two take about as long (docs/testing.md).
lane_b() {
  local rc=0
  standin_tests "$PY" "torch 2.14.1" || rc=$?
  old_driver_tests || rc=$?
  if [[ ${GRAPHTREES_SKIP_TORCH211:-0} != 1 ]]; then
    build_211 || return 1
    (cd "$SRC" && standin_tests "$VENV/bin/python" "torch 2.11.0" "${VALUES_211[@]}") || rc=$?
  fi
  return $rc
}
# The host cost per compiled call against PyTorch's trees (issue 40), printed every run so that a
# regression shows the day it lands: a measurement, not a test. It runs between the lanes, while
# nothing else does: beside the CPU suite the other lane doubled graphtrees' figure and hid any
# change of its own.
host_cost() {
  [[ ${#STANDIN_ENV[@]} -gt 0 ]] || return 0
  local t rc=0
  t=$(date +%s)
  (cd "$ROOT" && env "${STANDIN_ENV[@]}" CUDA_STANDIN_VALUES=0 "$PY" benchmarks/bench_standin.py --sections overhead \
    --iters 1000 --rounds 5 < /dev/null | tail -n 16) > "$HOST_COST_LOG" || rc=$?
  cat "$HOST_COST_LOG"
  # The same replayed calls with and without a running torch.profiler: what graphtrees' profiler
  # ranges cost (Note [Call ranges]: nothing without a profiler, one range with one).
  (cd "$ROOT" && env "${STANDIN_ENV[@]}" CUDA_STANDIN_VALUES=0 "$PY" benchmarks/bench_ranges.py \
    --device cuda --iters 1000 --rounds 5 < /dev/null 2> /dev/null | tail -n 6) || rc=$?
  stamp "host cost on the CUDA stand-in (torch 2.14.1, nothing else running)" "$t"
  return $rc
}
HOST_COST_LOG="$ROOT/build/host-cost.txt"
# The same variants' instructions per call under callgrind (issue 50): wall time depends on the
# machine, instruction counts do not, so the two are printed side by side. Any load beside it
# leaves the counts as they are: it runs in the tail's lane after the ThreadSanitizer tests.
host_instructions() {
  [[ ${#STANDIN_ENV[@]} -gt 0 ]] || return 0
  local t rc=0
  t=$(date +%s)
  if ! command -v valgrind > /dev/null && command -v apt-get > /dev/null && [[ $(id -u) == 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends valgrind \
      > /dev/null 2>&1 || echo "[run_tests] valgrind could not be installed"
  fi
  (cd "$ROOT" && env "${STANDIN_ENV[@]}" CUDA_STANDIN_VALUES=0 "$PY" benchmarks/callgrind_overhead.py \
    --calls 200 --cache-sim < /dev/null) > "$HOST_COST_LOG.instructions" 2>&1 || rc=$?
  echo "[run_tests] host cost per call, wall time (measured alone, earlier) and instructions:"
  grep -h "^Above the" "$HOST_COST_LOG" 2> /dev/null
  cat "$HOST_COST_LOG.instructions"
  stamp "instructions per call under callgrind (CUDA stand-in, torch 2.14.1)" "$t"
  # 3: valgrind is missing (said above); not a failure of the tests.
  [[ $rc == 0 || $rc == 3 ]]
}
echo "[run_tests] beside the CPU suite and the sanitizer stage: the CUDA stand-in's tests and the torch 2.11 build (logged below when done)"
lane_start lane_b
t=$(date +%s)
cpu_rc=0
"$PY" -m pytest tests "${PYTEST_OPTS[@]}" || cpu_rc=$?
stamp "tests (torch 2.14.1)" "$t"
san_rc=0
sanitizer_stage "$SAN_PY" "$SAN_LABEL" || san_rc=$?
# The ThreadSanitizer build (torch 2.14.1) in what is left of lane A's time: one file at a time
# while lane B still runs (it keeps one core busy), both cores once it is done.
tsan_rc=0
tsan_jobs=2
if [[ -n $LANE_PID ]] && kill -0 "$LANE_PID" 2> /dev/null; then tsan_jobs=1; fi
if [[ $cpu_rc == 0 && $san_rc == 0 ]]; then
  tsan_build "$PY" "torch 2.14.1" "${TSAN_JOBS:-$tsan_jobs}" || tsan_rc=$?
fi
lane_wait || exit 1
[[ $cpu_rc == 0 ]] || exit $cpu_rc
[[ $san_rc == 0 ]] || exit $san_rc
[[ $tsan_rc == 0 ]] || exit $tsan_rc
host_cost || exit 1
if [[ ${GRAPHTREES_SKIP_TORCH211:-0} == 1 ]]; then
  tsan_tests "$PY" "torch 2.14.1" || exit 1
  host_instructions || exit 1
  echo "[run_tests] GRAPHTREES_SKIP_TORCH211=1: the torch 2.11 stages were skipped"
  stamp "all stages" "$t_all"
  exit 0
fi
# The ThreadSanitizer tests (torch 2.14.1, built in lane A), then the instructions per call under
# callgrind (counts, which load beside them leaves as they are), in a lane beside the torch 2.11
# CPU files: each keeps about one core busy.
tail_lane() {
  local rc=0
  tsan_tests "$PY" "torch 2.14.1" || rc=$?
  host_instructions || rc=$?
  return $rc
}
echo "[run_tests] beside the torch 2.11 CPU files: the ThreadSanitizer tests, then the instruction counts (logged below when done)"
lane_start tail_lane

# On torch 2.11 the CPU suite's files that touch what differs between the two torches (the
# extension's symbols and stubs, dynamo and AOTAutograd, piecewise splitting, the CPU program
# replay, the tree's behaviour, the fidelity cases), alone: lane B ran every CUDA test on it.
# GRAPHTREES_FULL_TORCH211=1 runs the whole CPU suite here too.
cd "$SRC"
t=$(date +%s)
TORCH211_TESTS=(tests/test_package.py tests/test_compile.py tests/test_piecewise.py
  tests/test_cpu_graphs.py tests/test_tree_behaviour.py tests/test_fidelity.py
  tests/test_policy.py tests/test_wheel.py tests/test_control_flow.py)
[[ ${GRAPHTREES_FULL_TORCH211:-0} == 1 ]] && TORCH211_TESTS=(tests)
cpu_rc=0
# The wheel built here must refuse torch 2.14.1 (test_wheel.py): its site-packages.
OTHER_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
GRAPHTREES_OTHER_TORCH_SITE=$OTHER_SITE PYTHON="$VENV/bin/python" \
  "$VENV/bin/python" -m pytest "${TORCH211_TESTS[@]}" "${PYTEST_OPTS[@]}" || cpu_rc=$?
stamp "tests (torch 2.11.0)" "$t"
cd "$ROOT"
lane_wait || exit 1
[[ $cpu_rc == 0 ]] || exit $cpu_rc
stamp "all stages" "$t_all"
