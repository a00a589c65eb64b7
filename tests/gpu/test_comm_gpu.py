"""The bounded wait and the EP comm kernels on one GPU (mok/launchers/comm.py).

1. Timeout: a probe waits on a flag nobody sets (limit 0.2 s). The kernel must record the wait
   and trap, and `check_errors` must raise MoKWaitTimeoutError naming the phase and rank, not
   hang. A trap kills the CUDA context, so that case runs in a subprocess (this file run as a
   script) and the test reads its exit status and stderr.
2. Success: the flag is set by another stream while the probe waits (or was set before; or is
   past the target, since counters are monotone), and the probe completes.
3. EP group of one (workspace from mok.functional.get_workspace(config, None, ...)): the
   barrier runs 100 times and its counter equals the arrivals made and the device arrival
   epoch; the routing all-gather gives exactly the local ids narrowed to int32, on the vector
   and scalar store paths, with one chunk and with many; counters and epoch wrap around 2^31
   and 2^32 in step.
4. CUDA graphs: mok.functional.build_schedule (all-gather + schedule kernel) captured once and
   replayed with new routing ids in the same input tensor equals mok.reference.build_schedule
   each time, and every replay advances the device epoch (the wait targets are not frozen into
   the graph).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mok.config import MoKConfig
from mok.launchers import comm
from mok.runtime import WaitPhase
from mok.testing import make_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROBE_TIMEOUT_NS = 200_000_000  # 0.2 s
HANG_GUARD_S = 120  # the subprocess must end long before this, or the wait is not bounded
HIDDEN = 128


def _probe_until_timeout() -> None:
    """Subprocess body: wait on a flag that is never set; check_errors must raise."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    comm.flag_wait_probe(
        flag, done, 1, timeout_ns=PROBE_TIMEOUT_NS, rank=0, phase=WaitPhase.GRID_BARRIER
    )
    comm.check_errors(flag.device)  # raises MoKWaitTimeoutError: the traceback goes to stderr
    print("probe returned without a timeout", file=sys.stderr)
    sys.exit(3)


def test_probe_times_out_with_an_error_naming_phase_and_rank():
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "probe-timeout"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stderr
    assert "MoKWaitTimeoutError" in result.stderr, result.stderr
    assert re.search(
        r"rank 0 timed out waiting in phase GRID_BARRIER \(id 3\): counter 0 in this rank's "
        r"memory read 0, expected 1 \(CTA 0, task -1\)",
        result.stderr,
    ), result.stderr
    assert elapsed < 60, f"the 0.2 s timeout took {elapsed:.1f} s to surface"


def test_probe_completes_when_another_stream_sets_the_flag():
    device = torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    done = torch.zeros(1, dtype=torch.int32, device=device)
    setter = torch.cuda.Stream(device)
    # Load the setter's kernels before the probe spins: under CUDA lazy module loading the
    # first launch of a kernel may wait for the running ones, i.e. for the probe (measured on
    # the H200: without this warm-up the flag is never set and the probe times out).
    with torch.cuda.stream(setter):
        torch.cuda._sleep(1)
        flag.fill_(7)
        flag.fill_(0)
    torch.cuda.synchronize()
    comm.flag_wait_probe(flag, done, 7, timeout_ns=10_000_000_000)
    with torch.cuda.stream(setter):
        torch.cuda._sleep(20_000_000)  # ~10 ms of spinning, so the probe really waits
        flag.fill_(7)
    comm.check_errors(device)
    assert done.item() == 1
    assert flag.item() == 7


@pytest.mark.parametrize(
    "flag_value, expected",
    [(3, 3), (9, 3), (-(2**31), 2**31 - 16)],  # equal; past (monotone); past across the wrap
)
def test_probe_completes_when_the_flag_has_already_reached_the_target(flag_value, expected):
    flag = torch.full((1,), flag_value, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    comm.flag_wait_probe(flag, done, expected, timeout_ns=10_000_000_000)
    comm.check_errors(flag.device)
    assert done.item() == 1


def _workspace(num_tokens: int, topk: int):
    from mok.functional import get_workspace  # noqa: PLC0415

    return get_workspace(
        MoKConfig(),
        None,
        device="cuda",
        num_local_tokens=num_tokens,
        hidden_size=HIDDEN,
        topk=topk,
    )


def test_ep_barrier_group_of_one_repeats():
    workspace = _workspace(64, 2)
    counter = workspace.buffers["barrier_buffer"]
    epoch = workspace.buffers["barrier_epoch_buffer"]
    before = int(counter[0].item())
    for _ in range(100):
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=5_000_000_000)
    comm.check_errors(workspace.device)
    assert int(counter[0].item()) == before + 100
    # The device epoch (the base of the next call's targets) follows the arrivals; the CTA
    # count is back to zero for the next launch.
    assert epoch.tolist() == [before + 100, 0]


@pytest.mark.parametrize(
    "num_tokens, topk, chunk_bytes",
    [
        (4096, 8, 2048),  # 16-byte stores, 64 chunks over 64 CTAs
        (1, 4, 2048),  # one vector
        (7, 3, 16),  # 21 ids: 4-byte stores, 6 chunks
        (1000, 6, 64),  # 16-byte stores, a ragged last chunk, 375 chunks over 64 CTAs
        (3, 1, 2048),  # 3 ids: fewer than one vector
    ],
)
def test_all_gather_group_of_one_is_the_local_ids(num_tokens, topk, chunk_bytes):
    workspace = _workspace(num_tokens, topk)
    config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
    gen = torch.Generator().manual_seed(num_tokens * 31 + topk)
    for call in range(3):  # repeated calls overwrite the buffer and keep the counters in step
        ids = torch.randint(0, 1 << 20, (num_tokens, topk), generator=gen, dtype=torch.int64)
        ids = ids.cuda()
        gathered = workspace.buffers["all_gather_top_experts_buffer"]
        gathered.fill_(-7)  # poison: an unwritten id shows up as -7
        out = comm.all_gather_top_experts(workspace, config, ids, timeout_ns=5_000_000_000)
        comm.check_errors(workspace.device)
        assert out.data_ptr() == gathered.data_ptr()
        assert out.shape == (1, num_tokens, topk) and out.dtype == torch.int32
        assert torch.equal(out[0], ids.to(torch.int32)), f"call {call}"
    counter = workspace.buffers["barrier_buffer"]
    epoch = workspace.buffers["barrier_epoch_buffer"]
    assert epoch.tolist() == [int(counter[0].item()), 0]


def _arrivals_per_all_gather(num_ids: int, chunk_bytes: int, world_size: int = 1) -> int:
    """Arrivals per barrier slot of one all-gather call: 2 per CTA writing to one peer."""
    num_chunks = -(-num_ids // (chunk_bytes // 4))
    return 2 * min(num_chunks, max(1, comm.MAX_GATHER_CTAS // world_size))


@pytest.mark.parametrize("start", [2**31 - 5, -3])  # across the signed wrap; across 2^32
def test_counters_and_epoch_wrap_in_step(start):
    workspace = _workspace(64, 2)
    config = MoKConfig(all_gather_top_experts_chunk_bytes=64)  # 8 CTAs: 16 arrivals per call
    ids = torch.arange(128, dtype=torch.int64, device="cuda").reshape(64, 2)
    comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START)  # state made before the poke
    comm.check_errors(workspace.device)
    counter = workspace.buffers["barrier_buffer"]
    epoch = workspace.buffers["barrier_epoch_buffer"]
    counter.fill_(start)  # both moved together: the invariant "slot == epoch" still holds
    epoch[0] = start
    for _ in range(3):
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=5_000_000_000)
        out = comm.all_gather_top_experts(workspace, config, ids, timeout_ns=5_000_000_000)
    comm.check_errors(workspace.device)
    assert torch.equal(out[0], ids.to(torch.int32))
    expected = start + 3 * (1 + _arrivals_per_all_gather(128, 64))
    expected = (expected + 2**31) % 2**32 - 2**31  # as int32
    assert int(counter[0].item()) == expected
    assert epoch.tolist() == [expected, 0]


def test_all_gather_and_functional_build_schedule_replay_in_a_cuda_graph():
    """One graph of the all-gather and `functional.build_schedule` (a group of one, whose
    schedule reads the ids in place): each replay follows the new ids in the input buffer,
    and the all-gather reads its targets from the device epoch and advances it (the
    schedule makes no comm arrivals)."""
    from mok import functional as F  # noqa: PLC0415
    from mok import reference as R  # noqa: PLC0415

    num_tokens, topk, num_experts = 1024, 4, 32
    config = MoKConfig()
    workspace = F.get_workspace(config, None, device="cuda", num_local_tokens=num_tokens,
                                hidden_size=HIDDEN, topk=topk,
                                num_local_experts=num_experts)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    static_ids = make_routing(num_tokens, num_experts, topk, "random", gen).cuda()

    def calls():
        gathered = comm.all_gather_top_experts(workspace, config, static_ids,
                                               num_experts=num_experts)  # fmt: skip
        return gathered, F.build_schedule(workspace, config, static_ids,
                                          num_local_experts=num_experts)  # fmt: skip

    # Warm-up outside capture: loads the cubins, uploads the peer tables, maps the record.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    F.check_errors(workspace)  # also collects the eager call's pending status copy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gathered, graphed = calls()
    counter = workspace.buffers["barrier_buffer"]
    epoch = workspace.buffers["barrier_epoch_buffer"]
    per_call = _arrivals_per_all_gather(
        num_tokens * topk, config.all_gather_top_experts_chunk_bytes
    )
    for replay, routing in enumerate(["random", "one_expert", "empty_experts"]):
        ids = make_routing(num_tokens, num_experts, topk, routing, gen)
        static_ids.copy_(ids.cuda())
        before = int(epoch[0].item())
        gathered.fill_(-7)
        for out in (graphed.peer_rank, graphed.peer_token_idx, graphed.num_tokens):
            out.fill_(-7)  # poison: a replay that wrote nothing fails
        graph.replay()
        comm.check_errors(workspace.device)
        assert torch.equal(gathered[0].cpu(), ids.to(torch.int32)), f"replay {replay}"
        want = R.build_schedule(
            ids[None], ep_rank=0, num_local_experts=num_experts,
            capacity=workspace.schedule_capacity,
        )  # fmt: skip
        for name in ("peer_rank", "peer_token_idx", "num_tokens", "tokens_per_expert"):
            got = getattr(graphed, name).cpu()
            assert torch.equal(got, getattr(want, name)), f"replay {replay} ({routing}): {name}"
        # The replay read its targets from the device epoch and advanced it.
        assert epoch.tolist() == [before + per_call, 0], f"replay {replay}"
        assert int(counter[0].item()) == before + per_call, f"replay {replay}"
    # Eager calls after the replays keep the same device state in step.
    calls()
    F.check_errors(workspace)
    assert epoch.tolist() == [int(counter[0].item()), 0]


def test_all_gather_rejects_bad_ids():
    workspace = _workspace(8, 2)
    with pytest.raises(ValueError, match="top_experts must be a contiguous int64"):
        comm.all_gather_top_experts(
            workspace, MoKConfig(), torch.zeros(8, 2, dtype=torch.int32, device="cuda")
        )
    with pytest.raises(ValueError, match=r"shape \[8, 2\]"):
        comm.all_gather_top_experts(
            workspace, MoKConfig(), torch.zeros(8, 3, dtype=torch.int64, device="cuda")
        )


def test_check_errors_passes_on_a_clear_record():
    record = comm.get_error_record("cuda")
    assert record is comm.get_error_record(torch.device("cuda", torch.cuda.current_device()))
    record.clear()
    comm.check_errors("cuda")


if __name__ == "__main__":
    if sys.argv[1:] == ["probe-timeout"]:
        _probe_until_timeout()
    else:
        sys.exit(f"usage: {sys.argv[0]} probe-timeout")
