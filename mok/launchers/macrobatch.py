"""Macrobatch ring reuse with replay: the GPU forward and backward ops when
`MoKConfig.macrobatch_size` is below the routed rows T * k (forward_op.py and backward_op.py
hand over to this module; every other size runs there, every routed row at once).

Macrobatch m is rows [m * MB, min((m + 1) * MB, C)) of the schedule (MB = macrobatch_size, a
multiple of 128 and of the minibatch; C the capacity): the `macrobatch_schedule` kernel writes
each one's sub-schedule (its rows and its clipped expert segments) on the device, and each
megakernel launch walks one macrobatch through views of the schedule, with no host sync.

    forward   macrobatches C / MB - 1 .. 0, one forward megakernel launch each (dispatch,
              gate/up + SwiGLU, down rows pushed to their slots); the context returned holds
              macrobatch 0's rows only ([MB, H], [MB, I]); shared expert and the fixed-order
              combine as forward_op's
    backward  macrobatches 0 .. C / MB - 1: macrobatch 0 from the context (or every macrobatch
              from a context of all C rows, e.g. a recomputed one), each later one replayed
              (gather_rows, the gate/up + SwiGLU kernel: recompute_forward_context's kernels,
              bitwise the forward's); then one backward megakernel launch (dispatch of w * dY,
              d_hidden + SwiGLU backward, d_x rows to slots, and for bf16 weight gradients its
              weight tasks: the `window` variant, backward_megakernel.WeightWindow) and the
              router-grad push; with fp32 main_grads or MXFP8, the launch without its weight
              phase and the window weight-gradient kernel for each of dW_gate, dW_up, dW_down
              (expert_gemm_bwd_weights_window.py). Either way each expert's fp32 sum goes on
              from the previous macrobatch's partial and is rounded to bf16 (or added into its
              fp32 main_grad) only in the macrobatch holding the expert's last rows

With MoKConfig.macrobatch_replay "gather" (BF16) each forward launch writes its gate, up and
hidden rows into tensors of every row, which the context keeps beside macrobatch 0's x rows,
and the backward's replay of a later macrobatch is gather_rows alone.

Every row's results are computed by the same tiles as with one macrobatch (its edges are row
tile edges) and every weight-gradient sum runs over the same 64-row K steps in the same order,
continued in fp32: every output and gradient is bitwise the same for every macrobatch size.

Memory: the routed buffers are per macrobatch, released before the next macrobatch's are made,
so torch's caching allocator hands the same memory back (stream-ordered): the ring. The
backward holds the context (macrobatch 0), one replay ring, one macrobatch of activation
gradients and two fp32 partials of [3 * H * I] (one expert crosses each macrobatch edge).
"""

from __future__ import annotations

import torch

from ..types import MoKSchedule
from ..validation import check_macrobatch, fused_gate_up, tensor_key
from . import dispatch, epilogues, expert_gemm, mxfp8
from .backward_megakernel import WeightWindow, launch_routed_backward, push_router_grads
from .checks import (
    check_counts,
    check_cuda,
    check_expert_weights,
    check_extents,
    check_gpu_layer,
    check_macrobatch_edge,
    check_multiple,
)
from .comm import group_barrier, publish_x
from .device_args import TILE_ROWS, sm_count
from .expert_gemm_bwd import M_ALIGNMENT, N_ALIGNMENT, gate_up_gradients
from .forward_megakernel import launch_routed_forward
from .peer_table import peer_table
from .plans import Descriptors, aligned, all_aligned, current_stream, plan
from .shared_expert import shared_backward, shared_forward

SCHEDULE_KERNEL = "macrobatch_schedule"
# The macrobatch_schedule kernel's one CTA has a thread per local expert.
MAX_LOCAL_EXPERTS = 1024
# weight_gradient_window's `output` -> (kernel, dtype of out)
# The window kernels' params a call of a bound launch writes (`_WindowPlan`), in its order.
WINDOW_DYNAMIC = (
    "tma_a",
    "tma_b",
    "out_ptr",
    "partial_in_ptr",
    "partial_out_ptr",
    "tokens_per_expert_ptr",
    "first_row",
)
WINDOW_KERNELS = {
    "bf16": ("expert_gemm_bwd_weights_window_bf16", torch.bfloat16),
    "accumulate": ("expert_gemm_bwd_weights_window_accumulate", torch.float32),
}


def num_macrobatches(capacity: int, macrobatch_size: int) -> int:
    """Macrobatches of a schedule of `capacity` rows (at least one)."""
    return max(1, -(-capacity // macrobatch_size))


def window_schedules(schedule, macrobatch_size: int) -> list[tuple[int, MoKSchedule]]:
    """(first row, sub-schedule) of each macrobatch of `schedule` (one `macrobatch_schedule`
    launch, no host sync): rows as views of the schedule's, num_tokens and tokens_per_expert
    written on the device. mok.reference.macrobatch_windows is the oracle."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity = schedule.peer_rank.shape[0]
    num_experts = schedule.tokens_per_expert.shape[0]
    if not 1 <= num_experts <= MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"a macrobatch below the routed rows takes 1 to {MAX_LOCAL_EXPERTS} local experts, "
            f"got {num_experts}"
        )
    windows = num_macrobatches(capacity, macrobatch_size)
    device = schedule.peer_rank.device
    num_tokens = torch.empty(windows, dtype=torch.int32, device=device)
    tokens_per_expert = torch.empty(windows, num_experts, dtype=torch.int32, device=device)
    get_kernel(SCHEDULE_KERNEL, device=device).launch(
        (1, 1, 1),
        {
            "num_tokens_ptr": schedule.num_tokens,
            "tokens_per_expert_ptr": schedule.tokens_per_expert,
            "window_tokens_ptr": num_tokens,
            "window_tokens_per_expert_ptr": tokens_per_expert,
            "num_experts": num_experts,
            "num_windows": windows,
            "window_rows": macrobatch_size,
            "capacity": capacity,
        },
    )
    out = []
    for m in range(windows):
        rows = slice(m * macrobatch_size, min((m + 1) * macrobatch_size, capacity))
        out.append((rows.start, MoKSchedule(
            schedule.peer_rank[rows], schedule.peer_token_idx[rows], num_tokens[m : m + 1],
            tokens_per_expert[m],
        )))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------


def forward(ws, schedule, x, router_weights, shared, routed, pass_config):
    """forward_op.forward with ring reuse: the same outputs, bitwise; the routed context holds
    macrobatch 0 ([macrobatch_size, H], [macrobatch_size, I])."""
    check_gpu_layer(ws, "forward")
    num_tokens, topk = router_weights.shape
    macrobatch_size = pass_config.macrobatch_size
    check_macrobatch(macrobatch_size, num_tokens, topk, "forward", pass_config.minibatch_size)
    table = peer_table(ws)
    publish_x(ws, x, table)
    peers = None if table is None else (ws.ep_rank, table)
    slots = ws.buffers["combine_buffer"]
    windows = window_schedules(schedule, macrobatch_size)
    # MXFP8 pairs: their bf16 values once for every macrobatch's launch.
    dequantized = mxfp8.dequantized_weights(routed) if isinstance(routed[0], tuple) else None
    # macrobatch_replay "gather": gate, up and hidden of every macrobatch written into tensors
    # of every row, which the context keeps.
    kept = None
    if pass_config.macrobatch_replay == "gather":
        rows, inter = schedule.peer_rank.shape[0], routed[0].shape[1]
        kept = [torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device) for _ in range(3)]
    routed_ctx = None
    # Last to first: the context left is macrobatch 0's. Each macrobatch's buffers are
    # dropped before the next macrobatch's are made: the allocator hands the memory back.
    for first, window in reversed(windows):
        routed_ctx, context = None, None
        if kept is not None:
            rows = window.peer_rank.shape[0]
            x_routed = torch.empty(rows, x.shape[1], dtype=torch.bfloat16, device=x.device)
            context = (x_routed, *(t[first : first + rows] for t in kept))
        routed_ctx, slots = launch_routed_forward(
            x,
            window,
            ws.topk,
            routed,
            pass_config,
            peers=peers,
            slots=slots,
            dequantized=dequantized,
            context=context,
        )
    if kept is not None:
        routed_ctx = (routed_ctx[0], *kept)
    group_barrier(ws, "PEER_BARRIER_END")
    # Distinct empty tensors: custom-op outputs may not alias each other.
    shared_ctx, y_shared = tuple(x.new_empty(0) for _ in range(3)), None
    if shared[0] is not None:
        *shared_ctx, y_shared = shared_forward(x, *shared, pass_config.swiglu_limit)
    out = epilogues.fwd_epilogue(y_shared, slots, router_weights)
    return (out, *routed_ctx, *shared_ctx)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


def backward(ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
             pass_config, main_grads):  # fmt: skip
    """backward_op.backward with ring reuse and replay: the same outputs, bitwise. The routed
    context holds macrobatch 0 (forward's) or every row (recompute_forward_context's)."""
    check_gpu_layer(ws, "backward")
    num_tokens, topk = router_weights.shape
    macrobatch_size = pass_config.macrobatch_size
    check_macrobatch(macrobatch_size, num_tokens, topk, "backward", pass_config.minibatch_size)
    # MXFP8 (backward_op.py's layer): the GEMMs read the transposed copies' bf16 values, the
    # replay the forward pairs' (along H); every GEMM operand is a round trip.
    is_mxfp8, forward_weights, weights = isinstance(routed[0], tuple), routed[:2], routed
    if is_mxfp8:
        forward_weights = mxfp8.dequantized_weights((routed[0][:2], routed[1][:2]))
        weights = mxfp8.backward_weights(routed)
    routed_gate, routed_up, routed_down = weights
    if routed_down.shape[2] % N_ALIGNMENT:
        raise ValueError(
            f"intermediate_size must be a multiple of {N_ALIGNMENT} on the sm_90a backward "
            f"kernel path, got {routed_down.shape[2]}"
        )
    x_routed, gate, up, hidden, gate_s, up_s, hidden_s = ctx_tensors
    capacity = schedule.peer_rank.shape[0]
    first_rows = min(macrobatch_size, capacity)
    if x_routed.dim() != 2 or x_routed.shape[0] not in (capacity, first_rows):
        raise ValueError(
            f"forward_context.x_routed must hold macrobatch 0 ({first_rows} rows) or every "
            f"routed row ({capacity}), got shape {list(x_routed.shape)}"
        )
    full_context = x_routed.shape[0] == capacity
    # MoKConfig.macrobatch_replay "gather": gate, up and hidden of every row beside macrobatch
    # 0's x rows; a later macrobatch pulls its x rows again and nothing else.
    gathered = not full_context and gate.dim() == 2 and gate.shape[0] == capacity
    table = peer_table(ws)
    peers = None if table is None else (ws.ep_rank, table)
    slots = ws.buffers["d_x_routed_buffer"]
    if table is None:
        d_router = torch.empty(num_tokens, topk, dtype=torch.float32, device=x.device)
    else:
        ws.buffers["d_y_buffer"].copy_(grad_output)
        ws.buffers["router_weight_buffer"].copy_(router_weights)
        # The replayed macrobatches pull x rows again (on every rank: a peer may replay).
        ws.buffers["x_buffer"].copy_(x)
        d_router = ws.buffers["d_router_weight_buffer"]
    group_barrier(ws, "PEER_BARRIER_START")

    windows = window_schedules(schedule, macrobatch_size)
    fused = (main_grads[0] is None and main_grads[1] is None
             and fused_gate_up(routed_gate, routed_up))  # fmt: skip
    grads = _WeightGradients(*weights, main_grads[:3], fused)
    # bf16 gradients: each macrobatch's weight tiles in its backward launch.
    in_launch = not is_mxfp8 and all(g is None for g in main_grads[:3])
    replay = None
    if not full_context:
        replay = _Replay(x, *forward_weights, pass_config.swiglu_limit, first_rows, is_mxfp8,
                         x_only=gathered)  # fmt: skip
    for m, (first, window) in enumerate(windows):
        rows = window.peer_rank.shape[0]
        if full_context:
            ctx = tuple(t[first : first + rows] for t in (x_routed, gate, up, hidden))
        elif gathered:
            x_rows = x_routed if m == 0 else replay.x_rows(window, topk, peers)
            ctx = (x_rows, *(t[first : first + rows] for t in (gate, up, hidden)))
        elif m == 0:
            ctx = (x_routed, gate, up, hidden)
        else:
            ctx = replay(window, topk, peers)
        x_rows, gate_rows, up_rows, hidden_rows = ctx
        if is_mxfp8:  # the SwiGLU backward's inputs (a context exact already: identities)
            gate_rows, up_rows = mxfp8.gate_up_operands(gate_rows, up_rows)
        dy_e, d_gate, d_up, partials, slots, _ = launch_routed_backward(
            grad_output,
            router_weights,
            window,
            (x_rows, gate_rows, up_rows, hidden_rows),
            weights,
            pass_config,
            weight_grads=False,
            peers=peers,
            slots=slots,
            mxfp8=is_mxfp8,
            window=grads.window(m, first, schedule.tokens_per_expert) if in_launch else None,
        )
        push_router_grads(partials, window, router_weights, d_router, peers=peers)
        if not in_launch:
            if is_mxfp8:  # every operand's round trip along the tokens (32-row blocks: a
                # macrobatch edge is a block edge)
                dy_e, x_rows, d_gate, d_up, hidden_rows = mxfp8.weight_gradient_operands(
                    dy_e, d_gate, d_up, x_rows, hidden_rows
                )
            grads.add(m, first, schedule.tokens_per_expert, (d_gate, d_up, dy_e),
                      (x_rows, hidden_rows))  # fmt: skip
        # Released before the next macrobatch's are made (stream-ordered: the allocator
        # hands the memory back to the next launch only).
        del dy_e, d_gate, d_up, partials, ctx, x_rows, gate_rows, up_rows, hidden_rows
    group_barrier(ws, "PEER_BARRIER_END")
    if table is not None:
        d_router = d_router.clone()  # the buffer is the next call's

    # Distinct empty tensors: custom-op outputs may not alias each other.
    d_x_shared, shared_grads = None, [x.new_empty(0) for _ in range(3)]
    if shared[0] is not None:
        shared_ctx, limit = (gate_s, up_s, hidden_s), pass_config.swiglu_limit
        d_x_shared, shared_grads = shared_backward(
            grad_output, x, shared_ctx, shared, limit, main_grads[3:]
        )
    d_x = epilogues.bwd_epilogue(d_x_shared, slots, topk)
    return (d_x, d_router, *grads.results(x), *shared_grads)


class _Replay:
    """A later macrobatch's context, rebuilt into one ring of [macrobatch_size] rows: its x rows
    pulled (gather_rows), gate/up + SwiGLU (recompute_forward_context's kernels, bitwise the
    forward megakernel's rows), or with `x_only` the x rows alone. `mxfp8`: the GEMMs read the
    x rows' round trip along H (one more ring) and the weights are the forward pairs' bf16
    values, as the MXFP8 forward's."""

    def __init__(self, x, gate_weights, up_weights, swiglu_limit, rows: int, mxfp8=False,
                 x_only=False):  # fmt: skip
        inter = gate_weights.shape[1]
        bf16 = dict(dtype=torch.bfloat16, device=x.device)
        self.x, self.weights, self.limit = x, (gate_weights, up_weights), swiglu_limit
        self.x_ring = torch.empty(rows, x.shape[1], **bf16)
        # gate, up, hidden: only where `__call__` runs (not with `x_only`).
        self.ring = () if x_only else tuple(torch.empty(rows, inter, **bf16) for _ in range(3))
        self.rounded = torch.empty(rows, x.shape[1], **bf16) if mxfp8 and not x_only else None

    def x_rows(self, window, topk: int, peers):
        """The macrobatch's x rows, pulled into the ring (all a `x_only` replay makes)."""
        x_routed = self.x_ring[: window.peer_rank.shape[0]]
        dispatch.gather_rows(self.x, window.peer_rank, window.peer_token_idx, window.num_tokens,
                             topk, out=x_routed, peers=peers)  # fmt: skip
        return x_routed

    def __call__(self, window, topk: int, peers) -> tuple:
        """(x_routed, gate, up, hidden) of the macrobatch."""
        rows = window.peer_rank.shape[0]
        x_routed = self.x_rows(window, topk, peers)
        gate, up, hidden = (t[:rows] for t in self.ring)
        a_rows = x_routed
        if self.rounded is not None:
            a_rows = mxfp8.mxfp8_round_trip(x_routed, along_rows=False, out=self.rounded[:rows])
        expert_gemm.gate_up_swiglu(
            a_rows,
            *self.weights,
            window.tokens_per_expert,
            swiglu_limit=self.limit,
            gate=gate,
            up=up,
            hidden=hidden,
        )
        return x_routed, gate, up, hidden


class _WeightGradients:
    """dW_gate, dW_up, dW_down summed macrobatch by macrobatch (in each backward launch,
    `window`, or weight_gradient_window, `add`): into new bf16 tensors, or added into the fp32
    main_grads given. Two fp32 partial slots per GEMM: macrobatch m reads slot m % 2 (what
    crossed its first edge) and writes slot (m + 1) % 2."""

    def __init__(self, gate_weights, up_weights, down_weights, main_grads, fused=False):
        num_experts, inter, hidden = gate_weights.shape
        device = gate_weights.device
        self.outputs, self.modes, self.fused = [], [], fused
        # `fused` (no gate/up main_grads): dW_gate, dW_up the halves of one [E, 2 I, H].
        gate_up = gate_up_gradients(num_experts, inter, hidden, fused, device)
        for g, (weight, main_grad) in enumerate(zip((gate_weights, up_weights, down_weights),
                                                    main_grads, strict=True)):  # fmt: skip
            if main_grad is None:
                self.outputs.append(gate_up[g] if g < 2 else
                                    torch.empty(weight.shape, dtype=torch.bfloat16, device=device))  # fmt: skip
                self.modes.append("bf16")
            else:
                self.outputs.append(main_grad if main_grad.dim() == 3 else main_grad.unsqueeze(0))
                self.modes.append("accumulate")
        self.partials = torch.empty(2, 3, inter * hidden, dtype=torch.float32, device=device)
        self.shapes = ((inter, hidden), (inter, hidden), (hidden, inter))

    def window(self, m: int, first_row: int, tokens_per_expert) -> WeightWindow:
        """Macrobatch m's part in its backward launch (bf16 gradients only): it starts at
        schedule row `first_row`; `tokens_per_expert` is the whole schedule's."""
        return WeightWindow(tokens_per_expert, first_row, tuple(self.outputs),
                            self.partials[m % 2], self.partials[(m + 1) % 2])  # fmt: skip

    def add(self, m: int, first_row: int, tokens_per_expert, a_rows: tuple, b_rows: tuple):
        """Macrobatch m's part: `a_rows` = (d_gate, d_up, dY_e), `b_rows` = (x_routed, hidden)
        of its rows, which start at schedule row `first_row`."""
        x_routed, hidden = b_rows
        for g, (a, b) in enumerate(zip(a_rows, (x_routed, x_routed, hidden), strict=True)):
            partial_in, partial_out = (self.partials[s, g].view(self.shapes[g])
                                       for s in (m % 2, (m + 1) % 2))  # fmt: skip
            weight_gradient_window(a, b, tokens_per_expert, first_row, self.outputs[g],
                                   partial_in, partial_out, output=self.modes[g])  # fmt: skip

    def results(self, like) -> list:
        """[dW_gate, dW_up, dW_down]: bf16, or empty where added into a main_grad; `fused`:
        the [E, 2 I, H] gradient in gate's place, empty in up's (the op's outputs)."""
        results = [out if mode == "bf16" else like.new_empty(0)
                   for out, mode in zip(self.outputs, self.modes, strict=True)]  # fmt: skip
        if self.fused:
            results[:2] = [self.outputs[0]._base, like.new_empty(0)]
        return results


def weight_gradient_window(
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    first_row: int,
    out: torch.Tensor,
    partial_in: torch.Tensor,
    partial_out: torch.Tensor,
    *,
    output: str,
) -> torch.Tensor:
    """One macrobatch's part of out[e] = A[rows of e]^T @ B[rows of e] (kernel
    expert_gemm_bwd_weights_window_*): a_rows bf16 [R, M] and b_rows bf16 [R, N] are the
    macrobatch's routed rows, schedule rows first_row .. first_row + R - 1; `tokens_per_expert`
    int32 [E] the whole schedule's. An expert's sum starts from `partial_in` (fp32 [M, N]) where
    its rows began in an earlier macrobatch and goes into `partial_out` where they go on past
    this one; else it is finished here: out bf16 [E, M, N] (output "bf16") or out fp32 += sum
    (output "accumulate", a main_grad); `out` may be a half of a fused [E, 2 M, N] tensor
    (checks.expert_rows). An expert with no rows is finished (zeros, or out += 0)
    by the macrobatch at row 0. Constraints: M % 128 == 0, N % 256 == 0, first_row % 128 == 0.
    """
    if output not in WINDOW_KERNELS:
        raise ValueError(f"output must be one of {sorted(WINDOW_KERNELS)}, got {output!r}")
    check_macrobatch_edge(first_row, partial_in, partial_out)
    # Everything but the addresses and first_row is the plan's key: its first call runs the
    # full checks (one macrobatch after another reuses it, a launch each).
    key = (
        "weights_window",
        output,
        tensor_key(a_rows),
        tensor_key(b_rows),
        tensor_key(tokens_per_expert),
        tensor_key(out),
        tensor_key(partial_in),
        tensor_key(partial_out),
        current_stream(a_rows.get_device()),
    )

    def make():
        return _WindowPlan(a_rows, b_rows, tokens_per_expert, out, partial_in, partial_out, output)

    plan(key, make)(a_rows, b_rows, tokens_per_expert, first_row, out, partial_in, partial_out)
    return out


class _WindowPlan:
    """`weight_gradient_window` for one (shapes, output): checked and bound on its first call;
    a call writes the addresses and first_row, and launches (none for no experts)."""

    def __init__(self, a_rows, b_rows, tokens_per_expert, out, partial_in, partial_out, output):
        from mok.runtime import get_kernel  # noqa: PLC0415

        rows, m_size = a_rows.shape if a_rows.dim() == 2 else (-1, -1)
        n_size = b_rows.shape[1] if b_rows.dim() == 2 else -1
        num_experts = tokens_per_expert.shape[0] if tokens_per_expert.dim() == 1 else -1
        kernel_name, out_dtype = WINDOW_KERNELS[output]
        check_cuda("a_rows", a_rows, torch.bfloat16, (rows, m_size))
        check_cuda("b_rows", b_rows, torch.bfloat16, (rows, n_size))
        check_multiple("M (a_rows.shape[1])", m_size, M_ALIGNMENT)
        check_multiple("N (b_rows.shape[1])", n_size, N_ALIGNMENT)
        check_multiple("the macrobatch's rows", rows, TILE_ROWS)
        check_counts("tokens_per_expert", tokens_per_expert, num_experts)
        out_rows = check_expert_weights("out", out, out_dtype, (num_experts, m_size, n_size))
        check_extents("E * out rows per expert", rows, num_experts * out_rows, m_size, n_size)
        check_cuda("partial_in", partial_in, torch.float32, (m_size, n_size))
        check_cuda("partial_out", partial_out, torch.float32, (m_size, n_size))
        self.bound = None
        self.device_index = a_rows.get_device()
        if num_experts == 0:
            return
        kernel = get_kernel(kernel_name, device=a_rows.device)
        self.tma_a, self.tma_b = Descriptors(kernel, "tma_a"), Descriptors(kernel, "tma_b")
        tiles = num_experts * (m_size // M_ALIGNMENT) * (n_size // N_ALIGNMENT)
        grid = (max(1, min(sm_count(a_rows.device), tiles)), 1, 1)
        self.bound = kernel.bind(
            grid,
            {
                "tma_a": self.tma_a.get(a_rows),
                "tma_b": self.tma_b.get(b_rows),
                "out_ptr": out,
                "partial_in_ptr": partial_in,
                "partial_out_ptr": partial_out,
                "tokens_per_expert_ptr": tokens_per_expert,
                "num_experts": num_experts,
                "m_size": m_size,
                "n_size": n_size,
                "out_expert_rows": out_rows,
                "first_row": 0,
                "window_rows": rows,
            },
            dynamic=WINDOW_DYNAMIC,
        )

    def __call__(
        self, a_rows, b_rows, tokens_per_expert, first_row, out, partial_in, partial_out
    ) -> None:
        if self.bound is None:
            return
        addresses = (
            a_rows.data_ptr(),
            b_rows.data_ptr(),
            out.data_ptr(),
            partial_in.data_ptr(),
            partial_out.data_ptr(),
        )
        all_aligned(("a_rows", "b_rows", "out", "partial_in", "partial_out"), addresses)
        aligned("tokens_per_expert", tokens_per_expert.data_ptr(), 4)
        self.bound.launch(
            self.tma_a.at(addresses[0], lambda: a_rows),
            self.tma_b.at(addresses[1], lambda: b_rows),
            *addresses[2:],
            tokens_per_expert.data_ptr(),
            first_row,
            stream=current_stream(self.device_index),
        )
