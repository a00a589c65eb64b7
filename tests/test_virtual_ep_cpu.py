"""The virtual EP group's CPU-side contract: clear refusals, rank shards of a global layer."""

from __future__ import annotations

import pytest
import torch

from mok.testing import make_inputs, rank_inputs
from mok.virtual_ep import VirtualEPGroup


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_virtual_group_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        VirtualEPGroup(2)


def test_virtual_group_checks_its_size():
    with pytest.raises((TypeError, ValueError), match="size"):
        VirtualEPGroup(0)


def test_rank_inputs_split_tokens_and_experts_contiguously():
    inputs = make_inputs(64, 128, 128, 8, 2, shared=True, seed=1)
    shards = [rank_inputs(inputs, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([s["x"] for s in shards]), inputs["x"])
    assert torch.equal(torch.cat([s["routed_gate"] for s in shards]), inputs["routed_gate"])
    assert torch.equal(torch.cat([s["top_experts"] for s in shards]), inputs["top_experts"])
    assert all(s["shared_up"] is inputs["shared_up"] for s in shards)
    with pytest.raises(ValueError, match="must split evenly over 3 ranks"):
        rank_inputs(inputs, 0, 3)
