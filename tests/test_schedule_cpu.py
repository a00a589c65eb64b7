"""Schedule properties over random and adversarial routings (the reference; the GPU kernel is
tested for exact equality with it in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from mok import reference as R
from mok.config import ROUTED_ROW_ALIGNMENT as ALIGN
from mok.testing import make_routing


def routing_all_ranks(num_ranks, num_tokens, num_experts, topk, routing, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([make_routing(num_tokens, num_experts, topk, routing, gen)
                        for _ in range(num_ranks)]).to(torch.int32)  # fmt: skip


def check_schedule(ids, ep_rank, num_local, capacity):
    s = R.build_schedule(ids, ep_rank=ep_rank, num_local_experts=num_local, capacity=capacity)
    num_ranks, num_tokens, topk = ids.shape
    total = int(s.num_tokens)
    assert s.peer_rank.shape == s.peer_token_idx.shape == (capacity,)
    assert (s.tokens_per_expert % ALIGN == 0).all()
    assert int(s.tokens_per_expert.sum()) == total
    # Rows past num_tokens are all -1.
    assert (s.peer_rank[total:] == -1).all() and (s.peer_token_idx[total:] == -1).all()
    start = 0
    flat = ids.reshape(num_ranks, -1)
    for e, n in enumerate(s.tokens_per_expert.tolist()):
        rank, slot = s.peer_rank[start : start + n], s.peer_token_idx[start : start + n]
        real = rank >= 0
        # Real rows first, then padding (-1 in both arrays), padding < one tile.
        count = int(real.sum())
        assert real[:count].all() and not real[count:].any()
        assert (slot[count:] == -1).all() and n - count < ALIGN
        # Exactly the (rank, slot) pairs routed to this expert, in (rank, slot) order.
        want = torch.nonzero(flat == ep_rank * num_local + e)
        got = torch.stack([rank[:count], slot[:count]], dim=1).long()
        assert torch.equal(got, want)
        start += n
    return s


@pytest.mark.parametrize(
    "num_ranks,num_tokens,num_experts,topk,routing",
    [
        (1, 256, 8, 2, "random"),
        (1, 300, 8, 1, "random"),  # k = 1, T not a multiple of anything
        (1, 64, 8, 8, "first_experts"),  # k = E
        (1, 256, 8, 2, "one_expert"),  # every token reaches expert 0
        (1, 256, 8, 2, "empty_experts"),
        (2, 128, 8, 2, "random"),
        (4, 64, 16, 4, "random"),
        (4, 64, 16, 2, "empty_experts"),  # ranks 2 and 3 receive no tokens at all
    ],
)
def test_schedule_properties(num_ranks, num_tokens, num_experts, topk, routing):
    ids = routing_all_ranks(num_ranks, num_tokens, num_experts, topk, routing, seed=num_tokens)
    num_local = num_experts // num_ranks
    capacity = num_ranks * num_tokens * topk + num_local * ALIGN
    totals = [int(check_schedule(ids, r, num_local, capacity).num_tokens) for r in range(num_ranks)]
    if routing == "empty_experts" and num_ranks == 4:
        assert totals[2] == totals[3] == 0


def test_schedule_is_deterministic():
    ids = routing_all_ranks(2, 512, 16, 4, "random", seed=1)
    a = R.build_schedule(ids, ep_rank=1, num_local_experts=8, capacity=8192)
    b = R.build_schedule(ids.clone(), ep_rank=1, num_local_experts=8, capacity=8192)
    for x, y in zip((a.peer_rank, a.peer_token_idx, a.num_tokens, a.tokens_per_expert),
                    (b.peer_rank, b.peer_token_idx, b.num_tokens, b.tokens_per_expert), strict=False):  # fmt: skip
        assert torch.equal(x, y)


def test_capacity_overflow_is_an_error():
    ids = routing_all_ranks(1, 256, 8, 2, "random", seed=0)
    with pytest.raises(
        ValueError, match=r"schedule capacity overflow on EP rank 0: \d+ routed rows"
    ):
        R.build_schedule(ids, ep_rank=0, num_local_experts=8, capacity=512)
