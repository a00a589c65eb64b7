"""Errors mok raises beyond ValueError/TypeError for bad input."""

from __future__ import annotations


class MoKKernelUnavailableError(NotImplementedError):
    """The device is supported, but the shipped cubins hold no kernel for this operation yet.

    mok never falls back silently: CPU tensors run the PyTorch reference path, GPU tensors run
    kernels or raise this.
    """
