"""A kernel's ordered parameter spec: one (name, placeholder) per `__call__` argument.

The DSL maps each PTX parameter to a named Python parameter, so `__call__` and the
`@cute.kernel` keep explicit signatures; the spec gives the compile placeholders, and the
build checks that `__call__`'s names are the spec's, in order (`check_call_signature`).
"""

import inspect

from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from .args import global_pointer


def bf16_pointer():
    return global_pointer(BFloat16, 16)


def int32_pointer():
    return global_pointer(Int32, 4)


def int64_pointer():
    return global_pointer(Int64, 8)


def fp32_pointer():
    return global_pointer(Float32, 4)


def placeholders(spec: tuple) -> tuple:
    """The compile placeholders of `spec` ((name, make) pairs; `make()` gives the placeholder
    of a pointer, or a typed scalar is given as is)."""
    return tuple(make() if callable(make) else make for _, make in spec)


def check_call_signature(kernel_cls, spec: tuple) -> None:
    """Raise ValueError unless `kernel_cls.__call__` takes exactly the spec's names, in order."""
    names = [n for n in inspect.signature(kernel_cls.__call__).parameters][1:]
    expected = [name for name, _ in spec]
    if names != expected:
        raise ValueError(
            f"{kernel_cls.__name__}.__call__ takes {names}, but its parameter spec says {expected}"
        )


def uint8_pointer():
    return global_pointer(Uint8, 16)
