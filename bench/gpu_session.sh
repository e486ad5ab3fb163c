#!/usr/bin/env bash
# One device call: the GPU tests of the ops, models and allocator (no tuning: fast), then the block
# benchmark (tunes on first use). Results under $OUT. Usage: OUT=/some/dir bench/gpu_session.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/codagen-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
CODAGEN_TRITON_AUTOTUNE=0 timeout 170 python3 -m pytest -q -m gpu -p no:warnings tests/test_ops_gpu.py \
    tests/test_hf.py tests/test_triton_allocator.py tests/test_triton_backend.py -k "not test_gpu_every_config" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -12
timeout "${BLOCK_SECONDS:-400}" python3 -m codagen bench block --shapes llama3-8b llama3-1b --layers 2 --out "$OUT" \
    2>&1 | tee "$OUT/block.log" | tail -25
