"""Kernel parameters declared once, as typed bundles.

A kernel's parameters are `typing.NamedTuple` bundles whose fields are annotated with the DSL
type, a pointer's with its compile placeholder too (`Bf16Pointer` = a bf16 global pointer,
16-byte aligned). `__call__` and the `@cute.kernel` take the bundles; the DSL flattens each
bundle into its fields, in order, so every field is one PTX parameter named after it. From
the same declaration:
- `compile_arguments(kernel)`: the placeholders `cute.compile` takes (no tensors, no GPU);
- `flat_params(annotation)`: the (name, annotation) of each PTX parameter, which the build
  pairs with the PTX `.entry` to write the manifest the runtime binds by name.
Inside a kernel a field reads as `args.hidden_size`; a bundle is a tuple, so a slice of it
(`tma[:6]`) is a tuple of its fields.
"""

from __future__ import annotations

import inspect
from typing import Annotated, get_args, get_origin, get_type_hints

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from .args import global_pointer


def aligned_pointer(dtype, assumed_align: int):
    """The field annotation of a global pointer to `dtype` that the kernel may assume
    `assumed_align`-byte aligned (its compile placeholder: both are compiled in)."""

    def make():
        return global_pointer(dtype, assumed_align)

    return Annotated[cute.Pointer, make]


# Field annotations: the DSL type, and for a pointer the placeholder it is compiled with.
Bf16Pointer = aligned_pointer(BFloat16, 16)
Int32Pointer = aligned_pointer(Int32, 4)
Int64Pointer = aligned_pointer(Int64, 8)
Fp32Pointer = aligned_pointer(Float32, 4)
Uint8Pointer = aligned_pointer(Uint8, 16)
# The error record (mok/runtime/error_record.py: 16 int32 words, 64-byte aligned).
ErrorRecordPointer = aligned_pointer(Int32, 64)
SCALARS = (Int32, Int64, Float32)


def is_bundle(annotation) -> bool:
    """True for a NamedTuple class (a parameter bundle)."""
    return (
        inspect.isclass(annotation)
        and issubclass(annotation, tuple)
        and hasattr(annotation, "_fields")
    )


def _fields(bundle) -> list[tuple[str, object]]:
    hints = get_type_hints(bundle, include_extras=True)
    return [(name, hints[name]) for name in bundle._fields]


def _placeholder(owner: str, annotation, kernel):
    if is_bundle(annotation):
        return annotation(
            *(_placeholder(f"{owner}.{n}", a, kernel) for n, a in _fields(annotation))
        )
    if get_origin(annotation) is Annotated:
        _, make = get_args(annotation)[:2]
        # A placeholder that depends on the kernel's config (an output's dtype) takes the kernel.
        return make(kernel) if inspect.signature(make).parameters else make()
    if annotation in SCALARS:
        return annotation(0)
    raise ValueError(
        f"{owner}: annotation {annotation!r} has no compile placeholder (expected a bundle, an "
        "Annotated pointer such as Bf16Pointer, or one of Int32, Int64, Float32)"
    )


def compile_arguments(kernel) -> tuple:
    """The placeholders of `kernel.__call__`'s parameters, in order (scalars are zero: every one
    is a runtime parameter of the cubin, so its value is not compiled in)."""
    call = type(kernel).__call__
    hints = get_type_hints(call, include_extras=True)
    names = list(inspect.signature(call).parameters)[1:]  # skip self
    return tuple(_placeholder(f"{type(kernel).__name__}.{n}", hints[n], kernel) for n in names)


def flat_params(annotation, name: str = "") -> list[tuple[str, object]]:
    """(name, DSL type) of each leaf of a parameter: a bundle's fields in order, recursively;
    Annotated pointers as `cute.Pointer`."""
    if is_bundle(annotation):
        return [leaf for n, a in _fields(annotation) for leaf in flat_params(a, n)]
    if get_origin(annotation) is Annotated:
        return [(name, get_args(annotation)[0])]
    return [(name, annotation)]
