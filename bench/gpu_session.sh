#!/usr/bin/env bash
# One device call: the GPU tests (no tuning: fast; the sweeps are left to bench/gpu_kernels.sh),
# then the block benchmark with the arguments given (default: the LLaMA-3 shapes and a 2-layer model).
#   OUT=/some/dir bench/gpu_session.sh [codagen bench block args...]
# Liger-Kernel, when carried as a wheel in .whl/ (see the device README), is installed to /tmp/site first.
# The paper's shapes with every provider take about 2.5 minutes, the LLaMA shapes with the model step
# about 2 (H200, 2026-11-30); torch.compile's compile time is most of it.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/codagen-out}; mkdir -p "$OUT"
# wheels: .whl/ here, or beside a snapshot of the tree taken into a subfolder (../.whl)
for wheels in .whl ../.whl; do
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels/*.whl \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH"
    break
  fi
done
python3 -c "import liger_kernel" 2>/dev/null || echo "note: liger_kernel is not importable; the liger provider will record an error"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
# the every-config sweep and the ping-pong kernels' program sweep (48 compiles, ~4 min) are left to
# bench/gpu_kernels.sh
CODAGEN_TRITON_AUTOTUNE=0 timeout "${TEST_SECONDS:-300}" python3 -m pytest -q -m gpu -p no:warnings -p no:cacheprovider \
    tests -k "not test_gpu_every_config and not (test_pingpong and test_gpu_program)" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--shapes llama3-8b llama3-1b --layers 2)
timeout "${BLOCK_SECONDS:-400}" python3 -m codagen bench block "${args[@]}" --out "$OUT" 2>&1 \
    | grep -v "^  \[\|^codagen: tuning\|^  ->" | tee "$OUT/block.log" | tail -25
