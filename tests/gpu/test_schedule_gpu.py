"""GPU schedule (mok/launchers/schedule_kernels.py) == mok.reference.build_schedule, bit for bit.

Run: pytest -m gpu tests/gpu/test_schedule_gpu.py -s (needs the schedule cubins in the manifest).
"""

import pytest
import torch

from mok import reference
from mok.config import ROUTED_ROW_ALIGNMENT
from mok.launchers import schedule_kernels as launcher

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POISON = 12345
GUARD = 4096  # poisoned elements on each side of every output in the overflow test


def make_routing(kind: str, ranks: int, tokens: int, topk: int, experts: int, seed: int = 0):
    """[P, T, k] int32 global expert ids, distinct per token; built on the CPU (same as the
    CPU test's generator) so that several ranks' routings are simulated on one GPU."""
    generator = torch.Generator().manual_seed(seed)
    total_experts = experts * ranks
    scores = torch.rand(ranks, tokens, total_experts, generator=generator)
    if kind == "one_expert":
        scores[..., 0] = 2.0
    elif kind == "empty_experts":
        keep = torch.arange(total_experts) % 3 == 0
        if int(keep.sum()) >= topk:
            scores[..., ~keep] -= 2.0
    elif kind == "rank_starved":
        if total_experts - experts >= topk:
            scores[..., :experts] -= 2.0
    elif kind == "skewed":
        scores = scores * torch.arange(1, total_experts + 1).float().pow(-1.5)
    return scores.topk(topk, dim=-1).indices.to(torch.int32).contiguous()


def _capacity(ids, experts, factor=1.0):
    ranks, tokens, topk = ids.shape
    rows = int(ranks * tokens * topk * factor) + experts * (ROUTED_ROW_ALIGNMENT - 1)
    return -(-rows // ROUTED_ROW_ALIGNMENT) * ROUTED_ROW_ALIGNMENT


def _poisoned_outputs(capacity, experts, guard=0):
    """Outputs as views into poisoned buffers with `guard` poisoned elements on both sides."""
    buffers, views = [], []
    for size in (capacity, capacity, 1, experts, launcher.STATUS_WORDS):
        buffer = torch.full((size + 2 * guard,), POISON, dtype=torch.int32, device="cuda")
        buffers.append(buffer)
        views.append(buffer[guard : guard + size])
    return buffers, views


def _run(ids_gpu, ep_rank, experts, capacity):
    _, outs = _poisoned_outputs(capacity, experts)
    launcher.launch_schedule(ids_gpu, *outs, ep_rank=ep_rank, num_local_experts=experts)
    return outs


def _assert_equal_reference(ids, ep_rank, experts, capacity, outs):
    expected = reference.build_schedule(
        ids, ep_rank=ep_rank, num_local_experts=experts, capacity=capacity
    )
    names = ("peer_rank", "peer_token_idx", "num_tokens", "tokens_per_expert")
    wants = (expected.peer_rank, expected.peer_token_idx, expected.num_tokens,
             expected.tokens_per_expert)  # fmt: skip
    for name, want, have in zip(names, wants, outs[:4], strict=True):
        assert torch.equal(want, have.cpu()), name
    # The status words are written only on overflow: poisoned (launch_schedule) or zeroed
    # (build_schedule_gpu) words stay as they were.
    untouched = ([POISON] * launcher.STATUS_WORDS, [0] * launcher.STATUS_WORDS)
    assert outs[4].tolist() in untouched


CASES = [
    # (kind, P, T, k, E)
    ("random", 1, 100, 2, 8),
    ("random", 2, 777, 4, 16),
    ("random", 4, 300, 8, 32),
    ("one_expert", 2, 4500, 2, 8),
    ("empty_experts", 2, 513, 3, 16),
    ("rank_starved", 4, 200, 4, 8),
    ("skewed", 4, 1000, 6, 64),
    ("random", 2, 64, 1, 4),  # k = 1
    ("random", 2, 50, 8, 4),  # k = E * P
    ("random", 1, 3, 5, 5),  # k = E
    ("random", 1, 0, 4, 8),  # no tokens
    ("random", 1, 2000, 8, 1000),
    ("random", 1, 16384, 8, 128),  # EP = 1, Qwen3-30B-A3B-like
    ("random", 8, 16384, 8, 128),  # the performance case: ~1M entries
    ("random", 1, 16384, 8, 512),  # E = 512 (Qwen3.5-397B)
    ("skewed", 8, 4096, 10, 64),
]


@pytest.mark.parametrize("kind, ranks, tokens, topk, experts", CASES)
def test_schedule_equals_reference(kind, ranks, tokens, topk, experts):
    ids = make_routing(kind, ranks, tokens, topk, experts, seed=tokens + topk)
    ids_gpu = ids.cuda()
    for ep_rank in sorted({0, ranks // 2, ranks - 1}):
        capacity = _capacity(ids, experts)
        outs = _run(ids_gpu, ep_rank, experts, capacity)
        _assert_equal_reference(ids, ep_rank, experts, capacity, outs)


def test_schedule_deterministic_and_allocating_api():
    ids = make_routing("skewed", 8, 8192, 8, 64, seed=7)
    ids_gpu = ids.cuda()
    capacity = _capacity(ids, 64)
    runs = [
        launcher.build_schedule_gpu(ids_gpu, ep_rank=2, num_local_experts=64, capacity=capacity)
        for _ in range(3)
    ]
    for run in runs[1:]:
        for first, again in zip(runs[0], run, strict=True):
            assert torch.equal(first, again)
    _assert_equal_reference(ids, 2, 64, capacity, runs[0])


@pytest.mark.parametrize("capacity", [0, 128, 4096])
def test_overflow_raises_and_writes_nothing_out_of_bounds(capacity):
    ids = make_routing("one_expert", 2, 4500, 2, 8)
    with pytest.raises(ValueError) as expected:
        reference.build_schedule(ids, ep_rank=0, num_local_experts=8, capacity=capacity)
    buffers, outs = _poisoned_outputs(capacity, 8, guard=GUARD)
    launcher.launch_schedule(ids.cuda(), *outs, ep_rank=0, num_local_experts=8)
    with pytest.raises(ValueError) as raised:
        launcher.check_schedule(outs[4])
    assert str(raised.value) == str(expected.value)
    for buffer in buffers:  # the guards on both sides are untouched
        assert bool((buffer[:GUARD] == POISON).all()) and bool((buffer[-GUARD:] == POISON).all())
    # Documented overflow state: no row placed, every row -1, no row to run, the true padded
    # total in the status.
    assert bool((outs[0] == -1).all()) and bool((outs[1] == -1).all())
    assert int(outs[2]) == 0 and int(outs[3].sum()) == 0
    total = int(outs[4][1])
    assert total > capacity and outs[4].tolist() == [1, total, 0, capacity]


@pytest.mark.parametrize("tokens, topk, experts", [(100, 2, 8), (4500, 2, 8), (3, 5, 5),
                                                   (0, 4, 8), (16384, 8, 128)])  # fmt: skip
def test_group_of_one_reads_its_int64_ids_in_place(tokens, topk, experts):
    """The ids64 variants (a group of one, no all-gather): the caller's int64 [T, k] routing
    gives the reference's schedule of its int32 narrowing; a bad id (checked on the int64
    value) lands in the value-status words and keys as its low 32 bits, as the all-gather's
    copy would."""
    from mok.launchers import status  # noqa: PLC0415

    ids = make_routing("random", 1, tokens, topk, experts, seed=tokens + 1)[0].long()
    words = status.status_ptr(torch.device("cuda"))
    for bad in (False, True):
        wide = ids.clone()
        if bad and tokens >= 2:
            wide[0, 0] = (1 << 32) + 1  # low word 1: routed to expert 1, flagged
            wide[1, 0] = -1  # low word -1: not routed, flagged
        narrowed = (wide & 0xFFFFFFFF).to(torch.int32)  # two's complement low words
        capacity = _capacity(narrowed[None], experts)
        _, outs = _poisoned_outputs(capacity, experts)
        launcher.launch_schedule(wide.cuda(), *outs[:4], words, ep_rank=0,
                                 num_local_experts=experts)  # fmt: skip
        torch.cuda.synchronize()
        outs[4].fill_(POISON)  # not written: the words are the device's
        _assert_equal_reference(narrowed[None], 0, experts, capacity, outs)
        if bad and tokens >= 2:
            with pytest.raises(ValueError, match=rf"expert ids in \[0, {experts}\)"):
                status.raise_value_errors(torch.device("cuda"))
        status.raise_value_errors(torch.device("cuda"))  # clear after a bad call, else nothing


def test_cuda_graph_replay_equals_eager():
    ids = make_routing("random", 4, 4096, 8, 32, seed=3)
    ids_gpu = ids.cuda()
    capacity = _capacity(ids, 32)
    eager = launcher.build_schedule_gpu(ids_gpu, ep_rank=1, num_local_experts=32, capacity=capacity)
    static_ids = ids_gpu.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (loads the cubins)
        launcher.build_schedule_gpu(static_ids, ep_rank=1, num_local_experts=32, capacity=capacity)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = launcher.build_schedule_gpu(
            static_ids, ep_rank=1, num_local_experts=32, capacity=capacity
        )
    for out in graphed:
        out.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a, b)
    # New routing in the same input buffer: the replay follows it.
    other = make_routing("skewed", 4, 4096, 8, 32, seed=4)
    static_ids.copy_(other.cuda())
    graph.replay()
    torch.cuda.synchronize()
    _assert_equal_reference(other, 1, 32, capacity, graphed)


def test_timing_big_case():
    """Prints the time of the ~1M-entry case (not asserted; target: well under 100 us)."""
    for ranks, tokens, topk, experts in [(8, 16384, 8, 128), (1, 16384, 8, 512)]:
        ids_gpu = make_routing("random", ranks, tokens, topk, experts, seed=11).cuda()
        capacity = _capacity(ids_gpu, experts)
        outs = launcher.build_schedule_gpu(
            ids_gpu, ep_rank=0, num_local_experts=experts, capacity=capacity
        )
        for _ in range(10):
            launcher.launch_schedule(ids_gpu, *outs, ep_rank=0, num_local_experts=experts)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 100
        start.record()
        for _ in range(iters):
            launcher.launch_schedule(ids_gpu, *outs, ep_rank=0, num_local_experts=experts)
        end.record()
        torch.cuda.synchronize()
        print(
            f"\nschedule P={ranks} T={tokens} k={topk} E={experts}: "
            f"{start.elapsed_time(end) / iters * 1000:.1f} us per build (3 kernels, eager)"
        )
