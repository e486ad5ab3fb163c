#!/usr/bin/env bash
# One short device call for the RoPE / SwiGLU-backward epilogue work (see docs/triton.md):
#   1. GPU accuracy tests of RoPE at LLaMA-3 positions (hardware sin/cos after the 2 pi reduction);
#   2. the two kernels (qkv_rope, down_swiglu_bwd) on every model shape: cuBLAS vs codagen (tuned);
#   3. the same kernels with the previous generator (generator 1), codagen only, its shipped configs,
#      from .before/, made beforehand and carried (run(carry=[".whl", ".before"])):
#        mkdir .before; for f in codegen.py configs.py tuned.json; do
#          git show aeaf9cc:codagen/backends/triton/$f > .before/$f; done; echo /.before/ >> .git/info/exclude
#   4. the remaining GPU tests of the two programs, in whatever time is left.
#   bench/gpu_rope_swiglu.sh [seconds]      (a deadline for the whole script, default 225)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/rope_swiglu}"; mkdir -p "$OUT"
end=$((SECONDS + ${1:-225}))
left() { local t=$((end - SECONDS - ${1:-0})); [ $t -gt 5 ] && echo $t || echo 5; }
export PYTHONUNBUFFERED=1 CODAGEN_CACHE_DIR=/tmp/cc
if ! python3 -c "import pytest" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "$(left 170)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_backend.py -x -k rope_long 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -3
timeout "$(left 60)" python3 -m codagen bench kernels --kernels qkv_rope,down_swiglu_bwd --providers cublas_gemm,codagen \
  --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^|"
cp /tmp/cc/triton/tuning.json "$OUT/tuning.json" 2>/dev/null
if [ -d .before ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old "$OUT/before" && cp -r codagen /tmp/old/ && cp .before/* /tmp/old/codagen/backends/triton/
  (cd /tmp/old && CODAGEN_CACHE_DIR=/tmp/cc_old timeout "$(left 25)" python3 -m codagen bench kernels \
     --kernels qkv_rope,down_swiglu_bwd --providers codagen --out "$OUT/before" 2>&1 | grep -v "^|")
fi
timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_backend.py -k "(rope or swiglu) and not rope_long" \
  2>&1 | tee -a "$OUT/gpu_tests.log" | tail -4
echo "== new"; cat "$OUT"/*-kernels.md 2>/dev/null; echo "== before"; cat "$OUT"/before/*-kernels.md 2>/dev/null
