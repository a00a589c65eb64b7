#!/usr/bin/env bash
# One run on a GPU machine: install mok, run the GPU tests named in $TESTS, the
# benchmarks named in $BENCH, and write every log under $OUT. Usage (from the repo root):
#   TESTS="tests/gpu/test_runtime_gpu.py" BENCH="memory moe main" bash tools/gpu_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
status=0
[ -n "${DIAG:-}" ] && timeout 200 python3 $DIAG 2>&1 | tee "$OUT/diag.log"
# Each test file in its own process: a trapped kernel kills its CUDA context, and must not
# take the other files' tests with it.
for t in ${TESTS:-}; do
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider $t ${TEST_ARGS:-} 2>&1 | tee -a "$OUT/pytest_gpu.log" | tail -12
  status=$(( status | PIPESTATUS[0] ))
done
if [ -n "${MULTI:-}" ]; then
  timeout "${MULTI_TIMEOUT:-240}" torchrun --nproc-per-node 2 -m pytest -m multigpu -q -rfE -p no:cacheprovider $MULTI 2>&1 | tee "$OUT/pytest_multigpu.log" | tail -30
  status=$(( status | PIPESTATUS[0] ))
fi
for b in ${BENCH:-}; do
  case $b in
    memory) timeout 240 python3 -m benchmarks.memory_kernels --json "$OUT/memory_kernels.json" --profile "$OUT/launch_profile.txt" 2>&1 | tee "$OUT/memory_kernels.log" | tail -20 ;;
    moe) timeout "${MOE_TIMEOUT:-300}" python3 -m benchmarks.moe ${MOE_ARGS:-} --json "$OUT/moe.json" --png "$OUT/moe.png" 2>&1 | tee "$OUT/moe.log" | tail -30 ;;
    main) timeout 120 python3 -m mok 2>&1 | tee "$OUT/main.log" | tail -16 ;;
    moe2) timeout "${MOE_TIMEOUT:-300}" torchrun --nproc-per-node 2 -m benchmarks.moe ${MOE_ARGS:-} --json "$OUT/moe_ep2.json" --png "$OUT/moe_ep2.png" 2>&1 | tee "$OUT/moe_ep2.log" | grep -v "^W1" | tail -30 ;;
  esac
done
exit $status
