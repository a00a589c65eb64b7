"""The MoE layer with real EP ranks (symmetric memory over NVLink), against EP = 1.

Run: torchrun --nproc-per-node N -m pytest -m multigpu tests/multigpu (N >= 2).

Every rank makes the same global problem (same seed), runs its shard (tokens and experts split
contiguously, mok.testing.rank_inputs) through mok.functional with the group, and compares its
outputs with the same problem run on its own GPU as an EP group of one: out, d_x, d_router
and the routed weight gradients bitwise. The same kernels as the virtual group's
(tests/gpu/test_virtual_ep_gpu.py); here the peers are other GPUs, so system-scope ordering
and NVLink are what is tested. Each rank also runs the same global problem as a virtual group
of the same P on its own GPU (mok.virtual_ep; it needs CUDA_DEVICE_MAX_CONNECTIONS > P, which
tools/multigpu_run.sh sets) and compares its shard's outputs with that group's rank. A
captured training step (schedule, forward, backward with the group's workspace) replays with
the eager step's bits. Not run yet: no multi-GPU machine was lent when it was written.
"""

from __future__ import annotations

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
# The shared process-group fixture (NCCL, multicast off) of the comm tests.
from test_comm_multigpu import group  # noqa: E402, F401


def _virtual_rank(config, inputs, num_experts, rank, size):
    """(out, 8 gradients) of `rank` in a virtual group of `size` ranks on this GPU, the same
    global problem."""
    from mok.testing import virtual_group_step  # noqa: PLC0415

    ranks, spaces = virtual_group_step(config, inputs, num_experts, size)
    for ws in spaces:
        ws.destroy()
    out, *grads = ranks[rank]
    return out, grads


@pytest.mark.parametrize("routing", ["random", "first_experts", "empty_experts", "one_expert"])
def test_layer_is_bitwise_the_group_of_one(group, routing):  # noqa: F811
    from mok import functional as F  # noqa: PLC0415
    from mok.testing import make_inputs, rank_inputs, run_layer_step  # noqa: PLC0415

    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * size
    inputs = make_inputs(512 * size, 512, 256, num_experts, 2, routing=routing, seed=11,
                         device=device)  # fmt: skip
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)
    t, h = inputs["x"].shape
    one = F.get_workspace(config, None, device=device, num_local_tokens=t, hidden_size=h, topk=2,
                          num_local_experts=num_experts)  # fmt: skip
    out_one, _, grads_one = run_layer_step(config, one, inputs, num_experts)
    F.check_errors(one)

    shard = rank_inputs(inputs, rank, size)
    ws = F.get_workspace(config, group, device=device, num_local_tokens=t // size,
                         hidden_size=h, topk=2, num_local_experts=num_experts // size)  # fmt: skip
    out, _, grads = run_layer_step(config, ws, shard, num_experts // size)
    F.check_errors(ws)
    tokens = slice(rank * t // size, (rank + 1) * t // size)
    experts = slice(rank * num_experts // size, (rank + 1) * num_experts // size)
    assert torch.equal(out, out_one[tokens])
    assert torch.equal(grads[0], grads_one[0][tokens])  # d_x
    assert torch.equal(grads[1], grads_one[1][tokens])  # d_router
    for index in (2, 3, 4):  # routed gate, up, down weight gradients of this rank's experts
        assert torch.equal(grads[index], grads_one[index][experts])
    out_virtual, grads_virtual = _virtual_rank(config, inputs, num_experts, rank, size)
    assert torch.equal(out, out_virtual)
    for index in range(5):  # d_x, d_router, routed gate, up, down
        assert torch.equal(grads[index], grads_virtual[index]), index
    dist.barrier()


def test_training_step_replays_in_a_cuda_graph(group):  # noqa: F811
    """Every rank captures its own schedule + forward + backward (the group's workspace) once;
    two replays, each with new inputs copied into the captured ones, give the eager step's bits
    on those inputs."""
    from mok import functional as F  # noqa: PLC0415
    from mok.testing import make_inputs, rank_inputs, run_layer_step  # noqa: PLC0415

    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    num_experts = 4 * size
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)

    def shard(seed):
        inputs = make_inputs(512 * size, 512, 256, num_experts, 2, seed=seed, device=device)
        return rank_inputs(inputs, rank, size)

    static = shard(21)
    t, h = static["x"].shape
    ws = F.get_workspace(config, group, device=device, num_local_tokens=t, hidden_size=h, topk=2,
                         num_local_experts=num_experts // size)  # fmt: skip

    def step(inputs):
        out, _, grads = run_layer_step(config, ws, inputs, num_experts // size)
        return [out, *grads[:5]]

    step(static)  # warm-up outside capture: plans, peer tables, the error record
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    for seed in (22, 23):
        fresh = shard(seed)
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor) and static.get(name) is not None:
                static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        F.check_errors(ws)
        eager = step(fresh)
        F.check_errors(ws)
        for index, (a, b) in enumerate(zip(captured, eager, strict=True)):
            assert torch.equal(a, b), (seed, index)
    dist.barrier()
