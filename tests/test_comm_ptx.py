"""CPU checks of the EP comm kernels (mok/dsl_kernels/kernels/{flag_wait_probe, ep_barrier,
all_gather_top_experts}.py over mok/dsl_kernels/common/{bounded_wait, barrier_arrivals}.py):
they compile for sm_90a and sm_100a, their PTX uses the memory orders the protocol needs (acquire polls, release arrivals at system scope, the
error-record CAS + fence, the arrival epoch read with an acquire first and retired with an
acq_rel count last), backs off with nanosleep, bounds waits with %globaltimer and traps, and
never uses NVLink multicast. Their parameters are the names mok/launchers/comm.py passes: no
wait target is a launch argument (CUDA-graph replays read the epoch from the device).
About a second in total.
"""

import re

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels import build  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")

# Every bounded wait: acquire poll, back-off, clock, and the error record's write protocol.
BOUNDED_WAIT = (
    "ld.acquire.sys.global.b32",
    "nanosleep.u32",
    "%globaltimer",
    "atom.relaxed.sys.global.cas.b32",
    "st.relaxed.sys.global.b32",
    "fence.sc.sys",
    "trap;",
)
ARRIVAL = ("red.release.sys.global.add.s32",)
# The arrival epoch (ep_barrier.py): read with an acquire, retired with an acq_rel CTA count.
EPOCH_RETIRE = "atom.acq_rel.gpu.global.add.s32"
PARAMS = {
    "flag_wait_probe": [
        "flag_ptr",
        "done_ptr",
        "expected",
        "error_record_ptr",
        "rank",
        "phase",
        "timeout_ns",
    ],
    "ep_barrier": [
        "peer_table_ptr",
        "rank",
        "world_size",
        "barrier_epoch_ptr",
        "error_record_ptr",
        "phase",
        "timeout_ns",
    ],
    "all_gather_top_experts": [
        "ids_ptr",
        "peer_table_ptr",
        "rank",
        "world_size",
        "num_ids",
        "chunk_ids",
        "ctas_per_peer",
        "barrier_epoch_ptr",
        "error_record_ptr",
        "entry_phase",
        "gather_phase",
        "timeout_ns",
        "num_experts",
        "status_ptr",
    ],
}
REQUIRED = {
    "flag_wait_probe": BOUNDED_WAIT,
    "ep_barrier": BOUNDED_WAIT + ARRIVAL + (EPOCH_RETIRE, "bar.sync"),
    "all_gather_top_experts": BOUNDED_WAIT
    + ARRIVAL
    + (EPOCH_RETIRE, "st.global.v4.b32", "st.global.b32", "fence.acq_rel.sys", "ld.global.nc.s64")
    # The id range check on the int64 value, before narrowing (value_checks.py).
    + ("setp.ge.u64", "@bad st.global.b32"),
}


@pytest.fixture(scope="module")
def compiled():
    registry = {v.name: v for v in variants()}
    return {
        (name, arch): build.compile_variant(registry[name], arch)
        for name in PARAMS
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_comm_kernel_ptx(compiled, name, arch):
    entry, cubin, ptx = compiled[(name, arch)]
    assert cubin.startswith(b"\x7fELF")
    assert [p["name"] for p in entry["params"]] == PARAMS[name]
    assert entry["block"] == ([32, 1, 1] if name == "flag_wait_probe" else [128, 1, 1])
    assert entry["dynamic_smem_bytes"] == 0
    for instruction in REQUIRED[name]:
        assert instruction in ptx, f"{name} ({arch}) lacks {instruction}"
    # NVLink multicast is forbidden (DESIGN §3): no multimem, no multicast addresses.
    assert "multimem" not in ptx
    assert not re.search(r"\.multicast", ptx)
    # Every poll of a counter is an acquire at system scope; no weaker load of a counter.
    assert not re.search(r"ld\.(relaxed|volatile)\.", ptx)
    # The record is claimed before it is written and flagged valid after a fence.
    body = ptx[ptx.index(".entry") :]
    claim = body.index("atom.relaxed.sys.global.cas.b32")
    fence = body.index("fence.sc.sys", claim)
    assert claim < fence < body.index("trap;", fence)


def test_release_arrivals_follow_the_fence_in_the_all_gather(compiled):
    _, _, ptx = compiled[("all_gather_top_experts", "sm_90a")]
    body = ptx[ptx.index(".entry") :]
    last_store = body.rindex("st.global.v4.b32")
    fence = body.index("fence.acq_rel.sys", last_store)
    assert body.index("bar.sync", last_store) < fence
    assert "red.release.sys.global.add.s32" in body[fence:]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["ep_barrier", "all_gather_top_experts"])
def test_epoch_is_read_first_and_retired_last(compiled, name, arch):
    """Targets come from the device epoch: read (acquire) before any arrival, retired (one
    acq_rel count per CTA) after the last arrival and after the bar.sync that orders every
    thread's read of it."""
    _, _, ptx = compiled[(name, arch)]
    body = ptx[ptx.index(".entry") :]
    assert body.count(EPOCH_RETIRE) == 1
    first_read = body.index("ld.acquire.sys.global.b32")
    retire = body.index(EPOCH_RETIRE)
    assert first_read < body.index("red.release.sys.global.add.s32")
    assert body.rindex("red.release.sys.global.add.s32") < retire
    assert body.rindex("bar.sync") < retire
