"""Bad input values found by the kernels, reported without a host sync.

The kernels that read an input value anyway check it there and, when it is bad, store a
nonzero word into the device's value-status words (pinned, mapped host memory after the error
record, mok/runtime/error_record.py) and go on without writing out of bounds. Every mok op on CUDA
of a group of one starts by reading these words with plain host loads (no CUDA call, so also
under graph capture); `mok.functional.check_errors` syncs first, and is where EP groups get
them (a rank raising mid-step would strand its peers in a barrier). A nonzero word is cleared
and raised once.

    word  written by               on
    0-3   schedule                 capacity overflow: [1, padded total, ep_rank, capacity]
    4-5   all_gather_top_experts   an expert id outside [0, E * P): [1, E * P]
          (a group of one's:
          schedule_ids64)
    6     moe_combine_forward      a router weight <= 0 or non-finite: 1
          (or moe_forward's last
          phase, combine_phase.py)
    7     router_grad_push         the same in backward: 1 + the EP rank owning the weight
          (or backward_finish, or
          moe_backward's last phase)

Kernels only ever store these values (never 0), so a report cannot be lost to a later call.
"""

from __future__ import annotations

import ctypes

from .comm import get_error_record

SCHEDULE_OVERFLOW = 0
BAD_EXPERT_ID = 4
BAD_WEIGHT_FORWARD = 6
BAD_WEIGHT_BACKWARD = 7
_REPORTED = (SCHEDULE_OVERFLOW, BAD_EXPERT_ID, BAD_WEIGHT_FORWARD, BAD_WEIGHT_BACKWARD)
_FOUND = "found on the GPU without a host sync; reported by the next mok call or check_errors"


def status_ptr(device) -> int:
    """The device address of `device`'s value-status words (a kernel pointer argument)."""
    return get_error_record(device).status_ptr


def message(words, device) -> str | None:
    """The ValueError message of the first set word, or None when all are clear."""
    from .schedule_kernels import overflow_message  # noqa: PLC0415

    if words[SCHEDULE_OVERFLOW]:
        return overflow_message(words[2], words[1], words[3])
    if words[BAD_EXPERT_ID]:
        return (
            f"top_experts must hold expert ids in [0, {words[BAD_EXPERT_ID + 1]}) "
            f"(num_local_experts * EP size), got one outside in a call of mok.ops.build_schedule "
            f"on {device} ({_FOUND})"
        )
    if words[BAD_WEIGHT_FORWARD]:
        return (
            f"router_weights must be finite and > 0, got a value <= 0 or non-finite in a call "
            f"of mok.ops.forward on {device} ({_FOUND})"
        )
    if words[BAD_WEIGHT_BACKWARD]:
        return (
            f"router_weights must be finite and > 0, got a value <= 0 or non-finite in a call "
            f"of mok.ops.backward on {device} (router weights of EP rank "
            f"{words[BAD_WEIGHT_BACKWARD] - 1}; {_FOUND})"
        )
    return None


def raise_value_errors(device) -> None:
    """Raise ValueError for a bad value a kernel on `device` recorded (then clear the words)."""
    record = get_error_record(device)
    words = record.status
    if not any(words[i] for i in _REPORTED):
        return
    snapshot = list(words)
    ctypes.memset(ctypes.addressof(words), 0, ctypes.sizeof(words))
    raise ValueError(message(snapshot, f"cuda:{record.device_index}"))


def value_error_check(device):
    """`raise_value_errors(device)` as a callable that reads the words it holds (a resolved
    layer step calls it before each op)."""
    words = get_error_record(device).status
    a, b, c, d = _REPORTED

    def check() -> None:
        if words[a] or words[b] or words[c] or words[d]:
            raise_value_errors(device)

    return check
