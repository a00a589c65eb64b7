"""The forward megakernel for an EP group of one (dsl_kernels/sm90/moe_forward.py).

One persistent launch pulls the routed rows of x, runs every gate/up + SwiGLU tile and every
down tile, and stores each down row at its (token, j) slot; the fixed-order combine
(`epilogues.fwd_epilogue`) follows. Its dependency counters are zeroed right before the launch
on the same stream (graph-capturable, no host sync); a wait that gives up reports through the
device's error record (MoKWaitTimeoutError at the next `check_errors`).
"""

from __future__ import annotations

import torch

from .comm import DEFAULT_TIMEOUT_NS, get_error_record
from .expert_gemm import (
    DOWN_N_ALIGNMENT,
    GATE_UP_N_ALIGNMENT,
    K_ALIGNMENT,
    MAX_K,
    MAX_ROWS,
    TILE_ROWS,
    _check,
    _check_multiple,
    _descriptor,
    _sm_count,
)

KERNEL = "moe_forward"


def routed_forward(
    x: torch.Tensor,
    schedule,
    topk: int,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    num_comm_ctas: int = 0,
    minibatch_size: int | None = None,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((x_routed, gate, up, hidden), slots) of the routed experts, in one launch.

    x bf16 [T, H]; weights bf16 [E, I, H] (gate, up) and [E, H, I] (down); `schedule` a
    MoKSchedule of this rank (a group of one). slots bf16 [T * k, H]: row t * k + j is the
    output of token t's j-th expert. Routed rows at or past schedule.num_tokens are not written.
    `num_comm_ctas` CTAs dispatch the rows while the others start the GEMMs (0: every CTA
    dispatches first). `minibatch_size` (routed rows, a multiple of 128; None: all of them):
    the tasks run minibatch by minibatch, pipelined (a minibatch's down tiles after the next
    one's gate/up tiles: dsl_kernels/sm90/tickets.py, Minibatches), so down tiles start before
    every row is dispatched. Any value gives the same bits.
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_tokens, hidden_size = x.shape
    num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
    capacity = schedule.peer_rank.shape[0]
    _check("x", x, torch.bfloat16, (num_tokens, hidden_size))
    _check_multiple("hidden_size", hidden_size, DOWN_N_ALIGNMENT)
    _check_multiple("intermediate_size", intermediate_size, GATE_UP_N_ALIGNMENT)
    _check_multiple("intermediate_size", intermediate_size, K_ALIGNMENT)
    for name, w, shape in (
        ("gate_weights", gate_weights, (num_experts, intermediate_size, hidden_size)),
        ("up_weights", up_weights, (num_experts, intermediate_size, hidden_size)),
        ("down_weights", down_weights, (num_experts, hidden_size, intermediate_size)),
    ):
        _check(name, w, torch.bfloat16, shape)
    if max(hidden_size, intermediate_size) >= MAX_K:
        raise ValueError(f"hidden and intermediate sizes must be below {MAX_K}")
    if capacity >= MAX_ROWS or num_experts * max(hidden_size, intermediate_size) >= MAX_ROWS:
        raise ValueError(f"routed rows and weight rows must be below {MAX_ROWS}")
    minibatch_tiles = minibatch_row_tiles(minibatch_size, capacity)  # before any allocation
    device = x.device
    x_routed = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, device=device)
    gate, up, hidden = (
        torch.empty(capacity, intermediate_size, dtype=torch.bfloat16, device=device)
        for _ in range(3)
    )
    slots = torch.empty(num_tokens * topk, hidden_size, dtype=torch.bfloat16, device=device)
    if capacity == 0 or num_experts == 0 or num_tokens == 0:
        return (x_routed, gate, up, hidden), slots
    # dispatched[m] then hidden_done[m], one int32 per 128-row tile of the routed buffer, then
    # the task ticket.
    counters = torch.zeros(2 * (-(-capacity // TILE_ROWS)) + 1, dtype=torch.int32, device=device)
    kernel = get_kernel(KERNEL, device=device)
    gate_up_flat = (num_experts * intermediate_size, hidden_size)
    grid = _sm_count(device)
    kernel.launch(
        (grid, 1, 1),
        {
            "tma_x": _descriptor(kernel, "tma_x", x_routed),
            "tma_wg": _descriptor(kernel, "tma_wg", gate_weights.view(gate_up_flat)),
            "tma_wu": _descriptor(kernel, "tma_wu", up_weights.view(gate_up_flat)),
            "tma_h": _descriptor(kernel, "tma_h", hidden),
            "tma_wd": _descriptor(
                kernel, "tma_wd", down_weights.view(num_experts * hidden_size, intermediate_size)
            ),
            "x_ptr": x,
            "x_routed_ptr": x_routed,
            "gate_ptr": gate,
            "up_ptr": up,
            "hidden_ptr": hidden,
            "slots_ptr": slots,
            **walk_arguments(
                schedule,
                counters,
                timeout_ns,
                x,
                gate_weights,
                topk,
                swiglu_limit,
                num_comm_ctas,
                grid,
                minibatch_tiles,
            ),  # fmt: skip
        },
    )
    return (x_routed, gate, up, hidden), slots


def minibatch_row_tiles(minibatch_size: int | None, capacity: int) -> int:
    """The megakernel's minibatch in 128-row tiles: `minibatch_size` routed rows (a positive
    multiple of 128), at most the whole routed buffer (None: all of it, one minibatch)."""
    all_tiles = max(1, -(-capacity // TILE_ROWS))
    if minibatch_size is None:
        return all_tiles
    if isinstance(minibatch_size, bool) or not isinstance(minibatch_size, int) or (
        minibatch_size <= 0 or minibatch_size % TILE_ROWS
    ):  # fmt: skip
        raise ValueError(
            f"minibatch_size must be None or a positive multiple of {TILE_ROWS} routed rows, "
            f"got {minibatch_size!r}"
        )
    return min(minibatch_size // TILE_ROWS, all_tiles)


# The phase clock (a diagnostic, tools/diag_phase_clock.py): an int64 CUDA tensor [>= grid, 8]
# the megakernels stamp %globaltimer into at their phase boundaries
# (dsl_kernels/common/phase_clock.py), or None (the default: no stamps).
_phase_clock: torch.Tensor | None = None
CLOCK_SLOTS = 8


def set_phase_clock(clock: torch.Tensor | None) -> torch.Tensor | None:
    """Stamp the megakernels' phase boundaries into `clock` from the next launch on (None:
    stop); returns the previous clock. Rows are CTAs, columns the slots of phase_clock.py."""
    global _phase_clock
    if clock is not None and (
        clock.dtype != torch.int64 or clock.dim() != 2 or clock.shape[1] != CLOCK_SLOTS
        or not clock.is_contiguous() or not clock.is_cuda
    ):  # fmt: skip
        raise ValueError(
            f"clock must be a contiguous int64 CUDA tensor [CTAs, {CLOCK_SLOTS}], got "
            f"{clock.dtype} {tuple(clock.shape)} on {clock.device}"
        )
    if clock is not None and clock.shape[0] < _sm_count(clock.device):
        raise ValueError(
            f"clock needs a row per CTA: at least {_sm_count(clock.device)} rows (the SM "
            f"count), got {clock.shape[0]}"
        )
    previous, _phase_clock = _phase_clock, clock
    return previous


# None: the config's count; 0: every CTA dispatches before its tasks (a diagnostic A/B).
_comm_override: int | None = None


def set_comm_ctas(count: int | None) -> int | None:
    """Diagnostics: run the megakernels with `count` communication CTAs whatever the config
    says (0: every CTA dispatches first), or None (the config's); returns the previous
    override."""
    global _comm_override
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(f"count must be None or an int >= 0, got {count!r}")
    previous, _comm_override = _comm_override, count
    return previous


def comm_count(num_comm_ctas: int, grid: int) -> int:
    """The communication CTAs a launch runs with: the config's (or set_comm_ctas's), at most
    grid - 1."""
    comm = num_comm_ctas if _comm_override is None else _comm_override
    return max(0, min(comm, grid - 1))


def walk_arguments(
    schedule, counters, timeout_ns, rows, gate_weights, topk, swiglu_limit, num_comm_ctas, grid,
    minibatch_tiles,
) -> dict:  # fmt: skip
    """The launch arguments both megakernels (forward and backward) take for their dispatch
    and task walk: the schedule, the zeroed counters, the error record, the sizes (`rows` the
    [T, H] source of the dispatch, `gate_weights` [E, I, H]), the communication CTAs
    (`comm_count` of the launch's `grid`) and the minibatch in row tiles (`minibatch_row_tiles`)."""
    return {
        "peer_rank_ptr": schedule.peer_rank,
        "peer_token_idx_ptr": schedule.peer_token_idx,
        "num_tokens_ptr": schedule.num_tokens,
        "tokens_per_expert_ptr": schedule.tokens_per_expert,
        "counters_ptr": counters,
        "error_record_ptr": get_error_record(counters.device).device_ptr,
        "clock_ptr": _phase_clock,
        "timeout_ns": timeout_ns,
        "num_experts": gate_weights.shape[0],
        "hidden_size": rows.shape[1],
        "intermediate_size": gate_weights.shape[1],
        "topk": topk,
        "num_src_rows": rows.shape[0],
        "capacity": schedule.peer_rank.shape[0],
        "has_limit": int(swiglu_limit is not None),
        "swiglu_limit": 0.0 if swiglu_limit is None else float(swiglu_limit),
        "num_comm_ctas": comm_count(num_comm_ctas, grid),
        "minibatch_tiles": minibatch_tiles,
    }
