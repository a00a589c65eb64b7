"""What the bitwise GPU tests share: outputs compared bit for bit, and a step captured in a CUDA
graph after eager warm-ups, replayed with new routing, each output bitwise the eager step's."""

from __future__ import annotations

import torch


def bits(t):
    """The bytes of a tensor (None stays None): equal bits compare equal, NaN included."""
    return None if t is None else t.contiguous().view(torch.uint8)


def assert_bitwise(got, want, what):
    """Outputs (tensors or Nones) of two runs: the same count, shapes, dtypes and bits."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, (what, i)
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        assert torch.equal(bits(a), bits(b)), (what, i)


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
