"""The bounded wait and the EP comm kernels on one GPU (mok/launchers/comm.py).

1. Timeout: a probe waits on a flag nobody sets (limit 0.2 s). The kernel must record the wait
   and trap, and `check_errors` must raise MoKWaitTimeoutError naming the phase and rank, not
   hang. A trap kills the CUDA context, so that case runs in a subprocess (this file run as a
   script) and the test reads its exit status and stderr.
2. Success: the flag is set by another stream while the probe waits (or was set before; or is
   past the target, since counters are monotone), and the probe completes.
3. EP group of one (workspace from mok.functional.get_workspace(config, None, ...)): the
   barrier runs 100 times and its counter equals the arrivals made; the routing all-gather
   gives exactly the local ids narrowed to int32, on the vector and scalar store paths, with
   one chunk and with many.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mok.runtime import WaitPhase

from mok.config import MoKConfig
from mok.launchers import comm

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
    before = int(counter[0].item())
    for _ in range(100):
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=5_000_000_000)
    comm.check_errors(workspace.device)
    assert int(counter[0].item()) == before + 100
    assert int(counter[0].item()) == workspace._mok_comm_state.arrivals


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
    assert int(counter[0].item()) == workspace._mok_comm_state.arrivals


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
