"""CPU checks of the SM90 forward megakernel's build (dsl_kernels/sm90/moe_forward.py), no GPU.

What its GPU run depends on and a refactor could silently lose: the dispatch warp's bulk copies
(load on an mbarrier, store in a bulk group, the read-wait before a slot is refilled and the
full wait before a counter is released), the GPU-scope release/acquire counters, the two-way
consumer <-> signal-warp handshake on named barriers 3 and 4 (256 consumers + 32), the staged
epilogue's 16-byte stores, and shared memory within the H100/H200 opt-in.
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
    for line in ("bar.arrive 3, 288;", "bar.arrive 4, 288;", "bar.sync \t3, 288;",
                 "bar.sync \t4, 288;"):  # fmt: skip
        assert line in ptx, line


def test_staged_epilogue_and_shared_memory(built):
    entry, _, ptx = built
    assert entry["config"] == {"stages": 3}
    assert ptx.count("st.global.v4") >= 3 * 8  # gate, up, hidden: 8 row chunks per thread each
    assert entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    assert entry["cluster"] == [1, 1, 1]
