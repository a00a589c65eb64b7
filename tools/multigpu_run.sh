#!/usr/bin/env bash
# Issue 16 on a machine with 2 to 8 H200s over NVLink, one run per part, every
# log under $OUT and a short table last. From the repo root:
#   PART=tests  bash tools/multigpu_run.sh   # torchrun -m pytest -m multigpu
#   PART=moe    bash tools/multigpu_run.sh   # benchmarks.moe at 16384 and 2048 tokens per GPU
#   PART=sweep  bash tools/multigpu_run.sh   # benchmarks.ep_sweep (comm CTAs, minibatch)
# NPROC (default: every visible GPU) sets the ranks. NVLink multicast stays off.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
run() {  # name, timeout, command...: the log in $OUT/name.log, one summary line
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name (N=$NPROC) rc=$rc $(( $(date +%s) - start ))s: $(grep -v '^W1' "$OUT/$name.log" | tail -1)" | tee -a "$OUT/summary.log"
}
case ${PART:-tests} in
  tests)  # the layer test also runs a virtual group of N ranks on each GPU: N + 1 connections
    export CUDA_DEVICE_MAX_CONNECTIONS=16
    run pytest_multigpu 540 torchrun --nproc-per-node "$NPROC" -m pytest -m multigpu -q -rfE -p no:cacheprovider tests/multigpu ;;
  moe)
    for tokens in 16384 2048; do
      run "moe_t$tokens" 280 torchrun --nproc-per-node "$NPROC" -m benchmarks.moe --tokens "$tokens" \
        --shapes qwen3-30b-a3b,deepseek-v3,mixtral-8x7b --json "$OUT/moe_t$tokens.json"
    done
    grep -h "ceilings\|peers\|x vs baseline" "$OUT"/moe_t*.log | grep -v "^W1" | cut -c1-220 ;;
  sweep)
    run ep_sweep 540 torchrun --nproc-per-node "$NPROC" -m benchmarks.ep_sweep \
      --shapes qwen3-30b-a3b,deepseek-v3 --json "$OUT/ep_sweep.json"
    grep -h "fastest" "$OUT/ep_sweep.log" ;;
esac
cat "$OUT/summary.log"
