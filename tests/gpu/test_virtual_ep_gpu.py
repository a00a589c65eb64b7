"""Expert parallelism inside the megakernels, proven on one GPU with a virtual EP group
(mok.virtual_ep): P ranks, tokens and experts split contiguously, every output and gradient
bitwise identical to an EP group of one on the same global problem. Rows are pulled from the
source rank's x / dY / router-weight buffers and pushed into its combine, d_x and d_router
buffers by the same kernels real ranks run; only the allocation and peer tables differ."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mok import functional as F
from mok.testing import (
    make_inputs,
    oracle_errors,
    rank_inputs,
    rel_error,
    run_layer_step,
    virtual_group_step,
)
from mok.virtual_ep import VirtualEPGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
# Capacity for the adversarial routings: one rank may receive every routed row of the group.
WHOLE_GROUP = dataclasses.replace(F.MoKConfig(), schedule_capacity_multiplier=1.0)
NAMES = ("out", "d_x", "d_router", "d_gate", "d_up", "d_down", "d_shared_gate", "d_shared_up",
         "d_shared_down")  # fmt: skip


def group_step(inputs, num_experts, size, limit=None, config=WHOLE_GROUP):
    """Per-rank (out, 8 gradients) of one training step on a virtual group of `size` ranks."""
    return virtual_group_step(config, inputs, num_experts, size, swiglu_limit=limit)


def assert_equal_to_group_of_one(inputs, num_experts, size, limit=None, check_oracle=False):
    one, _ = group_step(inputs, num_experts, 1, limit)
    (expected,) = one
    if check_oracle:
        failures = [
            f"{name}: {err:.3e} > 2x bf16 {base:.3e}"
            for name, ok, err, base in oracle_errors(expected, inputs, swiglu_limit=limit)
            if not ok
        ]
        assert not failures, "; ".join(failures)
    ranks, _ = group_step(inputs, num_experts, size, limit)
    # Per token (out, d_x, d_router) and per expert (routed weight gradients): concatenated.
    for index in range(6):
        got = torch.cat([r[index] for r in ranks])
        assert torch.equal(got, expected[index]), f"{NAMES[index]} differs at P = {size}"
    # The shared expert's weight gradients are each rank's own tokens' (data parallel): their
    # sum over ranks is the group of one's up to fp32 summation order.
    for index in range(6, 9):
        if expected[index] is None or expected[index].numel() == 0:
            continue
        total = sum(r[index].float() for r in ranks)
        assert rel_error(total, expected[index].float()) < 1e-2, NAMES[index]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("shared", [False, True])
def test_virtual_group_is_bitwise_the_group_of_one(size, shared):
    inputs = make_inputs(2048, 512, 512, 16, 4, shared=shared, seed=size, device=CUDA)
    assert_equal_to_group_of_one(inputs, 16, size, check_oracle=size == 2)


def test_eight_ranks_in_a_process_with_enough_connections():
    # Eight rank streams and the caller's need CUDA_DEVICE_MAX_CONNECTIONS > 8, set before
    # CUDA initialises: a fresh process.
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, "tests/gpu")
        import torch
        from mok.testing import make_inputs
        from test_virtual_ep_gpu import assert_equal_to_group_of_one
        inputs = make_inputs(2048, 512, 512, 16, 4, shared=True, seed=8, device="cuda")
        assert_equal_to_group_of_one(inputs, 16, 8)
        print("EIGHT RANKS OK")
        """
    )
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="16")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, env=env)  # fmt: skip
    assert "EIGHT RANKS OK" in done.stdout, (done.stdout + done.stderr)[-3000:]


@pytest.mark.parametrize(
    "name,t,h,i,e,k,limit",
    [
        ("qwen3-30b-a3b", 2048, 2048, 768, 16, 8, None),  # 128 experts scaled to 16
        ("deepseek-v3", 1024, 7168, 2048, 8, 8, 7.0),  # 256 experts scaled to 8, clamp on
        ("k1", 1024, 512, 256, 8, 1, None),
    ],
)
def test_model_shapes_at_p4(name, t, h, i, e, k, limit):
    inputs = make_inputs(t, h, i, e, k, seed=len(name), device=CUDA)
    assert_equal_to_group_of_one(inputs, e, 4, limit, check_oracle=name == "qwen3-30b-a3b")


@pytest.mark.parametrize("routing", ["first_experts", "empty_experts", "one_expert"])
def test_adversarial_routing(routing):
    # first_experts: every token of every rank to rank 0's experts; empty_experts: ranks 2-3
    # receive nothing; one_expert: every token's first choice is expert 0.
    inputs = make_inputs(1024, 512, 256, 8, 2, routing=routing, seed=3, device=CUDA)
    assert_equal_to_group_of_one(inputs, 8, 4)


def test_capacity_overflow_is_a_clear_error():
    inputs = make_inputs(1024, 512, 256, 8, 2, routing="first_experts", seed=4, device=CUDA)
    with pytest.raises(ValueError, match="capacity"):
        group_step(inputs, 8, 4, config=F.MoKConfig())  # multiplier 0.5: rank 0 overflows


def test_group_refuses_too_few_connections(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS is 2, not above the group"):
        VirtualEPGroup(2)


def test_a_rank_that_never_arrives_times_out_naming_it():
    # In a subprocess: the trapped kernel ends its CUDA context.
    script = textwrap.dedent(
        """
        import torch
        from mok import functional as F
        from mok.testing import make_inputs, rank_inputs, run_layer_step
        from mok.virtual_ep import VirtualEPGroup
        group = VirtualEPGroup(2)
        inputs = make_inputs(512, 512, 256, 4, 2, seed=1, device="cuda")
        spaces = group.workspaces(F.MoKConfig(), num_local_tokens=256, hidden_size=512, topk=2,
                                  num_local_experts=2)
        spaces[0].wait_timeout_ns = 2_000_000_000
        # Only rank 0 runs: rank 1 never arrives. The trapped wait fails the next CUDA call,
        # and check_errors then names the wait that gave up.
        try:
            group.run(lambda rank: run_layer_step(F.MoKConfig(), spaces[0],
                                                  rank_inputs(inputs, 0, 2), 2)
                      if rank == 0 else None)
            F.check_errors(spaces[0])
        except Exception:
            try:
                F.check_errors(spaces[0])
            except Exception as error:
                print(type(error).__name__, error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))  # fmt: skip
    output = done.stdout + done.stderr
    assert "MoKWaitTimeoutError" in output, output[-3000:]
    assert "rank 0" in output, output[-3000:]


def test_training_step_replays_in_one_cuda_graph():
    size, e = 2, 8
    inputs = make_inputs(1024, 512, 256, e, 2, seed=9, device=CUDA)
    group = VirtualEPGroup(size)
    spaces = group.workspaces(WHOLE_GROUP, num_local_tokens=512, hidden_size=512, topk=2,
                              num_local_experts=e // size)  # fmt: skip
    shards = [rank_inputs(inputs, rank, size) for rank in range(size)]

    def step():
        results = group.run(
            lambda rank: run_layer_step(WHOLE_GROUP, spaces[rank], shards[rank], e // size)
        )
        group.join()
        return [[out, *grads] for out, _, grads in results]

    eager = step()  # also the warm-up: peer tables and error record outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for rank in range(size):
            for name, a, b in zip(NAMES, captured[rank], eager[rank], strict=True):
                assert (a is None and b is None) or torch.equal(a, b), (rank, name)
