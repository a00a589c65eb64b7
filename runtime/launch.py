"""Host-side launch plumbing that needs no GPU: argument packing, grid and layout checks.

Kernel parameters go to cuLaunchKernelEx as `kernelParams`, a `void*[]` with one pointer per
PTX param, each pointing at that param's bytes in host memory kept alive for the call. The
hand-packed `extra` buffer is never used: the device-side param layout (param 0 of a kernel
with a TMA descriptor sits at offset 48 on sm_90) is known only to the cubin.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import MoKParamMismatchError
from .manifest import ParamSpec, TmaSpec, VariantSpec
from .tma import TMA_DESCRIPTOR_BYTES, TmaDescriptor

_INT_RANGES = {"int32": (-(1 << 31), 1 << 32), "int64": (-(1 << 63), 1 << 64)}
_INT_CTYPES = {"int32": ctypes.c_uint32, "int64": ctypes.c_uint64}
# Grid limits of the hardware (x up to 2^31 - 1, y and z up to 65535).
_GRID_LIMITS = ((1 << 31) - 1, 65535, 65535)


class PackedArgs:
    """Param bytes and the `void*[]` that points at them; pass `address` as kernelParams.

    One host buffer holds every param at its manifest alignment (absolute host address), so
    the driver copies each from an aligned location. Keep this object alive until the launch
    call returns (the driver copies the values during the call, so not longer than that).
    """

    __slots__ = ("_storage", "_pointers", "offsets", "base", "address", "sizes")

    def __init__(self, params: Sequence[ParamSpec]):
        self.offsets = []
        self.sizes = []
        offset = 0
        max_align = 1
        for param in params:
            offset = (offset + param.align - 1) // param.align * param.align
            self.offsets.append(offset)
            self.sizes.append(param.size)
            offset += param.size
            max_align = max(max_align, param.align)
        self._storage = (ctypes.c_ubyte * (offset + max_align))()
        start = ctypes.addressof(self._storage)
        self.base = (start + max_align - 1) // max_align * max_align
        self._pointers = (ctypes.c_void_p * max(1, len(params)))(
            *[self.base + o for o in self.offsets]
        )
        self.address = ctypes.addressof(self._pointers)

    def param_address(self, index: int) -> int:
        return self.base + self.offsets[index]

    def param_bytes(self, index: int) -> bytes:
        return ctypes.string_at(self.param_address(index), self.sizes[index])


def _type_name(value: Any) -> str:
    return type(value).__name__


def pack_args(
    variant: VariantSpec,
    args: Mapping[str, Any],
    *,
    device_index: int | None = None,
) -> PackedArgs:
    """Validate an args dict (param name -> value) against a variant and pack it.

    Values by kind: pointer: a CUDA torch.Tensor (its data_ptr; on `device_index` when
    given), an int address, or None (null); int32/int64: an int (two's complement, unsigned
    values up to 2^32/2^64 accepted for magic numbers); float32: a float or int; tma_desc: a
    TmaDescriptor built for the same spec; bytes: a bytes-like object of the param's size.
    Raises ValueError (missing/unknown name, value out of range) or TypeError (wrong kind),
    naming the kernel and argument.
    """
    if not isinstance(args, Mapping):
        raise TypeError(f"kernel {variant.name!r}: args must be a dict, got {_type_name(args)}")
    expected = [p.name for p in variant.params]
    missing = [name for name in expected if name not in args]
    unknown = [name for name in args if name not in expected]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(map(repr, unknown))}")
        raise ValueError(
            f"kernel {variant.name!r} ({variant.arch}): bad argument names: {'; '.join(parts)} "
            f"(expected exactly: {', '.join(expected)})"
        )
    packed = PackedArgs(variant.params)
    for index, param in enumerate(variant.params):
        _pack_one(variant, param, args[param.name], packed.param_address(index), device_index)
    return packed


def _pack_one(
    variant: VariantSpec, param: ParamSpec, value: Any, address: int, device_index: int | None
) -> None:
    where = f"kernel {variant.name!r} argument {param.name!r} ({param.kind})"
    kind = param.kind
    if kind == "pointer":
        if value is None:
            pointer = 0
        elif isinstance(value, torch.Tensor):
            if not value.is_cuda:
                raise ValueError(f"{where} must be a CUDA tensor, got one on {value.device}")
            if device_index is not None and value.get_device() != device_index:
                raise ValueError(
                    f"{where} must be on cuda:{device_index}, got one on {value.device}"
                )
            pointer = value.data_ptr()
        elif isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < 1 << 64:
                raise ValueError(f"{where}: address must be in 0..2^64-1, got {value}")
            pointer = value
        else:
            raise TypeError(
                f"{where} takes a CUDA tensor, an int address or None, got {_type_name(value)}"
            )
        ctypes.c_uint64.from_address(address).value = pointer
    elif kind in _INT_RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} takes an int, got {_type_name(value)}")
        low, high = _INT_RANGES[kind]
        if not low <= value < high:
            raise ValueError(f"{where}: {value} does not fit in {kind} (range {low}..{high - 1})")
        _INT_CTYPES[kind].from_address(address).value = value  # wraps modulo 2^bits
    elif kind == "float32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} takes a float, got {_type_name(value)}")
        try:
            struct.pack_into("<f", (ctypes.c_ubyte * 4).from_address(address), 0, value)
        except OverflowError:
            raise ValueError(f"{where}: {value} overflows float32") from None
    elif kind == "tma_desc":
        if not isinstance(value, TmaDescriptor):
            raise TypeError(
                f"{where} takes a TmaDescriptor (mok.runtime.make_tma_descriptor), "
                f"got {_type_name(value)}"
            )
        _check_tma_spec(variant, param, value, where)
        ctypes.memmove(address, value.address, TMA_DESCRIPTOR_BYTES)
    elif kind == "bytes":
        try:
            raw = memoryview(value).cast("B")
        except TypeError:
            raise TypeError(
                f"{where} takes a bytes-like object of {param.size} bytes, got {_type_name(value)}"
            ) from None
        if raw.nbytes != param.size:
            raise ValueError(f"{where} takes {param.size} bytes, got {raw.nbytes}")
        ctypes.memmove(address, bytes(raw), param.size)
    else:  # the manifest parser rejects other kinds
        raise TypeError(f"{where}: unknown param kind {kind!r}")


def _check_tma_spec(
    variant: VariantSpec, param: ParamSpec, descriptor: TmaDescriptor, where: str
) -> None:
    expected: TmaSpec | None = variant.tma_spec(param.name)
    if expected is None or descriptor.spec is None:
        return
    if descriptor.spec.layout_key() != expected.layout_key():
        raise ValueError(
            f"{where}: descriptor was built for {descriptor.spec}, the kernel needs {expected}"
        )


def normalize_grid(grid: int | Sequence[int], cluster: Sequence[int]) -> tuple[int, int, int]:
    """A grid as 3 ints, checked against hardware limits and divisibility by the cluster."""
    if isinstance(grid, int) and not isinstance(grid, bool):
        dims = [grid, 1, 1]
    elif isinstance(grid, (tuple, list)) and 1 <= len(grid) <= 3:
        dims = [*grid, *([1] * (3 - len(grid)))]
    else:
        raise TypeError(f"grid must be an int or 1 to 3 ints, got {grid!r}")
    for axis, (size, limit, cluster_size) in enumerate(
        zip(dims, _GRID_LIMITS, cluster, strict=True)
    ):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"grid must hold ints, got {grid!r}")
        if not 1 <= size <= limit:
            raise ValueError(f"grid dim {'xyz'[axis]} must be in 1..{limit}, got {size}")
        if size % cluster_size:
            raise ValueError(
                f"grid {dims} is not a multiple of the cluster {list(cluster)} in {'xyz'[axis]}"
            )
    return (dims[0], dims[1], dims[2])


def check_param_layout(variant: VariantSpec, actual: Sequence[tuple[int, int]]) -> None:
    """Compare the driver's (offset, size) per param (cuFuncGetParamInfo) with the manifest.

    `actual` lists every param the cubin's function has (the caller probes past the end).
    Checks: same count; same size per param; offsets increasing without overlap, with a
    padding gap before each param smaller than its alignment (the device layout may start
    param 0 past offset 0 to align a descriptor, so offsets are not compared to a C layout);
    exact offsets where the manifest records them. Raises MoKParamMismatchError naming the
    variant, param index, expected and actual.
    """
    where = f"kernel {variant.name!r} ({variant.arch}, symbol {variant.symbol!r})"
    if len(actual) != len(variant.params):
        raise MoKParamMismatchError(
            f"{where}: the cubin function takes {len(actual)} params, the manifest lists "
            f"{len(variant.params)}; refusing to launch (rebuild the cubins and manifest)"
        )
    previous_end = None
    for index, (param, (offset, size)) in enumerate(zip(variant.params, actual, strict=True)):
        label = f"{where}: param {index} ({param.name!r}, {param.kind})"
        if size != param.size:
            raise MoKParamMismatchError(
                f"{label}: expected size {param.size} bytes, cubin has {size}; refusing to launch"
            )
        if param.offset is not None and offset != param.offset:
            raise MoKParamMismatchError(
                f"{label}: expected offset {param.offset}, cubin has {offset}; refusing to launch"
            )
        if previous_end is not None and not previous_end <= offset < previous_end + param.align:
            raise MoKParamMismatchError(
                f"{label}: expected offset in {previous_end}..{previous_end + param.align - 1} "
                f"(after the previous param, align {param.align}), cubin has {offset}; "
                f"refusing to launch"
            )
        previous_end = offset + size
