"""A kernel launch whose constant arguments are checked and packed once (`Kernel.bind`).

A layer step launches the same kernels with mostly the same arguments every time: sizes,
weights' descriptors, workspace buffers, the error record. `BoundLaunch` packs them once, with
the full per-param checks of `ArgPacker`, and a launch then writes only the `dynamic` params
(the fresh activations' addresses and descriptors) into the same buffer:

    bound = kernel.bind(grid, args, dynamic=("x_ptr", "tma_x"))   # args: every param
    bound.launch(x.data_ptr(), descriptor_of_x)                   # in `dynamic` order

Dynamic values are written without checks: an int (a pointer's address, an int32/int64) or a
TmaDescriptor for a `tma_desc` param, in the order of `dynamic`. They come from the launcher
that bound it, which checked the tensors they are taken from. Not thread-safe: a bound launch
belongs to one thread's plan (the launchers keep plans per thread).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

from .launch import normalize_grid
from .tma import TMA_DESCRIPTOR_BYTES

_SCALAR_TYPES = {
    "pointer": ctypes.c_uint64,
    "int32": ctypes.c_uint32,
    "int64": ctypes.c_uint64,
    "float32": ctypes.c_float,
}
_INT_MASKS = {"int32": (1 << 32) - 1, "int64": (1 << 64) - 1, "pointer": (1 << 64) - 1}


class BoundLaunch:
    """See the module docstring. `kernel` is a `mok.runtime.Kernel`."""

    __slots__ = ("kernel", "grid", "dynamic", "_packed", "_setters", "_config", "_stream")

    def __init__(
        self,
        kernel: Any,
        grid: int | Sequence[int],
        args: Mapping[str, Any],
        dynamic: Sequence[str] = (),
    ):
        variant = kernel.variant
        self.kernel = kernel
        self.grid = normalize_grid(grid, variant.cluster)
        self.dynamic = tuple(dynamic)
        packer = kernel._packer
        self._packed = packer.pack(args, kernel.device_index)  # every param, fully checked
        setters = []
        for name in self.dynamic:
            if name not in packer.names:
                raise ValueError(
                    f"kernel {variant.name!r}: dynamic param {name!r} is not one of its params "
                    f"({', '.join(packer.names)})"
                )
            index = packer.names.index(name)
            kind = variant.params[index].kind
            address = self._packed.param_address(index)
            if kind == "tma_desc":
                setters.append((None, address))
            elif kind in _SCALAR_TYPES:
                setters.append((_SCALAR_TYPES[kind].from_address(address), kind))
            else:
                raise ValueError(
                    f"kernel {variant.name!r}: param {name!r} of kind {kind!r} cannot be dynamic"
                )
        self._setters = tuple(setters)
        self._config = kernel._launch_config(self.grid, 0)
        self._stream = 0

    def launch(self, *values: Any, stream: int | None = None) -> None:
        """Write the dynamic values (in `dynamic` order) and launch on `stream` (a raw CUstream
        handle; default: torch's current stream of the kernel's device)."""
        kernel = self.kernel
        # (None, host address) for a descriptor, (ctypes scalar at the param, kind) otherwise.
        for (slot, where), value in zip(self._setters, values, strict=True):
            if slot is None:
                ctypes.memmove(where, value.address, TMA_DESCRIPTOR_BYTES)
            elif where == "float32":
                slot.value = value
            else:
                slot.value = value & _INT_MASKS[where]
        handle = kernel.current_stream_handle() if stream is None else stream
        config = self._config
        if handle != self._stream:
            config.hStream = kernel._cu.CUstream(handle)
            self._stream = handle
        kernel.launch_packed(config, self._packed, self.grid)
