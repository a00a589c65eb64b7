"""What the CUDA-graph tests share: a step captured after eager warm-ups, replayed with new
routing, each output bitwise the eager step's (tests/bitwise.py)."""

from __future__ import annotations

import torch
from bitwise import assert_bitwise


def check_replays(step, ids, num_experts, seeds, after_warmup=None):
    """Capture step() (a tuple of tensors or Nones, or one tensor) on a side stream after an
    eager run on the current stream and one on the side stream (`after_warmup()` after each,
    e.g. F.check_errors); then for each seed: new top-k routing copied into `ids` [T, k] in
    place, the captured floating outputs filled with NaN, the graph replayed, and every output
    compared bit for bit with an eager step()."""
    step()
    if after_warmup is not None:
        after_warmup()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()
        if after_warmup is not None:
            after_warmup()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    captured = captured if isinstance(captured, tuple) else (captured,)
    tokens, topk = ids.shape
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        ids.copy_(torch.randn(tokens, num_experts, generator=gen).topk(topk, dim=-1).indices)
        for c in captured:
            if c is not None and c.is_floating_point():
                c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert_bitwise(captured, eager if isinstance(eager, tuple) else (eager,), seed)
