#!/usr/bin/env bash
# README's test command (and what .ci/run runs): installs what the tests need (torchvision and
# transformers included: tests/integration builds their models from configs, random weights,
# nothing downloaded), builds the extension and runs the whole suite against torch 2.14.1 in
# the current Python; then builds a
# second copy against torch 2.11.0 -- the GPU test machine's version -- in .venv-torch211 and runs
# the suite there too, so that a compile error or a missing symbol is found here, not on the GPU.
#   GRAPHTREES_SKIP_TORCH211=1   only the first stage
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python}
DEPS=(ninja "setuptools>=70" pytest hypothesis numpy transformers diffusers==0.42.1 clang-format==23.1.5 ruff==0.17.6)
t_all=$(date +%s)
stamp() { echo "[run_tests] $1: $(( $(date +%s) - $2 )) s"; }

t=$(date +%s)
"$PY" -m pip install torch==2.14.1 torchvision==0.29.1 "${DEPS[@]}"
stamp "install (torch 2.14.1)" "$t"
t=$(date +%s)
echo "[run_tests] building graphtrees against torch 2.14.1 (about 1-2 minutes on 2 cores)"
"$PY" -m pip install --no-build-isolation --no-deps -e .
stamp "build (torch 2.14.1)" "$t"
t=$(date +%s)
"$PY" -m pytest tests -q
stamp "tests (torch 2.14.1)" "$t"

if [[ ${GRAPHTREES_SKIP_TORCH211:-0} == 1 ]]; then
  echo "[run_tests] GRAPHTREES_SKIP_TORCH211=1: the torch 2.11 stage was skipped"
  exit 0
fi

# The second stage builds a copy of the sources, so that its extension never replaces the first
# one's (an extension only loads with the torch it was compiled against).
VENV=$ROOT/.venv-torch211
SRC=$VENV/src
t=$(date +%s)
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install torch==2.11.0 torchvision==0.26.0 "${DEPS[@]}"
stamp "install (torch 2.11.0)" "$t"
t=$(date +%s)
rm -rf "$SRC" && mkdir -p "$SRC"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"
else
  tar -cf - --exclude=./.venv-torch211 --exclude=./build --exclude='*.so' . | tar -xf - -C "$SRC"
fi
cd "$SRC"
echo "[run_tests] building graphtrees against torch 2.11.0"
"$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e .
stamp "build (torch 2.11.0)" "$t"
t=$(date +%s)
PYTHON="$VENV/bin/python" "$VENV/bin/python" -m pytest tests -q -p no:cacheprovider
stamp "tests (torch 2.11.0)" "$t"
stamp "all stages" "$t_all"
