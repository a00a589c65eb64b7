"""The host-visible error record that bounded waits inside the megakernels write before trapping.

A trapped kernel leaves its CUDA context unusable, so the record lives in pinned, mapped host
memory (cuMemHostAlloc with DEVICEMAP | PORTABLE): the kernel writes it through the device
pointer, and the host reads it with plain loads even after the context has died.

Layout: `ERROR_RECORD_FIELDS` int32 words at `device_ptr` (64 bytes, 64-byte aligned):

    word  field          meaning
    0     flag           0 clear; 1 claimed (a writer is filling the record); 2 valid
    1     rank           EP rank of the GPU that gave up waiting
    2     phase          WaitPhase id (mok.runtime.WaitPhase) of what it waited for
    3     counter_index  index of the counter it polled (in that phase's counter array)
    4     observed       the counter value it last read
    5     expected       the value it waited for
    6     peer_rank      rank whose memory holds the counter (-1: this rank's own memory)
    7     cta            linear block index of the waiting CTA
    8     task           task-list index the CTA was working on (-1: none)
    9-15  reserved       write 0

The same allocation holds, after the record, `STATUS_WORDS` int32 value-status words at
`status_ptr`: kernels that find a bad input value (an expert id out of range, a router weight
<= 0 or non-finite, a schedule overflow) store a nonzero word there and go on without a fault;
the host reads them with plain loads at the next mok call (layout: mok/launchers/status.py).

Kernel protocol (one writer wins; later timeouts only trap):
  1. `atom.global.cas.b32 flag, 0 -> 1` (sys scope); if the old value was not 0, skip to 4.
  2. Store words 1..8 with `st.volatile.global` (or `st.relaxed.sys`).
  3. `fence.sc.sys` (`__threadfence_system()`), then store 2 to word 0.
  4. `trap`.
The host treats flag 1 as a record cut short (its fields may be partial).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import _driver
from .arch import device_index as _device_index
from .errors import MoKWaitTimeoutError, phase_name
from .module import _make_current, _restore, primary_context

ERROR_RECORD_FIELDS = 16
ERROR_RECORD_BYTES = ERROR_RECORD_FIELDS * 4
STATUS_WORDS = 16
_ALLOCATION_BYTES = ERROR_RECORD_BYTES + STATUS_WORDS * 4
FLAG_CLEAR = 0
FLAG_CLAIMED = 1
FLAG_VALID = 2
FIELD_INDEX = {
    "flag": 0,
    "rank": 1,
    "phase": 2,
    "counter_index": 3,
    "observed": 4,
    "expected": 5,
    "peer_rank": 6,
    "cta": 7,
    "task": 8,
}


@dataclass(frozen=True)
class ErrorRecordFields:
    """A snapshot of a non-clear record."""

    flag: int
    rank: int
    phase: int
    counter_index: int
    observed: int
    expected: int
    peer_rank: int
    cta: int
    task: int

    @property
    def phase_name(self) -> str:
        return phase_name(self.phase)


def decode_error_record(words: list[int]) -> ErrorRecordFields | None:
    """The fields of a record (int32 words as read from memory), or None when clear."""
    if len(words) < len(FIELD_INDEX):
        raise ValueError(f"an error record has {ERROR_RECORD_FIELDS} words, got {len(words)}")
    if words[0] == FLAG_CLEAR:
        return None
    return ErrorRecordFields(**{name: words[index] for name, index in FIELD_INDEX.items()})


def error_message(fields: ErrorRecordFields) -> str:
    """The MoKWaitTimeoutError message: who waited for what, and what it saw."""
    where = "this rank's memory" if fields.peer_rank < 0 else f"rank {fields.peer_rank}'s memory"
    message = (
        f"rank {fields.rank} timed out waiting in phase {fields.phase_name} "
        f"(id {fields.phase}): counter {fields.counter_index} in {where} read "
        f"{fields.observed}, expected {fields.expected} (CTA {fields.cta}, task {fields.task})"
    )
    if fields.flag == FLAG_CLAIMED:
        message += "; the record was cut short, so fields may be partial"
    elif fields.flag != FLAG_VALID:
        message += f"; unexpected flag value {fields.flag}"
    return message


def raise_for_words(words: list[int], cause: BaseException | None = None) -> None:
    """Raise MoKWaitTimeoutError if the record holds an error; else return."""
    fields = decode_error_record(words)
    if fields is not None:
        raise MoKWaitTimeoutError(error_message(fields), fields) from cause


class ErrorRecord:
    """A pinned, mapped host buffer of ERROR_RECORD_FIELDS int32 words and STATUS_WORDS
    value-status words (layout: module doc).

    Pass `device_ptr` (`status_ptr`) to the kernel as a pointer param; `status` is the host view
    of the value-status words. After a sync, or when a launch or
    sync raised, call `check(cause=exc)`: it raises MoKWaitTimeoutError if a wait gave up.
    Free with `destroy()` (or use as a context manager); one record per device.
    """

    def __init__(self, device: int | str | torch.device | None = None):
        self.device_index = _device_index(device)
        cu = _driver.driver()
        previous = _make_current(primary_context(self.device_index))
        try:
            flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
            self.host_ptr = int(
                _driver.check(
                    cu.cuMemHostAlloc(_ALLOCATION_BYTES, flags),
                    f"cuMemHostAlloc({_ALLOCATION_BYTES} B, DEVICEMAP | PORTABLE)",
                )
            )
            try:
                self.device_ptr = int(
                    _driver.check(
                        cu.cuMemHostGetDevicePointer(self.host_ptr, 0),
                        "cuMemHostGetDevicePointer (error record)",
                    )
                )
            except BaseException:
                cu.cuMemFreeHost(self.host_ptr)
                raise
        finally:
            _restore(previous)
        self._words = (ctypes.c_int32 * ERROR_RECORD_FIELDS).from_address(self.host_ptr)
        self.status_ptr = self.device_ptr + ERROR_RECORD_BYTES
        self.status = (ctypes.c_int32 * STATUS_WORDS).from_address(
            self.host_ptr + ERROR_RECORD_BYTES
        )
        ctypes.memset(self.host_ptr, 0, _ALLOCATION_BYTES)

    def read(self) -> ErrorRecordFields | None:
        """The record's fields, or None when clear. Plain host loads: no CUDA call."""
        self._require_alive()
        flag = self._words[0]  # read the flag first: the kernel writes it last
        words = list(self._words)
        words[0] = flag
        return decode_error_record(words)

    def check(self, cause: BaseException | None = None) -> None:
        """Raise MoKWaitTimeoutError (chained to `cause`) if a kernel recorded a timeout."""
        self._require_alive()
        flag = self._words[0]
        words = list(self._words)
        words[0] = flag
        raise_for_words(words, cause)

    def clear(self) -> None:
        """Zero the record. Only while no kernel that may write it is running."""
        self._require_alive()
        ctypes.memset(self.host_ptr, 0, ERROR_RECORD_BYTES)

    def destroy(self) -> None:
        """Free the pinned buffer (idempotent). Ignores errors of a context that trapped."""
        if getattr(self, "host_ptr", 0):
            cu = _driver.driver()
            cu.cuMemFreeHost(self.host_ptr)  # a dead context may refuse; nothing to do then
            self.host_ptr = 0
            self.device_ptr = 0
            self.status_ptr = 0

    def _require_alive(self) -> None:
        if not self.host_ptr:
            raise RuntimeError("this ErrorRecord has been destroyed")

    def __enter__(self) -> ErrorRecord:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if not self.host_ptr else f"device_ptr={self.device_ptr:#x}"
        return f"ErrorRecord(cuda:{self.device_index}, {state})"
