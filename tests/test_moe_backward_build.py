"""CPU checks of the SM90 backward megakernel v1's build (mok/dsl_kernels/sm90/moe_backward.py), no
GPU: the scaled dispatch phase (batched loads, one mul.rn per element, fence and barrier before
the counters are released), the GPU-scope release/acquire counters and the exit that leaves
them zero, the wgmmas reading B
transposed (weights as stored; both operands in the weight phase), the hand-off of every tile
to the crew of warps 1-3 (two per d_hidden tile, one per d_x and weight tile), and shared
memory within the H100/H200 opt-in.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402
from tests.test_expert_gemm_build import H200_SMEM_OPTIN, _count  # noqa: E402
from tests.test_moe_forward_build import assert_dispatch_batches, assert_retires  # noqa: E402

WGMMA = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"


@pytest.fixture(scope="module")
def built():
    variant = {v.name: v for v in variants()}["moe_backward"]
    return build.compile_variant(variant, "sm_90a")


def test_scaled_dispatch_phase(built):
    _, _, ptx = built
    assert_dispatch_batches(ptx)
    # dY_e = bf16(w * dY): one correctly rounded product per element, never an fma.
    assert _count(ptx, "mul.rn.f32") == 8 * 8


def test_counters_and_wgmma(built):
    _, _, ptx = built
    assert_retires(ptx)
    # The CTA's dispatch counters and the crew's d_hidden counters, per row tile; the CTA's
    # count of the row tiles it dispatched and the crew's count of d_hidden tiles (the weight
    # phase's two waits); the crew's count of d_x tiles (the finish's wait).
    assert _count(ptx, "red.release.gpu.global.add.s32") == 5
    assert _count(ptx, "ld.acquire.gpu.global") >= 4
    # Two mainloops (d_hidden, d_x) of 4 K-blocks x 2 accumulators, B transposed (MN-major);
    # the weight phase's, A transposed too.
    wgmmas = re.findall(re.escape(WGMMA) + r"\s*\{[^}]*\},\s*%rd\d+,\s*%rd\d+,\s*([^;]*);", ptx)
    modes = [tuple(x.strip() for x in w.split(",")) for w in wgmmas]
    assert modes.count(("p", "1", "1", "0", "1")) == 2 * 8
    assert modes.count(("p", "1", "1", "1", "1")) == 8 and len(modes) == 3 * 8
    # d_hidden: one A box and two pairs of B boxes per K block; d_x: the same per K half;
    # each weight GEMM: a pair of 64-wide A boxes and two pairs of B boxes.
    assert _count(ptx, "cp.async.bulk.tensor.2d.shared") == 5 + 2 * 5 + 3 * 6


def test_handoffs_and_shared_memory(built):
    entry, _, ptx = built
    # Hand-offs: the consumers' d_hidden (two blocks), d_x and weight tiles and their end of
    # the ticketed tasks; the crew's first wait, its two ticketed phases (d_hidden's second
    # block apart) and one store per weight GEMM. The crew's counter barrier after a d_hidden
    # tile or a d_x tile's count, and its two slot look-up barriers per d_x tile.
    for line, count in (("bar.sync \t4, 352;", 5), ("bar.arrive 3, 352;", 5),
                        ("bar.arrive 4, 352;", 7), ("bar.sync \t3, 352;", 7),
                        ("bar.sync \t6, 96;", 2), ("bar.sync \t5, 96;", 2)):  # fmt: skip
        assert ptx.count(line) == count, line
    # 8 dispatch stores, d_gate + d_up per chunk of each d_hidden hand-off, 2 per d_x chunk,
    # 2 per chunk of each weight GEMM's tile, the finish's d_x sum one per token (4 tokens).
    assert _count(ptx, "st.global.v4") == 8 + 2 * 2 + 2 + 3 * 2 + 4
    # The producer prefetches a d_hidden task's gate/up; it takes each task with an atomic add
    # (the first ticket, then one site per ticketed phase), the dispatch each row tile (two
    # sites: test_moe_forward_build.assert_dispatch_batches).
    assert _count(ptx, "prefetch.global.L2") == 1
    assert _count(ptx, "atom.relaxed.gpu.global.add.s32") == 3 + 2
    assert entry["config"] == {"stages": 3}
    assert 3 * 48 * 1024 + 2 * 34816 <= entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    assert entry["cluster"] == [1, 1, 1] and entry["block"] == [384, 1, 1]
    assert [t["param"] for t in entry["tma"]] == ["tma_dy", "tma_wd", "tma_dg", "tma_du",
                                                   "tma_wg", "tma_wu", "tma_xdy", "tma_xdg",
                                                   "tma_xdu", "tma_xh", "tma_xx"]  # fmt: skip


def test_finish_phase(built):
    """combine_phase.finish_backward: the d_hidden epilogue stores its router partials before
    the hand-off (the crew's d_hidden count then covers them); after the consumers' last
    hand-off, one thread's two bounded GPU-scope acquires (d_x tiles, d_hidden tiles), the 256
    consumers' barrier 7, then the unweighted d_x sum's 16-byte slot loads (4 slots x 4
    tokens, the peeled step and the loop) and the push's one division per routed row."""
    _, _, ptx = built
    lines = [line.strip() for line in ptx.splitlines()]
    (meet,) = [i for i, line in enumerate(lines) if line == "bar.sync \t7, 256;"]
    partials = [i for i, line in enumerate(lines[:meet]) if line.startswith("st.global.b32")]
    assert len(partials) == 4  # rows r0 and r0 + 8, in each of the two d_hidden blocks
    for i in partials:
        hand_off = next(j for j in range(i, meet) if lines[j].startswith("bar."))
        assert lines[hand_off] == "bar.sync \t4, 352;"
    last_hand_off = max(i for i, line in enumerate(lines) if line == "bar.arrive 3, 352;")
    acquires = {lines[i].split("[")[1] for i in range(last_hand_off, meet)
                if lines[i].startswith("ld.acquire.gpu.global")}  # fmt: skip
    assert len(acquires) == 2  # two counters
    loads = [i for i, line in enumerate(lines) if line.startswith("ld.global.v4") and i > meet]
    assert len(loads) == 32
    (division,) = [i for i, line in enumerate(lines) if line.startswith("div.rn.f32")]
    assert division > meet
