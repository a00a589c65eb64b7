"""The forward megakernel's launcher (mok/dsl_kernels/sm90/moe_forward.py): dispatch, gate/up +
SwiGLU and down to slots in one launch, before `epilogues.fwd_epilogue`; or, for a plan made
with `combine` (a group of one without a shared expert, launchers/forward_op.py), with that
epilogue's weighted sum into `out` as the launch's last phase. Its counters (the
plan's `plans.Counters`) are zero when it starts: each launch leaves them zero, and they are
zeroed on the stream only before the plan's first eager launch and before captured ones.
"""

from __future__ import annotations

import torch

from ..config import DEFAULT_WAIT_TIMEOUT_NS
from ..types import PassConfig
from ..validation import check_tensor
from . import mxfp8
from .checks import check_cuda, check_multiple, expert_rows_view
from .device_args import sm_count
from .expert_gemm import DOWN_N_ALIGNMENT, GATE_UP_N_ALIGNMENT, K_ALIGNMENT
from .megakernel_walk import (
    FORWARD_COUNTER_TAIL,
    check_mxfp8_routed_operands,
    check_routed_operands,
    megakernel_counters,
    stamped_ctas,
    walk_arguments,
)
from .plans import (
    Descriptors,
    aligned,
    current_stream,
    new_tensors,
    plan,
    schedule_addresses,
    tensor_key,
    weight_key,
)
from .status import status_ptr

KERNEL = "moe_forward"
KERNEL_MXFP8 = "moe_forward_mxfp8"


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
    timeout_ns: int = DEFAULT_WAIT_TIMEOUT_NS,
    peers: tuple | None = None,
    slots: torch.Tensor | None = None,
    grid: int | None = None,
    dequantized: tuple | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((x_routed, gate, up, hidden), slots) of this rank's routed experts, in one launch.

    x bf16 [T, H]; weights bf16 [E, I, H] (gate, up), [E, H, I] (down) of the local experts,
    or all three MXFP8 pairs (E4M3 data of those shapes, UE8M0 scales; mok.ops.mxfp8_quantize
    along K): the MXFP8 layer (mok.reference.mxfp8_forward's rows, the same bf16 outputs);
    `schedule` this rank's MoKSchedule. slots bf16 [T * k, H] (`slots`, or a new tensor): row
    t * k + j is token t's j-th expert output. `peers` = (ep_rank, the EP group's peer table,
    launchers.peer_table; None: a group of one): rows of other ranks' tokens are pulled from
    their x buffers and pushed into their slots (combine) buffers.
    The settings are a PassConfig's fields (mok.types): `num_comm_ctas` CTAs dispatch while
    the rest compute (0: all dispatch first); `minibatch_size` (routed rows; None: all) never
    changes the bits; `grid`: CTAs (None: the SM count). `dequantized` (MXFP8): the pairs'
    bf16 values (mxfp8.dequantized_weights) where the caller has them already (a macrobatch
    ring launches once per macrobatch).
    """
    pass_config = PassConfig(swiglu_limit=swiglu_limit, num_comm_ctas=num_comm_ctas,
                             minibatch_size=minibatch_size, timeout_ns=timeout_ns, grid=grid)  # fmt: skip
    weights = (gate_weights, up_weights, down_weights)
    return launch_routed_forward(
        x, schedule, topk, weights, pass_config, peers=peers, slots=slots, dequantized=dequantized
    )


def launch_routed_forward(
    x, schedule, topk, weights, pass_config, *, peers=None, slots=None, dequantized=None,
    context=None,
):  # fmt: skip
    """`routed_forward` with its routed weights (gate, up, down) and settings (a PassConfig)
    each as one object, as the launch path holds them; `context`: as the plan's call takes
    it."""
    key = (
        KERNEL, tensor_key(x), tensor_key(schedule.peer_rank), tensor_key(schedule.peer_token_idx),
        tensor_key(schedule.num_tokens), tensor_key(schedule.tokens_per_expert),
        *map(weight_key, weights), tensor_key(slots), topk, pass_config,
        None if peers is None else (peers[0], peers[1].data_ptr()),
        current_stream(x.get_device()),
    )  # fmt: skip

    def make():
        return forward_plan(
            x, schedule, topk, weights, pass_config, peers, slots, dequantized=dequantized
        )

    return plan(key, make)(x, schedule, slots, weights, dequantized=dequantized, context=context)


def forward_plan(
    x, schedule, topk, weights, pass_config, peers, slots, combine=False, schedule_ids=None,
    dequantized=None,
):  # fmt: skip
    """`routed_forward`'s plan for these arguments (checked now); call it as
    plan(x, schedule, slots, (gate, up, down)) with tensors that differ from these in their
    addresses only (the weights are read on every call only as MXFP8 pairs). `combine` (a group
    of one: `peers` None): the launch also writes out = sum_j w[t, j] * slots[t * k + j] (bf16
    [T, H], `epilogues.fwd_epilogue` without y_shared, the same bits and router-weight check);
    call it as plan(x, schedule, slots, weights, (out, router_weights)), router_weights fp32
    [T, k] checked by the caller. `schedule_ids` (with `combine`: a layer step's): the
    group's int64 [T, k] routing, of which the launch first writes the schedule itself into
    `schedule`'s addresses (the `schedule_ids64` kernel's tasks, phases/schedule_phase.py); call
    `launch` with its address (`ids_at`)."""
    if combine and peers is not None:
        raise ValueError("combine: the in-kernel combine is a group of one's (peers must be None)")
    if schedule_ids is not None and not combine:
        raise ValueError("schedule_ids: the in-kernel schedule needs the in-kernel combine")
    return _ForwardPlan(
        x, schedule, topk, weights, pass_config, peers, slots, combine, schedule_ids, dequantized
    )


class _ForwardPlan:
    """One (shapes, weights, settings) of `routed_forward`: checked and bound on its first call."""

    def __init__(
        self, x, schedule, topk, weights, pass_config, peers, slots, combine=False,
        schedule_ids=None, dequantized=None,
    ):  # fmt: skip
        from mok.runtime import get_kernel  # noqa: PLC0415

        num_tokens, hidden_size = x.shape
        check_cuda("x", x, torch.bfloat16, (num_tokens, hidden_size))
        pairs = [isinstance(w, tuple) for w in weights]
        if any(pairs) and not all(pairs):
            raise ValueError(
                "gate_weights, up_weights and down_weights must be all bf16 tensors or all "
                f"MXFP8 pairs (data, scales); got pairs for {pairs} (gate, up, down)"
            )
        self.mxfp8 = all(pairs)
        check = check_mxfp8_routed_operands if self.mxfp8 else check_routed_operands
        num_experts, intermediate_size, capacity = check(
            *weights, schedule, slots, num_tokens, topk, hidden_size, x.device
        )
        check_multiple("hidden_size", hidden_size, DOWN_N_ALIGNMENT)
        check_multiple("intermediate_size", intermediate_size, GATE_UP_N_ALIGNMENT)
        check_multiple("intermediate_size", intermediate_size, K_ALIGNMENT)
        self.device = x.device
        self.device_index = x.get_device()
        self.shapes = ((capacity, hidden_size), (capacity, intermediate_size),
                       (num_tokens * topk, hidden_size))  # fmt: skip
        self.bound = None
        self.timeline_ctas = 0  # a diagnostic build's grid (tools/phase_timeline.py)
        self.schedules = False  # the launch writes the schedule (`schedule_ids`)
        if capacity == 0 or num_experts == 0 or num_tokens == 0:
            return
        entries, schedule_scratch = 0, (None, None)
        if schedule_ids is not None:
            entries, schedule_scratch = in_kernel_schedule(schedule_ids, num_experts, capacity,
                                                           (num_tokens, topk))  # fmt: skip
            self.schedules = True
        self.schedule_scratch = schedule_scratch  # held: the launch writes it by address
        ep_rank, table = peers if peers is not None else (0, None)
        kernel = get_kernel(KERNEL_MXFP8 if self.mxfp8 else KERNEL, device=x.device)
        grid = pass_config.grid or sm_count(x.device)
        # dispatched[m], hidden_done[m] per 128-row tile, the task and dispatch tickets, the exit
        # (and a diagnostic build's phase stamps, tools/phase_timeline.py).
        self.timeline_ctas = stamped_ctas(kernel, grid)
        self.counters = megakernel_counters(capacity, FORWARD_COUNTER_TAIL, x.device,
                                            self.timeline_ctas)  # fmt: skip
        self.weight_tma = {name: Descriptors(kernel, name) for name in WEIGHT_TMA}
        if self.mxfp8:
            # The pairs' bf16 values, only to bind the plan: every launch dequantises its own
            # (kept by no plan, so a call that fails leaves none of them behind).
            weights = dequantized or mxfp8.dequantized_weights(weights)
        x_routed, gate, up, hidden = self._outputs()
        # MXFP8: the GEMMs' A operands are the rows' round trips (scratch of this call).
        a_x, a_h = self._operands(x_routed, hidden)
        self.tma_x = Descriptors(kernel, "tma_x")
        self.tma_h = Descriptors(kernel, "tma_h")
        self.last_descriptors = (None, None)  # (addresses, descriptors) of the last BF16 call
        first_slots = slots if slots is not None else x_routed  # any address: rewritten per call
        self.bound = kernel.bind(
            (grid, 1, 1),
            {
                "tma_x": self.tma_x.get(a_x),
                "tma_h": self.tma_h.get(a_h),
                **self._weight_descriptors(weights),
                "x_rounded_ptr": a_x if self.mxfp8 else None,
                "hidden_rounded_ptr": a_h if self.mxfp8 else None,
                "x_ptr": x,
                "x_routed_ptr": x_routed,
                "gate_ptr": gate,
                "up_ptr": up,
                "hidden_ptr": hidden,
                "slots_ptr": first_slots,
                "peer_table_ptr": table,
                "out_ptr": None,
                "router_weights_ptr": None,
                "status_ptr": status_ptr(x.device) if combine else None,
                "combine_tokens": num_tokens if combine else 0,
                "ids_ptr": schedule_ids if entries else None,
                "schedule_counts_ptr": schedule_scratch[0],
                "schedule_expert_counts_ptr": schedule_scratch[1],
                "schedule_entries": entries,
                **walk_arguments(
                    schedule, self.counters.tensor, x, weights[0], topk, pass_config, grid, ep_rank
                ),
            },
            dynamic=DYNAMIC + (WEIGHT_TMA if self.mxfp8 else ()),
        )

    def _weight_descriptors(self, weights) -> dict:
        """The bf16 weights' TMA descriptors: over gate's and up's [rows, H] views from their
        first elements (`expert_rows_view`: fused halves with no copy), down's [E * H, I]."""
        gate, up, down = weights
        views = (expert_rows_view("gate_weights", gate)[0],
                 expert_rows_view("up_weights", up)[0], down.view(-1, down.shape[-1]))  # fmt: skip
        return {name: self.weight_tma[name].get(view)
                for name, view in zip(WEIGHT_TMA, views, strict=True)}  # fmt: skip

    def layout(self) -> list:
        """(dtype, shape) of the context it writes: x_routed, gate, up, hidden."""
        (rows, hidden_size), (_, inter), _ = self.shapes
        bf16 = torch.bfloat16
        return [(bf16, (rows, hidden_size))] + [(bf16, (rows, inter))] * 3

    def _outputs(self):
        return new_tensors(self.layout(), self.device)

    def _checked(self, context) -> tuple:
        """`context` as `__call__` takes it, checked against `layout()`."""
        names = ("x_routed", "gate", "up", "hidden")
        for name, tensor, (dtype, shape) in zip(names, context, self.layout(), strict=True):
            check_tensor(f"context.{name}", tensor, dtype=dtype, shape=list(shape),
                         device=self.device)  # fmt: skip
            aligned(f"context.{name}", tensor.data_ptr())
        return tuple(context)

    def _operands(self, x_routed, hidden):
        """The GEMMs' A operands: the rows themselves (BF16), or new scratch for their MXFP8
        round trips, which dispatch and the crew write."""
        if not self.mxfp8:
            return x_routed, hidden
        return torch.empty_like(x_routed), torch.empty_like(hidden)

    def __call__(self, x, schedule, slots, weights, combine=None, dequantized=None,
                 context=None):  # fmt: skip
        """((x_routed, gate, up, hidden), slots): the context in new tensors, or written into
        `context` (four contiguous bf16 tensors of `layout()`'s shapes on the plan's device,
        e.g. rows of larger ones: macrobatch.py). `combine`: (out, router_weights) of a plan
        made with `combine`; not for one made with `schedule_ids` (`launch`). `dequantized`:
        as `routed_forward`'s."""
        if self.schedules:
            raise ValueError("a plan made with schedule_ids launches by address (launch)")
        outputs = self._outputs() if context is None else self._checked(context)
        if slots is None:
            slots = torch.empty(self.shapes[2], dtype=torch.bfloat16, device=self.device)
        if self.bound is not None:
            combine_at = (0, 0) if combine is None else tuple(t.data_ptr() for t in combine)
            self.launch(x, schedule_addresses(schedule), tuple(t.data_ptr() for t in outputs),
                        outputs.__getitem__, slots.data_ptr(), weights, combine_at,
                        dequantized=dequantized)  # fmt: skip
        return outputs, slots

    def launch(self, x, schedule_at, context_at, context, slots_at, weights,
               combine_at=(0, 0), ids_at=0, dequantized=None) -> None:  # fmt: skip
        """The launch on addresses: the schedule's four (`schedule_addresses`), the context's
        four (x_routed, gate, up, hidden: contiguous, `layout()`'s shapes, 16-byte aligned);
        `context(i)` makes context tensor i, only for a TMA descriptor not made yet;
        `combine_at`: (out, router_weights) of a plan made with `combine`; `ids_at`: the
        int64 routing's address (8-byte aligned, its shape and device as the plan's
        `schedule_ids`) of a plan made with `schedule_ids`, whose launch writes the schedule;
        `dequantized`: as `routed_forward`'s."""
        x_routed_at, gate_at, up_at, hidden_at = context_at
        if self.mxfp8:
            a_x, a_h = self._operands(context(0), context(3))
            tma_x, tma_h = self.tma_x.get(a_x), self.tma_h.get(a_h)
            bf16 = dequantized or mxfp8.dequantized_weights(weights)
            bf16_weights = tuple(self._weight_descriptors(bf16).values())
            rounded_at = (a_x.data_ptr(), a_h.data_ptr())
        else:
            last_at, last = self.last_descriptors
            if last_at != (x_routed_at, hidden_at):
                last = (self.tma_x.at(x_routed_at, lambda: context(0)),
                        self.tma_h.at(hidden_at, lambda: context(3)))  # fmt: skip
                self.last_descriptors = ((x_routed_at, hidden_at), last)
            (tma_x, tma_h), bf16_weights, rounded_at = last, (), (0, 0)
        x_address = x.data_ptr()
        aligned("x", x_address)
        stream = current_stream(self.device_index)
        self.counters.before_launch(stream)
        if self.schedules:
            aligned("top_experts", ids_at, 8)
        self.bound.launch(tma_x, tma_h, x_address, *context_at, slots_at, *rounded_at,
                          *combine_at, ids_at, *schedule_at, *bf16_weights, stream=stream)  # fmt: skip


def in_kernel_schedule(ids, num_experts, capacity, shape) -> tuple:
    """(T * k, (counts, expert_counts) scratch) of a plan whose launch writes the schedule of
    `ids` (a group of one's int64 routing, `shape` [T, k]), checked as the `schedule_ids64`
    kernel's routing."""
    from .schedule_kernels import in_kernel_schedule_scratch  # noqa: PLC0415

    return ids.numel(), in_kernel_schedule_scratch(ids, num_experts, capacity, shape)


# Rewritten on every launch, in this order (BoundLaunch.launch).
DYNAMIC = (
    "tma_x", "tma_h", "x_ptr", "x_routed_ptr", "gate_ptr", "up_ptr", "hidden_ptr", "slots_ptr",
    "x_rounded_ptr", "hidden_rounded_ptr", "out_ptr", "router_weights_ptr", "ids_ptr",
    "peer_rank_ptr",
    "peer_token_idx_ptr", "num_tokens_ptr", "tokens_per_expert_ptr",
)  # fmt: skip
# The weights' descriptors: bound once (BF16), or after DYNAMIC on every launch (MXFP8).
WEIGHT_TMA = ("tma_wg", "tma_wu", "tma_wd")
