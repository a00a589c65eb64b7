"""mok: a deterministic Mixture-of-Experts megakernel for Hopper and Blackwell GPUs.

Submodules: `mok.functional` (the API), `mok.ops` (torch.library custom ops), `mok.nn`
(autograd Function and MoKExperts module), `mok.reference` (the PyTorch oracle),
`mok.runtime` (cubin loader and launcher), `mok.dsl_kernels` (CuTe DSL sources, build only).
Importing `mok` imports none of them; they load on first attribute access. `mok.MoKConfig` and
mok's errors (`mok.MoKInputError`, `mok.MoKWaitTimeoutError`, ...: `mok.errors`) load the same way.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# Run from a source checkout without an editable install (the checkout's root first on sys.path,
# so this folder shadows an installed copy): mok.runtime and mok.dsl_kernels are the sibling
# folders runtime/ and dsl_kernels/ there, so the root joins this package's search path. An
# installed package has them inside it and is left as it is.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "runtime")) and os.path.isfile(
    os.path.join(_ROOT, "runtime", "__init__.py")
):
    __path__.append(_ROOT)  # noqa: F821 - a package's own __path__
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
