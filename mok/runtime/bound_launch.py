"""A kernel launch whose constant arguments are checked and packed once (`Kernel.bind`).

A layer step launches the same kernels with mostly the same arguments every time: sizes,
weights' descriptors, workspace buffers, the error record. `BoundLaunch` packs them once, with
the full per-param checks of `ArgPacker`, and a launch then replaces only the `dynamic` params
(the fresh activations' addresses and descriptors):

    bound = kernel.bind(grid, args, dynamic=("x_ptr", "tma_x"))   # args: every param
    bound.launch(x.data_ptr(), descriptor_of_x)                   # in `dynamic` order

It keeps every param's packed value in a list (descriptors and raw bytes as bytes); a launch
puts the dynamic values in their places and writes the whole buffer with one precompiled
`struct.Struct` (a param at a time through ctypes cost about three times as much at the
backward megakernel's 24 dynamic params).

Dynamic values are written without checks: an int (a pointer's address, an int32/int64; ints
are written modulo 2^bits as `ArgPacker` does) or a TmaDescriptor for a `tma_desc` param, in the
order of `dynamic`. They come from the launcher that bound it, which checked the tensors they
are taken from. Not thread-safe: a bound launch belongs to one thread's plan (the launchers keep
plans per thread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .launch import normalize_grid, params_struct

_INT_MASKS = {"int32": (1 << 32) - 1, "int64": (1 << 64) - 1, "pointer": (1 << 64) - 1}
_DESCRIPTOR, _FLOAT = None, 0  # a dynamic param's conversion; an int kind's is its mask


class BoundLaunch:
    """See the module docstring. `kernel` is a `mok.runtime.Kernel`."""

    __slots__ = ("kernel", "grid", "dynamic", "_packed", "_struct", "_values", "_slots",
                 "_config", "_stream")  # fmt: skip

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
        self._packed = packed = packer.pack(args, kernel.device_index)  # every param, checked
        self._struct = params_struct(variant.params, packer._layout, opaque="s")
        # One value per param, in param order (pad bytes take none).
        self._values = list(self._struct.unpack_from(packed._storage, packed.storage_offset))
        slots = []
        for name in self.dynamic:
            if name not in packer.names:
                raise ValueError(
                    f"kernel {variant.name!r}: dynamic param {name!r} is not one of its params "
                    f"({', '.join(packer.names)})"
                )
            index = packer.names.index(name)
            kind = variant.params[index].kind
            if kind == "tma_desc":
                slots.append((index, _DESCRIPTOR))
            elif kind == "float32":
                slots.append((index, _FLOAT))
            elif kind in _INT_MASKS:
                slots.append((index, _INT_MASKS[kind]))
            else:
                raise ValueError(
                    f"kernel {variant.name!r}: param {name!r} of kind {kind!r} cannot be dynamic"
                )
        self._slots = tuple(slots)
        self._config = kernel._launch_config(self.grid, 0)
        self._stream = 0

    def launch(self, *values: Any, stream: int | None = None) -> None:
        """Put the dynamic values (in `dynamic` order) in place and launch on `stream` (a raw
        CUstream handle; default: torch's current stream of the kernel's device)."""
        current = self._values
        for (index, conversion), value in zip(self._slots, values, strict=True):
            if conversion is _DESCRIPTOR:
                current[index] = value.raw
            elif conversion:
                current[index] = value & conversion
            else:
                current[index] = value
        packed = self._packed
        self._struct.pack_into(packed._storage, packed.storage_offset, *current)
        kernel = self.kernel
        handle = kernel.current_stream_handle() if stream is None else stream
        config = self._config
        if handle != self._stream:
            config.hStream = kernel._cu.CUstream(handle)
            self._stream = handle
        kernel.launch_packed(config, packed, self.grid)
