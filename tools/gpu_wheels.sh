#!/usr/bin/env bash
# Download the wheels an offline GPU machine (Python 3.12, x86-64, torch and transformers
# installed) needs for mok's GPU tests of the integrations, into DIR (default .whl), for
# tools/gpu_run.sh's WHEELS=DIR:
#   bash tools/gpu_wheels.sh [DIR] [--datasets]
# Always: megatron-core (tests/gpu/test_nn_gpu.py's DDP test), TorchTitan 0.2.2 and what its
# model code imports beyond torch (tests/gpu/test_integrations_gpu.py -k torchtitan_02,
# examples/train_torchtitan.py). --datasets adds `datasets` and its needs, which TorchTitan
# 0.2's Qwen3 package imports through its dataloaders (pyarrow alone is ~55 MB).
set -euo pipefail
dir=.whl datasets=0
for arg in "$@"; do
    if [ "$arg" = "--datasets" ]; then datasets=1; else dir=$arg; fi
done
mkdir -p "$dir"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
get() {
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dir" "$@"
}
get megatron-core==0.19.2 torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 \
    docstring_parser==0.18.0 typeguard==4.6.1 dill==0.4.0 colorama==0.4.6
if [ "$datasets" = 1 ]; then
    get datasets xxhash multiprocess pyarrow fsspec
fi
ls -la "$dir"
du -sh "$dir"
