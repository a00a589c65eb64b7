"""CPU checks of the SM90 forward megakernel's build (dsl_kernels/sm90/moe_forward.py), no GPU.

What its GPU run depends on and a refactor could silently lose: the dispatch warp's bulk copies
(load on an mbarrier, store in a bulk group, the read-wait before a slot is refilled and the
full wait before a counter is released), the GPU-scope release/acquire counters, the hand-off
of every tile from the consumers to the crew of warps 2-3 (epilogue_warps.py: named barriers 3
and 4 of 256 + 64 threads) and the crew's 16-byte stores and counter release, and shared
memory within the H100/H200 opt-in.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

H200_SMEM_OPTIN = 232_448


@pytest.fixture(scope="module")
def built():
    variant = {v.name: v for v in variants()}["moe_forward"]
    return build.compile_variant(variant, "sm_90a")


def test_dispatch_moves_rows_with_bulk_copies(built):
    _, _, ptx = built
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") >= 1
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 1
    assert "cp.async.bulk.commit_group" in ptx
    assert "cp.async.bulk.wait_group.read \t1;" in ptx  # a slot is refilled once its store read it
    assert "cp.async.bulk.wait_group \t0;" in ptx  # a tile's counter waits for its stores


def test_counters_and_handshake(built):
    _, _, ptx = built
    assert "red.release.gpu.global.add.s32" in ptx and "ld.acquire.gpu.global.b32" in ptx
    # Two tile walks (gate/up, then down) on each side of the hand-off; the crew meets on
    # barrier 6 before it releases a gate/up tile's counter, and on 5 around slot look-ups.
    for line, count in (("bar.sync \t4, 320;", 2), ("bar.arrive 3, 320;", 2),
                        ("bar.arrive 4, 320;", 2), ("bar.sync \t3, 320;", 2),
                        ("bar.sync \t6, 64;", 1), ("bar.sync \t5, 64;", 2)):  # fmt: skip
        assert ptx.count(line) == count, line


def test_crew_stores_and_shared_memory(built):
    entry, _, ptx = built
    assert entry["config"] == {"stages": 3}
    # gate, up, hidden per gate/up chunk and the two blocks per down chunk; the rest are the
    # dispatch warp's zero-filled padding rows.
    stores = [line for line in ptx.splitlines() if "st.global.v4" in line]
    assert len([line for line in stores if "{0, 0, 0, 0}" not in line]) == 3 + 2
    assert ptx.count("st.shared.b32") >= 2 * 2 * 32  # both walks round 2 accumulators
    assert entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    assert entry["cluster"] == [1, 1, 1]
