#!/usr/bin/env bash
# The device check for a lent GPU machine (no network; torch 2.11 cu130, Python 3.12, 16 cores):
# builds the extension, runs the whole test suite with the CUDA backend enabled, runs the GPU
# benchmarks, and writes logs and JSON under $OUT (6 files). Budget: under 8 minutes.
#   OUT=/tmp/out bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/graphtrees-gpu-check}
mkdir -p "$OUT"
export GRAPHTREES_CUDA=1 PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PIP_NO_INPUT=1
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  $PY -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

start=$(date +%s)
if ! timeout 240 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - start )) s"; $PY -m graphtrees.info | tail -1

timeout 300 $PY -m pytest tests -q -rs -p no:cacheprovider > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -25 "$OUT/tests.log"
echo "tests exit code: $tests_rc ($(( $(date +%s) - start )) s so far)"

timeout 200 $PY benchmarks/bench_gpu.py --out "$OUT" --iters 2000 > "$OUT/bench.log" 2>&1
bench_rc=$?
cat "$OUT"/gpu-*.md 2>/dev/null || tail -30 "$OUT/bench.log"
echo "bench exit code: $bench_rc; total $(( $(date +%s) - start )) s"
exit $(( tests_rc != 0 || bench_rc != 0 ))
