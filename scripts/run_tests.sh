#!/usr/bin/env bash
# README's test command (and what .ci/run runs): installs what the tests need (torchvision,
# transformers and diffusers included: tests/integration builds their models from configs, random
# weights, nothing downloaded), builds the extension, and for torch 2.14.1 and then torch 2.11.0
# (the GPU machine's, in .venv-torch211) runs
#   - the suite on CPU (the CUDA tests skipped: no GPU), and
#   - the suite's CUDA tests on the CUDA stand-in (tests/cuda_standin: a fake CUDA runtime under
#     real torch, kernels never executed), with GRAPHTREES_CUDA=1 -- a stand-in run, not a GPU
#     run; tests that need kernel results are skipped there with their reason.
#   GRAPHTREES_SKIP_TORCH211=1   only torch 2.14.1
#   GRAPHTREES_FULL_TORCH211=1   the whole CPU suite on torch 2.11 too (not only its API-facing files)
#   GRAPHTREES_SKIP_STANDIN=1    no CUDA stand-in stages
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
    stamp "build the CUDA stand-in" "$t"
  else
    echo "[run_tests] the CUDA stand-in stages are skipped (see the reason above)"
  fi
}

# standin_start PYTHON LABEL: the suite's CUDA tests on the stand-in, in the background (its
# own process, beside the CPU stage: the two take about as long, and each mostly keeps one core
# busy), logged to a file; standin_wait prints that log and fails if they failed.
STANDIN_PID=
STANDIN_LOG=
trap '[[ -z $STANDIN_PID ]] || kill "$STANDIN_PID" 2> /dev/null || true' EXIT
standin_start() {
  local python=$1 label=$2
  [[ ${#STANDIN_ENV[@]} -gt 0 ]] || return 0
  STANDIN_LOG=$(mktemp)
  echo "[run_tests] CUDA tests on the CUDA stand-in ($label; kernels are not executed), beside the CPU stage"
  (
    t=$(date +%s)
    rc=0
    env "${STANDIN_ENV[@]}" PYTHON="$python" "$python" -m pytest tests "${PYTEST_OPTS[@]}" \
      -m needs_cuda < /dev/null || rc=$?
    stamp "tests on the CUDA stand-in ($label)" "$t"
    exit $rc
  ) > "$STANDIN_LOG" 2>&1 &
  STANDIN_PID=$!
}
standin_wait() {
  [[ -n $STANDIN_PID ]] || return 0
  local rc=0
  wait "$STANDIN_PID" || rc=$?
  cat "$STANDIN_LOG"
  rm -f "$STANDIN_LOG"
  STANDIN_PID=
  return $rc
}

t=$(date +%s)
"$PY" -m pip install torch==2.14.1 torchvision==0.29.1 "${DEPS[@]}"
stamp "install (torch 2.14.1)" "$t"
t=$(date +%s)
echo "[run_tests] building graphtrees against torch 2.14.1 (build/temp-torch2.14.1*: only what changed)"
"$PY" -m pip install --no-build-isolation --no-deps -e .
"$PY" -c "import graphtrees._ext as e; print('[run_tests] backends compiled in:', e.get_ext().backends)"
stamp "build (torch 2.14.1)" "$t"
standin_build
standin_start "$PY" "torch 2.14.1"
t=$(date +%s)
cpu_rc=0
"$PY" -m pytest tests "${PYTEST_OPTS[@]}" || cpu_rc=$?
stamp "tests (torch 2.14.1)" "$t"
standin_wait
[[ $cpu_rc == 0 ]] || exit $cpu_rc

if [[ ${GRAPHTREES_SKIP_TORCH211:-0} == 1 ]]; then
  echo "[run_tests] GRAPHTREES_SKIP_TORCH211=1: the torch 2.11 stages were skipped"
  stamp "all stages" "$t_all"
  exit 0
fi

# The second torch builds a copy of the sources, so that its extension never replaces the first
# one's (an extension only loads with the torch it was compiled against). The copy keeps its own
# build folder between runs; only files whose content changed are written (scripts/sync_tree.py).
VENV=$ROOT/.venv-torch211
SRC=$VENV/src
t=$(date +%s)
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install torch==2.11.0 torchvision==0.26.0 "${DEPS[@]}"
stamp "install (torch 2.11.0)" "$t"
t=$(date +%s)
"$PY" scripts/sync_tree.py "$SRC"
cd "$SRC"
echo "[run_tests] building graphtrees against torch 2.11.0"
"$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e .
stamp "build (torch 2.11.0)" "$t"
t=$(date +%s)
# On torch 2.11 the CPU suite's files that touch what differs between the two torches (the
# extension's symbols and stubs, dynamo and AOTAutograd, piecewise splitting, the CPU program
# replay, the tree's behaviour, the fidelity cases); the CUDA stand-in stage below runs every
# CUDA test on it. GRAPHTREES_FULL_TORCH211=1 runs the whole CPU suite here too.
TORCH211_TESTS=(tests/test_package.py tests/test_compile.py tests/test_piecewise.py
  tests/test_cpu_graphs.py tests/test_tree_behaviour.py tests/test_fidelity.py
  tests/test_policy.py tests/test_wheel.py)
[[ ${GRAPHTREES_FULL_TORCH211:-0} == 1 ]] && TORCH211_TESTS=(tests)
standin_start "$VENV/bin/python" "torch 2.11.0"
cpu_rc=0
# The wheel built here must refuse torch 2.14.1 (test_wheel.py): its site-packages.
OTHER_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
GRAPHTREES_OTHER_TORCH_SITE=$OTHER_SITE PYTHON="$VENV/bin/python" \
  "$VENV/bin/python" -m pytest "${TORCH211_TESTS[@]}" "${PYTEST_OPTS[@]}" || cpu_rc=$?
stamp "tests (torch 2.11.0)" "$t"
standin_wait
[[ $cpu_rc == 0 ]] || exit $cpu_rc
stamp "all stages" "$t_all"
