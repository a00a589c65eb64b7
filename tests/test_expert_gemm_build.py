"""CPU checks of the SM90 grouped expert GEMMs (mok/dsl_kernels/sm90/expert_gemm.py).

Compiles both variants for sm_90a (about 1 s each, into memory, never into the committed
cubins) and checks what a GPU run depends on: the engine's instructions are in the PTX (TMA
loads, wgmma, setmaxnreg split, mbarrier ring), nothing spills to local memory (PTX and the
cubin's frame size), the mbarrier transaction count equals the bytes of the TMA boxes the
manifest records, and the manifest entry (params, tma specs, smem) is what the launcher packs.
"""

import re
import struct

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

NAMES = ("expert_gemm_gate_up_swiglu", "expert_gemm_down")
H200_SMEM_OPTIN = 232_448  # bytes of shared memory one CTA may use on H100/H200
EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11


@pytest.fixture(scope="module")
def built():
    """{name: (manifest entry, cubin bytes, PTX)} for both variants on sm_90a."""
    registry = {v.name: v for v in variants()}
    return {name: build.compile_variant(registry[name], "sm_90a") for name in NAMES}


def _instructions(ptx: str) -> list[str]:
    return re.findall(r"^\s*(?:@!?%?\w+\s+)?([a-z][\w.]*)", ptx, re.M)


def _count(ptx: str, prefix: str) -> int:
    return sum(op.startswith(prefix) for op in _instructions(ptx))


def _cubin_attributes(cubin: bytes) -> dict[int, list[int]]:
    """EIATTR values (attribute id -> [value per function]) of the cubin's .nv.info sections."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    found: dict[int, list[int]] = {}
    for header in headers:
        name_end = cubin.index(b"\0", names_offset + header[0])
        if not cubin[names_offset + header[0] : name_end].startswith(b".nv.info"):
            continue
        body = cubin[header[4] : header[4] + header[5]]
        i = 0
        while i < len(body):
            fmt, attribute = body[i], body[i + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size + payload
                size = struct.unpack_from("<H", body, i + 2)[0]
                if size == 8:
                    found.setdefault(attribute, []).append(struct.unpack_from("<I", body, i + 8)[0])
                i += 4 + size
            elif fmt in (2, 3):  # EIFMT_BVAL / EIFMT_HVAL
                i += 4
            else:  # EIFMT_NVAL
                i += 2
    return found


def test_registered_for_sm90a_only():
    registry = {v.name: v for v in variants()}
    for name in NAMES:
        assert registry[name].archs == ("sm_90a",)


@pytest.mark.parametrize("name", NAMES)
def test_engine_instructions(built, name):
    _, _, ptx = built[name]
    assert ".target sm_90a" in ptx
    # The mainloop body: one TMA load per operand tile (A, B0, B1) and 4 K-blocks x 2
    # accumulators of m64n128k16 wgmma; the loops are not unrolled.
    assert _count(ptx, "cp.async.bulk.tensor.2d.shared") == 3
    assert _count(ptx, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 8
    assert _count(ptx, "wgmma.commit_group") >= 1 and _count(ptx, "wgmma.wait_group") >= 2
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232;", ptx)
    stages = {v.name: v for v in variants()}[name].config["stages"]
    assert _count(ptx, "mbarrier.init") >= 2 * stages  # full + empty barrier per stage
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx
    # Epilogue warps: swiglu stores gate, up and hidden per 16-byte chunk; down two blocks.
    assert_epilogue_handoff(ptx, 3 if name == "expert_gemm_gate_up_swiglu" else 2, slots=False,
                            ticketed=True)  # fmt: skip


def assert_epilogue_handoff(
    ptx: str,
    stores_per_chunk: int,
    slots: bool,
    crew: int = 96,
    handoffs: int = 1,
    ticketed: bool = False,
) -> None:
    """The epilogue-warps hand-off (mok/dsl_kernels/sm90/epilogue_warps.py) is what the PTX does:
    the consumers write their 2 x 32 bf16 pairs of the two accumulators to shared memory
    between `bar.sync BUFFERS_FREE` and `bar.arrive TILE_READY` (256 consumer threads + the
    crew's `crew` threads); the crew arrives on BUFFERS_FREE at the start of each tile, waits
    on TILE_READY, and copies each 16-byte chunk of both blocks out with 16-byte stores; slots
    tiles look their 128 destination rows up between two crew-wide barriers. `handoffs`: per
    tile (each side's code unrolled that many times). `ticketed`: tiles come by a dynamic
    ticket (tickets.py): one more of each barrier (the consumers' empty last hand-off, the
    crew's first wait) and the producer's two task-slot stores."""
    extra = 1 if ticketed else 0
    handoff = str(256 + crew)
    barriers = re.findall(r"^\s*(bar\.(?:sync|arrive))\s+(\d+)(?:,\s*(\d+))?;", ptx, re.M)
    for op, barrier_id in (
        ("bar.sync", "4"),
        ("bar.arrive", "3"),
        ("bar.sync", "3"),
        ("bar.arrive", "4"),
    ):
        assert barriers.count((op, barrier_id, handoff)) == handoffs + extra, (op, barrier_id)
    assert barriers.count(("bar.sync", "5", str(crew))) == (2 if slots else 0)
    # A bf16 pair is one 4-byte store, written b32 or v2.b16 as the compiler packs it.
    shared_stores = _count(ptx, "st.shared.b32") + _count(ptx, "st.shared.v2.b16")
    assert shared_stores == handoffs * 2 * 32 + 2 * extra + (1 if slots else 0)
    assert _count(ptx, "atom.relaxed.gpu.global.add.s32") == 2 * extra
    assert _count(ptx, "ld.shared.v4") == handoffs * 2
    assert _count(ptx, "st.global.v4") == handoffs * stores_per_chunk


@pytest.mark.parametrize("name", NAMES)
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
        ("tma_a", "tma_desc"),
        ("tma_b0", "tma_desc"),
        ("tma_b1", "tma_desc"),
        ("out_ptr", "pointer"),
        ("gate_ptr", "pointer"),
        ("up_ptr", "pointer"),
        ("peer_rank_ptr", "pointer"),
        ("peer_token_idx_ptr", "pointer"),
        ("tokens_per_expert_ptr", "pointer"),
        ("ticket_ptr", "pointer"),
        ("num_experts", "int32"),
        ("k_size", "int32"),
        ("n_size", "int32"),
        ("b_expert_rows", "int32"),
        ("has_limit", "int32"),
        ("swiglu_limit", "float32"),
    ]
    assert all(p["size"] == 128 and p["align"] == 64 for p in entry["params"][:3])
    assert entry["block"] == [384, 1, 1] and entry["cluster"] == [1, 1, 1]
    # 3 ring stages of 48 KiB and the crew's two 34 KiB hand-off blocks, within the opt-in.
    assert 3 * 48 * 1024 + 2 * 34816 <= entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    assert [t["param"] for t in entry["tma"]] == ["tma_a", "tma_b0", "tma_b1"]
    for spec in entry["tma"]:
        assert spec["dtype"] == "bf16" and spec["rank"] == 2 and spec["swizzle"] == "128B"
        assert spec["box"] == [64, 128]  # 64 bf16 = one 128-byte swizzle row, 128 rows
    # The box bytes the runtime encodes must be the transaction bytes the kernel waits for.
    expect_tx = {
        int(v)
        for v in re.findall(r"mov\.b32\s+%r\d+,\s*(\d+);\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    }
    box_bytes = sum(2 * spec["box"][0] * spec["box"][1] for spec in entry["tma"])
    assert expect_tx == {box_bytes}


def test_manifest_parses_and_packs(built):
    """The runtime reads the entries and packs a launch with descriptors built from the specs."""
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
                "out_ptr": 0x10000,
                "gate_ptr": None,
                "up_ptr": None,
                "peer_rank_ptr": None,
                "peer_token_idx_ptr": None,
                "tokens_per_expert_ptr": 0x20000,
                "ticket_ptr": 0x30000,
                "num_experts": 128,
                "k_size": 2048,
                "n_size": 768,
                "b_expert_rows": 2 * 768,
                "has_limit": 0,
                "swiglu_limit": 0.0,
            },
        )
        # Qwen3-30B-A3B x_routed [131072, 2048] and W_gate viewed [128 * 768, 2048] encode.
        import torch

        for shape in ((131072, 2048), (128 * 768, 2048)):
            args = tma_encode_args(
                variant.tma_spec("tma_a"), shape, (shape[1], 1), torch.bfloat16, 0x100000
            )
            assert args.box == (64, 128) and args.swizzle == "128B"
