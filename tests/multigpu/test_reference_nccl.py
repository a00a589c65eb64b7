"""mok.reference's EP data movement over NCCL on GPUs (the CPU suite covers gloo).

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu tests/multigpu
Each rank holds num_experts / P experts and its own tokens; forward and backward over the
NCCL group must equal one GPU running the whole problem as an EP group of one, bitwise for the
routed results (the schedule gives every expert GEMM the same rows in the same order).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mok import reference as R
from mok.config import ROUTED_ROW_ALIGNMENT
from mok.testing import make_inputs

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs at least 2 CUDA GPUs",
    ),
]
T, H, I, E, K = 256, 128, 256, 8, 2
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


@pytest.fixture(scope="module")
def group():
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        pytest.skip("run under torchrun --nproc-per-node N (N >= 2)")
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")  # fmt: skip
    made = not dist.is_initialized()
    if made:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    yield dist.group.WORLD
    # The group lives until the process ends: a second init in the same torchrun process
    # cannot rendezvous again, and every multigpu test file shares it.
    if made:
        dist.barrier()


def layer(inputs, group, num_local, experts):
    topk = inputs["top_experts"].shape[1]
    capacity = 2 * inputs["x"].shape[0] * topk * 4 + num_local * ROUTED_ROW_ALIGNMENT
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=num_local,
                               capacity=capacity, group=group)  # fmt: skip
    weights = [inputs[n] if n.startswith("shared") else inputs[n][experts] for n in WEIGHTS]
    out, ctx = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights, group=group)
    grads = R.backward(schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights, group=group)  # fmt: skip
    return out, grads


@pytest.mark.parametrize("routing", ["random", "empty_experts"])
def test_reference_over_nccl_equals_one_gpu(group, routing):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device())
    full = make_inputs(size * T, H, I, E, K, shared=True, routing=routing, seed=7, device=device)
    rows = slice(rank * T, (rank + 1) * T)
    mine = {n: (v[rows] if n in ("x", "router_weights", "top_experts", "grad_output") else v)
            for n, v in full.items()}  # fmt: skip
    local = E // size
    experts = slice(rank * local, (rank + 1) * local)
    out, grads = layer(mine, group, local, experts)
    want_out, want = layer(full, None, E, slice(0, E))
    assert torch.equal(out, want_out[rows])
    assert torch.equal(grads[0], want[0][rows]) and torch.equal(grads[1], want[1][rows])
    for got, ref in zip(grads[2:5], want[2:5], strict=True):
        assert torch.equal(got, ref[experts])
