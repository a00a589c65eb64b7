"""CPU checks of the SM90 backward expert GEMMs (mok/dsl_kernels/sm90/expert_gemm_bwd.py and
expert_gemm_bwd_weights.py).

Compiles the three variants for sm_90a (into memory, never into the committed cubins) and checks
what a GPU run depends on: B is read MN-major, so every wgmma must take B transposed
(imm-trans-a 0, imm-trans-b 1) and each 128-column B tile arrives as two 64 x 64 TMA boxes;
the engine's instructions (TMA, setmaxnreg split, mbarrier ring) are there; nothing spills;
the mbarrier transaction count equals the bytes of the boxes the manifest records; the
SwiGLU backward epilogue uses a correctly rounded reciprocal; the manifest entry packs. The
weight-gradient GEMM reads both operands MN-major (imm-trans-a 1 and imm-trans-b 1) and stores
fp32 pairs.
"""

import re

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402
from tests.test_expert_gemm_build import (  # noqa: E402
    EIATTR_FRAME_SIZE,
    EIATTR_REGCOUNT,
    H200_SMEM_OPTIN,
    _count,
    _cubin_attributes,
    assert_epilogue_handoff,
)

D_HIDDEN = "expert_gemm_bwd_d_hidden_swiglu"
D_X = "expert_gemm_bwd_d_x"
WEIGHTS = "expert_gemm_bwd_weights"
NAMES = (D_HIDDEN, D_X)
ALL_NAMES = (D_HIDDEN, D_X, WEIGHTS)
WGMMA = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"


@pytest.fixture(scope="module")
def built():
    """{name: (manifest entry, cubin bytes, PTX)} for the three variants on sm_90a."""
    registry = {v.name: v for v in variants()}
    return {name: build.compile_variant(registry[name], "sm_90a") for name in ALL_NAMES}


def test_registered_for_sm90a_only():
    registry = {v.name: v for v in variants()}
    for name in ALL_NAMES:
        assert registry[name].archs == ("sm_90a",)


@pytest.mark.parametrize("name", NAMES)
def test_engine_instructions(built, name):
    _, _, ptx = built[name]
    assert ".target sm_90a" in ptx
    # One K half (d_hidden) or two (d_x: gate half, then up half, each its own loop body):
    # per K block one A box and four 64-column B boxes.
    halves = 2 if name == D_X else 1
    assert _count(ptx, "cp.async.bulk.tensor.2d.shared") == 5 * halves
    # 4 K-blocks x 2 accumulators per stage; every one reads B transposed (MN-major B):
    # operands (scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b) = (p, 1, 1, 0, 1).
    wgmmas = re.findall(re.escape(WGMMA) + r"\s*\{[^}]*\},\s*%rd\d+,\s*%rd\d+,\s*([^;]*);", ptx)
    assert len(wgmmas) == 8 == _count(ptx, "wgmma.mma_async")
    assert {tuple(x.strip() for x in w.split(",")) for w in wgmmas} == {("p", "1", "1", "0", "1")}
    assert _count(ptx, "wgmma.commit_group") >= 1 and _count(ptx, "wgmma.wait_group") >= 2
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    stages = {v.name: v for v in variants()}[name].config["stages"]
    assert _count(ptx, "mbarrier.init") >= 2 * stages  # full + empty barrier per stage
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx


def test_d_hidden_epilogue(built):
    _, _, ptx = built[D_HIDDEN]
    # Two 128 x 128 blocks per tile, 32 bf16 pairs per thread each: gate and up loaded with
    # 4-byte accesses (9 more 4-byte loads walk the tile list: producer, consumers, crew);
    # d_gate and d_up handed to the crew, which stores each 16-byte chunk of both (one
    # hand-off per block); one fp32 router partial per row (two rows per thread per block),
    # summed over the row's quad by two butterfly shuffles. The crew prefetches the tile's
    # gate and up rows into L2.
    assert _count(ptx, "ld.global.v2.b16") + _count(ptx, "ld.global.b32") - 9 == 2 * 2 * 32
    assert_epilogue_handoff(ptx, 2, slots=False, handoffs=2)
    assert _count(ptx, "st.global.b32") == 2 * 2
    assert _count(ptx, "shfl.sync.bfly") == 2 * 2 * 2
    assert _count(ptx, "st.global.b16") == 0
    assert _count(ptx, "prefetch.global.L2") == 1
    # sigmoid = rcp.approx(1 + ex2.approx(-g * log2 e)): one of each per element, no IEEE
    # division (its slow-path check and call were ~10 instructions of the ~47 per element
    # of this instruction-bound epilogue); the gate clamp one NaN-propagating max.
    assert _count(ptx, "ex2.approx") == 2 * 64
    assert _count(ptx, "rcp.approx.ftz.f32") == 2 * 64
    assert _count(ptx, "rcp.rn.f32") == 0 and _count(ptx, "div.rn") == 0
    assert _count(ptx, "min.NaN.f32") == 2 * 64  # NVVM folds -max(-g, -limit)


def test_d_x_epilogue(built):
    _, _, ptx = built[D_X]
    # Epilogue warps: each 16-byte chunk of both 128-column blocks stored as one.
    assert_epilogue_handoff(ptx, 2, slots=False)
    assert _count(ptx, "st.global.b16") == 0
    assert _count(ptx, "ex2.approx") == 0


def test_weights_instructions(built):
    _, _, ptx = built[WEIGHTS]
    assert ".target sm_90a" in ptx
    # Per K block (64 tokens): A as two 64 x 64 boxes, B as four.
    assert _count(ptx, "cp.async.bulk.tensor.2d.shared") == 6
    # Both operands MN-major: (scale-d, scale-a, scale-b, trans-a, trans-b) = (p, 1, 1, 1, 1).
    wgmmas = re.findall(re.escape(WGMMA) + r"\s*\{[^}]*\},\s*%rd\d+,\s*%rd\d+,\s*([^;]*);", ptx)
    assert len(wgmmas) == 8 == _count(ptx, "wgmma.mma_async")
    assert {tuple(x.strip() for x in w.split(",")) for w in wgmmas} == {("p", "1", "1", "1", "1")}
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx
    # fp32 epilogue: 2 accumulators x 32 fp32 pairs per thread, 8-byte stores, nothing else.
    assert _count(ptx, "st.global.v2.b32") + _count(ptx, "st.global.v2.f32") == 2 * 32
    assert _count(ptx, "st.global") == 2 * 32


def test_weights_manifest_entry(built):
    entry, _, ptx = built[WEIGHTS]
    assert [(p["name"], p["kind"]) for p in entry["params"]] == [
        ("tma_a", "tma_desc"),
        ("tma_b", "tma_desc"),
        ("out_ptr", "pointer"),
        ("tokens_per_expert_ptr", "pointer"),
        ("num_experts", "int32"),
        ("m_size", "int32"),
        ("n_size", "int32"),
        ("out_expert_rows", "int32"),
    ]
    assert entry["block"] == [384, 1, 1] and entry["cluster"] == [1, 1, 1]
    assert 4 * 48 * 1024 <= entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN - 1024
    assert [t["param"] for t in entry["tma"]] == ["tma_a", "tma_b"]
    for spec in entry["tma"]:
        assert spec["box"] == [64, 64] and spec["swizzle"] == "128B" and spec["rank"] == 2
    expect_tx = {
        int(v)
        for v in re.findall(r"mov\.b32\s+%r\d+,\s*(\d+);\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    }
    assert expect_tx == {2 * 6 * 64 * 64}  # two A boxes + four B boxes per stage


@pytest.mark.parametrize("name", ALL_NAMES)
def test_no_local_memory(built, name):
    _, cubin, ptx = built[name]
    assert ".local" not in ptx and "ld.local" not in ptx and "st.local" not in ptx
    attributes = _cubin_attributes(cubin)
    assert attributes.get(EIATTR_FRAME_SIZE, [0]) and max(attributes[EIATTR_FRAME_SIZE]) == 0
    # 384 threads: the launch register budget is 168; setmaxnreg moves 40 -> 232 at run time.
    assert attributes[EIATTR_REGCOUNT] == [168]


@pytest.mark.parametrize("name", NAMES)
def test_manifest_entry(built, name):
    entry, cubin, ptx = built[name]
    assert cubin.startswith(b"\x7fELF") and entry["symbol"].encode() in cubin
    assert [(p["name"], p["kind"]) for p in entry["params"]] == [
        ("tma_a0", "tma_desc"),
        ("tma_a1", "tma_desc"),
        ("tma_b0", "tma_desc"),
        ("tma_b1", "tma_desc"),
        ("out0_ptr", "pointer"),
        ("out1_ptr", "pointer"),
        ("gate_ptr", "pointer"),
        ("up_ptr", "pointer"),
        ("partials_ptr", "pointer"),
        ("peer_rank_ptr", "pointer"),
        ("peer_token_idx_ptr", "pointer"),
        ("tokens_per_expert_ptr", "pointer"),
        ("num_experts", "int32"),
        ("k_size", "int32"),
        ("n_size", "int32"),
        ("has_limit", "int32"),
        ("swiglu_limit", "float32"),
    ]
    assert all(p["size"] == 128 and p["align"] == 64 for p in entry["params"][:4])
    assert entry["block"] == [384, 1, 1] and entry["cluster"] == [1, 1, 1]
    # 3 ring stages of 48 KiB and the crew's two 34 KiB hand-off blocks, within the opt-in.
    assert 3 * 48 * 1024 + 2 * 34816 <= entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    specs = {t["param"]: t for t in entry["tma"]}
    assert list(specs) == ["tma_a0", "tma_a1", "tma_b0", "tma_b1"]
    for spec in specs.values():
        assert spec["dtype"] == "bf16" and spec["rank"] == 2 and spec["swizzle"] == "128B"
    # A: 64 K (one 128-byte swizzle row) x 128 rows; B: 64 N x 64 K rows (MN-major).
    assert specs["tma_a0"]["box"] == specs["tma_a1"]["box"] == [64, 128]
    assert specs["tma_b0"]["box"] == specs["tma_b1"]["box"] == [64, 64]
    # The transaction bytes the kernel waits for per stage: one A box and four B boxes.
    expect_tx = {
        int(v)
        for v in re.findall(r"mov\.b32\s+%r\d+,\s*(\d+);\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    }
    a_box, b_box = specs["tma_a0"]["box"], specs["tma_b0"]["box"]
    assert expect_tx == {2 * (a_box[0] * a_box[1] + 4 * b_box[0] * b_box[1])}


def test_manifest_parses_and_packs(built):
    """The runtime reads the entries and packs a launch with descriptors built from the specs."""
    import torch

    from mok.runtime import TmaDescriptor
    from mok.runtime.launch import pack_args
    from mok.runtime.manifest import parse_manifest
    from mok.runtime.tma import tma_encode_args

    data = {"format": 1, "variants": [built[name][0] for name in NAMES]}
    manifest = parse_manifest(data, build.CUBIN_DIR / "manifest.json")
    for name in NAMES:
        variant = manifest.variant(name, "sm_90a")
        descriptors = {s.param: TmaDescriptor(s, bytes(128)) for s in variant.tma}
        pack_args(
            variant,
            {
                **descriptors,
                "out0_ptr": 0x10000,
                "out1_ptr": None,
                "gate_ptr": None,
                "up_ptr": None,
                "partials_ptr": None,
                "peer_rank_ptr": None,
                "peer_token_idx_ptr": None,
                "tokens_per_expert_ptr": 0x20000,
                "num_experts": 128,
                "k_size": 2048,
                "n_size": 768,
                "has_limit": 0,
                "swiglu_limit": 0.0,
            },
        )
        # Qwen3-30B-A3B: dY_e [131072, 2048] and W_down viewed [128 * 2048, 768] encode.
        a = tma_encode_args(
            variant.tma_spec("tma_a0"), (131072, 2048), (2048, 1), torch.bfloat16, 0x100000
        )
        b = tma_encode_args(
            variant.tma_spec("tma_b0"), (128 * 2048, 768), (768, 1), torch.bfloat16, 0x100000
        )
        assert a.box == (64, 128) and b.box == (64, 64) and b.swizzle == "128B"
