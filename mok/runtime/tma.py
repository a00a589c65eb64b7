"""TMA descriptors (CUtensorMap) built by the driver from a manifest spec and a torch tensor.

A descriptor holds the tensor's global address, so it is valid only while the tensor's
storage lives: `TmaDescriptor` keeps a reference to the tensor for that reason. Build
descriptors once per workspace (buffers are allocated once and reused), not per launch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import _driver
from .manifest import TmaSpec

TMA_DESCRIPTOR_BYTES = 128
# cuTensorMapEncodeTiled: global address and every byte stride must be 16-byte multiples.
TMA_GLOBAL_ALIGN = 16
TMA_MAX_STRIDE = 1 << 40
TMA_MAX_DIM = 1 << 32
SWIZZLE_SPAN_BYTES = {"none": None, "32B": 32, "64B": 64, "128B": 128}

# spec dtype -> (CUtensorMapDataType member suffix, element bytes, torch dtype names accepted)
_DTYPE_INFO = {
    "bf16": ("BFLOAT16", 2, ("bfloat16",)),
    "fp16": ("FLOAT16", 2, ("float16",)),
    "fp32": ("FLOAT32", 4, ("float32",)),
    # TMA moves 1-byte floats as raw bytes; the kernel knows how to read them.
    "fp8_e4m3": ("UINT8", 1, ("float8_e4m3fn", "uint8")),
    "fp8_e5m2": ("UINT8", 1, ("float8_e5m2", "uint8")),
    "fp8_e8m0": ("UINT8", 1, ("float8_e8m0fnu", "uint8")),
    "uint8": ("UINT8", 1, ("uint8", "int8")),
    "int32": ("INT32", 4, ("int32",)),
}
_SWIZZLE_ENUM = {"none": "NONE", "32B": "32B", "64B": "64B", "128B": "128B"}
_L2_ENUM = {"none": "NONE", "64B": "L2_64B", "128B": "L2_128B", "256B": "L2_256B"}
_OOB_ENUM = {"none": "NONE", "nan": "NAN_REQUEST_ZERO_FMA"}


@dataclass(frozen=True)
class TmaEncodeArgs:
    """The arguments of cuTensorMapEncodeTiled, dims innermost first (driver enum names)."""

    data_type: str
    rank: int
    global_address: int
    global_dims: tuple[int, ...]
    global_strides_bytes: tuple[int, ...]  # rank - 1 entries: dims 1.. (dim 0 is contiguous)
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    swizzle: str
    l2_promotion: str
    oob_fill: str


def tma_encode_args(
    spec: TmaSpec,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: torch.dtype,
    data_ptr: int,
    *,
    what: str = "tensor",
) -> TmaEncodeArgs:
    """Check a tensor (outermost-first torch shape/strides in elements) against a spec.

    Raises ValueError/TypeError naming `what`, the constraint, and the value given.
    """
    type_name, element_bytes, torch_names = _DTYPE_INFO[spec.dtype]
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in torch_names:
        raise TypeError(
            f"TMA descriptor for {spec.param!r} needs a {spec.dtype} {what} "
            f"(torch {' or '.join(torch_names)}), got {dtype_name}"
        )
    if len(shape) != spec.rank:
        raise ValueError(
            f"TMA descriptor for {spec.param!r} needs a rank-{spec.rank} {what}, "
            f"got shape {list(shape)}"
        )
    if strides[-1] != 1:
        raise ValueError(
            f"TMA descriptor for {spec.param!r}: the innermost dim of {what} must be contiguous "
            f"(stride 1), got strides {list(strides)}"
        )
    if data_ptr % TMA_GLOBAL_ALIGN:
        raise ValueError(
            f"TMA descriptor for {spec.param!r}: {what} address must be {TMA_GLOBAL_ALIGN}-byte "
            f"aligned, got {data_ptr:#x}"
        )
    global_dims = tuple(reversed(shape))
    for size in global_dims:
        if not 1 <= size <= TMA_MAX_DIM:
            raise ValueError(
                f"TMA descriptor for {spec.param!r}: every dim of {what} must be in "
                f"1..2^32, got shape {list(shape)}"
            )
    strides_bytes = tuple(s * element_bytes for s in reversed(strides[:-1]))
    for stride in strides_bytes:
        if stride % TMA_GLOBAL_ALIGN or not 0 < stride < TMA_MAX_STRIDE:
            raise ValueError(
                f"TMA descriptor for {spec.param!r}: byte strides of {what} must be positive "
                f"multiples of {TMA_GLOBAL_ALIGN} below 2^40, got {list(strides_bytes)} bytes "
                f"(element strides {list(strides)}, {element_bytes} bytes per element); "
                f"pad the row length"
            )
    inner_box_bytes = spec.box[0] * element_bytes
    if inner_box_bytes % 16:
        raise ValueError(
            f"TMA descriptor for {spec.param!r}: innermost box {spec.box[0]} x {element_bytes} B "
            f"= {inner_box_bytes} B is not a multiple of 16 bytes"
        )
    span = SWIZZLE_SPAN_BYTES[spec.swizzle]
    if span is not None and inner_box_bytes > span:
        raise ValueError(
            f"TMA descriptor for {spec.param!r}: innermost box of {inner_box_bytes} B exceeds "
            f"the {spec.swizzle} swizzle span"
        )
    return TmaEncodeArgs(
        data_type=type_name,
        rank=spec.rank,
        global_address=data_ptr,
        global_dims=global_dims,
        global_strides_bytes=strides_bytes,
        box=spec.box,
        element_strides=(1,) * spec.rank,
        swizzle=_SWIZZLE_ENUM[spec.swizzle],
        l2_promotion=_L2_ENUM[spec.l2_promotion],
        oob_fill=_OOB_ENUM[spec.oob_fill],
    )


class TmaDescriptor:
    """A 128-byte CUtensorMap, passed by value to a `tma_desc` kernel param.

    Attributes: `spec` (the manifest spec it was built for; launch checks it matches the
    param), `tensor` (kept alive: the descriptor holds its address), `address` (host address
    of the 128 bytes, 64-byte aligned, valid while this object lives), `raw` (the same bytes,
    what a bound launch writes).
    """

    __slots__ = ("spec", "tensor", "_storage", "address", "raw")

    def __init__(self, spec: TmaSpec | None, raw: bytes, tensor: torch.Tensor | None = None):
        if len(raw) != TMA_DESCRIPTOR_BYTES:
            raise ValueError(f"a TMA descriptor is {TMA_DESCRIPTOR_BYTES} bytes, got {len(raw)}")
        self.spec = spec
        self.tensor = tensor
        self.raw = bytes(raw)
        # CUtensorMap is declared 64-byte aligned; over-allocate and align by hand.
        self._storage = (ctypes.c_ubyte * (TMA_DESCRIPTOR_BYTES + 64))()
        base = ctypes.addressof(self._storage)
        self.address = (base + 63) & ~63
        ctypes.memmove(self.address, raw, TMA_DESCRIPTOR_BYTES)

    def to_bytes(self) -> bytes:
        return ctypes.string_at(self.address, TMA_DESCRIPTOR_BYTES)

    def __repr__(self) -> str:
        param = self.spec.param if self.spec is not None else "?"
        return f"TmaDescriptor(param={param!r}, tensor_shape={_shape(self.tensor)})"


def _shape(tensor: torch.Tensor | None) -> list[int] | None:
    return None if tensor is None else list(tensor.shape)


def make_tma_descriptor(spec: TmaSpec, tensor: torch.Tensor) -> TmaDescriptor:
    """Encode a tiled TMA descriptor for `tensor` (a CUDA tensor) as `spec` says.

    Dims are passed innermost first, element strides 1, interleave none; the box, swizzle,
    L2 promotion and OOB fill come from the manifest (they must match the compiled kernel).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"TMA descriptor for {spec.param!r} needs a torch.Tensor, got {tensor!r}")
    if not tensor.is_cuda:
        raise ValueError(
            f"TMA descriptor for {spec.param!r} needs a CUDA tensor, got one on {tensor.device}"
        )
    args = tma_encode_args(
        spec, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.data_ptr()
    )
    cu = _driver.driver()
    tensor_map = _driver.check(
        cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{args.data_type}"),
            args.rank,
            args.global_address,
            [cu.cuuint64_t(d) for d in args.global_dims],
            [cu.cuuint64_t(s) for s in args.global_strides_bytes],
            [cu.cuuint32_t(b) for b in args.box],
            [cu.cuuint32_t(e) for e in args.element_strides],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{args.swizzle}"),
            getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{args.l2_promotion}"),
            getattr(cu.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{args.oob_fill}"),
        ),
        f"cuTensorMapEncodeTiled for {spec.param!r} (shape {list(tensor.shape)}, "
        f"strides {list(tensor.stride())}, box {list(spec.box)}, swizzle {spec.swizzle})",
    )
    raw = ctypes.string_at(tensor_map.getPtr(), TMA_DESCRIPTOR_BYTES)
    return TmaDescriptor(spec, raw, tensor)
