"""Exceptions raised by mok's runtime, and the phase ids of the bounded-wait error record.

Every error names what was asked for and what was found, so a failed launch on a remote GPU
machine can be diagnosed from the message alone.
"""

from __future__ import annotations

import enum


class MoKRuntimeError(RuntimeError):
    """Base class of every error the runtime raises that is not a plain argument error."""


class MoKCudaError(MoKRuntimeError):
    """A CUDA driver call failed; `error_name` is the driver's name (e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, what: str, error_name: str, error_code: int, detail: str = "") -> None:
        self.what = what
        self.error_name = error_name
        self.error_code = error_code
        message = f"{what} failed: {error_name} ({error_code})"
        if detail:
            message += f": {detail}"
        super().__init__(message)


class MoKUnsupportedDeviceError(MoKRuntimeError):
    """The GPU (or the arch forced by MOK_ARCH) has no shipped cubins that can run on it."""


class MoKManifestError(MoKRuntimeError):
    """The cubin manifest is missing, malformed, or lacks the requested kernel variant."""


class MoKParamMismatchError(MoKRuntimeError):
    """A cubin's parameter layout (cuFuncGetParamInfo) disagrees with the manifest."""


class WaitPhase(enum.IntEnum):
    """What a bounded wait inside a megakernel was waiting for, as written to the error record.

    Ids are a wire format shared with the kernels: append new members, never renumber.
    """

    UNKNOWN = 0
    # Cross-rank barrier at kernel start (all peers' workspaces are ready to be read).
    PEER_BARRIER_START = 1
    # Cross-rank barrier at kernel end (peers have finished reading this rank's buffers).
    PEER_BARRIER_END = 2
    # Grid-wide barrier among the CTAs of one rank.
    GRID_BARRIER = 3
    # Routing ids of every peer (the top-expert all-gather chunks) have arrived.
    ROUTING_ALLGATHER = 4
    # Routed rows of an expert have been pulled into the routed buffer (dispatch done).
    DISPATCH = 5
    # Gate/up GEMM tiles a down-GEMM tile depends on have been written.
    GATE_UP_GEMM = 6
    # Down GEMM tiles of a minibatch have been written (before combine push).
    DOWN_GEMM = 7
    # Combine rows from every peer have landed in this rank's per-(token, j) slots.
    COMBINE = 8
    # Backward: w * dY rows pulled from peers.
    BACKWARD_DISPATCH = 9
    # Backward: d_hidden GEMM tiles (SwiGLU backward input) written.
    BACKWARD_DHIDDEN_GEMM = 10
    # Backward: d_x GEMM tiles written (before the d_x push).
    BACKWARD_DX_GEMM = 11
    # Backward: d_x rows from every peer have landed.
    BACKWARD_COMBINE = 12
    # Backward: weight-gradient GEMM inputs of an expert are complete.
    BACKWARD_WGRAD_GEMM = 13
    # Task-list ticket counter (a compute CTA waiting for a task's dependencies in general).
    TASK_DEPENDENCY = 14
    # The receive schedule's placement waiting for its count tasks' scan (one launch).
    SCHEDULE = 15


def phase_name(phase_id: int) -> str:
    """The WaitPhase name for an id read from the record, or a description of an unknown id."""
    try:
        return WaitPhase(phase_id).name
    except ValueError:
        return f"unknown phase id {phase_id}"


class MoKWaitTimeoutError(MoKRuntimeError):
    """A bounded wait inside a kernel gave up; the fields come from the error record."""

    def __init__(self, message: str, fields: object) -> None:
        self.fields = fields
        super().__init__(message)
