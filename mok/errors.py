"""Errors mok raises for bad input and for operations it cannot run."""

from __future__ import annotations


class MoKKernelUnavailableError(NotImplementedError):
    """The device is supported, but the shipped cubins hold no kernel for this operation yet.

    mok never falls back silently: CPU tensors run the PyTorch reference path, GPU tensors run
    kernels or raise this.
    """


class MoKInputError(ValueError, TypeError):
    """An argument of the wrong type or dtype. Both a TypeError (Python's convention for a wrong
    type) and a ValueError (what the original raises for a wrong dtype), so code catching
    either keeps working."""
