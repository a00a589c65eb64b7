"""The backward megakernel's launcher (mok/dsl_kernels/sm90/moe_backward.py): dispatch, d_hidden,
d_x to slots and (unless fp32 main_grads take them) the weight gradients in one launch; for a
plan made with `finish` (a group of one without a shared expert, launchers/backward_op.py), also
backward_finish's d_x sum and router-weight gradients as the launch's last phase; with a
`WeightWindow` (one macrobatch of ring reuse, launchers/macrobatch.py), that macrobatch's part
of the bf16 weight gradients, continued from and into fp32 partials. Its counters (the plan's
`plans.Counters`) are zero when it starts, as the forward megakernel's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import DEFAULT_WAIT_TIMEOUT_NS
from ..types import PassConfig
from .checks import (
    check_arg,
    check_counts,
    check_cuda,
    check_expert_weights,
    check_macrobatch_edge,
    check_multiple,
    expert_rows_view,
)
from .device_args import sm_count, tma_descriptor
from .expert_gemm_bwd import N_ALIGNMENT, gate_up_gradients
from .megakernel_walk import (
    BACKWARD_COUNTER_TAIL,
    check_routed_operands,
    megakernel_counters,
    stamped_ctas,
    walk_arguments,
)
from .plans import (
    Carve,
    Descriptors,
    aligned,
    all_aligned,
    current_stream,
    plan,
    schedule_addresses,
    tensor_key,
    weight_key,
)
from .status import status_ptr

KERNEL = "moe_backward"
KERNEL_MXFP8 = "moe_backward_mxfp8"
KERNEL_WINDOW = "moe_backward_window"


class WeightWindow(NamedTuple):
    """One macrobatch's bf16 weight gradients in its backward launch (the `window` variant).
    The launch's schedule is the macrobatch's (its rows, its clipped segments) and its context
    the macrobatch's rows; `tokens_per_expert` (int32 [E]) is the whole schedule's and
    `first_row` (a multiple of 128) the schedule row of the macrobatch's first. Each expert's
    tile sums start from `partial_in` where its segment began in an earlier macrobatch, go
    into `partial_out` where it goes on past this one (fp32 [3, H * I] each, different
    buffers: dW_down's [H, I], dW_gate's and dW_up's [I, H] sums, in that order), and are
    rounded into `d_weights` = (dW_gate, dW_up, dW_down) (bf16 [E, I, H] (or the halves of one
    [E, 2 I, H]), [E, I, H], [E, H, I]) in the macrobatch of the segment's last rows."""

    tokens_per_expert: torch.Tensor
    first_row: int
    d_weights: tuple
    partial_in: torch.Tensor
    partial_out: torch.Tensor


def routed_backward(
    grad_output: torch.Tensor,
    router_weights: torch.Tensor,
    schedule,
    x_routed: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    hidden: torch.Tensor,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    weight_grads: bool = True,
    num_comm_ctas: int = 0,
    minibatch_size: int | None = None,
    timeout_ns: int = DEFAULT_WAIT_TIMEOUT_NS,
    peers: tuple | None = None,
    slots: torch.Tensor | None = None,
    grid: int | None = None,
    mxfp8: bool = False,
    fused_grads: bool = False,
) -> tuple:
    """(dy_e, d_gate, d_up, router_partials, slots, [dW_gate, dW_up, dW_down] or None) in one launch.

    grad_output bf16 [T, H]; router_weights fp32 [T, k]; x_routed bf16 [C, H], gate, up, hidden
    bf16 [C, I] (forward context); weights bf16 [E, I, H] (gate, up), [E, H, I] (down); `schedule`
    this rank's MoKSchedule. `peers` = (ep_rank, the EP group's peer table,
    launchers.peer_table; None: a group of one): rows of other ranks' tokens pull dY and w from
    their buffers and push d_x into their slots (d_x_routed) buffers. Outputs: dy_e bf16 [C, H]; d_gate, d_up bf16 [C, I];
    router_partials fp32 [C, I / 128]; slots bf16 [T * k, H] (row t * k + j: token t's d_x through
    expert j). `weight_grads`: bf16 weight gradients, bitwise expert_gemm_bwd.weight_gradient's.
    The settings are a PassConfig's fields (mok.types): `num_comm_ctas` CTAs dispatch while
    the rest compute (0: all dispatch first); `minibatch_size` (routed rows; None: all) never
    changes the bits; `grid`: CTAs (None: the SM count). `slots`: the d_x slots buffer to push
    into (None: a new one).

    `mxfp8`: the MXFP8 variant (SEMANTICS §5). The weights are the bf16 values of the MXFP8
    copies, new tensors on every call (bound per launch; their shapes are fixed by the plan's
    key, or its op's MXFP8 tuples, so they pass the plan's checks as the first call's did); gate
    and up the context's round trips along I; the GEMMs read dY_e's round trip along H and
    d_gate's and d_up's along I (scratch per call). No weight gradients in the launch (`weight_grads` must be False): their operands
    are round-tripped along the tokens first (backward_op.py).

    `fused_grads`: dW_gate and dW_up are the two halves of one new [E, 2 I, H] bf16 tensor
    (for weights that are the halves of one: validation.fused_gate_up).
    """
    pass_config = PassConfig(swiglu_limit=swiglu_limit, num_comm_ctas=num_comm_ctas,
                             minibatch_size=minibatch_size, timeout_ns=timeout_ns, grid=grid)  # fmt: skip
    return launch_routed_backward(
        grad_output, router_weights, schedule, (x_routed, gate, up, hidden),
        (gate_weights, up_weights, down_weights), pass_config, weight_grads=weight_grads,
        peers=peers, slots=slots, mxfp8=mxfp8, fused_grads=fused_grads,
    )  # fmt: skip


def launch_routed_backward(grad_output, router_weights, schedule, context, weights, pass_config,
                           *, weight_grads=True, peers=None, slots=None, mxfp8=False,
                           fused_grads=False, window=None):  # fmt: skip
    """`routed_backward` with its context (x_routed, gate, up, hidden), routed weights (gate,
    up, down) and settings (a PassConfig) each as one object, as the launch path holds them.
    `window`: a WeightWindow (then `weight_grads` must be False: the gradients are the
    window's)."""
    window_key = None
    if window is not None:
        window_key = (tensor_key(window.tokens_per_expert), *map(tensor_key, window.d_weights),
                      tensor_key(window.partial_in), tensor_key(window.partial_out))  # fmt: skip
    key = (
        KERNEL, tensor_key(grad_output), tensor_key(router_weights),
        tensor_key(schedule.peer_rank), tensor_key(schedule.peer_token_idx),
        tensor_key(schedule.num_tokens), tensor_key(schedule.tokens_per_expert),
        *map(tensor_key, context), *map(tensor_key if mxfp8 else weight_key, weights),
        tensor_key(slots), pass_config, weight_grads,
        None if peers is None else (peers[0], peers[1].data_ptr()),
        mxfp8, fused_grads, window_key, current_stream(grad_output.get_device()),
    )  # fmt: skip

    def make():
        return backward_plan(
            grad_output, router_weights, schedule, context, weights, pass_config, weight_grads,
            peers, slots, mxfp8, fused_grads=fused_grads, window=window,
        )  # fmt: skip

    launch = plan(key, make)
    call_weights = weights if mxfp8 else None  # read per launch only as MXFP8's bf16 values
    return launch(grad_output, router_weights, schedule, context, slots, call_weights,
                  window=window)  # fmt: skip


def backward_plan(
    grad_output, router_weights, schedule, context, weights, pass_config, weight_grads, peers,
    slots, mxfp8=False, finish=False, fused_grads=False, window=None,
):  # fmt: skip
    """`routed_backward`'s plan for these arguments (checked now); call it as
    plan(grad_output, router_weights, schedule, context, slots, weights) (`context` = (x_routed,
    gate, up, hidden); `weights` = (gate, up, down) with `mxfp8`, else None). `finish` (a group
    of one: `peers` None): the launch also writes d_x = sum_j slots[t * k + j] (bf16 [T, H])
    and the router weights' gradient d_router (fp32 [T, k]), backward_finish's bits and
    router-weight check; pass `finish` = (d_x, d_router) to the call (or their addresses to
    `launch`). `window`: a WeightWindow (checked now; pass one of the same shapes to each
    call)."""
    if finish and peers is not None:
        raise ValueError("finish: the in-kernel finish is a group of one's (peers must be None)")
    return _BackwardPlan(grad_output, router_weights, schedule, context, weights, pass_config,
                         weight_grads, peers, slots, mxfp8, finish, fused_grads, window)  # fmt: skip


class _BackwardPlan:
    """One (shapes, weights, settings) of `routed_backward`: checked and bound on its first
    call."""

    def __init__(
        self, grad_output, router_weights, schedule, context, weights, pass_config, weight_grads,
        peers, slots, mxfp8, finish=False, fused_grads=False, window=None,
    ):  # fmt: skip
        from mok.runtime import get_kernel  # noqa: PLC0415

        if mxfp8 and (weight_grads or window is not None):
            raise ValueError(
                "the MXFP8 backward megakernel computes no weight gradients in its launch "
                "(weight_grads must be False and window None; backward_op round-trips their "
                "operands first)"
            )
        if window is not None and (weight_grads or finish):
            raise ValueError(
                "window: the macrobatch's weight gradients are the window's (weight_grads must "
                "be False) and its launch has no finish"
            )

        num_tokens, hidden_size = grad_output.shape
        topk = router_weights.shape[1]
        check_cuda("grad_output", grad_output, torch.bfloat16, (num_tokens, hidden_size))
        # Read as 4-byte scalars: a router-weight view needs no 16-byte alignment.
        check_arg("router_weights", router_weights, torch.float32, (num_tokens, topk),
                  cuda=True, align=4)  # fmt: skip
        num_experts, intermediate_size, capacity = check_routed_operands(
            *weights, schedule, slots, num_tokens, topk, hidden_size, grad_output.device
        )
        check_multiple("hidden_size", hidden_size, N_ALIGNMENT)
        check_multiple("intermediate_size", intermediate_size, N_ALIGNMENT)
        x_routed, gate, up, hidden = context
        for name, t, shape in (
            ("x_routed", x_routed, (capacity, hidden_size)),
            ("gate", gate, (capacity, intermediate_size)),
            ("up", up, (capacity, intermediate_size)),
            ("hidden", hidden, (capacity, intermediate_size)),
        ):
            check_cuda(name, t, torch.bfloat16, shape)
        gate_up_rows = (2 if fused_grads else 1) * intermediate_size
        if window is not None:
            gate_up_rows = _check_window(window, num_experts, hidden_size, intermediate_size)
        self.device = grad_output.device
        self.device_index = grad_output.get_device()
        self.sizes = (num_tokens, topk, capacity, num_experts, hidden_size, intermediate_size)
        self.window = window is not None
        self.weight_grads = weight_grads
        self.fused_grads = fused_grads
        self.mxfp8 = mxfp8
        self.bound = None
        self.timeline_ctas = 0  # a diagnostic build's grid (tools/phase_timeline.py)
        self.scratch = Carve(self.scratch_layout(), self.device)
        if capacity == 0 or num_experts == 0 or num_tokens == 0:
            return
        ep_rank, table = peers if peers is not None else (0, None)
        name = KERNEL_MXFP8 if mxfp8 else KERNEL_WINDOW if window is not None else KERNEL
        kernel = get_kernel(name, device=self.device)
        grid = pass_config.grid or sm_count(self.device)
        # dispatched[m], dgu_done[m] per 128-row tile, then the tail (megakernel_walk.py), and a
        # diagnostic build's phase stamps (tools/phase_timeline.py).
        self.timeline_ctas = stamped_ctas(kernel, grid)
        self.counters = megakernel_counters(capacity, BACKWARD_COUNTER_TAIL, self.device,
                                            self.timeline_ctas)  # fmt: skip
        self.flat = {"tma_wd": (num_experts * hidden_size, intermediate_size)}
        buffer, first_slots, d_weights, rounded = self._outputs(slots)
        dy_e, d_gate, d_up, partials = self.scratch.views(buffer)
        # Without weight gradients the weight phase has no tasks; its outputs point anywhere.
        d_w_gate, d_w_up, d_w_down = d_weights if d_weights is not None else (dy_e,) * 3
        self.dynamic_tma = DYNAMIC_TMA + (WEIGHT_TMA if mxfp8 else ())
        self.descriptor_list = [Descriptors(kernel, name) for name in self.dynamic_tma]
        self.last_descriptors = (None, None)  # (addresses, descriptors) of the last BF16 call
        tma = self._descriptors(dy_e, d_gate, d_up, hidden, x_routed, rounded, weights)
        if not mxfp8:
            tma.update({name: tma_descriptor(kernel, name, self._weight_view(name, w))
                        for name, w in zip(WEIGHT_TMA, weights, strict=True)})  # fmt: skip
        dy_q, d_gate_q, d_up_q = rounded if mxfp8 else (None,) * 3
        self.bound = kernel.bind(
            (grid, 1, 1),
            {
                **tma,
                "dy_rounded_ptr": dy_q,
                "d_gate_rounded_ptr": d_gate_q,
                "d_up_rounded_ptr": d_up_q,
                "d_w_down_ptr": d_w_down,
                "d_w_gate_ptr": d_w_gate,
                "d_w_up_ptr": d_w_up,
                "dy_ptr": grad_output,
                "weight_ptr": router_weights,
                "dy_routed_ptr": dy_e,
                "gate_ptr": gate,
                "up_ptr": up,
                "d_gate_ptr": d_gate,
                "d_up_ptr": d_up,
                "partials_ptr": partials,
                "slots_ptr": first_slots,
                "peer_table_ptr": table,
                "d_x_ptr": None,
                "d_router_ptr": None,
                "status_ptr": status_ptr(self.device) if finish else None,
                "finish_tokens": num_tokens if finish else 0,
                **walk_arguments(
                    schedule, self.counters.tensor, grad_output, weights[0], topk, pass_config,
                    grid, ep_rank,
                ),
                "weight_gemms": 3 if weight_grads or window is not None else 0,
                "d_w_gate_up_rows": gate_up_rows,
                # The window variant's (the other variants do not read them).
                "schedule_tokens_per_expert_ptr": None,
                "window_first_row": 0,
                "window_rows": capacity,
                "partial_in_ptr": None,
                "partial_out_ptr": None,
            },
            dynamic=(*self.dynamic_tma, *DYNAMIC_POINTERS,
                     *(ROUNDED_POINTERS if mxfp8 else ()),
                     *(WINDOW_POINTERS if window is not None else ())),
        )  # fmt: skip

    def _descriptors(self, dy_e, d_gate, d_up, hidden, x_routed, rounded, weights) -> dict:
        """The per-launch descriptors (by name) of these tensors: see `_descriptors_at`."""
        tensors = (dy_e, d_gate, d_up, hidden, x_routed)
        addresses = tuple(t.data_ptr() for t in tensors)
        return dict(zip(self.dynamic_tma, self._descriptors_at(
            addresses, tensors.__getitem__, rounded, weights), strict=True))  # fmt: skip

    def _descriptors_at(self, addresses, tensor, rounded, weights) -> list:
        """The per-launch descriptors, in `dynamic_tma` order: the GEMMs' A (MXFP8: the round
        trips), the weight phase's operands, then (MXFP8) the weights of this call. `addresses`
        of (dy_e, d_gate, d_up, hidden, x_routed); `tensor(i)` makes the i-th of them, only
        for a descriptor not made yet."""
        if not self.mxfp8 and self.last_descriptors[0] == addresses:
            return self.last_descriptors[1]  # a step's buffers at the last call's addresses
        cache = self.descriptor_list
        made = [cache[i + 3].at(address, lambda i=i: tensor(i))
                for i, address in enumerate(addresses)]  # fmt: skip
        if not self.mxfp8:
            made = [cache[i].at(addresses[i], lambda i=i: tensor(i)) for i in range(3)] + made
            self.last_descriptors = (addresses, made)
            return made
        a_operands = [cache[i].get(t) for i, t in enumerate(rounded)]
        flat = [cache[8 + i].get(self._weight_view(name, w))
                for i, (name, w) in enumerate(zip(WEIGHT_TMA, weights, strict=True))]  # fmt: skip
        return a_operands + made + flat

    def _weight_view(self, name: str, weights: torch.Tensor) -> torch.Tensor:
        """The [rows, K] view a weight's descriptor is encoded from: down's [E * H, I]; gate's
        and up's from their first elements, fused halves with no copy (`expert_rows_view`)."""
        if name == "tma_wd":
            return weights.view(self.flat[name])
        return expert_rows_view(name, weights)[0]

    def scratch_layout(self) -> list:
        """(dtype, shape) of the launch's scratch: dy_e, d_gate, d_up, router partials."""
        _, _, capacity, _, hidden_size, inter = self.sizes
        bf16 = torch.bfloat16
        return [(bf16, (capacity, hidden_size)), (bf16, (capacity, inter)),
                (bf16, (capacity, inter)), (torch.float32, (capacity, inter // 128))]  # fmt: skip

    def _outputs(self, slots):
        """A scratch buffer (`self.scratch`), slots, the weight gradients (or None) and the
        MXFP8 round trips' scratch (or None)."""
        num_tokens, topk, capacity, num_experts, hidden_size, inter = self.sizes
        bf16 = dict(dtype=torch.bfloat16, device=self.device)
        if slots is None:
            slots = torch.empty(num_tokens * topk, hidden_size, **bf16)
        d_weights = None
        if self.weight_grads:
            d_weights = gate_up_gradients(num_experts, inter, hidden_size, self.fused_grads,
                                          self.device)  # fmt: skip
            d_weights.append(torch.empty(num_experts, hidden_size, inter, **bf16))
        rounded = None
        if self.mxfp8:  # scratch of this launch: the round trips the GEMMs read
            rounded = (torch.empty(capacity, hidden_size, **bf16),
                       torch.empty(capacity, inter, **bf16), torch.empty(capacity, inter, **bf16))  # fmt: skip
        return self.scratch.new(), slots, d_weights, rounded

    def __call__(self, grad_output, router_weights, schedule, context, slots, weights=None,
                 finish=None, window=None):  # fmt: skip
        """(dy_e, d_gate, d_up, partials, slots, d_weights): the scratch as views of one
        allocation; `context` = (x_routed, gate, up, hidden). `finish`: (d_x, d_router) of a
        plan made with `finish`; `window`: the WeightWindow of a plan made with one (its
        d_weights are returned)."""
        finish_at = (0, 0) if finish is None else tuple(t.data_ptr() for t in finish)
        buffer, slots, d_weights = self.launch(
            grad_output, router_weights, schedule_addresses(schedule),
            tuple(t.data_ptr() for t in context), context.__getitem__, slots, weights, finish_at,
            window,
        )  # fmt: skip
        return (*self.scratch.views(buffer), slots, d_weights)

    def launch(self, grad_output, router_weights, schedule_at, context_at, context, slots,
               weights=None, finish_at=(0, 0), window=None):  # fmt: skip
        """The launch on addresses: the schedule's four (`schedule_addresses`), the context's
        four (x_routed, gate, up, hidden; `context(i)` makes tensor i, only for a descriptor
        not made yet); `finish_at`: (d_x, d_router) of a plan made with `finish`; `window`:
        the WeightWindow of a plan made with one. -> (scratch buffer (`self.scratch`: dy_e,
        d_gate, d_up, partials), slots, d_weights or None)."""
        if (window is not None) != self.window:
            raise ValueError(
                f"window: this plan was made {'with' if self.window else 'without'} one"
            )
        buffer, slots, d_weights, rounded = self._outputs(slots)
        if window is not None:
            d_weights = list(window.d_weights)
        if self.bound is None:
            if window is not None:
                # No rows in the macrobatch: only the first touches its outputs (zeros).
                if window.first_row == 0:
                    for d_w in d_weights:
                        d_w.zero_()
            elif d_weights is not None:
                for d_w in d_weights:
                    d_w.zero_()
            return buffer, slots, d_weights
        grad_output_at, weights_at = grad_output.data_ptr(), router_weights.data_ptr()
        all_aligned(CHECKED_ADDRESSES, (*context_at, grad_output_at))
        aligned("router_weights", weights_at, 4)
        dy_e_at, d_gate_at, d_up_at, partials_at = scratch_at = self.scratch.addresses(buffer)
        x_routed_at, gate_at, up_at, hidden_at = context_at
        scratch = self.scratch

        def operand(i):  # dy_e, d_gate, d_up, hidden, x_routed
            return scratch.view(buffer, i) if i < 3 else context(3 if i == 3 else 0)

        descriptors = self._descriptors_at((*scratch_at[:3], hidden_at, x_routed_at), operand,
                                           rounded, weights)  # fmt: skip
        d_w_at = (dy_e_at,) * 3 if d_weights is None else tuple(t.data_ptr() for t in d_weights)
        window_at = ()
        if window is not None:
            window_at = (window.tokens_per_expert.data_ptr(), window.first_row,
                         window.partial_in.data_ptr(), window.partial_out.data_ptr())  # fmt: skip
            all_aligned(("window.d_weights", "window.d_weights", "window.d_weights",
                         "window.partial_in", "window.partial_out"),
                        (*d_w_at, *window_at[2:]))  # fmt: skip
            check_macrobatch_edge(
                window.first_row, window.partial_in, window.partial_out, "window."
            )
        stream = current_stream(self.device_index)
        self.counters.before_launch(stream)
        self.bound.launch(
            *descriptors, d_w_at[2], d_w_at[0], d_w_at[1], grad_output_at, weights_at, dy_e_at,
            gate_at, up_at, d_gate_at, d_up_at, partials_at, slots.data_ptr(), *finish_at,
            *schedule_at,
            *(t.data_ptr() for t in rounded or ()),
            *window_at,
            stream=stream,
        )  # fmt: skip
        return buffer, slots, d_weights


# The call's tensors whose addresses must keep 16-byte alignment (the router weights: 4).
CHECKED_ADDRESSES = ("x_routed", "gate", "up", "hidden", "grad_output")
# Rewritten on every launch, in this order (BoundLaunch.launch): descriptors, then pointers.
DYNAMIC_TMA = ("tma_dy", "tma_dg", "tma_du", "tma_xdy", "tma_xdg", "tma_xdu", "tma_xh", "tma_xx")
# The MXFP8 variant's weights (dequantised per call) and round-trip scratch, after those.
WEIGHT_TMA = ("tma_wg", "tma_wu", "tma_wd")
ROUNDED_POINTERS = ("dy_rounded_ptr", "d_gate_rounded_ptr", "d_up_rounded_ptr")
# The window variant's, after the pointers (WeightWindow).
WINDOW_POINTERS = ("schedule_tokens_per_expert_ptr", "window_first_row", "partial_in_ptr",
                   "partial_out_ptr")  # fmt: skip


DYNAMIC_POINTERS = (
    "d_w_down_ptr", "d_w_gate_ptr", "d_w_up_ptr", "dy_ptr", "weight_ptr", "dy_routed_ptr",
    "gate_ptr", "up_ptr", "d_gate_ptr", "d_up_ptr", "partials_ptr", "slots_ptr", "d_x_ptr",
    "d_router_ptr", "peer_rank_ptr", "peer_token_idx_ptr", "num_tokens_ptr",
    "tokens_per_expert_ptr",
)  # fmt: skip


def _check_window(window, num_experts, hidden_size, inter) -> int:
    """A WeightWindow's tensors checked; returns dW_gate's (and dW_up's) rows per expert."""
    if not isinstance(window, WeightWindow):
        raise TypeError(f"window must be a WeightWindow, got {type(window).__name__}")
    check_macrobatch_edge(window.first_row, window.partial_in, window.partial_out, "window.")
    check_counts("window.tokens_per_expert", window.tokens_per_expert, num_experts)
    if len(window.d_weights) != 3:
        raise ValueError(f"window.d_weights must be (dW_gate, dW_up, dW_down), got "
                         f"{len(window.d_weights)} tensors")  # fmt: skip
    d_w_gate, d_w_up, d_w_down = window.d_weights
    gate_rows = check_expert_weights("window.d_weights[0]", d_w_gate, torch.bfloat16,
                                     (num_experts, inter, hidden_size))  # fmt: skip
    up_rows = check_expert_weights("window.d_weights[1]", d_w_up, torch.bfloat16,
                                   (num_experts, inter, hidden_size))  # fmt: skip
    if gate_rows != up_rows:
        raise ValueError(
            f"window.d_weights: dW_gate and dW_up must have the same strides, got "
            f"{tuple(d_w_gate.stride())} and {tuple(d_w_up.stride())}"
        )
    check_cuda("window.d_weights[2]", d_w_down, torch.bfloat16,
               (num_experts, hidden_size, inter))  # fmt: skip
    for name in ("partial_in", "partial_out"):
        check_cuda(f"window.{name}", getattr(window, name), torch.float32,
                   (3, hidden_size * inter))  # fmt: skip
    return gate_rows


def push_router_grads(
    partials: torch.Tensor,
    schedule,
    router_weights: torch.Tensor,
    d_router: torch.Tensor,
    *,
    peers: tuple | None = None,
) -> torch.Tensor:
    """d_router fp32 [T, k] of this rank's tokens' slots that this rank's experts hold: each
    routed row's sum_b partials[r, b] / w, pushed to its token's rank (kernel router_grad_push;
    a weight <= 0 or non-finite sets the value-status words, launchers/status.py).
    `router_weights` fp32 [T, k] and `d_router` are this rank's; `peers` = (ep_rank, the EP group's
    peer table) or None (a group of one)."""
    key = ("router_grad_push", tensor_key(partials), tensor_key(schedule.peer_rank),
           tensor_key(router_weights), tensor_key(d_router),
           None if peers is None else (peers[0], peers[1].data_ptr()),
           current_stream(partials.get_device()))  # fmt: skip
    push = plan(key, lambda: router_grad_push_plan(partials, schedule, router_weights,
                                                   d_router, peers))  # fmt: skip
    return push(partials, schedule, router_weights, d_router)


def router_grad_push_plan(partials, schedule, router_weights, d_router, peers):
    """`push_router_grads`' plan for these shapes (checked now):
    plan(partials, schedule, router_weights, d_router)."""
    return _RouterGradPushPlan(partials, schedule, router_weights, d_router, peers)


class _RouterGradPushPlan:
    def __init__(self, partials, schedule, router_weights, d_router, peers):
        self.device_index = partials.get_device()
        self.bound = _bind_router_grad_push(partials, schedule, router_weights, d_router, peers)

    def __call__(self, partials, schedule, router_weights, d_router):
        self.launch(partials.data_ptr(), schedule_addresses(schedule), router_weights, d_router)
        return d_router

    def launch(self, partials_at, schedule_at, router_weights, d_router) -> None:
        """The launch with partials and the schedule by address (the schedule's four:
        `schedule_addresses`)."""
        if self.bound is not None:
            self.bound.launch(partials_at, *schedule_at[:3], router_weights.data_ptr(),
                              d_router.data_ptr(), stream=current_stream(self.device_index))  # fmt: skip


def check_router_grad_push(partials, schedule, router_weights, d_router) -> tuple[int, int]:
    """The push's tensors checked: (routed rows, partial blocks)."""
    capacity, blocks = partials.shape
    check_arg("router_weights", router_weights, torch.float32, tuple(router_weights.shape),
              cuda=True, align=4)  # fmt: skip
    check_arg("d_router", d_router, torch.float32, tuple(router_weights.shape), cuda=True, align=4)
    check_arg("partials", partials, torch.float32, (capacity, blocks), cuda=True, align=4)
    for name, t, size in (("schedule.peer_rank", schedule.peer_rank, capacity),
                          ("schedule.peer_token_idx", schedule.peer_token_idx, capacity),
                          ("schedule.num_tokens", schedule.num_tokens, 1)):  # fmt: skip
        check_arg(name, t, torch.int32, (size,), cuda=True, align=4)
    return capacity, blocks


def _bind_router_grad_push(partials, schedule, router_weights, d_router, peers):
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, blocks = check_router_grad_push(partials, schedule, router_weights, d_router)
    ep_rank, table = peers if peers is not None else (0, None)
    if capacity == 0:
        return None
    kernel = get_kernel("router_grad_push", device=partials.device)
    threads = int(kernel.variant.config["threads"])
    return kernel.bind(
        (-(-capacity // threads), 1, 1),
        {
            "partials_ptr": partials,
            "peer_rank_ptr": schedule.peer_rank,
            "peer_token_idx_ptr": schedule.peer_token_idx,
            "num_tokens_ptr": schedule.num_tokens,
            "weight_ptr": router_weights,
            "d_router_ptr": d_router,
            "peer_table_ptr": table,
            "ep_rank": ep_rank,
            "num_rows": capacity,
            "blocks": blocks,
            "status_ptr": status_ptr(partials.device),
        },
        dynamic=("partials_ptr", "peer_rank_ptr", "peer_token_idx_ptr", "num_tokens_ptr",
                 "weight_ptr", "d_router_ptr"),
    )  # fmt: skip
