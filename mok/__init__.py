"""mok: a deterministic Mixture-of-Experts megakernel for Hopper and Blackwell GPUs.

Submodules: `mok.functional` (the API), `mok.ops` (torch.library custom ops), `mok.nn`
(autograd Function and MoKExperts module), `mok.reference` (the PyTorch oracle),
`mok.runtime` (cubin loader and launcher), `mok.dsl_kernels` (CuTe DSL sources, build only).
Importing `mok` imports none of them; they load on first attribute access. `mok.MoKConfig` and
mok's errors (`mok.MoKInputError`, `mok.MoKWaitTimeoutError`, ...: `mok.errors`) load the same way.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("config", "functional", "ops", "nn", "reference", "types", "runtime")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"mok.{name}")
    if name == "MoKConfig":
        return importlib.import_module("mok.config").MoKConfig
    if name.startswith("MoK") and name.endswith("Error"):
        errors = importlib.import_module("mok.errors")
        if name in errors.PUBLIC_ERRORS:
            return getattr(errors, name)
    raise AttributeError(f"module 'mok' has no attribute {name!r}")
