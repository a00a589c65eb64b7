"""CUDA launchers of mok's ops over the shipped cubins (`mok.runtime`), found by
`mok.kernels.require(op, device)`; submodules import `mok.runtime` lazily, so import is cheap.
"""

from __future__ import annotations

from .backward_op import backward
from .comm import check_errors
from .epilogues import bwd_epilogue, fwd_epilogue
from .forward_op import forward, recompute_forward_context
from .mxfp8 import mxfp8_quantize
from .schedule_op import build_schedule
from .status import raise_value_errors

__all__ = [
    "backward",
    "build_schedule",
    "check_errors",
    "bwd_epilogue",
    "forward",
    "fwd_epilogue",
    "mxfp8_quantize",
    "raise_value_errors",
    "recompute_forward_context",
]
