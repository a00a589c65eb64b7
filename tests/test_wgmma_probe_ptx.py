"""The wgmma probe's engines are what tools/wgmma_probe.py says they measure (PTX, no GPU):
bf16 m64n128k16 or E4M3 m64n128k32 wgmma, four a pass; no CUDA-core math in the plain engines;
one `fma.rn.f32` per accumulator element per K-block in fp8_promote1, and a `mul.rn.f32` too in
fp8_promote2 (64 elements a thread, 4 K-blocks a pass, one more block's adds after the loop
in neither: the loop body is the pass)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from mok.dsl_kernels.build import compile_variant  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

EXPECTED = {  # engine: (wgmma shape and types, fma.rn, mul.rn)
    "bf16": ("m64n128k16.f32.bf16.bf16", 0, 0),
    "fp8": ("m64n128k32.f32.e4m3.e4m3", 0, 0),
    "fp8_promote1": ("m64n128k32.f32.e4m3.e4m3", 4 * 64, 0),
    "fp8_promote2": ("m64n128k32.f32.e4m3.e4m3", 4 * 64, 4 * 64),
}


@pytest.mark.parametrize("engine", sorted(EXPECTED))
def test_probe_engine_ptx(engine):
    variant = next(v for v in variants() if v.name == f"wgmma_probe_{engine}")
    _, _, ptx = compile_variant(variant, "sm_90a")
    shape, fmas, muls = EXPECTED[engine]
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx)
    assert wgmmas == [shape] * 4
    assert len(re.findall(r"fma\.rn\.f32", ptx)) == fmas
    assert len(re.findall(r"mul\.rn\.f32", ptx)) == muls
