#!/usr/bin/env bash
# The two-GPU runs of FSDP2 and tensor parallelism (docs/sharding.md, "Two-GPU runs"), one device call per part,
# each under 9 minutes (every step has a time cap); every log and JSON goes to $OUT as soon as it exists:
#   OUT=/some/dir bench/two_gpu.sh part1   # the GPU tests of sharding and TP, the convergence runs
#   OUT=/some/dir bench/two_gpu.sh part2   # bench/sharded_step.py throughput: fsdp, tp, tp_sp
#   OUT=/some/dir bench/two_gpu.sh part3   # bench/torchtitan_step.py on one GPU (FSDP degree 1)
#   OUT=/some/dir bench/two_gpu.sh part4   # bench/torchtitan_step.py on two GPUs: FSDP 2, then TP 2 (+ SP)
#   bench/two_gpu.sh table DIR...          # the table of the JSON files in DIR... (each part prints its own)
# DRY_RUN=1 runs the same steps on two CPU processes (gloo, tiny shapes): a check of the script itself.
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1; bench/sharded_convergence.py refuses to run without them).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CODAGEN_TRITON_AUTOTUNE=0
OUT=${OUT:-/tmp/codagen-out}
PYTHON=${PYTHON:-python3}
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2)
DATE=$(date -u +%Y-%m-%d)
if [ "${DRY_RUN:-0}" = 1 ]; then
  CONVERGENCE_ARGS=(--dry-run)
  STEP_ARGS=(--device cpu --shape tiny --layers 2 --tokens 256 --steps 2 --warmup 1)
else
  CONVERGENCE_ARGS=(--shape d512 --steps 200)
  STEP_ARGS=(--shape llama3-8b --layers 4 --tokens 8192 --steps 10 --warmup 3)
fi

table() {  # table DIR...: one line per comparison, record and throughput in the JSON files of DIR...
  "$PYTHON" - "$@" <<'EOF'
import json, sys
from pathlib import Path

for path in sorted(p for folder in sys.argv[1:] for p in Path(folder).glob("*.json")):
    result = json.loads(path.read_text())
    env, records = result.get("env", {}), result.get("records", [])
    world = env.get("world_size", records[0].get("world") if records else None)
    print(f"\n{path.name}  ({env.get('gpu')}, torch {env.get('torch')}, world {world})")
    for c in result.get("comparisons", []):
        print(f"  {c['name']:42} max |dloss| {c['max_abs_diff']:.3e}  ({c['max_rel_diff']:.2e} rel, step {c['step']})")
    for r in records:
        if "losses" in r:
            print(f"  {r['mode']:6} {r['provider']:12} loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
        elif "tokens_per_s" in r:
            per_gpu = r["tokens_per_s"] / r.get("world", 1)
            peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f} GiB"
            print(f"  {r.get('mode', ''):6} {r.get('provider', ''):12} {r.get('median_step_ms', float('nan')):9.1f} ms"
                  f" {per_gpu:12,.0f} tok/s/GPU  peak {peak}")
EOF
}

STATUS=()
step() {  # step NAME SECONDS COMMAND...: COMMAND under a time cap; its whole output in $OUT/NAME.log
  local name=$1 seconds=$2 start=$SECONDS
  shift 2
  echo "== $name (at most $seconds s): $*"
  timeout -k 10 "$seconds" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-20}"
  STATUS+=("$name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s")
}

sharded_step() {  # sharded_step MODE SECONDS: bench/sharded_step.py for MODE, as $OUT/<date>-sharded-step-MODE.json
  step "sharded_step_$1" "$2" "${TORCHRUN[@]}" bench/sharded_step.py --modes "$1" "${STEP_ARGS[@]}" --out "$OUT/step-$1"
  for json in "$OUT/step-$1"/*-sharded-step.json; do
    [ -f "$json" ] && mv "$json" "$OUT/$DATE-sharded-step-$1.json"
  done
  rmdir "$OUT/step-$1" 2>/dev/null
}

torchtitan_wheels() {  # torchtitan and its pure-Python needs, when carried as wheels (see the device README)
  for wheels in .whl ../.whl; do
    if ls $wheels/*.whl >/dev/null 2>&1; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        $wheels/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
      break
    fi
  done
}

part=${1:-}
if [ "$part" = table ]; then
  shift
  table "$@"
  exit
fi
case "$part" in
  part1|part2|part3|part4) ;;
  *) echo "usage: bench/two_gpu.sh part1|part2|part3|part4|table DIR..." >&2; exit 2;;
esac
mkdir -p "$OUT"
if [ "${DRY_RUN:-0}" != 1 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    echo "bench/two_gpu.sh: needs 2 GPUs, nvidia-smi lists $gpus" >&2
    exit 1
  fi
  { nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader; nvidia-smi topo -m; } \
    | tee "$OUT/gpus-$part.txt"
fi

case "$part" in
  part1)  # about 5 minutes: spawned NCCL jobs and Triton compiles for the tests' shapes, then 6 runs of 200 steps
    step gpu_tests 280 "$PYTHON" -m pytest -q -m gpu -k gpu -p no:warnings -p no:cacheprovider --durations=10 \
      tests/models/test_sharding.py tests/models/test_tensor_parallel.py
    step convergence 230 "${TORCHRUN[@]}" bench/sharded_convergence.py --modes single fsdp tp \
      "${CONVERGENCE_ARGS[@]}" --out "$OUT"
    ;;
  part2)  # Llama-3-8B dims, 4 layers, 8192 tokens per rank (fsdp) or per step (tp, tp_sp)
    sharded_step fsdp 200
    sharded_step tp 140
    sharded_step tp_sp 140
    ;;
  part3)  # torchtitan's trainer on one GPU, codagen's model against torchtitan's
    torchtitan_wheels
    step torchtitan_one_gpu 500 "$PYTHON" bench/torchtitan_step.py --steps 30 --warmup 10 --out "$OUT"
    ;;
  part4)  # torchtitan's trainer on two GPUs: FSDP 2, then TP 2 with sequence parallelism (torchtitan's own TP plan)
    torchtitan_wheels
    step torchtitan_fsdp2 250 "$PYTHON" bench/torchtitan_step.py --gpus 2 --configs torchtitan_sdpa codagen \
      --steps 30 --warmup 10 --out "$OUT"
    step torchtitan_tp2 250 "$PYTHON" bench/torchtitan_step.py --gpus 2 --tp 2 --configs torchtitan_sdpa codagen \
      --steps 30 --warmup 10 --out "$OUT"
    ;;
esac
printf '%s\n' "${STATUS[@]}" | tee "$OUT/status-$part.txt"
table "$OUT"
