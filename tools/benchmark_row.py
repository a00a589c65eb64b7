"""The benchmark harness's own inputs and mok row for the diagnostic tools (run them as
`python -m tools.<name>` from the repository root: `benchmarks` is not installed)."""

from __future__ import annotations

import torch

from benchmarks.inputs import make_inputs
from benchmarks.mok_impls import MOK_IMPLS
from benchmarks.shapes import scale_for_run, select_shapes


def timed(fn):
    """(milliseconds, result) of `fn()` between two CUDA events on the current stream."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    result = fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), result


def benchmark_row(shape_name: str, row: str = "mok", tokens: int = 16384):
    """(shape, inputs, impl): the inputs of `shape_name` on one GPU as the harness makes them
    (seed 0, no shared expert) and its `row` (benchmarks.mok_impls.MOK_IMPLS)."""
    shape = scale_for_run(select_shapes(shape_name)[0], 1, False)
    inputs = make_inputs(shape, tokens, rank=0, world_size=1, device=torch.device("cuda"),
                         seed=0, shared=False)  # fmt: skip
    inputs.release_group_tensors()
    return shape, inputs, MOK_IMPLS[row](inputs, None)
