"""Launch plans: what a launcher derives from a call's unchanging part, made once and reused.

A training step calls each launcher with the same weights, workspace, sizes and config every
time; only the activations are new. A launcher keys a plan on everything but the activations'
addresses (`tensor_key` of each tensor: shape, dtype, device, layout; `weight_key` adds the
address) and the current stream. The first call of a key runs the launcher's full argument
checks and binds its kernels (`Kernel.bind`: constant params checked and packed once); later
calls write only the new addresses and launch. So every call is checked: a tensor that differs
in anything but its address from the one the plan was checked with makes a new key, whose plan
runs the checks again (and raises).

Plans are per thread and per stream (a plan's scratch counters serve one stream's launches in
order) and bounded (the cache is cleared when full).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

from mok.runtime import _driver
from mok.runtime.module import current_stream_handle

from ..validation import tensor_key
from ..workspace import capturing, on_cuda_destroy
from .device_args import tma_descriptor

_PLANS_MAX = 64
_DESCRIPTORS_MAX = 32
_local = threading.local()


def weight_key(t: torch.Tensor | None) -> tuple | None:
    """What a plan checked about a tensor it keeps using: `tensor_key` and its address."""
    if isinstance(t, tuple):  # an MXFP8 pair (data, scales)
        return tuple(weight_key(part) for part in t)
    key = tensor_key(t)
    return (t.data_ptr(), *key) if isinstance(t, torch.Tensor) else key


def schedule_addresses(schedule) -> tuple[int, int, int, int]:
    """A MoKSchedule's four addresses, in its order (what the plans' `launch` methods take)."""
    return (schedule.peer_rank.data_ptr(), schedule.peer_token_idx.data_ptr(),
            schedule.num_tokens.data_ptr(), schedule.tokens_per_expert.data_ptr())  # fmt: skip


def current_stream(device_index: int) -> int:
    """torch's current CUstream on a CUDA device (0 for a CPU tensor's index -1: the launchers'
    CPU tests, whose fake kernels ignore it)."""
    return current_stream_handle(device_index) if device_index >= 0 else 0


def plan(key: tuple, make: Callable[[], object], current: Callable[[object], bool] | None = None):
    """This thread's plan for `key` (make() on a miss: it runs the full checks). `current`: a
    test a found plan must pass, else it is made anew in its place (a plan made for an object
    that is gone, e.g. an evicted workspace whose handle a new one took over)."""
    plans = plans_of_thread()
    found = plans.get(key)
    if found is None or (current is not None and not current(found)):
        found = make()
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = found
    return found


def plans_of_thread() -> dict:
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = {}
    return plans


@on_cuda_destroy
def clear_plans() -> None:
    """Drop this thread's plans (tests, `MoKWorkspace.destroy`). A plan holds no tensor of the
    caller's: only its own scratch and, for an EP group, its workspace's buffers and peer table."""
    _local.plans = {}


class Descriptors:
    """TMA descriptors of one kernel param for tensors of one shape, by address."""

    __slots__ = ("kernel", "param", "_by_address")

    def __init__(self, kernel, param: str):
        self.kernel, self.param = kernel, param
        self._by_address: dict[int, object] = {}

    def get(self, tensor: torch.Tensor):
        return self.at(tensor.data_ptr(), lambda: tensor)

    def at(self, address: int, tensor: Callable[[], torch.Tensor]):
        """The descriptor of the tensor at `address`; `tensor()` makes it (the plan's shape,
        contiguous) only when this address has none yet."""
        descriptor = self._by_address.get(address)
        if descriptor is None:
            descriptor = tma_descriptor(self.kernel, self.param, tensor())
            if len(self._by_address) >= _DESCRIPTORS_MAX:
                self._by_address.clear()
            self._by_address[address] = descriptor
        return descriptor


def new_tensors(layout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One new (uninitialised) tensor per (dtype, shape) of `layout`: a `Carve`'s pieces as
    separate allocations (for outputs that reach a custom op, which may not alias)."""
    return tuple(torch.empty(shape, dtype=dtype, device=device) for dtype, shape in layout)


class Carve:
    """Pieces of one allocation: contiguous (dtype, shape) each, every one 256-byte aligned.

    A launch plan's scratch, or a layer step's context, is many tensors that live and die
    together; one allocation of their layout costs one allocator call, and their kernels need
    only their addresses (`addresses`: the buffer's plus fixed offsets). Views are made only
    where a tensor is needed (`view`, `views`)."""

    __slots__ = ("pieces", "offsets", "nbytes", "device")

    def __init__(self, pieces, device: torch.device):
        self.pieces = tuple((dtype, tuple(shape)) for dtype, shape in pieces)
        self.device = device
        offsets, end = [], 0
        for dtype, shape in self.pieces:
            start = -(-end // 256) * 256
            offsets.append(start)
            end = start + math.prod(shape) * dtype.itemsize
        self.offsets, self.nbytes = tuple(offsets), end

    def new(self) -> torch.Tensor:
        """A new buffer of this layout (uint8, uninitialised)."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def addresses(self, buffer: torch.Tensor) -> tuple[int, ...]:
        return tuple(map(buffer.data_ptr().__add__, self.offsets))

    def view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        dtype, shape = self.pieces[index]
        start = self.offsets[index]
        size = math.prod(shape) * dtype.itemsize
        return buffer[start : start + size].view(dtype).view(shape)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(buffer, i) for i in range(len(self.pieces))]


def zero_async(tensor: torch.Tensor, stream: int) -> None:
    """Zero an int32 tensor on `stream` (cuMemsetD32Async: no allocation, capturable)."""
    if not tensor.is_cuda:
        tensor.zero_()
        return
    cu = _driver.driver()
    result = cu.cuMemsetD32Async(tensor.data_ptr(), 0, tensor.numel(), stream)
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        _driver.check(result, "cuMemsetD32Async (launch-plan counters)")


class Counters:
    """A megakernel plan's int32 counters, zero whenever a launch starts. The kernel leaves them
    zero itself (its grid's last CTA, mok/dsl_kernels/common/retire.py), so they are zeroed on the
    stream only before the plan's first eager launch and before every launch a CUDA graph
    captures (each replay zeroes them first: a graph made before any eager launch, or replayed
    after another stream's, starts from zero too)."""

    __slots__ = ("tensor", "_zeroed")

    def __init__(self, words: int, device: torch.device):
        self.tensor = torch.empty(words, dtype=torch.int32, device=device)
        self._zeroed = False

    def before_launch(self, stream: int) -> None:
        """Call right before each launch that uses them, on its stream."""
        captured = self.tensor.is_cuda and capturing()
        if self._zeroed and not captured:
            return
        zero_async(self.tensor, stream)
        self._zeroed = self._zeroed or not captured


def aligned(name: str, address: int, align: int = 16) -> None:
    """A dynamic address must keep the alignment the plan's first tensor was checked for."""
    if address % align:
        raise ValueError(f"{name} must be {align}-byte aligned, got address {address:#x}")


def all_aligned(names: tuple[str, ...], addresses: tuple[int, ...], align: int = 16) -> None:
    """`aligned` of each (name, address), the first misaligned one named."""
    if any(address % align for address in addresses):
        for name, address in zip(names, addresses, strict=True):
            aligned(name, address, align)
