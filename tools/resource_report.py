"""ptxas's resource report (registers, spills, stack) of registered kernel variants, no GPU.

python tools/resource_report.py expert_gemm_bwd_weights_bf16 [more variant names]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from mok.dsl_kernels.build import compile_variant
from mok.dsl_kernels.registry import variants


def report(name: str, arch: str = "sm_90a") -> str:
    variant = next(v for v in variants() if v.name == name)
    _, _, ptx = compile_variant(variant, arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.ptx"
        path.write_text(ptx)
        out = subprocess.run(
            ["ptxas", f"-arch={arch}", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    # Register and spill counts, and every "Potential Performance Loss" (e.g. C7514 / C7520:
    # wgmma serialised by ptxas).
    keys = ("registers", "spill", "Performance Loss")
    lines = [ln for ln in out.stderr.splitlines() if any(key in ln for key in keys)]
    return f"{name}: " + " | ".join(ln.split("ptxas info    : ")[-1] for ln in lines)


if __name__ == "__main__":
    for variant_name in sys.argv[1:]:
        print(report(variant_name))
