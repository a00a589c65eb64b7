"""The dispatch launcher's argument dict against the shipped manifest, on CPU.

A fake kernel records the launch and packs its arguments with the runtime's `pack_args` for the
real sm_90a manifest entry: a name the kernel does not take, or one it lacks, fails here
instead of on the GPU.
"""

from __future__ import annotations

import mok.runtime as runtime
import pytest
import torch
from mok.runtime.launch import pack_args

from mok.launchers import dispatch


class _FakeKernel:
    def __init__(self, name: str):
        self.variant = runtime.load_manifest().variant(name, "sm_90a")
        self.launches = []

    def launch(self, grid, args):
        addresses = {
            k: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for k, v in args.items()
        }
        pack_args(self.variant, addresses)
        self.launches.append((grid, args))


@pytest.mark.parametrize("scaled", [False, True])
def test_gather_rows_launch_packs(monkeypatch, scaled):
    kernels = {}

    def fake_get_kernel(name, device=None, **_):
        kernels[name] = _FakeKernel(name)
        return kernels[name]

    monkeypatch.setattr(runtime, "get_kernel", fake_get_kernel)
    t, h, k, capacity = 300, 256, 2, 1024
    src = torch.zeros(t, h, dtype=torch.bfloat16)
    peer = torch.zeros(capacity, dtype=torch.int32)
    slot = torch.zeros(capacity, dtype=torch.int32)
    weights = torch.ones(t, k) if scaled else None
    dispatch.gather_rows(src, peer, slot, torch.tensor([600], dtype=torch.int32), k,
                         weights=weights)  # fmt: skip
    ((name, kernel),) = kernels.items()
    assert name == ("gather_rows_scaled" if scaled else "gather_rows")
    ((grid, args),) = kernel.launches
    assert grid == (1, capacity // 4, 1) and args["num_rows"] == capacity
