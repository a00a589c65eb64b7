#!/usr/bin/env bash
# One run on a one-GPU machine, bounded in time: install mok, then the GPU test files in $TESTS
# (each in its own process, $PAR at a time, none started after $DEADLINE_S), the original's
# suite if $ORIGINAL names its checkout, the benchmarks in $BENCH; logs under $OUT (packed as
# $OUT/logs.tgz with $OUT/summary.txt beside it), the summary printed last. From the repo root:
#   TESTS="tests/gpu/test_runtime_gpu.py tests/gpu/test_comm_gpu.py" PAR=4 bash tools/gpu_run.sh
#   TESTS=tests/gpu/test_forward_gpu.py TEST_DIRS="variant=DIR" bash tools/gpu_run.sh  (DIR too)
#   ORIGINAL=PATH_TO_ORIGINAL_CHECKOUT BENCH="main moe" bash tools/gpu_run.sh
#   SONIC_KIT=.peers/sonic BENCH=moe MOE_ARGS="--shapes qwen3-30b-a3b --no-liger" bash tools/gpu_run.sh
#   SONIC_KIT=.peers/sonic BENCH="warm moe" MOE_ARGS=... bash tools/gpu_run.sh  (peer compiles first)
#   BENCH=macro [MACRO_ARGS="--shapes qwen3-30b-a3b --tokens 16384 --macrobatch 16384"] bash tools/gpu_run.sh
#   BASELINE=DIR BENCH=ab MOE_ARGS="--shapes qwen3-30b-a3b --tokens 2048,16384" bash tools/gpu_run.sh
#   BENCH=phases PHASE_SHAPES="qwen3-30b-a3b kimi-k2" [TIMELINE_DIR=DIR] bash tools/gpu_run.sh
#   BENCH=ncu NCU_TOKENS="2048 16384" [NCU_SHAPE=kimi-k2] bash tools/gpu_run.sh
#   BENCH=kernels KERNEL_DIRS="variant=DIR" [KERNEL_CASES=qwen3-30b-a3b:2048] bash tools/gpu_run.sh
#   TESTS=tests/gpu/test_copy_probe_gpu.py BENCH=copy bash tools/gpu_run.sh
#   TESTS=tests/gpu/test_row_tma_probe_gpu.py BENCH=rows bash tools/gpu_run.sh
#     (DIR: another tree of mok, e.g. `git archive REV | tar -x -C DIR`; tools/tree_ab.py compares)
# A run leaves two files in $OUT: logs.tgz (every log) and summary.txt.
# WHEELS=DIR: wheels installed into /tmp/site (put on PYTHONPATH) first, except TorchTitan's,
# which tests/conftest.py installs for its own checks from the same folder (PIP_FIND_LINKS).
# SONIC_KIT=DIR / LIGER_KIT=DIR (a peer kit's folder, carried; ../shared/peers/): installed
# first, and `moe` gets its `--sonic-site` / `--liger-site`. The SonicMoE kit's cache folders
# are exported, so QuACK finds its prebuilt kernels (without them it compiles each GEMM on the
# first call, minutes a shape). QuACK's autotuning (about a minute a shape and token count) is
# kept too: the run leaves its choices (*.autotune.json) in $OUT/peer_cache_<GPU>.tgz, and
# PEER_CACHE=DIR (carried) seeds them from DIR/<GPU>/quack, where <GPU> is the card's name with
# '_' for spaces (unpack the archive there: tar -xzf FILE -C DIR/<GPU>/quack). The compile caches
# live in $SONIC_CACHE (default runs/sonic_cache, git-ignored, so a later call on the same
# machine finds them: `BENCH=warm`, then `BENCH=moe` in the next call); the kits unpack into
# $SONIC_SITE / $LIGER_SITE (default runs/sonic_site, runs/liger_site), which that later call
# reuses without unpacking again while the archive is the same (install_kit). The summary
# ends with the size of each of SonicMoE's compile caches (files, bytes, gzipped): its first
# call of a shape compiles for minutes on a machine that has not compiled it (docs/NOTES.md §4).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; LOGS=$(mktemp -d); mkdir -p "$OUT"; START=$(date +%s)
export LOGS DEADLINE=$(( START + ${DEADLINE_S:-540} )) TEST_TIMEOUT=${TEST_TIMEOUT:-420}
# SonicMoE's compile caches as the run leaves them (files, bytes, gzipped bytes): what a later
# run would need to carry to skip a shape's first-call compiles.
cache_sizes() {
  for var in QUACK_CACHE_DIR TRITON_CACHE_DIR CUTE_DSL_CACHE_DIR TVM_FFI_CACHE_DIR; do
    dir=${!var:-}; [ -n "$dir" ] && [ -d "$dir" ] || continue
    echo "peer cache $var: $(find "$dir" -type f | wc -l) files, $(du -sb "$dir" | cut -f1) bytes," \
      "$(tar -cf - -C "$dir" . | gzip -1 | wc -c) gzipped" >> "$LOGS/summary.txt"
  done
}
pack() {
  cp "$LOGS/summary.txt" "$OUT/" 2>/dev/null; tar -czf "$OUT/logs.tgz" -C "$LOGS" .
  if [ -n "${QUACK_CACHE_DIR:-}" ] && [ -d "$QUACK_CACHE_DIR" ]; then
    (cd "$QUACK_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$OUT/peer_cache_$GPU_NAME.tgz" -T -)
  fi
}
trap pack EXIT
: > "$LOGS/summary.txt"
note() { echo "$*" >> "$LOGS/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$LOGS/gpu.txt"
GPU_NAME=$(head -1 "$LOGS/gpu.txt" | cut -d, -f1 | tr ' ' '_')  # the peer caches' folder name
if [ -n "${WHEELS:-}" ]; then
  wheels=$(ls "$WHEELS"/*.whl | grep -v torchtitan)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels > "$LOGS/wheels.log" 2>&1 \
    || note "wheels: install failed (wheels.log)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PIP_NO_INDEX=1 PIP_FIND_LINKS=$(cd "$WHEELS" && pwd)
fi
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$LOGS/gpu.txt"
python3 -m pip install --no-deps --no-build-isolation -e . > "$LOGS/install.log" 2>&1 || { tail -20 "$LOGS/install.log"; exit 1; }
# A peer kit (NAME: sonic or liger) installed into SITE, its install log (whose `export` lines
# the caller reads) in $LOGS/install_NAME.log. SITE defaults to a git-ignored folder of the tree,
# which a later call on the same machine keeps: there the same archive (its .sha256 file) with
# the same ENV (what else the install's exports name: SonicMoE's $SONIC_CACHE) is not unpacked
# and checked again (~10 s a kit), and the log that install left is used.
install_kit() {  # NAME KIT_DIR SITE LABEL [ENV]
  local name=$1 kit=$2 site=$3 label=$4 log="$LOGS/install_$1.log"
  local sum="$kit/${name}_peer.tar.xz.sha256" stamp="$site/.kit_install.key" kept="$site/.kit_install.log"
  local key; key="$(cat "$sum" 2>/dev/null) ${5:-}"
  if [ -f "$sum" ] && [ -f "$kept" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    cp "$kept" "$log"; note "$label kit: installed in $site by an earlier call (same archive)"; return 0
  fi
  rm -f "$stamp" "$kept"
  if bash "$kit/install_$name.sh" > "$log" 2>&1 && ! grep -q "FAILED" "$log"; then
    [ -f "$sum" ] && mkdir -p "$site" && cp "$log" "$kept" && printf '%s' "$key" > "$stamp"
  else
    note "$label kit: install failed (install_$name.log)"
  fi
}
peer_args=()
if [ -n "${SONIC_KIT:-}" ]; then
  export SONIC_CACHE=${SONIC_CACHE:-$PWD/runs/sonic_cache} SONIC_SITE=${SONIC_SITE:-$PWD/runs/sonic_site}
  install_kit sonic "$SONIC_KIT" "$SONIC_SITE" SonicMoE "SONIC_CACHE=$SONIC_CACHE"
  eval "$(grep -E '^export (SONIC_SITE|QUACK_CACHE_DIR)=' "$LOGS/install_sonic.log")"
  if [ -n "${PEER_CACHE:-}" ] && [ -d "$PEER_CACHE/$GPU_NAME/quack" ]; then
    cp -r "$PEER_CACHE/$GPU_NAME/quack/." "${QUACK_CACHE_DIR:?}/"
    note "QuACK autotuning seeded: $(find "$PEER_CACHE/$GPU_NAME/quack" -name '*.autotune.json' | wc -l) choices for $GPU_NAME"
  fi
  peer_args+=(--sonic-site "$SONIC_SITE")
fi
if [ -n "${LIGER_KIT:-}" ]; then
  export LIGER_SITE=${LIGER_SITE:-$PWD/runs/liger_site}
  install_kit liger "$LIGER_KIT" "$LIGER_SITE" LigerMoE
  eval "$(grep -E '^export LIGER_SITE=' "$LOGS/install_liger.log")"
  peer_args+=(--liger-site "$LIGER_SITE")
fi

# One test file in its own process: a trapped kernel kills its CUDA context, and must not take
# the other files' tests with it. "NAME=DIR:FILE" runs FILE with MOK_KERNEL_DIR=DIR (TEST_DIRS).
run_file() {
  local name left start file=$1 dir=
  case $1 in *=*:*) name=${1%%=*}; dir=${1#*=}; dir=${dir%%:*}; file=${1#*:} ;; esac
  name=${name:+${name}_}$(basename "$file" .py); start=$(date +%s); left=$(( DEADLINE - start ))
  [ "$left" -gt "$TEST_TIMEOUT" ] && left=$TEST_TIMEOUT
  if [ "$left" -lt 20 ]; then echo "$name not started (deadline)" >> "$LOGS/summary.txt"; return; fi
  env ${dir:+MOK_KERNEL_DIR=$PWD/$dir} timeout "$left" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    "$file" ${TEST_ARGS:-} > "$LOGS/$name.log" 2>&1
  echo "$name rc=$? $(grep -E '(passed|failed|error|skipped)' "$LOGS/$name.log" | tail -1 | cut -c1-100) [$(( $(date +%s) - start ))s]" >> "$LOGS/summary.txt"
}
export -f run_file
# $left: the seconds to the deadline; fails when under 30, too few to start anything.
time_left() { left=$(( DEADLINE - $(date +%s) )); [ "$left" -ge 30 ]; }
status=0
# TEST_DIRS="NAME=DIR ...": each of $TESTS again with that cubin folder (a diagnostic build);
# TEST_SHIPPED=0 leaves out the shipped cubins' runs.
jobs_list=$(for f in ${TESTS:-}; do
  [ "${TEST_SHIPPED:-1}" = 0 ] || echo "$f"
  for d in ${TEST_DIRS:-}; do echo "$d:$f"; done
done)
[ -n "${TESTS:-}" ] && printf '%s\n' $jobs_list | xargs -P "${PAR:-1}" -I{} bash -c 'run_file {}'
grep -q " rc=[1-9]" "$LOGS/summary.txt" && status=1

if [ -n "${ORIGINAL:-}" ]; then
  left=$(( DEADLINE - $(date +%s) ))
  timeout "$left" python3 tools/original_suite.py "$ORIGINAL" --timeout "${ORIGINAL_TIMEOUT:-300}" \
    --budget-s $(( left - 10 )) --json "$LOGS/original_suite.json" ${ORIGINAL_ARGS:-} \
    > "$LOGS/original_suite.log" 2>&1
  note "original suite rc=$?: $(tail -1 "$LOGS/original_suite.log")"
fi

for b in ${BENCH:-}; do
  time_left || { note "$b not started (deadline)"; continue; }
  case $b in
    main) timeout "$left" python3 -m mok > "$LOGS/main.log" 2>&1; note "python -m mok rc=$? $(tail -1 "$LOGS/main.log")" ;;
    warm) # a peer's first call of a shape compiles for minutes (docs/NOTES.md §4): one benchmarks.moe
        # per shape of WARM_SHAPES (the longest compiles first), WARM_PAR at once (compiles are
        # CPU-bound, one core each; each process and its peer worker hold up to ~23 GB of GPU
        # memory, so four at once ran out on an H100: WARM_PAR defaults to 3 there, 4 on a card
        # of over 100 GB), one rep at each of WARM_TOKENS (default 2048; with no seeded QuACK
        # choices, WARM_TOKENS=2048,4096,16384 makes SonicMoE autotune each token count here, and
        # its worker then holds more memory: fewer at once); timings not used
        mem_mib=$(head -1 "$LOGS/gpu.txt" | cut -d, -f3 | tr -dc 0-9)
        par=${WARM_PAR:-$([ "${mem_mib:-0}" -gt 100000 ] && echo 4 || echo 3)}
        note "warm: up to $par shapes at once (${mem_mib:-?} MiB of GPU memory)"
        for shape in ${WARM_SHAPES:-kimi-k2 deepseek-v3 qwen3-30b-a3b mixtral-8x7b}; do
          while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do wait -n; done
          # each shape gets the time left when it starts, so none outlasts the deadline
          time_left || { note "warm $shape not started (deadline)"; continue; }
          ( began=$(date +%s)
            timeout "$left" python3 -m benchmarks.moe --shapes "$shape" --tokens "${WARM_TOKENS:-2048}" \
              --passes fwd,fwdbwd --no-liger "${peer_args[@]}" --reps 1 --warmup 0 > "$LOGS/warm_$shape.log" 2>&1
            note "warm $shape rc=$? $(( $(date +%s) - began ))s, $(grep -c ' error in stage' "$LOGS/warm_$shape.log") peer errors" \
              "$(grep -o '\[compiled:[^]]*\]' "$LOGS/warm_$shape.log" | head -1)" ) &
        done
        wait
        note "warm done at $(( $(date +%s) - START ))s" ;;
    memory) timeout "$left" python3 -m benchmarks.memory_kernels --json "$LOGS/memory_kernels.json" > "$LOGS/memory_kernels.log" 2>&1; note "memory_kernels rc=$?" ;;
    moe) timeout "$left" python3 -m benchmarks.moe ${MOE_ARGS:-} "${peer_args[@]}" --time-limit $(( left - 25 )) --json "$LOGS/moe.json" --png "$OUT/moe.png" > "$LOGS/moe.log" 2>&1
         note "benchmarks.moe rc=$?"; grep -E "into the run\)$|--time-limit" "$LOGS/moe.log" >> "$LOGS/summary.txt"
         grep -A60 "^shape " "$LOGS/moe.log" >> "$LOGS/summary.txt" ;;
    macro) # the ring's rows (--macrobatch) in a benchmarks.moe of their own, no peers
        timeout "$left" python3 -m benchmarks.moe --no-liger --no-sonic ${MACRO_ARGS:---shapes qwen3-30b-a3b,deepseek-v3 --tokens 16384 --passes fwd,fwdbwd --macrobatch 16384} \
          --time-limit $(( left - 25 )) --json "$LOGS/macro.json" > "$LOGS/macro.log" 2>&1
        note "benchmarks.moe --macrobatch rc=$?"; grep -A30 "^shape " "$LOGS/macro.log" >> "$LOGS/summary.txt" ;;
    phases) # where a pass's time goes (tools/phase_times.py); with TIMELINE_DIR (a diagnostic build of the
        # megakernels, tools/phase_timeline.py's docstring) their phases CTA by CTA too
        for shape in ${PHASE_SHAPES:-qwen3-30b-a3b}; do
          time_left || break
          timeout "$left" python3 -m tools.phase_times --shape "$shape" --tokens "${PHASE_TOKENS:-2048,4096,16384}" \
            > "$LOGS/phase_times_$shape.log" 2>&1; note "phase_times $shape rc=$?"
          if [ -n "${TIMELINE_DIR:-}" ]; then
            time_left || break
            MOK_KERNEL_DIR=$TIMELINE_DIR timeout "$left" python3 -m tools.phase_timeline --shape "$shape" \
              --tokens "${PHASE_TOKENS:-2048,4096,16384}" > "$LOGS/phase_timeline_$shape.log" 2>&1
            note "phase_timeline $shape rc=$?"
          fi
        done ;;
    copy) timeout "$left" python3 -m tools.copy_probe > "$LOGS/copy_probe.log" 2>&1; note "copy_probe rc=$?"
          tail -20 "$LOGS/copy_probe.log" >> "$LOGS/summary.txt" ;;
    rows) timeout "$left" python3 -m tools.row_tma_probe > "$LOGS/row_tma_probe.log" 2>&1; note "row_tma_probe rc=$?"
          tail -6 "$LOGS/row_tma_probe.log" >> "$LOGS/summary.txt" ;;
    ncu) # ncu's sections for each kernel of tools/ncu_step.py (NCU_SHAPE, NCU_TOKENS), SM clock not locked
        for t in ${NCU_TOKENS:-2048}; do
          time_left || break
          timeout "$left" ncu --clock-control none -k "regex:moe_forward|gate_up_swiglu|moe_backward" \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
            --section SchedulerStats --section ComputeWorkloadAnalysis --section LaunchStats \
            python3 -m tools.ncu_step --shape "${NCU_SHAPE:-qwen3-30b-a3b}" --tokens "$t" \
            > "$LOGS/ncu_$t.txt" 2>&1
          note "ncu ${NCU_SHAPE:-qwen3-30b-a3b} $t rc=$?"
        done ;;
    kernels) # cubin folders against the shipped cubins, in turn, bits checked (tools/kernel_ab.py):
        # KERNEL_DIRS="NAME=DIR ...", KERNEL_CASES="SHAPE:TOKENS,..." (its default if unset)
        dirs=(); for d in ${KERNEL_DIRS:-}; do dirs+=(--dir "$d"); done
        timeout "$left" python3 -m tools.kernel_ab "${dirs[@]}" ${KERNEL_CASES:+--cases "$KERNEL_CASES"} \
          --budget-s $(( left - 10 )) > "$LOGS/kernel_ab.log" 2>&1
        note "kernel_ab rc=$?"; sed -n '/^shape /,$p' "$LOGS/kernel_ab.log" >> "$LOGS/summary.txt" ;;
    ab) # the same benchmark in $BASELINE (another tree of mok: A) and here (B), in turn, twice
        for i in 1 2; do
          for side in a b; do
            tree=.; [ $side = a ] && tree=$BASELINE
            time_left || break 2
            (cd "$tree" && timeout "$left" python3 -m benchmarks.moe --no-liger --no-sonic ${MOE_ARGS:-} \
              --json "$LOGS/ab_$side$i.json" > "$LOGS/ab_$side$i.log" 2>&1)
          done
        done
        python3 tools/tree_ab.py --a "$LOGS"/ab_a*.json --b "$LOGS"/ab_b*.json >> "$LOGS/summary.txt" 2>&1 ;;
  esac
done
cache_sizes
note "total $(( $(date +%s) - START ))s"
echo "======== summary"; cat "$LOGS/summary.txt"
exit $status
