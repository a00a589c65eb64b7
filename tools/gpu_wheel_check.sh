#!/usr/bin/env bash
# On the GPU machine: install the wheel in .whl/ into a fresh venv outside the checkout (the
# machine's torch and cuda-python by a .pth file: the machine has no network), then run
# the GPU path from there with `python -m mok --device cuda`. Usage: bash tools/gpu_wheel_check.sh
set -euo pipefail
ROOT=$(pwd)
VENV=$(mktemp -d)/venv
python3 -m venv "$VENV"
# The machine's torch and cuda-python, wherever they are installed (no network to install them).
python3 - "$ROOT" > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/machine_packages.pth" <<'PY'
import importlib, pathlib, sys
for name in ("torch", "cuda.bindings", "numpy"):
    path = pathlib.Path(importlib.import_module(name).__file__).resolve()
    site = path.parents[len(name.split("."))]
    if not str(site).startswith(sys.argv[1]):
        print(site)
PY
"$VENV/bin/pip" install -q --no-deps --no-index "$ROOT"/.whl/mok-*.whl
cd "$(dirname "$VENV")"
"$VENV/bin/python" -c "import mok, mok.launchers; print('mok from', mok.__file__)"
"$VENV/bin/python" -m mok --device cuda
