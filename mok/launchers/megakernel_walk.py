"""Both megakernels' dispatch and task-walk launch arguments: schedule, zeroed counters, error
record, sizes, and a pass's settings (mok.types.PassConfig): communication CTAs, the wait bound
and the minibatch, routed rows converted to row tiles here."""

from __future__ import annotations

import torch

from .checks import check_arg, check_cuda, check_extents, check_gate_up_weights, expert_rows
from .comm import get_error_record
from .device_args import TILE_ROWS
from .plans import Counters

# Counters after the two per-row-tile arrays: the forward's task and dispatch tickets, its
# down tiles stored and its schedule phase's four words; the backward's dispatch_total, dgu_total, task ticket, dispatch ticket and
# its d_x tiles stored; then each one's exit word (mok/dsl_kernels/common/retire.py). The kernels'
# COUNTER_TAIL (tests/test_moe_*_build.py).
FORWARD_COUNTER_TAIL = 8
BACKWARD_COUNTER_TAIL = 6
# A diagnostic build's (config `timeline`) int64 words per CTA past the counters
# (mok/dsl_kernels/common/timeline.py STAMPS).
TIMELINE_STAMPS = 16


def megakernel_counters(capacity: int, tail: int, device: torch.device, timeline_ctas: int = 0):
    """A megakernel plan's counters: two words per 128-row tile of the capacity, then `tail`;
    then, for a diagnostic build with `timeline` (`timeline_ctas` its grid), the CTAs' int64
    words from the next 8-byte boundary (`timeline_words` reads them)."""
    words = _counter_words(capacity, tail)
    if timeline_ctas:
        words += words % 2 + 2 * TIMELINE_STAMPS * timeline_ctas
    return Counters(words, device)


def stamped_ctas(kernel, grid: int) -> int:
    """The CTAs whose phase stamps a launch of `kernel` writes: its grid for a diagnostic build
    (its config's `timeline`), else none."""
    return grid if kernel.variant.config.get("timeline") else 0


def timeline_words(counters: Counters, capacity: int, tail: int, ctas: int) -> torch.Tensor:
    """int64 [ctas, TIMELINE_STAMPS]: a diagnostic build's words, as its last launch left them
    (from the first 8-byte boundary after the counters, common/timeline.py)."""
    words = _counter_words(capacity, tail)
    first = words + words % 2
    flat = counters.tensor[first : first + 2 * TIMELINE_STAMPS * ctas]
    return flat.view(torch.int64).view(ctas, TIMELINE_STAMPS)


def _counter_words(capacity: int, tail: int) -> int:
    return 2 * (-(-capacity // TILE_ROWS)) + tail


def check_routed_operands(
    gate_weights, up_weights, down_weights, schedule, slots, num_tokens, topk, hidden_size, device
):
    """Both megakernels' weights (bf16 [E, I, H], [E, I, H], [E, H, I]), slots (bf16 [T * k, H]
    or None) and schedule, as the kernels read them; returns (E, I, capacity). Gate and up may
    be the halves of one fused [E, 2 I, H] (checks.expert_rows), with equal strides: the
    kernels take one rows-per-expert for both."""
    num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
    capacity = schedule.peer_rank.shape[0]
    check_gate_up_weights(gate_weights, up_weights,
                          (num_experts, intermediate_size, hidden_size))  # fmt: skip
    check_cuda("down_weights", down_weights, torch.bfloat16,
               (num_experts, hidden_size, intermediate_size))  # fmt: skip
    return _check_rest(schedule, slots, num_tokens, topk, hidden_size, intermediate_size,
                       num_experts, capacity, device)  # fmt: skip


def check_mxfp8_routed_operands(
    gate_weights, up_weights, down_weights, schedule, slots, num_tokens, topk, hidden_size, device
):
    """`check_routed_operands` for MXFP8 weights: (E4M3 data, UE8M0 scales) pairs along K, data
    float8_e4m3fn [E, I, H], [E, I, H], [E, H, I], scales uint8 [E * N / 128, K / 128, 32, 16]
    (mok.ops.mxfp8_quantize's); returns (E, I, capacity)."""
    for name, pair in (("gate_weights", gate_weights), ("up_weights", up_weights),
                       ("down_weights", down_weights)):  # fmt: skip
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"{name} must be an MXFP8 pair (data, scales), got {type(pair)}")
    data, _ = gate_weights
    if data.dim() != 3:
        raise ValueError(f"gate_weights data must be [E, I, H], got {list(data.shape)}")
    num_experts, intermediate_size = data.shape[0], data.shape[1]
    capacity = schedule.peer_rank.shape[0]
    for name, (data, scales), (rows, k) in (
        ("gate_weights", gate_weights, (intermediate_size, hidden_size)),
        ("up_weights", up_weights, (intermediate_size, hidden_size)),
        ("down_weights", down_weights, (hidden_size, intermediate_size)),
    ):
        check_cuda(f"{name} data", data, torch.float8_e4m3fn, (num_experts, rows, k))
        check_cuda(f"{name} scales", scales, torch.uint8,
                   (num_experts * rows // 128, k // 128, 32, 16))  # fmt: skip
    return _check_rest(schedule, slots, num_tokens, topk, hidden_size, intermediate_size,
                       num_experts, capacity, device)  # fmt: skip


def _check_rest(schedule, slots, num_tokens, topk, hidden_size, intermediate_size, num_experts,
                capacity, device):  # fmt: skip
    """The checks after the weights': extents, slots, schedule; returns (E, I, capacity)."""
    widest = max(hidden_size, intermediate_size)
    check_extents("weight rows", capacity, num_experts * widest, widest, widest)
    if slots is not None:
        check_cuda("slots", slots, torch.bfloat16, (num_tokens * topk, hidden_size))
    check_schedule_tensors(schedule, capacity, num_experts, device)
    return num_experts, intermediate_size, capacity


def check_schedule_tensors(schedule, capacity: int, num_experts: int, device) -> None:
    """The schedule's int32 tensors as the kernels read them: [C], [C], [1], [E] on `device`
    (the dispatch source's: CUDA, except in the launchers' CPU tests)."""
    for name, t, size in (
        ("schedule.peer_rank", schedule.peer_rank, capacity),
        ("schedule.peer_token_idx", schedule.peer_token_idx, capacity),
        ("schedule.num_tokens", schedule.num_tokens, 1),
        ("schedule.tokens_per_expert", schedule.tokens_per_expert, num_experts),
    ):
        check_arg(name, t, torch.int32, (size,), cuda=device.type == "cuda", align=4)
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")


def minibatch_row_tiles(minibatch_size: int | None, capacity: int) -> int:
    """`minibatch_size` routed rows in 128-row tiles, at most the routed buffer (None: all of it)."""
    all_tiles = max(1, -(-capacity // TILE_ROWS))
    if minibatch_size is None:
        return all_tiles
    return max(1, min(minibatch_size // TILE_ROWS, all_tiles))


def walk_arguments(schedule, counters, rows, gate_weights, topk, pass_config, grid, ep_rank=0):
    """The walk's kernel arguments of a launch of `grid` CTAs with `pass_config`'s settings (a
    PassConfig): its minibatch in 128-row tiles (`minibatch_tiles`, made here only), at most
    grid - 1 comm CTAs. `rows`: the dispatch source [T, H]; `gate_weights` [E, I, H] (checked:
    its experts' rows are `gate_up_expert_rows` apart, as up's)."""
    limit, capacity = pass_config.swiglu_limit, schedule.peer_rank.shape[0]
    return {
        "peer_rank_ptr": schedule.peer_rank,
        "peer_token_idx_ptr": schedule.peer_token_idx,
        "num_tokens_ptr": schedule.num_tokens,
        "tokens_per_expert_ptr": schedule.tokens_per_expert,
        "counters_ptr": counters,
        "error_record_ptr": get_error_record(counters.device).device_ptr,
        "timeout_ns": pass_config.timeout_ns,
        "num_experts": gate_weights.shape[0],
        "hidden_size": rows.shape[1],
        "intermediate_size": gate_weights.shape[1],
        "gate_up_expert_rows": expert_rows("gate_weights", gate_weights),
        "topk": topk,
        "ep_rank": ep_rank,
        "capacity": capacity,
        "has_limit": int(limit is not None),
        "swiglu_limit": 0.0 if limit is None else float(limit),
        "num_comm_ctas": max(0, min(pass_config.num_comm_ctas, grid - 1)),
        "minibatch_tiles": minibatch_row_tiles(pass_config.minibatch_size, capacity),
    }
