#!/usr/bin/env bash
# One device call: GPU tests of the Triton backend (both schedules), then the kernel benchmark.
#   bench/gpu_kernels.sh [--quick] [more args of `codagen bench kernels`]
# Writes logs and results under $OUT (or bench/results when OUT is unset). Needs pytest: if the
# machine lacks it, wheels in .whl/ (carried) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
export PYTHONUNBUFFERED=1 CODAGEN_CACHE_DIR="${CODAGEN_CACHE_DIR:-/tmp/codagen-cache}"
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/backends/test_triton.py \
      tests/backends/test_pingpong.py --maxfail=8 -rs 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
fi
python3 -m codagen bench kernels --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^|" 
cp "$CODAGEN_CACHE_DIR/triton/tuning.json" "$OUT/tuning.json" 2>/dev/null
cat "$OUT"/*-kernels.md
