"""The receive schedule on the GPU: one launch, no host sync.

A stable counting sort (mok/dsl_kernels/kernels/schedule.py) of the all-gathered routing entries
(flat index i = rank * T * k + t * k + j; a group of one's own int64 [T, k] ids, read in place by
the `ids64` variant, which checks them) by local expert, in chunks of 4096 entries. Kernel
`schedule`, grid (num_chunks,), takes 2 * num_chunks tasks by ticket:
1. count tasks: counts[c, e] of chunk c; the task that counts last turns them into chunk c's
   offset in expert e's segment and writes expert_counts[e] = expert e's total, then releases
   the placement tasks (a bounded wait: the launch never hangs; a timeout is reported as
   WaitPhase.SCHEDULE);
2. placement tasks: task 0 writes tokens_per_expert, num_tokens and, on overflow, status; all
   fill padding rows with -1 and place their chunk's entries in flat-index order.
Atomics only count; rows come from prefix sums: the same bits as `mok.reference.build_schedule`.

Capacity overflow (padded rows > C) cannot raise without a sync: the kernel writes nothing out
of bounds, set peer_rank / peer_token_idx to -1 and store status = [1, total, ep_rank,
capacity] (the words are left as they were when it fits: zero them first);
`check_schedule(status)` raises.
"""

from __future__ import annotations

import torch

from ..config import ROUTED_ROW_ALIGNMENT
from .comm import DEFAULT_TIMEOUT_NS, get_error_record
from .plans import Counters, aligned, current_stream, plan, tensor_key

# Launch constants; they mirror mok/dsl_kernels/common/schedule_warp.py (tests/test_schedule_ptx.py
# checks that they agree).
ENTRIES_PER_CHUNK = 4096  # entries of one count / placement task
MAX_LOCAL_EXPERTS = 1024  # the kernels' shared-memory tables hold this many experts
STATUS_WORDS = 4  # [overflow 0/1, padded total, ep_rank, capacity]
COUNTER_WORDS = (
    4  # tickets, count arrivals, scanned, exits (mok/dsl_kernels/common/schedule_tasks.py)
)
_INT32_LIMIT = 1 << 31


def schedule_grid(num_entries: int) -> int:
    """The schedule kernel's grid (chunks of 4096) for P * T * k entries."""
    return max(1, -(-num_entries // ENTRIES_PER_CHUNK))


def overflow_message(ep_rank: int, total: int, capacity: int) -> str:
    """The ValueError message of a capacity overflow (the same text as the reference)."""
    return (
        f"schedule capacity overflow on EP rank {ep_rank}: {total} routed rows (padded to "
        f"{ROUTED_ROW_ALIGNMENT} per expert) > capacity {capacity}; raise "
        f"MoKConfig.schedule_capacity_multiplier or pass num_local_experts to get_workspace"
    )


def _check_int32_vector(name: str, tensor: torch.Tensor, size: int, device: torch.device):
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dtype != torch.int32
        or tensor.device != device
        or tuple(tensor.shape) != (size,)
        or not tensor.is_contiguous()
    ):
        got = (
            f"{tensor.dtype} {list(tensor.shape)} on {tensor.device} "
            f"(contiguous={tensor.is_contiguous()})"
            if isinstance(tensor, torch.Tensor)
            else type(tensor).__name__
        )
        raise ValueError(
            f"{name} must be a contiguous torch.int32 tensor of shape [{size}] on {device}, "
            f"got {got}"
        )


def in_kernel_schedule_scratch(ids, num_local_experts: int, capacity: int, shape) -> tuple:
    """The scratch (counts, expert_counts) of the schedule a forward megakernel writes itself
    (a group of one's int64 `ids`, `shape` [T, k], 8-byte aligned on the CUDA device), checked
    as `_SchedulePlan` checks the `schedule_ids64` kernel's."""
    _, tokens, topk, ids64 = _check_routing(ids, 0, num_local_experts)
    if not ids64 or (tokens, topk) != tuple(shape):
        raise ValueError(
            f"top_experts must be a contiguous CUDA torch.int64 tensor of shape {list(shape)}, "
            f"got {ids.dtype} {list(ids.shape)}"
        )
    aligned("top_experts", ids.data_ptr(), 8)
    return _schedule_scratch(tokens * topk, capacity, num_local_experts, ids.device)[1]


def _schedule_scratch(num_entries: int, capacity: int, num_local_experts: int, device) -> tuple:
    """(chunks, (counts int32 [chunks * E], expert_counts int32 [E])) of a schedule of
    `num_entries` routing entries into `capacity` rows, its row and count indices checked to
    fit int32."""
    if capacity + num_local_experts * ROUTED_ROW_ALIGNMENT >= _INT32_LIMIT:
        raise ValueError(f"capacity {capacity} is too large for int32 row indices")
    num_chunks = schedule_grid(num_entries)
    if num_chunks * num_local_experts >= _INT32_LIMIT:
        raise ValueError(f"{num_chunks} chunks x {num_local_experts} experts overflow int32")
    counts = torch.empty(num_chunks * num_local_experts, dtype=torch.int32, device=device)
    expert_counts = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    return num_chunks, (counts, expert_counts)


def _check_routing(top_experts_all, ep_rank: int, num_local_experts: int) -> tuple:
    """(P, T, k, ids64) of the routing the kernels read: the all-gather's int32 [P, T, k], or
    (ids64) a group of one's own int64 [T, k]."""
    if not isinstance(top_experts_all, torch.Tensor):
        raise TypeError(f"top_experts_all must be a torch.Tensor, got {type(top_experts_all)}")
    ids64 = top_experts_all.dtype == torch.int64 and top_experts_all.dim() == 2
    if (
        not (ids64 or (top_experts_all.dtype == torch.int32 and top_experts_all.dim() == 3))
        or not top_experts_all.is_cuda
        or not top_experts_all.is_contiguous()
    ):
        raise ValueError(
            "top_experts_all must be a contiguous CUDA torch.int32 tensor [P, T, k] (or a group "
            f"of one's int64 [T, k]), got {top_experts_all.dtype} "
            f"{list(top_experts_all.shape)} on {top_experts_all.device} "
            f"(contiguous={top_experts_all.is_contiguous()})"
        )
    shape = (1, *top_experts_all.shape) if ids64 else tuple(top_experts_all.shape)
    if top_experts_all.numel() >= _INT32_LIMIT:
        raise ValueError(
            f"top_experts_all has {top_experts_all.numel()} entries; the schedule kernel "
            f"index them with int32 (at most {_INT32_LIMIT - 1})"
        )
    if not 1 <= num_local_experts <= MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"num_local_experts must be in [1, {MAX_LOCAL_EXPERTS}], got {num_local_experts}"
        )
    if not 0 <= ep_rank < shape[0]:
        raise ValueError(f"ep_rank must be in [0, {shape[0]}) (P = dim 0), got {ep_rank}")
    return (*shape, ids64)


def launch_schedule(
    top_experts_all: torch.Tensor,
    peer_rank: torch.Tensor,
    peer_token_idx: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    status: torch.Tensor | int,
    *,
    ep_rank: int,
    num_local_experts: int,
) -> None:
    """Write the schedule into caller buffers (capacity = peer_rank.numel()); asynchronous.

    top_experts_all: int32 [P, T, k] contiguous (global ids; one outside this rank's experts is not
    routed here), or a group of one's int64 [T, k] (checked against [0, E) into the value-status
    words: `status` must then be their device address). Outputs, int32 contiguous: peer_rank
    [C], peer_token_idx [C], num_tokens [1], tokens_per_expert [E], status [4] (or the device
    address of 4 int32 words, e.g. the value-status words; written only on overflow). Current
    stream, no sync; graph-capturable.
    """
    static_status = status if isinstance(status, int) else None
    key = ("schedule", tensor_key(top_experts_all), tensor_key(peer_rank),
           tensor_key(peer_token_idx), tensor_key(num_tokens), tensor_key(tokens_per_expert),
           static_status if static_status is not None else tensor_key(status), ep_rank,
           num_local_experts, current_stream(top_experts_all.get_device()))  # fmt: skip
    launches = plan(key, lambda: schedule_plan(
        top_experts_all, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status,
        ep_rank, num_local_experts,
    ))  # fmt: skip
    launches(top_experts_all, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status)


def schedule_plan(top_experts_all, peer_rank, peer_token_idx, num_tokens, tokens_per_expert,
                  status, ep_rank: int, num_local_experts: int):  # fmt: skip
    """`launch_schedule`'s plan for these shapes (checked now): plan(top_experts_all,
    peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status) launches."""
    return _SchedulePlan(top_experts_all, peer_rank, peer_token_idx, num_tokens,
                         tokens_per_expert, status, ep_rank, num_local_experts)  # fmt: skip


class _SchedulePlan:
    """The schedule kernel for one set of shapes: checked and bound on the first call, with
    its scratch (every element written by the task that produces it; the launch's counters
    are zero between launches)."""

    def __init__(self, top_experts_all, peer_rank, peer_token_idx, num_tokens,
                 tokens_per_expert, status, ep_rank, num_local_experts):  # fmt: skip
        from mok.runtime import get_kernel  # noqa: PLC0415

        num_ranks, tokens, topk, ids64 = _check_routing(top_experts_all, ep_rank,
                                                        num_local_experts)  # fmt: skip
        device = top_experts_all.device
        capacity = peer_rank.numel() if isinstance(peer_rank, torch.Tensor) else -1
        _check_int32_vector("peer_rank", peer_rank, capacity, device)
        _check_int32_vector("peer_token_idx", peer_token_idx, capacity, device)
        _check_int32_vector("num_tokens", num_tokens, 1, device)
        _check_int32_vector("tokens_per_expert", tokens_per_expert, num_local_experts, device)
        if ids64 and not isinstance(status, int):
            raise ValueError(
                "status must be the device address of the value-status words (an int) with "
                "int64 routing: the placement records a bad expert id there"
            )
        if not isinstance(status, int):
            _check_int32_vector("status", status, STATUS_WORDS, device)
        num_entries = num_ranks * tokens * topk
        num_chunks, self.scratch = _schedule_scratch(num_entries, capacity, num_local_experts,
                                                     device)  # fmt: skip
        counts, expert_counts = self.scratch
        self.device_index = top_experts_all.get_device()
        self.ids_alignment = top_experts_all.element_size()
        self.counters = Counters(COUNTER_WORDS, device)
        self.kernel = get_kernel("schedule_ids64" if ids64 else "schedule", device=device).bind(
            (num_chunks, 1, 1),
            {
                "ids_ptr": top_experts_all,
                "counts_ptr": counts,
                "expert_counts_ptr": expert_counts,
                "counters_ptr": self.counters.tensor,
                "peer_rank_ptr": peer_rank,
                "peer_token_idx_ptr": peer_token_idx,
                "num_tokens_ptr": num_tokens,
                "tokens_per_expert_ptr": tokens_per_expert,
                "status_ptr": status,
                "error_record_ptr": get_error_record(device).device_ptr,
                "timeout_ns": DEFAULT_TIMEOUT_NS,
                "num_entries": num_entries,
                "entries_per_rank": tokens * topk,
                "ep_rank": ep_rank,
                "num_local_experts": num_local_experts,
                "capacity": capacity,
            },
            dynamic=("ids_ptr", "peer_rank_ptr", "peer_token_idx_ptr", "num_tokens_ptr",
                     "tokens_per_expert_ptr", "status_ptr"),
        )  # fmt: skip

    def __call__(self, ids, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status):
        self.launch(
            ids.data_ptr(),
            (peer_rank.data_ptr(), peer_token_idx.data_ptr(), num_tokens.data_ptr(),
             tokens_per_expert.data_ptr()),
            status if isinstance(status, int) else status.data_ptr(),
        )  # fmt: skip

    def launch(self, ids_at: int, outputs_at: tuple, status_at: int) -> None:
        """The launch on addresses: ids, then (peer_rank, peer_token_idx, num_tokens,
        tokens_per_expert) of tensors shaped as the plan's first ones (4-byte aligned)."""
        stream = current_stream(self.device_index)
        aligned("top_experts_all", ids_at, self.ids_alignment)
        self.counters.before_launch(stream)
        self.kernel.launch(ids_at, *outputs_at, status_at, stream=stream)


def build_schedule_gpu(
    top_experts_all: torch.Tensor,
    *,
    ep_rank: int,
    num_local_experts: int,
    capacity: int,
    status: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's receive schedule from the all-gathered routing, without a host sync.

    Inputs:
        top_experts_all:   int32 [P, T, k] contiguous CUDA (all-gathered routing ids)
        ep_rank:           int  this rank (its experts are [ep_rank * E, (ep_rank + 1) * E))
        num_local_experts: int  E, 1..1024
        capacity:          int  C, routed rows (padding included)
    Outputs (int32): peer_rank [C], peer_token_idx [C], num_tokens [1], tokens_per_expert [E]
        (equal to `mok.reference.build_schedule`), status [4] (for `check_schedule`; None when
        `status`, the device address of 4 int32 words to record an overflow in, is given).
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    _check_routing(top_experts_all, ep_rank, num_local_experts)
    i32 = dict(dtype=torch.int32, device=top_experts_all.device)
    peer_rank = torch.empty(capacity, **i32)
    peer_token_idx = torch.empty(capacity, **i32)
    num_tokens = torch.empty(1, **i32)
    tokens_per_expert = torch.empty(num_local_experts, **i32)
    words = torch.zeros(STATUS_WORDS, **i32) if status is None else None
    launch_schedule(
        top_experts_all, peer_rank, peer_token_idx, num_tokens, tokens_per_expert,
        status if status is not None else words, ep_rank=ep_rank,
        num_local_experts=num_local_experts,
    )  # fmt: skip
    return peer_rank, peer_token_idx, num_tokens, tokens_per_expert, words


def check_schedule(schedule_status: torch.Tensor) -> None:
    """Sync on `build_schedule_gpu`'s status words; on capacity overflow raise the reference's
    ValueError ("schedule capacity overflow on EP rank ..."). A host sync: not on the hot path."""
    _check_int32_vector("schedule_status", schedule_status, STATUS_WORDS, schedule_status.device)
    overflow, total, ep_rank, capacity = (int(v) for v in schedule_status.tolist())
    if overflow:
        raise ValueError(overflow_message(ep_rank, total, capacity))
