"""The MoE layer with real EP ranks (symmetric memory over NVLink), against EP = 1.

Run: torchrun --nproc-per-node N -m pytest -m multigpu tests/multigpu (N >= 2).

Every rank makes the same global problem (same seed), runs its shard (tokens and experts split
contiguously, mok.testing.rank_inputs) through mok.functional with the group, and compares its
outputs with the same problem run on its own GPU as an EP group of one: out, d_x, d_router
and the routed weight gradients bitwise. The same kernels as the virtual group's
(tests/gpu/test_virtual_ep_gpu.py); here the peers are other GPUs, so system-scope ordering
and NVLink are what is tested. Not run yet: no multi-GPU machine was lent when it was written.
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


@pytest.mark.parametrize("routing", ["random", "first_experts", "empty_experts"])
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
    dist.barrier()
