"""CPU checks of the ahead-of-time kernel build (mok/dsl_kernels/build.py).

Compiles every registered variant once per committed arch (a few seconds in total) and checks:
the committed cubins + manifest are exactly what the sources produce (cubins are byte-for-byte
reproducible run to run, so bytes are compared, not only the source hash), the manifest params
match each PTX `.entry`, and each sm_90a kernel's PTX uses the instructions it is meant to use.
"""

import json
import re

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

REQUIRED_ARCHS = ("sm_90a", "sm_100a")


def _committed_manifest() -> dict:
    return json.loads((build.CUBIN_DIR / build.MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def fresh_build():
    """One build of every variant for every committed arch (and at least sm_90a, sm_100a)."""
    committed_archs = {e["arch"] for e in _committed_manifest()["variants"]}
    archs = [a for a in build.SUPPORTED_ARCHS if a in committed_archs or a in REQUIRED_ARCHS]
    manifest, cubins, ptxs = build.build(archs, verbose=False)
    return manifest, cubins, ptxs


def _instructions(ptx: str) -> list[str]:
    """Opcodes of a PTX body (also those inside inline-asm blocks), predicates stripped."""
    return re.findall(r"^\s*(?:@!?%?\w+\s+)?([a-z][\w.]*)", ptx, re.M)


def test_every_variant_compiles_for_sm90a_and_sm100a(fresh_build):
    manifest, cubins, _ = fresh_build
    built = {(e["name"], e["arch"]) for e in manifest["variants"]}
    for variant in variants():
        # A variant may name the archs it exists for (the SM90 wgmma engine is Hopper-only;
        # Blackwell gets its own tcgen05 engine); every other variant builds for both.
        for arch in variant.archs or REQUIRED_ARCHS:
            if arch not in REQUIRED_ARCHS:
                continue
            assert (variant.name, arch) in built
            assert cubins[f"{variant.name}.{arch}.cubin"].startswith(b"\x7fELF")


def test_committed_manifest_and_cubins_match_sources(fresh_build):
    manifest, cubins, _ = fresh_build
    problems = build.check(build.CUBIN_DIR, manifest, cubins)
    assert problems == [], "rebuild: python -m mok.dsl_kernels.build\n" + "\n".join(problems)


def test_manifest_params_match_ptx_entry(fresh_build):
    manifest, _, ptxs = fresh_build
    for entry in manifest["variants"]:
        symbol, params, block = build.parse_ptx_entry(ptxs[entry["cubin"]])
        assert entry["symbol"] == symbol
        assert entry["block"] == list(block)
        # A TMA descriptor is a 128-byte, 64-aligned .b8 array in the PTX: kind "bytes" there,
        # named "tma_desc" in the manifest from the kernel's signature.
        assert [
            ("bytes" if p["kind"] == "tma_desc" else p["kind"], p["size"], p["align"])
            for p in entry["params"]
        ] == [(p.kind, p.size, p.align) for p in params]
        tma_params = {p["name"] for p in entry["params"] if p["kind"] == "tma_desc"}
        assert {t["param"] for t in entry["tma"]} == tma_params
    for committed in _committed_manifest()["variants"]:
        assert committed["cubin"] == f"{committed['name']}.{committed['arch']}.cubin"


# 8 rows x 16 B in and out per thread: the quantiser's exact math, then the exact
# dequantisation (E4M3 -> f16 -> f32, mul.rn by the scale, bf16x2); plain loads (an
# ld.global.nc would make the documented in-place use undefined).
_ROUND_TRIP_PTX = (
    {
        "ld.global.v4.b32": 8,
        "st.global.v4.b32": 8,
        "div.rn.f32": 8,
        "cvt.rn.satfinite.e4m3x2.f32": 32,
        "cvt.rn.f16x2.e4m3x2": 32,
        "mul.rn.f32": 128,
        "cvt.rn.bf16x2.f32": 32,
    },
    ("fma.rn.f32", "div.approx.f32", "div.full.f32", "ld.global.nc.v4.b32"),
)


@pytest.mark.parametrize(
    "name, required, forbidden",
    [
        # 8 rows x 16 B per thread, exact scale math, hardware E4M3 conversion
        (
            "mxfp8_quantize_rowwise",
            {
                "ld.global.v4.b32": 8,
                "cvt.rn.satfinite.e4m3x2.f32": 32,
                "div.rn.f32": 8,
                "mul.rn.f32": 64,
            },
            ("fma.rn.f32", "div.approx.f32", "div.full.f32"),
        ),
        (
            "mxfp8_quantize_transposed",
            {
                "ld.global.v4.b32": 8,
                "cvt.rn.satfinite.e4m3x2.f32": 32,
                "div.rn.f32": 8,
                "mul.rn.f32": 64,
            },
            ("fma.rn.f32", "div.approx.f32", "div.full.f32"),
        ),
        # Both round trips, along rows and along columns: the same instructions.
        ("mxfp8_round_trip_rowwise", *_ROUND_TRIP_PTX),
        ("mxfp8_round_trip_columns", *_ROUND_TRIP_PTX),
        # 8 x 8 E4M3 bytes and 8 scale words in, 8 x 16 B of bf16 out per thread
        (
            "mxfp8_dequantize_rowwise",
            {
                "st.global.v4.b32": 8,
                "cvt.rn.f16x2.e4m3x2": 32,
                "mul.rn.f32": 64,
                "cvt.rn.bf16x2.f32": 32,
            },
            ("fma.rn.f32", "mul.f32"),
        ),
        # 16-byte loads/stores; separately rounded mul + add, never an fma
        (
            "moe_combine_forward",
            {"ld.global.v4.b32": 2, "st.global.v4.b32": 1, "mul.rn.f32": 8, "add.rn.f32": 8},
            ("fma.rn.f32", "mul.f32", "add.f32"),
        ),
        (
            "moe_combine_backward",
            {"ld.global.v4.b32": 2, "st.global.v4.b32": 1, "add.rn.f32": 8},
            ("fma.rn.f32", "add.f32"),
        ),
    ],
)
def test_sm90a_ptx_uses_intended_instructions(fresh_build, name, required, forbidden):
    _, _, ptxs = fresh_build
    ptx = ptxs[f"{name}.sm_90a.cubin"]
    opcodes = _instructions(ptx)
    for opcode, at_least in required.items():
        assert opcodes.count(opcode) >= at_least, f"{name}: {opcode} x{opcodes.count(opcode)}"
    for opcode in forbidden:
        assert opcode not in opcodes, f"{name}: unexpected {opcode}"
    assert ".ftz" not in ptx, f"{name}: flush-to-zero would break bit-exactness on subnormals"


# ---- each kernel's parameters declared once (no compile) ----
def test_every_kernel_declares_its_params_once():
    """Every registered kernel's `__call__` takes bundles or scalars that have compile
    placeholders, and its `kernel`'s flattened bundles name the committed manifest's sm_90a
    params, in order (DSL-inserted `_dsl_*` params aside)."""
    from mok.dsl_kernels.common.params import compile_arguments

    committed = {e["name"]: e for e in _committed_manifest()["variants"] if e["arch"] == "sm_90a"}
    for variant in variants():
        kernel = variant.kernel(**variant.config)
        assert compile_arguments(kernel), variant.name  # raises on a parameter it cannot place
        names = [name for name, _ in build.python_params(kernel)]
        expected = [
            p["name"]
            for p in committed[variant.name]["params"]
            if not p["name"].startswith("_dsl_")
        ]
        assert names == expected, variant.name


# ---- the PTX/Python pairing rules, on synthetic input (no compile) ----
_PTX = """
.visible .entry mok_x_0(
\t.param .u64 .ptr .global .align 16 mok_x_0_param_0,
\t.param .align 64 .b8 mok_x_0_param_1[128],
\t.param .u32 mok_x_0_param_2,
\t.param .f32 mok_x_0_param_3
)
.reqntid 128, 1, 1
{
}
"""


def test_parse_ptx_entry_and_dsl_inserted_bytes_param():
    symbol, params, block = build.parse_ptx_entry(_PTX)
    assert symbol == "mok_x_0" and block == (128, 1, 1)
    assert [(p.kind, p.size, p.align) for p in params] == [
        ("pointer", 8, 8),
        ("bytes", 128, 64),
        ("int32", 4, 4),
        ("float32", 4, 4),
    ]
    named = build.name_params("x", params, [("a", "pointer"), ("n", "int32"), ("s", "float32")])
    assert [p["name"] for p in named] == ["a", "_dsl_1", "n", "s"]


def test_name_params_fails_on_count_or_kind_mismatch():
    _, params, _ = build.parse_ptx_entry(_PTX)
    with pytest.raises(build.BuildError, match="is int64 in Python"):
        build.name_params("x", params, [("a", "pointer"), ("n", "int64"), ("s", "float32")])
    with pytest.raises(build.BuildError, match="have no PTX parameter"):
        build.name_params(
            "x", params, [("a", "pointer"), ("n", "int32"), ("s", "float32"), ("extra", "int32")]
        )
    with pytest.raises(build.BuildError, match="has no Python argument"):
        build.name_params("x", params, [("a", "pointer"), ("n", "int32")])


def test_source_hash_covers_dsl_version():
    assert build.source_hash("4.8.1") == build.source_hash("4.8.1")
    assert build.source_hash("4.8.1") != build.source_hash("4.8.2")
