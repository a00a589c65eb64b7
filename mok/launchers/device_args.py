"""Kernel arguments besides tensors: cached TMA descriptors, the SM count, a zeroed ticket."""

from __future__ import annotations

from collections import OrderedDict

import torch

_DESCRIPTOR_CACHE_SIZE = 256
TILE_ROWS = 128  # rows per GEMM tile; schedule segments are multiples of it

_descriptors: OrderedDict[tuple, object] = OrderedDict()
_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        count = torch.cuda.get_device_properties(index).multi_processor_count
        _sm_counts[index] = count
    return count


def persistent_grid(device: torch.device, capacity: int, col_tiles: int) -> int:
    """One CTA per SM at most (~194 KiB of shared memory each), no more than `capacity`'s tiles."""
    return max(1, min(sm_count(device), (capacity // TILE_ROWS) * col_tiles))


def tma_descriptor(kernel, param: str, tensor: torch.Tensor):
    """The TMA descriptor of `tensor`, cached per (address, shape, strides): reused buffers encode once."""
    spec = kernel.variant.tma_spec(param)
    key = (
        kernel.device_index,
        None if spec is None else spec.layout_key(),
        tensor.data_ptr(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )
    descriptor = _descriptors.get(key)
    if descriptor is None:
        descriptor = kernel.make_tma_descriptor(param, tensor)
        # The bytes depend only on the key, so the cached copy must not pin the tensor.
        descriptor.tensor = None
        _descriptors[key] = descriptor
        if len(_descriptors) > _DESCRIPTOR_CACHE_SIZE:
            _descriptors.popitem(last=False)
    return descriptor


def clear_descriptor_cache() -> None:
    _descriptors.clear()


def new_ticket(device) -> torch.Tensor:
    """The zeroed int32 task ticket a GEMM launch hands out its tiles by."""
    return torch.zeros(1, dtype=torch.int32, device=device)
