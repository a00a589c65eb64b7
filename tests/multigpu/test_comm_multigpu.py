"""The EP comm kernels across GPUs: device barrier, routing all-gather, timeout of a lost peer.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu tests/multigpu
(any N >= 2 works). Each rank runs every test in the same order (the kernels are collective).

- all-gather equals torch.distributed.all_gather of the same ids exactly, over shapes that take
  the vector and the scalar store paths, repeated with new ids each call;
- CUDA graphs: each rank captures its own graph of a barrier + an all-gather once and replays
  it 10 times with new ids in the same input tensor (the late rank alternating), and every
  replay equals torch.distributed.all_gather: the wait targets come from the device epoch, so
  a replay waits for its own peers' data rather than for counts reached long ago;
- the barrier repeated 100 times keeps every slot equal to the arrivals made (and to the device
  arrival epoch), and orders memory:
  each rank writes its symmetric x_buffer, barrier, reads every peer's, barrier (with rank 0
  delayed so a missing wait would read stale data);
- a lost peer: rank 1 never arrives, rank 0's barrier ends in MoKWaitTimeoutError naming the
  phase, rank 0 and the late rank (counter 1). A trap kills the CUDA context, so this case runs
  in a fresh 2-GPU torchrun launched from rank 0 (this file run as a script, "lost-peer"),
  and every rank of the outer group sees the verdict;
- a lost peer in the layer: in a fresh torchrun of all N GPUs ("lost-layer-peer") the last
  rank never runs the layer, and every other rank's schedule + forward ends in
  MoKWaitTimeoutError naming that rank and the phase within 10 s (wait limit 2 s). Written,
  not run yet (no multi-GPU machine lent since).

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set before the process group is made (here and in the subprocess).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs at least 2 CUDA GPUs",
    ),
]

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
HIDDEN = 128
TIMEOUT_NS = 10_000_000_000
LOST_PEER_TIMEOUT_NS = 500_000_000
HANG_GUARD_S = 300
# Env of the outer torchrun that must not leak into the nested one.
_LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _init_group() -> bool:
    """Init NCCL from torchrun's env (multicast off); True if this call made the group."""
    os.environ.update(NO_MULTICAST_ENV)
    if dist.is_initialized():
        return False
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return True


@pytest.fixture(scope="module")
def group():
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("run under torchrun --nproc-per-node N (N >= 2)")
    made = _init_group()
    yield dist.group.WORLD
    # The group lives until the process ends: a second init in the same torchrun process
    # cannot rendezvous again, and every multigpu test file shares it.
    if made:
        dist.barrier()


def _workspace(group, num_tokens: int, topk: int):
    from mok.config import MoKConfig  # noqa: PLC0415
    from mok.functional import get_workspace  # noqa: PLC0415

    return get_workspace(
        MoKConfig(),
        group,
        device=torch.device("cuda", torch.cuda.current_device()),
        num_local_tokens=num_tokens,
        hidden_size=HIDDEN,
        topk=topk,
    )


@pytest.mark.parametrize(
    "num_tokens, topk, chunk_bytes",
    [
        (4096, 8, 2048),  # 16-byte stores, 64 chunks per peer
        (7, 3, 16),  # 21 ids: 4-byte stores, one id short of a vector in the last chunk
        (1000, 6, 64),  # 16-byte stores, many chunks per CTA, a ragged last chunk
    ],
)
def test_all_gather_equals_nccl_all_gather(group, num_tokens, topk, chunk_bytes):
    from mok.config import MoKConfig  # noqa: PLC0415
    from mok.launchers import comm  # noqa: PLC0415

    rank, world_size = dist.get_rank(), dist.get_world_size()
    workspace = _workspace(group, num_tokens, topk)
    config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
    gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
    results, expected = [], []
    for _ in range(5):  # back to back, no host sync: the entry barrier guards the overwrite
        ids = torch.randint(0, 1 << 20, (num_tokens, topk), generator=gen).cuda()
        gathered = comm.all_gather_top_experts(workspace, config, ids, timeout_ns=TIMEOUT_NS)
        results.append(gathered.clone())  # stream-ordered: before the next call overwrites
        reference = [torch.empty_like(ids) for _ in range(world_size)]
        dist.all_gather(reference, ids)
        expected.append(torch.stack(reference).to(torch.int32))
    comm.check_errors(workspace.device)
    for call, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(got, want), f"call {call}: rows differ {(got != want).any(-1).any(-1)}"


def test_barrier_and_all_gather_replay_in_a_cuda_graph(group):
    from mok.config import MoKConfig  # noqa: PLC0415
    from mok.launchers import comm  # noqa: PLC0415
    from mok.runtime import WaitPhase  # noqa: PLC0415

    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_tokens, topk = 1000, 6
    workspace = _workspace(group, num_tokens, topk)
    # 64-byte chunks: 375 chunks, many CTAs per peer, so many arrivals per replay.
    config = MoKConfig(all_gather_top_experts_chunk_bytes=64)
    static_ids = torch.zeros(num_tokens, topk, dtype=torch.int64, device="cuda")

    def step():
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=TIMEOUT_NS)
        gathered = comm.all_gather_top_experts(workspace, config, static_ids, timeout_ns=TIMEOUT_NS)
        return gathered.clone()  # before the next step overwrites the buffer

    step()  # warm-up outside capture: loads the cubins, uploads the peer tables
    comm.check_errors(workspace.device)
    dist.barrier()  # no NCCL work in flight while capturing
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = step()
    gen = torch.Generator().manual_seed(77 + rank)
    results, expected = [], []
    for replay in range(10):
        ids = torch.randint(0, 1 << 20, (num_tokens, topk), generator=gen).cuda()
        if replay % 2 == rank % 2:
            # This rank replays late: a replay that did not wait would clone a buffer its
            # peers have not written yet (or overwrite one they are still reading).
            torch.cuda._sleep(2_000_000)
        static_ids.copy_(ids)
        graph.replay()
        results.append(captured.clone())
        reference = [torch.empty_like(ids) for _ in range(world_size)]
        dist.all_gather(reference, ids)
        expected.append(torch.stack(reference).to(torch.int32))
    eager = step()  # eager after replays: the device epoch is shared by both
    reference = [torch.empty_like(static_ids) for _ in range(world_size)]
    dist.all_gather(reference, static_ids)
    comm.check_errors(workspace.device)
    for replay, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(got, want), (
            f"replay {replay}: rows differ {(got != want).any(-1).any(-1)}"
        )
    assert torch.equal(eager, torch.stack(reference).to(torch.int32))
    values = workspace.buffers["barrier_buffer"].tolist()
    epoch = workspace.buffers["barrier_epoch_buffer"].tolist()
    dist.barrier()  # every rank has read its counters before the next test arrives
    assert epoch[1] == 0 and values == [epoch[0]] * world_size


def test_barrier_repeated_keeps_counters_in_step(group):
    from mok.launchers import comm  # noqa: PLC0415
    from mok.runtime import WaitPhase  # noqa: PLC0415

    workspace = _workspace(group, 64, 2)
    for _ in range(100):
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=TIMEOUT_NS)
    comm.check_errors(workspace.device)
    counters = workspace.buffers["barrier_buffer"]
    values = counters.tolist()
    epoch = workspace.buffers["barrier_epoch_buffer"].tolist()
    # Nobody starts the next test's arrivals before every rank has read its counters.
    dist.barrier()
    assert epoch[1] == 0
    assert values == [epoch[0]] * dist.get_world_size()


def test_barrier_orders_peer_writes_and_reads(group):
    from mok.launchers import comm  # noqa: PLC0415
    from mok.runtime import WaitPhase  # noqa: PLC0415

    rank, world_size = dist.get_rank(), dist.get_world_size()
    workspace = _workspace(group, 64, 2)
    x_buffer = workspace.buffers["x_buffer"]
    handle = workspace._handles["x_buffer"]
    peers = [
        handle.get_buffer(peer, tuple(x_buffer.shape), x_buffer.dtype) for peer in range(world_size)
    ]
    seen = []
    for step in range(20):
        if rank == 0:
            torch.cuda._sleep(2_000_000)  # rank 0 writes late: a barrier that does not wait fails
        x_buffer.fill_(float(step * world_size + rank))
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_START, timeout_ns=TIMEOUT_NS)
        seen.append(torch.stack([peer[0, 0].clone() for peer in peers]))
        # Nobody overwrites its buffer for the next step before every peer has read it.
        comm.ep_barrier(workspace, phase=WaitPhase.PEER_BARRIER_END, timeout_ns=TIMEOUT_NS)
    comm.check_errors(workspace.device)
    for step, values in enumerate(seen):
        want = [float(step * world_size + peer) for peer in range(world_size)]
        assert values.float().tolist() == want, f"step {step}"


def test_lost_peer_times_out_with_an_error_naming_phase_and_rank(group, tmp_path_factory):
    verdict = torch.zeros(1, dtype=torch.int32, device="cuda")
    detail = ""
    if dist.get_rank() == 0:
        out_dir = tmp_path_factory.mktemp("lost_peer")
        result, elapsed = _nested_torchrun("lost-peer", 2, out_dir)
        message_file = out_dir / "rank0.txt"
        message = message_file.read_text() if message_file.exists() else ""
        detail = (
            f"exit {result.returncode} after {elapsed:.0f} s\nmessage: {message}\n"
            f"stdout: {result.stdout[-4000:]}\nstderr: {result.stderr[-4000:]}"
        )
        ok = result.returncode == 0 and re.search(
            r"^MoKWaitTimeoutError: rank 0 timed out waiting in phase PEER_BARRIER_END \(id 2\): "
            r"counter 1 in this rank's memory read 0, expected 1",
            message,
        )
        verdict.fill_(1 if ok else 0)
    dist.broadcast(verdict, src=0)
    assert verdict.item() == 1, detail or "rank 0's lost-peer subprocess failed (see rank 0)"


def _nested_torchrun(mode: str, nproc: int, out_dir: Path):
    """This file run as a script under a fresh torchrun of `nproc` ranks (the outer launcher's
    env removed, multicast off): (completed process, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    env.update(NO_MULTICAST_ENV)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), str(Path(__file__).resolve()), mode, str(out_dir)],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env=env,
    )  # fmt: skip
    return result, time.monotonic() - start


def test_a_peer_that_never_runs_the_layer_times_out_on_every_other_rank(group, tmp_path_factory):
    """N ranks make the group's workspace; the last never runs the layer. Every other rank's
    schedule (its all-gather waits for the lost rank) ends in MoKWaitTimeoutError naming that
    rank and the phase, within seconds of the call (the workspace's wait limit: 2 s)."""
    size = dist.get_world_size()
    verdict = torch.zeros(1, dtype=torch.int32, device="cuda")
    detail = ""
    if dist.get_rank() == 0:
        out_dir = tmp_path_factory.mktemp("lost_layer_peer")
        result, elapsed = _nested_torchrun("lost-layer-peer", size, out_dir)
        messages = {r: (out_dir / f"rank{r}.txt") for r in range(size - 1)}
        messages = {r: f.read_text() if f.exists() else "" for r, f in messages.items()}
        detail = (
            f"exit {result.returncode} after {elapsed:.0f} s\nmessages: {messages}\n"
            f"stdout: {result.stdout[-4000:]}\nstderr: {result.stderr[-4000:]}"
        )
        pattern = (r"^MoKWaitTimeoutError after (\d+\.\d) s: rank {} timed out waiting in "
                   r"phase (PEER_BARRIER_START|ROUTING_ALLGATHER) ")  # fmt: skip
        found = {r: re.search(pattern.format(r), m) for r, m in messages.items()}
        ok = result.returncode == 0 and all(
            match is not None and float(match.group(1)) < 10 for match in found.values()
        )
        verdict.fill_(1 if ok else 0)
    dist.broadcast(verdict, src=0)
    assert verdict.item() == 1, detail or "rank 0's lost-peer subprocess failed (see rank 0)"


def _lost_layer_peer_worker(out_dir: Path) -> None:
    """Nested torchrun body: the last rank makes the workspace but never runs the layer; every
    other rank runs schedule + forward and writes its verdict. Exits with os._exit (a trapped
    context cannot be torn down cleanly)."""
    from mok import functional as F  # noqa: PLC0415
    from mok.runtime import MoKWaitTimeoutError  # noqa: PLC0415
    from mok.testing import WEIGHT_NAMES, make_inputs, rank_inputs  # noqa: PLC0415

    _init_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * size
    shard = rank_inputs(make_inputs(256 * size, 512, 256, num_experts, 2, seed=5, device=device),
                        rank, size)  # fmt: skip
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)
    ws = F.get_workspace(config, dist.group.WORLD, device=device, num_local_tokens=256,
                         hidden_size=512, topk=2, num_local_experts=4)  # fmt: skip
    ws.wait_timeout_ns = 2_000_000_000
    torch.cuda.synchronize()
    dist.barrier()
    if rank < size - 1:
        start = time.monotonic()
        try:
            weights = [shard[n] for n in WEIGHT_NAMES]
            schedule = F.build_schedule(ws, config, shard["top_experts"], num_local_experts=4)
            F.forward(config, ws, schedule, shard["x"], shard["router_weights"], *weights)
            F.check_errors(ws)
            text, code = "no error: the layer ran without the last rank", 1
        except MoKWaitTimeoutError as exc:
            text, code = f"MoKWaitTimeoutError after {time.monotonic() - start:.1f} s: {exc}", 0
        except Exception as exc:  # noqa: BLE001 - reported to the outer test
            text, code = f"{type(exc).__name__}: {exc}", 1
        (out_dir / f"rank{rank}.txt").write_text(text)
        print(text, flush=True)
        os._exit(code)
    # The lost rank stays alive (its memory mapped) until every other rank has its verdict.
    deadline = time.monotonic() + HANG_GUARD_S / 2
    while time.monotonic() < deadline and not all(
        (out_dir / f"rank{r}.txt").exists() for r in range(size - 1)
    ):
        time.sleep(0.05)
    os._exit(0)


def _lost_peer_worker(out_dir: Path) -> None:
    """Nested torchrun body: rank 1 makes the workspace but never arrives at the barrier.

    Exits with os._exit: a trapped context cannot be torn down cleanly (NCCL would hang).
    """
    from mok.launchers import comm  # noqa: PLC0415
    from mok.runtime import MoKWaitTimeoutError, WaitPhase  # noqa: PLC0415

    _init_group()
    rank = dist.get_rank()
    workspace = _workspace(dist.group.WORLD, 64, 2)
    torch.cuda.synchronize()
    done_file = out_dir / "rank0.txt"
    if rank == 0:
        try:
            comm.ep_barrier(
                workspace, phase=WaitPhase.PEER_BARRIER_END, timeout_ns=LOST_PEER_TIMEOUT_NS
            )
            comm.check_errors(workspace.device)
            text, code = "no error: the barrier passed without rank 1", 1
        except MoKWaitTimeoutError as exc:
            text, code = f"MoKWaitTimeoutError: {exc}", 0
        except Exception as exc:  # noqa: BLE001 - reported to the outer test
            text, code = f"{type(exc).__name__}: {exc}", 1
        done_file.write_text(text)
        print(text, flush=True)
        os._exit(code)
    # Rank 1 stays alive (its memory mapped) until rank 0 has its verdict, then leaves.
    deadline = time.monotonic() + HANG_GUARD_S / 2
    while not done_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "lost-peer":
        _lost_peer_worker(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "lost-layer-peer":
        _lost_layer_peer_worker(Path(sys.argv[2]))
    else:
        sys.exit(
            f"usage: torchrun --nproc-per-node N {sys.argv[0]} lost-peer|lost-layer-peer OUT_DIR"
        )
