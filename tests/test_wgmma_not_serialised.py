"""Every SM90 GEMM variant keeps its wgmmas asynchronous (ptxas -v on the built PTX, no GPU).

ptxas serialises every wgmma of a kernel (each HGMMA followed by a wait) when accumulator
registers are read by other instructions before the wgmma completes (C7514), or when a
compiler-inserted warpgroup arrive lands in a divergent path (C7520, e.g. a release atomic
under `if tid == ...` in the consumer). Both cost 5-18% on the H200 (docs/NOTES.md) and print
only a "Potential Performance Loss" line, so a build that brings one back fails here.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("cutlass")

from mok.dsl_kernels.build import compile_variant, ptxas_report  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

GEMMS = [
    v
    for v in variants()
    if "sm_90a" in v.archs and v.name.startswith(("expert_gemm", "moe_", "wgmma_probe"))
]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize("variant", GEMMS, ids=[v.name for v in GEMMS])
def test_no_wgmma_serialisation(variant):
    _, _, ptx = compile_variant(variant, "sm_90a")
    report = ptxas_report(ptx, "sm_90a")
    serialised = [line for line in report.splitlines() if "serialized" in line]
    assert not serialised, "\n".join(serialised)
    assert "0 bytes spill stores, 0 bytes spill loads" in report
