"""Fakes shared by the CPU launcher tests.

`FakeKernel` stands for a shipped kernel: it records each launch and packs its arguments with
the runtime's `pack_args` for the real sm_90a manifest entry, so a name the kernel does not
take, or one it lacks, fails on CPU instead of on the GPU. `fake_push_router_grads` is the
router_grad_push kernel's math; `FakeErrorRecord` stands for the device error record and status
word whose addresses the megakernels take.
"""

from __future__ import annotations

import torch

import mok.runtime as runtime
from mok.runtime.launch import pack_args


class FakeKernel:
    device_index = 0

    def __init__(self, name: str):
        self.variant = runtime.load_manifest().variant(name, "sm_90a")
        self.launches = []

    def make_tma_descriptor(self, param, tensor):
        spec = self.variant.tma_spec(param)
        assert spec is not None, f"no TMA spec for {param}"
        return runtime.TmaDescriptor(spec, bytes(128))

    def launch(self, grid, args):
        addresses = {
            k: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for k, v in args.items()
        }
        pack_args(self.variant, addresses)
        self.launches.append((grid, args))

    def bind(self, grid, args, dynamic=()):
        """A launch plan's bound launch: each launch records the bound args with the dynamic
        values written over them (addresses as ints, descriptors as given)."""
        kernel = self

        class _Bound:
            def launch(self, *values, stream=None):
                kernel.launch(grid, {**args, **dict(zip(dynamic, values, strict=True))})

        pack_args(self.variant, {k: (v.data_ptr() if isinstance(v, torch.Tensor) else v)
                                 for k, v in args.items()})  # fmt: skip
        return _Bound()


class FakeErrorRecord:
    """Addresses of the device error record and status word, as a launcher packs them."""

    device_ptr = 0x1000
    status_ptr = 0x1040


def fake_kernels(monkeypatch) -> dict:
    """{name: FakeKernel} of every kernel a launcher asks the runtime for (the latest of each).
    The thread's launch plans are dropped first: a plan bound earlier holds another kernel and
    would launch it instead of asking for one."""
    from mok.launchers import plans  # noqa: PLC0415

    plans.clear_plans()
    made = {}

    def fake_get_kernel(name, device=None, **_):
        made[name] = FakeKernel(name)
        return made[name]

    monkeypatch.setattr(runtime, "get_kernel", fake_get_kernel)
    return made


def fake_push_router_grads(partials, schedule, router_weights, d_router, *, peers=None):
    """The router_grad_push kernel's math: each real row's block sum (increasing b) over w."""
    real = schedule.peer_rank >= 0
    slot = schedule.peer_token_idx[real].long()
    total = torch.zeros(partials.shape[0])
    for b in range(partials.shape[1]):
        total = total + partials[:, b]
    w = router_weights.reshape(-1)[slot]
    d_router.view(-1)[slot] = total[real] / w.clamp_min(torch.finfo(torch.float32).tiny)
    return d_router
