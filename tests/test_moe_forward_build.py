"""CPU checks of the SM90 forward megakernel's build (mok/dsl_kernels/sm90/moe_forward.py), no GPU.

What its GPU run depends on and a refactor could silently lose: the dispatch's batched loads
and its fence and barrier before the counters are released, the GPU-scope release/acquire
counters and the exit that leaves them zero for the next launch, the hand-off of every tile from the consumers to the crew of warps 1-3
(epilogue_warps.py: named barriers 3 and 4 of 256 + 96 threads) and the crew's 16-byte stores and counter release, and shared
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


def test_dispatch_batches_its_loads(built):
    _, _, ptx = built
    assert_dispatch_batches(ptx, schedule_tickets=2)


def assert_dispatch_batches(ptx: str, schedule_tickets: int = 0) -> None:
    """The megakernels' dispatch (dispatch_phase.py): row tiles by ticket, a relaxed atomic add
    for the first, then one per tile taken before that tile's loads (in flight during the
    copy); every thread makes DISPATCH_BATCH (8) 16-byte loads of source rows before their
    stores, source rows from a shared-memory table; then the async-proxy fence and the CTA
    barrier before thread 0's counter release. `schedule_tickets`: the relaxed ticket adds of
    a schedule phase before the dispatch (the forward's, schedule_phase.py: two)."""
    lines = [line.strip() for line in ptx.splitlines()]
    fence = lines.index("fence.proxy.async.global;")
    loads = [i for i, line in enumerate(lines[:fence]) if line.startswith("ld.global.v4")]
    assert len(loads) == 8
    first_store = next(i for i, line in enumerate(lines) if line.startswith("st.global.v4"))
    assert max(loads) < first_store
    release = next(
        i for i in range(fence, len(lines)) if lines[i].startswith("red.release.gpu.global")
    )
    assert first_store < fence < lines.index("bar.sync \t0;", fence) < release
    tickets = [i for i, line in enumerate(lines[:fence]) if line.startswith("atom.relaxed.gpu")]
    assert len(tickets) == 2 + schedule_tickets and tickets[-1] < min(loads)


def test_exit_leaves_counters_zero(built):
    _, _, ptx = built
    assert_retires(ptx)
    from mok.dsl_kernels.sm90 import moe_backward, moe_forward
    from mok.launchers import megakernel_walk

    assert moe_forward.COUNTER_TAIL == megakernel_walk.FORWARD_COUNTER_TAIL
    assert moe_backward.COUNTER_TAIL == megakernel_walk.BACKWARD_COUNTER_TAIL


def assert_retires(ptx: str) -> None:
    """The megakernels' exit (common/retire.py): after the kernel's last CTA barrier, one
    GPU-scope acq_rel count on the exit word behind a fence (the last of each: the forward's
    schedule phase has its own), then the zeroing stores."""
    lines = [line.strip() for line in ptx.splitlines()]
    barrier = max(i for i, line in enumerate(lines) if line == "bar.sync \t0;")
    fence = max(i for i, line in enumerate(lines) if line == "fence.acq_rel.sys;")
    count = max(i for i, line in enumerate(lines) if line.startswith("atom.acq_rel.gpu"))
    stores = [i for i, line in enumerate(lines) if line.startswith("st.global.b32")]
    assert barrier < fence < count < max(stores)


def test_counters_and_handshake(built):
    _, _, ptx = built
    assert "red.release.gpu.global.add.s32" in ptx and "ld.acquire.gpu.global.b32" in ptx
    # The dynamic tickets: a relaxed atomic add takes each task (tickets.py: the first ticket,
    # then one site per phase loop), each dispatched row tile (two sites, above) and each
    # schedule task (two sites, schedule_phase.py).
    assert ptx.count("atom.relaxed.gpu.global.add.s32") == 3 + 2 + 2
    # The schedule's tasks meet on named barrier 8 of threads 0 .. 255.
    assert "bar.sync \t8, 256;" in ptx
    # The hand-off: the consumers' two phase loops and their end signal; the crew's first
    # wait and its two phase loops. The crew meets on barrier 6 before it releases a gate/up
    # tile's counter or counts a down tile, and on 5 around slot look-ups.
    for line, count in (("bar.sync \t4, 352;", 3), ("bar.arrive 3, 352;", 3),
                        ("bar.arrive 4, 352;", 3), ("bar.sync \t3, 352;", 3),
                        ("bar.sync \t6, 96;", 2), ("bar.sync \t5, 96;", 2)):  # fmt: skip
        assert ptx.count(line) == count, line


def test_combine_phase(built):
    """combine_phase.py: after the consumers' end signal, one thread's bounded GPU-scope
    acquire of the down tiles' count, the 256 consumers' barrier 7, then combine_rows' 16-byte
    slot loads (4 slots x 4 tokens a step, the peeled step and the loop) with separate
    multiply and add roundings (no fma) and one 16-byte store per token."""
    _, _, ptx = built
    lines = [line.strip() for line in ptx.splitlines()]
    end_signal = max(i for i, line in enumerate(lines) if line == "bar.arrive 3, 352;")
    (meet,) = [i for i, line in enumerate(lines) if line == "bar.sync \t7, 256;"]
    acquire = [i for i, line in enumerate(lines[end_signal:meet])
               if line.startswith("ld.acquire.gpu.global")]  # fmt: skip
    assert end_signal < meet and acquire
    loads = [i for i, line in enumerate(lines) if line.startswith("ld.global.v4") and i > meet]
    assert len(loads) == 32
    body = "\n".join(lines[meet:])
    assert "mul.rn.f32" in body and "add.rn.f32" in body and "fma.rn.f32" not in body


def test_crew_stores_and_shared_memory(built):
    entry, _, ptx = built
    assert entry["config"] == {"stages": 3}
    # The dispatch's 8 per batch, gate, up, hidden per gate/up chunk, the two blocks per
    # down chunk and the combine's one per token (combine_rows: a loop over 4 tokens).
    assert ptx.count("st.global.v4") == 8 + 3 + 2 + 4
    assert ptx.count("st.shared.b32") >= 2 * 2 * 32  # both walks round 2 accumulators
    assert entry["dynamic_smem_bytes"] <= H200_SMEM_OPTIN
    assert entry["cluster"] == [1, 1, 1]
