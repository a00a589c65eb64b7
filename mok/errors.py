"""Errors mok raises for bad input and for operations it cannot run.

The runtime's errors (a CUDA driver failure, a bounded wait that gave up, ...) are defined in
`mok.runtime.errors` and importable from here, from `mok` and from `mok.functional`; they load
on first use, so importing mok does not import the runtime.
"""

from __future__ import annotations

import importlib


class MoKKernelUnavailableError(NotImplementedError):
    """The device is supported, but the shipped cubins hold no kernel for this operation yet.

    mok never falls back silently: CPU tensors run the PyTorch reference path, GPU tensors run
    kernels or raise this.
    """


class MoKInputError(ValueError, TypeError):
    """An argument of the wrong type or dtype. Both a TypeError (Python's convention for a wrong
    type) and a ValueError (what the original raises for a wrong dtype), so code catching
    either keeps working."""


# mok.runtime.errors' public classes (MoKRuntimeError is the base of the others).
RUNTIME_ERRORS = (
    "MoKCudaError",
    "MoKManifestError",
    "MoKParamMismatchError",
    "MoKRuntimeError",
    "MoKUnsupportedDeviceError",
    "MoKWaitTimeoutError",
)
PUBLIC_ERRORS = ("MoKInputError", "MoKKernelUnavailableError", *RUNTIME_ERRORS)

__all__ = list(PUBLIC_ERRORS)


def __getattr__(name: str):
    if name in RUNTIME_ERRORS:
        return getattr(importlib.import_module("mok.runtime.errors"), name)
    raise AttributeError(f"module 'mok.errors' has no attribute {name!r}")
