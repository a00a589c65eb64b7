"""EP-group communication launches: device barrier, routing-id all-gather, bounded-wait probe.

Kernels: mok/dsl_kernels/kernels ep_barrier.py, all_gather_top_experts.py, flag_wait_probe.py,
on common/bounded_wait.py and common/barrier_arrivals.py. Unicast peer loads, stores and atomics only: NVLink multicast is never used.

Launches never synchronise. A wait that gives up writes the device's error record (pinned,
mapped `mok.runtime.ErrorRecord`) and traps; `check_errors(device)` at a sync point raises
MoKWaitTimeoutError naming rank, phase and counter values.

Barrier counters (`barrier_buffer`, int32 [P], slot s = arrivals from rank s) are monotone. The
expected arrival total lives on the device (`barrier_epoch_buffer`, int32 [2]): each kernel
reads it, waits for it plus its own arrivals, and its last CTA advances it (race-free: see
ep_barrier.py, "Arrival epoch"). The host keeps no count, so launches are graph-capturable and
replayable, mixed with eager calls. Other kernels arriving on `barrier_buffer` must use
`read_arrival_epoch` / `retire_arrival_epoch` too.

Rules: every rank makes the same comm calls on a workspace in the same order with the same
`config`, in stream order (one stream or a chained graph; no programmatic dependent launch). The
first comm call on a workspace runs outside graph capture: it uploads the peer table.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEFAULT_WAIT_TIMEOUT_NS as DEFAULT_TIMEOUT_NS
from ..workspace import peer_table_of
from .plans import current_stream, plan, tensor_key

# Upper bound on the all-gather grid: small enough to be co-resident on any supported GPU
# (so no CTA waits on a CTA that cannot be scheduled), large enough to keep NVLink busy.
MAX_GATHER_CTAS = 64
# ctas_per_peer uses grid.x, world_size grid.y (limit 65535).
MAX_WORLD_SIZE = 65535
_INT32_RANGE = 1 << 32
_INT32_MAX = (1 << 31) - 1

_records_lock = threading.Lock()
_error_records: dict[int, object] = {}


@dataclass
class CommState:
    """What the comm launchers keep per workspace (its declared field `comm_state`, made by the
    first comm call on it)."""

    # The EP group's peer table (mok.workspace.peer_table_of), whose barrier_buffer and
    # all_gather_top_experts_buffer rows the comm kernels read
    peer_table: torch.Tensor
    epoch: torch.Tensor  # int32 [2]: this rank's barrier_epoch_buffer (arrival epoch, readers)


# ---- error records ----
def get_error_record(device: int | str | torch.device | None = None):
    """The device's ErrorRecord (pinned, mapped), made once per process and device."""
    if device.__class__ is torch.device and device.index is not None:
        record = _error_records.get(device.index)
        if record is not None:
            return record
    from mok.runtime import ErrorRecord  # noqa: PLC0415
    from mok.runtime.arch import device_index  # noqa: PLC0415

    index = device_index(device)
    with _records_lock:
        record = _error_records.get(index)
        if record is None:
            record = ErrorRecord(index)
            _error_records[index] = record
        return record


def check_errors(device: int | str | torch.device | None = None) -> None:
    """Synchronise `device`; raise MoKWaitTimeoutError if a bounded wait on it gave up (chained to
    the CUDA error a trapped kernel raises; a CUDA error with a clear record is re-raised as is)."""
    from mok.runtime.arch import device_index  # noqa: PLC0415

    index = device_index(device)
    record = _error_records.get(index)
    try:
        torch.cuda.synchronize(index)
    except Exception as exc:
        if record is not None:
            record.check(cause=exc)
        raise
    if record is not None:
        record.check()


# ---- workspace state ----
def _state(workspace) -> CommState:
    workspace.require_alive()
    if workspace.device.type != "cuda":
        raise ValueError(f"workspace must be on a CUDA device, got {workspace.device}")
    state = workspace.comm_state
    if state is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the first comm call on a workspace must run outside CUDA graph capture (it "
                "uploads the peer table and maps the error record): make one eager "
                "call (a warm-up) before capturing"
            )
        if workspace.ep_size > MAX_WORLD_SIZE:
            raise ValueError(f"ep_size must be <= {MAX_WORLD_SIZE}, got {workspace.ep_size}")
        epoch = workspace.buffers.get("barrier_epoch_buffer")
        if epoch is None or epoch.dtype != torch.int32 or epoch.numel() != 2:
            raise ValueError(
                "workspace.buffers['barrier_epoch_buffer'] must be an int32 tensor of 2 "
                f"elements, got {None if epoch is None else (epoch.dtype, list(epoch.shape))}"
            )
        for name in ("barrier_buffer", "all_gather_top_experts_buffer"):
            if name not in workspace.peer_ptrs:
                raise ValueError(f"workspace.peer_ptrs lacks {name!r}: its peer addresses")
        # Uploaded with an EP group's workspace; else made now (one-time setup: a blocking
        # host-to-device copy is fine here).
        table = workspace.peer_table
        state = CommState(peer_table=peer_table_of(workspace) if table is None else table,
                          epoch=epoch)  # fmt: skip
        get_error_record(workspace.device)  # made here, outside capture
        workspace.comm_state = state
    return state


def prepare(workspace) -> None:
    """Do a workspace's one-time comm setup now (error record, peer table),
    outside graph capture and before any rank's stream can wait on a peer."""
    _state(workspace)


def _as_int32_bits(value: int) -> int:
    # Counters wrap modulo 2^32 on the device and the kernels compare wrap-safely.
    return value % _INT32_RANGE


def _phase_id(phase) -> int:
    from mok.runtime import WaitPhase  # noqa: PLC0415

    if isinstance(phase, bool) or not isinstance(phase, int):
        raise TypeError(f"phase must be a mok.runtime.WaitPhase, got {type(phase).__name__}")
    return int(WaitPhase(phase))


def _check_timeout(timeout_ns: int) -> int:
    if isinstance(timeout_ns, bool) or not isinstance(timeout_ns, int):
        raise TypeError(f"timeout_ns must be an int, got {type(timeout_ns).__name__}")
    if not 0 < timeout_ns < 1 << 63:
        raise ValueError(f"timeout_ns must be in 1..2^63-1 nanoseconds, got {timeout_ns}")
    return timeout_ns


# ---- launchers ----
def ep_barrier(
    workspace,
    *,
    phase,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    manifest: str | Path | None = None,
) -> None:
    """Device barrier of the workspace's EP group on torch's current stream (no host sync).

    Collective, in comm-call order. When it ends on a rank's stream, every rank has finished what
    it queued before its call. `phase` (a WaitPhase) is what a timeout reports. Capturable after one
    eager comm call (the target comes from the device epoch).
    """
    workspace.require_alive()  # a plan holds the workspace's addresses
    key = ("ep_barrier", workspace.handle, phase, timeout_ns, manifest,
           current_stream(workspace.device.index or 0))  # fmt: skip
    plan(key, lambda: _bind_barrier(workspace, phase, timeout_ns, manifest)).launch(stream=key[-1])


def _bind_barrier(workspace, phase, timeout_ns, manifest):
    from mok.runtime import get_kernel  # noqa: PLC0415

    phase_id = _phase_id(phase)
    _check_timeout(timeout_ns)
    state = _state(workspace)
    kernel = get_kernel("ep_barrier", device=workspace.device, manifest=manifest)
    record = get_error_record(workspace.device)
    return kernel.bind(
        (1, 1, 1),
        {
            "peer_table_ptr": state.peer_table,
            "rank": workspace.ep_rank,
            "world_size": workspace.ep_size,
            "barrier_epoch_ptr": state.epoch,
            "error_record_ptr": record.device_ptr,
            "phase": phase_id,
            "timeout_ns": timeout_ns,
        },
    )


def all_gather_top_experts(
    workspace,
    config,
    top_experts: torch.Tensor,
    *,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    num_experts: int | None = None,
    manifest: str | Path | None = None,
) -> torch.Tensor:
    """Gather every rank's routing ids into the workspace's `all_gather_top_experts_buffer`.

    `top_experts`: int64 [T, k] contiguous on the workspace's device. `num_experts` (E * P;
    None: no range check): an id outside [0, num_experts) sets the device's value-status words
    (launchers/status.py) and is gathered narrowed to int32. Returns the buffer, int32
    [P, T, k], row p = rank p's ids, complete on this stream when the kernel ends; the next call
    overwrites it. Collective, in comm-call order, same `config`. No host sync; capturable after
    one eager comm call.
    """
    workspace.require_alive()  # a plan holds the workspace's addresses
    chunk_bytes = getattr(config, "all_gather_top_experts_chunk_bytes", None)
    key = ("all_gather_top_experts", workspace.handle, tensor_key(top_experts), chunk_bytes,
           timeout_ns, num_experts, manifest, current_stream(workspace.device.index or 0))  # fmt: skip
    bound = plan(key, lambda: all_gather_plan(workspace, config, top_experts, timeout_ns,
                                              num_experts, manifest))  # fmt: skip
    bound.launch(top_experts.data_ptr(), stream=key[-1])
    return workspace.buffers["all_gather_top_experts_buffer"]


def check_top_experts(workspace, top_experts) -> None:
    """This rank's routing ids as the all-gather (and a group of one's schedule) reads them:
    int64 [num_local_tokens, topk], contiguous, on the workspace's device."""
    num_tokens, topk = workspace.num_local_tokens, workspace.topk
    if not isinstance(top_experts, torch.Tensor):
        raise TypeError(f"top_experts must be a torch.Tensor, got {type(top_experts).__name__}")
    if (
        top_experts.dtype != torch.int64
        or tuple(top_experts.shape) != (num_tokens, topk)
        or not top_experts.is_contiguous()
        or top_experts.device != workspace.device
    ):
        raise ValueError(
            f"top_experts must be a contiguous int64 tensor of shape [{num_tokens}, {topk}] on "
            f"{workspace.device}, got {top_experts.dtype} {list(top_experts.shape)} on "
            f"{top_experts.device} (contiguous={top_experts.is_contiguous()})"
        )


def all_gather_plan(workspace, config, top_experts, timeout_ns, num_experts, manifest=None):
    """The all-gather's launch for one workspace and config, after its full checks (a
    BoundLaunch: launch(top_experts.data_ptr(), stream=...))."""
    from mok.runtime import WaitPhase, get_kernel  # noqa: PLC0415

    _check_timeout(timeout_ns)
    state = _state(workspace)
    num_tokens, topk = workspace.num_local_tokens, workspace.topk
    check_top_experts(workspace, top_experts)
    chunk_bytes = config.all_gather_top_experts_chunk_bytes
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(
            f"config.all_gather_top_experts_chunk_bytes must be a positive multiple of 16, "
            f"got {chunk_bytes}"
        )
    num_ids = num_tokens * topk
    world_size = workspace.ep_size
    if world_size * num_ids >= 1 << 31:
        raise ValueError(
            f"ep_size * num_local_tokens * topk must be < 2^31, got {world_size * num_ids}"
        )
    chunk_ids = chunk_bytes // 4
    num_chunks = -(-num_ids // chunk_ids)
    ctas_per_peer = min(num_chunks, max(1, MAX_GATHER_CTAS // world_size))
    kernel = get_kernel("all_gather_top_experts", device=workspace.device, manifest=manifest)
    record = get_error_record(workspace.device)
    return kernel.bind(
        (ctas_per_peer, world_size, 1),
        {
            "ids_ptr": top_experts,
            "peer_table_ptr": state.peer_table,
            "rank": workspace.ep_rank,
            "world_size": world_size,
            "num_ids": num_ids,
            "chunk_ids": chunk_ids,
            "ctas_per_peer": ctas_per_peer,
            "barrier_epoch_ptr": state.epoch,
            "error_record_ptr": record.device_ptr,
            "entry_phase": int(WaitPhase.PEER_BARRIER_START),
            "gather_phase": int(WaitPhase.ROUTING_ALLGATHER),
            "timeout_ns": timeout_ns,
            "num_experts": _INT32_MAX if num_experts is None else num_experts,
            "status_ptr": record.status_ptr,
        },
        dynamic=("ids_ptr",),
    )


def flag_wait_probe(
    flag: torch.Tensor,
    done: torch.Tensor,
    expected: int,
    *,
    error_record=None,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    rank: int = 0,
    phase=None,
    manifest: str | Path | None = None,
) -> None:
    """One thread waits (bounded) until int32 `flag[0]` reaches `expected`, then stores 1 to int32
    `done[0]`; on timeout the record (default: the device's) gets (rank, phase, 0, flag value,
    expected) and the kernel traps. `flag`: any int32 CUDA tensor (or mapped host view) another
    stream, kernel or GPU sets. No host sync.
    """
    from mok.runtime import WaitPhase, get_kernel  # noqa: PLC0415

    for name, tensor in (("flag", flag), ("done", done)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.int32 or tensor.numel() < 1 or not tensor.is_cuda:
            raise ValueError(
                f"{name} must be a CUDA int32 tensor with >= 1 element, got {tensor.dtype} "
                f"{list(tensor.shape)} on {tensor.device}"
            )
    if done.device != flag.device:
        raise ValueError(f"done must be on {flag.device} like flag, got {done.device}")
    if isinstance(expected, bool) or not isinstance(expected, int):
        raise TypeError(f"expected must be an int, got {type(expected).__name__}")
    _check_timeout(timeout_ns)
    phase_id = _phase_id(WaitPhase.UNKNOWN if phase is None else phase)
    record = error_record if error_record is not None else get_error_record(flag.device)
    kernel = get_kernel("flag_wait_probe", device=flag.device, manifest=manifest)
    kernel.launch(
        (1, 1, 1),
        {
            "flag_ptr": flag,
            "done_ptr": done,
            "expected": _as_int32_bits(expected),
            "error_record_ptr": record.device_ptr,
            "rank": rank,
            "phase": phase_id,
            "timeout_ns": timeout_ns,
        },
    )


# ---- the group's barriers around a pass ----
def group_barrier(ws, phase_name: str) -> None:
    """The EP group's device barrier (nothing for a group of one)."""
    if ws.ep_size > 1:
        from mok.runtime import WaitPhase  # noqa: PLC0415

        ep_barrier(ws, phase=WaitPhase[phase_name], timeout_ns=ws.wait_timeout_ns)


def publish_x(ws, x, table) -> None:
    """EP > 1: x into this rank's symmetric x buffer, then the start barrier: peers pull from
    it once every rank has arrived."""
    if table is not None:
        ws.buffers["x_buffer"].copy_(x)
    group_barrier(ws, "PEER_BARRIER_START")
