"""ptxas's resource report (registers, spills, stack) of registered kernel variants, no GPU.

python tools/resource_report.py expert_gemm_bwd_weights_bf16 [more variant names]
"""

from __future__ import annotations

import sys

from mok.dsl_kernels.build import compile_variant, ptxas_report
from mok.dsl_kernels.registry import variants


def report(name: str, arch: str = "sm_90a") -> str:
    variant = next(v for v in variants() if v.name == name)
    _, _, ptx = compile_variant(variant, arch)
    keys = ("registers", "spill", "Performance Loss")
    lines = [ln for ln in ptxas_report(ptx, arch).splitlines() if any(k in ln for k in keys)]
    return f"{name}: " + " | ".join(ln.split("ptxas info    : ")[-1] for ln in lines)


if __name__ == "__main__":
    for variant_name in sys.argv[1:]:
        print(report(variant_name))
