"""Lazy access to the CUDA driver bindings and checking of every CUresult.

The bindings are imported on first use, never at import of `mok.runtime`, so importing mok
touches no GPU state. cuda-bindings 12.x/13.x expose the driver as `cuda.bindings.driver`;
older cuda-python releases as `cuda.cuda`: both are accepted.
"""

from __future__ import annotations

from typing import Any

from .errors import MoKCudaError

_driver_module: Any = None


def driver() -> Any:
    """The cuda-python driver module (imported once, on first call)."""
    global _driver_module
    if _driver_module is None:
        try:
            from cuda.bindings import driver as module
        except ImportError:
            from cuda import cuda as module  # cuda-python < 12.6 spelling
        _driver_module = module
    return _driver_module


def error_name(error: Any) -> str:
    """The driver's name for a CUresult (cuGetErrorName), falling back to the enum name."""
    cu = driver()
    try:
        status, name = cu.cuGetErrorName(error)
        if status == cu.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a naming failure must not hide the original error
        pass
    return getattr(error, "name", str(error))


def _error_string(error: Any) -> str:
    cu = driver()
    try:
        status, text = cu.cuGetErrorString(error)
        if status == cu.CUresult.CUDA_SUCCESS and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001
        pass
    return ""


def check(result: Any, what: str) -> Any:
    """Raise MoKCudaError unless a driver call succeeded; return its outputs.

    cuda-python returns `(CUresult, out1, out2, ...)`; the return value is None for no
    outputs, the output itself for one, and a tuple for several.
    """
    if isinstance(result, tuple):
        status, outputs = result[0], result[1:]
    else:
        status, outputs = result, ()
    cu = driver()
    if status != cu.CUresult.CUDA_SUCCESS:
        raise MoKCudaError(what, error_name(status), int(status), _error_string(status))
    if not outputs:
        return None
    if len(outputs) == 1:
        return outputs[0]
    return outputs
