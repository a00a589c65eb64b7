"""Host-side launch plumbing that needs no GPU: argument packing, grid and layout checks.

Kernel parameters go to cuLaunchKernelEx as `kernelParams`, a `void*[]` with one pointer per
PTX param, each pointing at that param's bytes in host memory kept alive for the call. The
hand-packed `extra` buffer is never used: the device-side param layout (param 0 of a kernel
with a TMA descriptor sits at offset 48 on sm_90) is known only to the cubin.

Packing runs on every launch, so the work that depends only on the variant is done once, in
an `ArgPacker` (the packing plan): host offsets, one precompiled `struct.Struct` that writes
every scalar param in a single call, the `void*[]` of a buffer, the TMA spec of each
descriptor param. A launch then checks each value with exact-type tests and writes the
values; anything unusual (a subclass, a wrong type, a value out of range) takes the full
per-param check, which accepts exactly what it always did and raises the same errors.
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
# Ints are written unsigned: two's complement of a negative value, modulo 2^bits.
_INT_MASKS = {"int32": (1 << 32) - 1, "int64": (1 << 64) - 1}
# Grid limits of the hardware (x up to 2^31 - 1, y and z up to 65535).
_GRID_LIMITS = ((1 << 31) - 1, 65535, 65535)
_GRID_X_LIMIT, _GRID_YZ_LIMIT = _GRID_LIMITS[0], _GRID_LIMITS[1]

# Param kinds as small ints for the per-launch loop; struct codes of the scalar kinds
# (little-endian standard sizes, no implicit alignment: the plan adds padding explicitly).
_POINTER, _INT32, _INT64, _FLOAT32, _TMA_DESC, _BYTES = range(6)
_KIND_IDS = {
    "pointer": _POINTER,
    "int32": _INT32,
    "int64": _INT64,
    "float32": _FLOAT32,
    "tma_desc": _TMA_DESC,
    "bytes": _BYTES,
}
_STRUCT_CODES = {_POINTER: "Q", _INT32: "I", _INT64: "Q", _FLOAT32: "f"}
_INT32_LOW, _INT32_END, _INT32_MASK = -(1 << 31), 1 << 32, (1 << 32) - 1
_INT64_LOW, _INT64_END, _INT64_MASK = -(1 << 63), 1 << 64, (1 << 64) - 1
_MISSING = object()


def _param_layout(params: Sequence[ParamSpec]) -> tuple[list[int], list[int], int, int]:
    """(host offset of each param, its size, end of the last one, largest alignment)."""
    offsets, sizes = [], []
    offset = 0
    max_align = 1
    for param in params:
        offset = (offset + param.align - 1) // param.align * param.align
        offsets.append(offset)
        sizes.append(param.size)
        offset += param.size
        max_align = max(max_align, param.align)
    return offsets, sizes, offset, max_align


class PackedArgs:
    """Param bytes and the `void*[]` that points at them; pass `address` as kernelParams.

    One host buffer holds every param at its manifest alignment (absolute host address), so
    the driver copies each from an aligned location. Keep this object alive until the launch
    call returns (the driver copies the values during the call, so not longer than that). A
    buffer can be packed again for the next launch: `Kernel` keeps one per thread.
    """

    __slots__ = ("_storage", "_pointers", "offsets", "base", "address", "sizes", "storage_offset")

    def __init__(self, params: Sequence[ParamSpec], *, _layout: tuple | None = None):
        offsets, sizes, end, max_align = _layout if _layout is not None else _param_layout(params)
        self.offsets = list(offsets)
        self.sizes = list(sizes)
        self._storage = (ctypes.c_ubyte * (end + max_align))()
        start = ctypes.addressof(self._storage)
        self.base = (start + max_align - 1) // max_align * max_align
        self.storage_offset = self.base - start  # where param bytes start, for pack_into
        self._pointers = (ctypes.c_void_p * max(1, len(offsets)))(*[self.base + o for o in offsets])
        self.address = ctypes.addressof(self._pointers)

    def param_address(self, index: int) -> int:
        return self.base + self.offsets[index]

    def param_bytes(self, index: int) -> bytes:
        return ctypes.string_at(self.param_address(index), self.sizes[index])


def params_struct(params: Sequence[ParamSpec], layout: tuple, opaque: str) -> struct.Struct:
    """One struct over every param at its host offset (`layout` from `_param_layout`): scalars
    by kind, descriptors and raw bytes as `{size}{opaque}` ('x': pad bytes, written zero; 's':
    byte strings), padding between params as pad bytes."""
    offsets, sizes = layout[0], layout[1]
    formats, position = ["<"], 0
    for param, offset, size in zip(params, offsets, sizes, strict=True):
        if offset > position:
            formats.append(f"{offset - position}x")
        formats.append(_STRUCT_CODES.get(_KIND_IDS[param.kind], f"{size}{opaque}"))
        position = offset + size
    return struct.Struct("".join(formats))


def _type_name(value: Any) -> str:
    return type(value).__name__


class ArgPacker:
    """The packing plan of one variant: validates an args dict and writes it into a buffer.

    Build once per variant (`Kernel` holds one; `pack_args` keeps a small cache). Holds no
    per-launch state, so one packer serves every thread; each thread packs into its own
    `PackedArgs` (`new_args`).
    """

    __slots__ = ("variant", "names", "_layout", "_plan", "_struct")

    def __init__(self, variant: VariantSpec):
        self.variant = variant
        self.names = tuple(p.name for p in variant.params)
        self._layout = _param_layout(variant.params)
        offsets = self._layout[0]
        plan = []
        for param, offset in zip(variant.params, offsets, strict=True):
            kind = _KIND_IDS[param.kind]  # the manifest parser rejects other kinds
            spec = variant.tma_spec(param.name) if kind == _TMA_DESC else None
            layout_key = spec.layout_key() if spec is not None else None
            plan.append((param.name, kind, offset, param, spec, layout_key))
        self._plan = tuple(plan)
        # Descriptors and raw bytes are copied in after the struct write (which zeroes their
        # span): they are not Python scalars.
        self._struct = params_struct(variant.params, self._layout, opaque="x")

    def new_args(self) -> PackedArgs:
        """A buffer laid out for this variant, to pass to `pack_into`."""
        return PackedArgs(self.variant.params, _layout=self._layout)

    def pack(self, args: Mapping[str, Any], device_index: int | None = None) -> PackedArgs:
        """Validate `args` and pack them into a new buffer (see `pack_args`)."""
        return self.pack_into(self.new_args(), args, device_index)

    def pack_into(
        self, packed: PackedArgs, args: Mapping[str, Any], device_index: int | None = None
    ) -> PackedArgs:
        """Validate `args` and write them into `packed` (from `new_args`); return `packed`.

        Every param's bytes are rewritten on each call, so a buffer is reused across launches.
        """
        if args.__class__ is not dict and not isinstance(args, Mapping):
            raise TypeError(
                f"kernel {self.variant.name!r}: args must be a dict, got {_type_name(args)}"
            )
        if len(args) != len(self._plan):
            self._raise_bad_names(args)  # same count + every name found = no unknown name
        values = []
        copies = []
        for name, kind, offset, param, spec, layout_key in self._plan:
            value = args.get(name, _MISSING)
            cls = value.__class__
            # Fast paths: exact types only; everything else falls through to _convert.
            if kind == _POINTER:
                if cls is torch.Tensor:
                    if value.is_cuda and (
                        device_index is None or value.get_device() == device_index
                    ):
                        values.append(value.data_ptr())
                        continue
                elif value is None:
                    values.append(0)
                    continue
                elif cls is int and 0 <= value < _INT64_END:
                    values.append(value)
                    continue
            elif kind == _INT32:
                if cls is int and _INT32_LOW <= value < _INT32_END:
                    values.append(value & _INT32_MASK)
                    continue
            elif kind == _INT64:
                if cls is int and _INT64_LOW <= value < _INT64_END:
                    values.append(value & _INT64_MASK)
                    continue
            elif kind == _FLOAT32:
                if cls is float or cls is int:
                    values.append(value)  # overflow is caught by the struct write below
                    continue
            elif kind == _TMA_DESC:
                if cls is TmaDescriptor and (
                    value.spec is spec
                    or value.spec is None
                    or spec is None
                    or value.spec.layout_key() == layout_key
                ):
                    copies.append((offset, value.address, TMA_DESCRIPTOR_BYTES))
                    continue
            if value is _MISSING:
                self._raise_bad_names(args)
            converted = _convert(self.variant, param, value, device_index)
            if kind == _TMA_DESC or kind == _BYTES:
                copies.append((offset, converted, param.size))
            else:
                values.append(converted)
        try:
            self._struct.pack_into(packed._storage, packed.storage_offset, *values)
        except (OverflowError, struct.error):
            # Only a float32 beyond float32's range gets here: redo the full checks for the
            # message naming the argument.
            for name, _, _, param, _, _ in self._plan:
                _convert(self.variant, param, args[name], device_index)
            raise
        base = packed.base
        for offset, source, size in copies:
            ctypes.memmove(base + offset, source, size)
        return packed

    def _raise_bad_names(self, args: Mapping[str, Any]) -> None:
        expected = self.names
        missing = [name for name in expected if name not in args]
        unknown = [name for name in args if name not in expected]
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unknown:
            parts.append(f"unknown {', '.join(map(repr, unknown))}")
        raise ValueError(
            f"kernel {self.variant.name!r} ({self.variant.arch}): bad argument names: "
            f"{'; '.join(parts)} (expected exactly: {', '.join(expected)})"
        )


# Plans for `pack_args`, keyed by id(variant) and checked by identity (hashing a frozen
# VariantSpec costs more than packing it). Bounded: cleared when full.
_PACKERS: dict[int, ArgPacker] = {}
_PACKERS_MAX = 256


def arg_packer(variant: VariantSpec) -> ArgPacker:
    """The (cached) packing plan of `variant`."""
    packer = _PACKERS.get(id(variant))
    if packer is None or packer.variant is not variant:
        packer = ArgPacker(variant)
        if len(_PACKERS) >= _PACKERS_MAX:
            _PACKERS.clear()
        _PACKERS[id(variant)] = packer
    return packer


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
    naming the kernel and argument. Returns a new buffer.
    """
    return arg_packer(variant).pack(args, device_index)


def _convert(
    variant: VariantSpec, param: ParamSpec, value: Any, device_index: int | None
) -> int | float | bytes:
    """The full check of one value: what to write (tma_desc/bytes: the source of the copy).

    The reference semantics of packing; the fast paths of `ArgPacker.pack_into` accept a
    subset of what this accepts, and write the same bytes.
    """
    where = f"kernel {variant.name!r} argument {param.name!r} ({param.kind})"
    kind = param.kind
    if kind == "pointer":
        if value is None:
            return 0
        if isinstance(value, torch.Tensor):
            if not value.is_cuda:
                raise ValueError(f"{where} must be a CUDA tensor, got one on {value.device}")
            if device_index is not None and value.get_device() != device_index:
                raise ValueError(
                    f"{where} must be on cuda:{device_index}, got one on {value.device}"
                )
            return value.data_ptr()
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < 1 << 64:
                raise ValueError(f"{where}: address must be in 0..2^64-1, got {value}")
            return int(value)
        raise TypeError(
            f"{where} takes a CUDA tensor, an int address or None, got {_type_name(value)}"
        )
    if kind in _INT_RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} takes an int, got {_type_name(value)}")
        low, high = _INT_RANGES[kind]
        if not low <= value < high:
            raise ValueError(f"{where}: {value} does not fit in {kind} (range {low}..{high - 1})")
        return int(value) & _INT_MASKS[kind]  # two's complement, modulo 2^bits
    if kind == "float32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} takes a float, got {_type_name(value)}")
        try:
            struct.pack("<f", value)
        except (OverflowError, struct.error):  # struct.error: an int beyond any float
            raise ValueError(f"{where}: {value} overflows float32") from None
        return float(value)
    if kind == "tma_desc":
        if not isinstance(value, TmaDescriptor):
            raise TypeError(
                f"{where} takes a TmaDescriptor (mok.runtime.make_tma_descriptor), "
                f"got {_type_name(value)}"
            )
        _check_tma_spec(variant, param, value, where)
        return value.to_bytes()
    if kind == "bytes":
        try:
            raw = memoryview(value).cast("B")
        except TypeError:
            raise TypeError(
                f"{where} takes a bytes-like object of {param.size} bytes, got {_type_name(value)}"
            ) from None
        if raw.nbytes != param.size:
            raise ValueError(f"{where} takes {param.size} bytes, got {raw.nbytes}")
        return bytes(raw)
    # the manifest parser rejects other kinds
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
    # Fast path, on every launch: a plain int or 3-tuple of plain ints, all in range.
    cls = grid.__class__
    if cls is int:
        if 0 < grid <= _GRID_X_LIMIT and not grid % cluster[0] and cluster[1] == cluster[2] == 1:
            return (grid, 1, 1)
    elif cls is tuple and len(grid) == 3:
        x, y, z = grid
        if (
            x.__class__ is int
            and y.__class__ is int
            and z.__class__ is int
            and 0 < x <= _GRID_X_LIMIT
            and 0 < y <= _GRID_YZ_LIMIT
            and 0 < z <= _GRID_YZ_LIMIT
            and not (x % cluster[0] or y % cluster[1] or z % cluster[2])
        ):
            return grid
    return _normalize_grid_checked(grid, cluster)


def _normalize_grid_checked(grid: Any, cluster: Sequence[int]) -> tuple[int, int, int]:
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
