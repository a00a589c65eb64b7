"""Autograd and module front-ends over `mok.functional` (beyond the original API).

    experts = MoKExperts(num_experts=128, hidden_size=2048, intermediate_size=768, topk=8)
    out = experts(x, router_weights, top_experts)      # x bf16 [T, H]; weights fp32 [T, k]

`MoKFunction` is the autograd Function underneath: forward saves the forward context (or, with
`recompute=True`, only its inputs and rebuilds the context in backward, bitwise identical).
Gradients flow to x, router_weights and every weight. With `accumulate_main_grad=True`,
parameters that carry a `main_grad` attribute (fp32 or bf16) get their gradient added into it
in place, following Megatron-Core's convention: a parameter that also carries
`grad_added_to_main_grad` (Megatron's DDP sets it) gets it set True and a dummy gradient of its
shape (zeros if it carries `zero_out_wgrad`) for DDP's backward hook to drop; any other gets no
gradient (None). A bf16 main_grad receives the layer's fp32 sum rounded once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import functional
from .config import FEATURE_ALIGNMENT, MAX_TOPK, MoKConfig
from .errors import MoKInputError
from .groups import group_rank_size
from .layer_plan import LayerStep, LayerSteps
from .types import MoKForwardContext, MoKSchedule
from .validation import check_int, check_swiglu_limit, check_tensor, check_type, same_device
from .workspace import MoKWorkspace, check_cuda_available, workspace_from_handle


class MoKFunction(torch.autograd.Function):
    """out = mok layer(x, router_weights; weights) with its backward from `functional.backward`."""

    @staticmethod
    def forward(
        ctx,
        config: MoKConfig,
        workspace: MoKWorkspace,
        schedule: MoKSchedule | torch.Tensor,  # a resolved step's: its top_experts
        swiglu_limit: float | None,
        recompute: bool,
        accumulate_main_grad: bool,
        step: LayerStep | None,
        x: torch.Tensor,
        router_weights: torch.Tensor,
        *weights: torch.Tensor | None,
    ) -> torch.Tensor:
        # Routed gate given with no up: the gate is one fused gate_up [E, 2I, H] (`moe_fused`).
        fused = weights[3] is not None and weights[4] is None
        layer_weights = _layer_weights(weights) if fused else weights
        if step is not None:  # a resolved step (mok/layer_plan.py): its plans, no re-check
            # `schedule` is the call's top_experts: the step writes its schedule from them.
            out, saved_ctx = step.forward(schedule, x, router_weights, weights)
            schedule = None
        else:
            out, fwd_ctx = functional.forward(
                config, workspace, schedule, x, router_weights, *layer_weights,
                swiglu_limit=swiglu_limit,
            )  # fmt: skip
            saved_ctx = () if recompute else tuple(t for t in fwd_ctx.tensors() if t is not None)
        ctx.config, ctx.workspace, ctx.schedule, ctx.step = config, workspace, schedule, step
        ctx.swiglu_limit, ctx.recompute = swiglu_limit, recompute
        ctx.accumulate_main_grad = accumulate_main_grad
        ctx.has_shared, ctx.fused = weights[0] is not None, fused
        # The weights as given: a fused gate_up itself, not its halves.
        ctx.save_for_backward(x, router_weights, *weights, *saved_ctx)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, router_weights, *rest = ctx.saved_tensors
        weights, saved_ctx = rest[:6], rest[6:]
        fused = weights[3] if ctx.fused else None
        if fused is not None:
            weights = _layer_weights(weights)
        grad_output = grad_output.contiguous()
        step, schedule = ctx.step, ctx.schedule
        if step is not None:
            grads = step.backward(saved_ctx, grad_output, x, router_weights, weights)
            if grads is not None:
                return (None,) * 7 + _module_order(grads)
            schedule, saved_ctx = step.full_context(saved_ctx)
        shared_gate, shared_up, _, routed_gate, routed_up, _ = weights
        if ctx.recompute:
            fwd_ctx = functional.recompute_forward_context(
                ctx.config, ctx.workspace, schedule, x, shared_gate, shared_up,
                routed_gate, routed_up, swiglu_limit=ctx.swiglu_limit,
            )  # fmt: skip
        else:
            shared = saved_ctx[4:] if ctx.has_shared else (None, None, None)
            fwd_ctx = MoKForwardContext(*saved_ctx[:4], *shared)
        # weights are (shared g/u/d, routed g/u/d); backward's main_grads are routed first.
        main_grads, pending = None, ()
        if ctx.accumulate_main_grad:
            targets = [getattr(weights[i], "main_grad", None) for i in MAIN_GRAD_ORDER]
            halves = False
            if fused is not None:  # gate and up's sums go into the halves of gate_up's
                fused_main_grad = getattr(fused, "main_grad", None)
                if fused_main_grad is not None:
                    targets[:2] = split_gate_up(fused_main_grad)
                    # An fp32 contiguous one: the layer adds into its halves in place.
                    halves = (fused_main_grad.dtype == torch.float32
                              and fused_main_grad.is_contiguous())  # fmt: skip
            main_grads, pending = _layer_main_grads(targets, halves)
        grads = functional.backward(
            ctx.config, ctx.workspace, schedule, fwd_ctx, grad_output, x, router_weights,
            *weights, swiglu_limit=ctx.swiglu_limit, main_grads=main_grads,
            whole_gate_up_grad=fused is not None,
        )  # fmt: skip
        if step is not None:  # its plan for the next steps
            step.resolve_backward(schedule, saved_ctx, grad_output, x, router_weights, weights)
        for target, scratch in pending:
            target.add_(scratch)
        d_x, d_router, *weight_grads = _module_order(grads, main_grads)
        if main_grads is not None:
            params = [fused if fused is not None and i in (3, 4) else weights[i]
                      for i in range(6)]  # fmt: skip
            weight_grads = _megatron_grads(weight_grads, params, main_grads)
        if fused is not None:  # gate_up's gradient whole (or Megatron's dummy) in gate's place
            d_gate, d_up = weight_grads[3], weight_grads[4]
            # The layer wrote d_gate and d_up into the halves of one [E, 2I, H] (whole in gate's
            # place, None in up's), else (MXFP8) they are two tensors.
            if (main_grads is None or main_grads[0] is None) and d_up is not None:
                weight_grads[3] = torch.cat((d_gate, d_up), dim=1)
            weight_grads[4] = None
        return (None,) * 7 + (d_x, d_router, *weight_grads)


# torch's C `apply` of a Function, bound to MoKFunction: `Function.apply` is a Python wrapper
# around it (a functorch check, a dead-wrapper unwrap of every argument, a setup_context
# check), about 7 us of a resolved step's host time.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, MoKFunction)


def _step_apply(*args):
    """`MoKFunction.apply(*args)` of a resolved step: the wrapper's work done here for the
    tensors a step takes (top_experts in the schedule's place, x, router weights, weights),
    then torch's C apply. MoKFunction
    defines no setup_context; under functorch transforms the wrapper runs as it is."""
    if torch._C._are_functorch_transforms_active():
        return MoKFunction.apply(*args)
    unwrap, schedule = torch._C._functorch.unwrap_if_dead, args[2]
    if isinstance(schedule, torch.Tensor):
        schedule = unwrap(schedule)
    return _C_APPLY(*args[:2], schedule, *args[3:7],
                    *(a if a is None else unwrap(a) for a in args[7:]))  # fmt: skip


def layer_workspace(
    config: MoKConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    num_tokens: int,
    hidden_size: int,
    topk: int,
    num_local_experts: int,
) -> MoKWorkspace:
    """`functional.get_workspace` for a layer called from a model, also while torch.compile
    traces it: the workspace is made (or found) for real then, and its handle is a constant of
    the graph, as in `MoKExperts`."""
    return workspace_from_handle(_workspace_handle(config, group, device, num_tokens,
                                                   hidden_size, topk, num_local_experts))  # fmt: skip


@torch.compiler.assume_constant_result
def _workspace_handle(config, group, device, num_tokens, hidden_size, topk,
                      num_local_experts) -> int:  # fmt: skip
    return functional.get_workspace(
        config, group, device=device, num_local_tokens=num_tokens, hidden_size=hidden_size,
        topk=topk, num_local_experts=num_local_experts,
    ).handle  # fmt: skip


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): the two halves [E, I, H] of a fused gate_up [E, 2I, H] along dim 1, as views."""
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up weights must be [E, 2I, H] (gate rows first), got {list(gate_up.shape)}"
        )
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:]


def _layer_weights(weights: tuple) -> tuple:
    """The six weights as the layer reads them, from (shared g/u/d, gate_up, None, down): the
    fused gate_up's halves as [E, I, H] views, no copy (the kernels take the experts' row
    stride, and the reference path computes with the views; SEMANTICS §1). A gate_up that is
    not contiguous is copied to one that is first."""
    gate_up = weights[3]
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    return (*weights[:3], *split_gate_up(gate_up), weights[5])


def moe_fused(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    gate_up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    recompute: bool = False,
    accumulate_main_grad: bool = False,
) -> torch.Tensor:
    """Differentiable routed-only mok layer over fused gate_up [E, 2I, H] (gate rows first) and
    down [E, H, I] weights (the frameworks' layout): `moe` with gate = gate_up[:, :I] and
    up = gate_up[:, I:], read in place as views (no copy). gate_up's gradient comes back whole,
    [E, 2I, H], the layer writing dW_gate and dW_up into its halves. With
    `accumulate_main_grad`, it goes into `gate_up.main_grad` ([E, 2I, H], fp32 or bf16) and
    down's into `down.main_grad`, where they have one (Megatron's convention, as `moe`); an
    fp32 contiguous gate_up.main_grad is accumulated in place, half by half."""
    return MoKFunction.apply(
        config, workspace, schedule, swiglu_limit, recompute, accumulate_main_grad, None, x,
        router_weights, None, None, None, gate_up_weights, None, down_weights,
    )  # fmt: skip


# functional.backward's main_grads order (routed g/u/d, shared g/u/d) as indices of the
# module order (shared g/u/d, routed g/u/d).
MAIN_GRAD_ORDER = (3, 4, 5, 0, 1, 2)


def _layer_main_grads(targets, halves: bool = False) -> tuple[tuple, tuple]:
    """(main_grads for functional.backward, (target, scratch) pairs to add after it). An fp32
    main_grad is accumulated in place by the layer where it is contiguous, or (`halves`) where
    the routed gate's and up's (targets 0 and 1) are the halves of one contiguous fp32
    [E, 2I, H] (a fused gate_up's main_grad: the kernels take its experts' row stride); a bf16
    one, or any other view, gets the layer's fp32 sums in zeroed fp32 scratch, added to it once
    after the layer (rounded once, for bf16)."""
    main_grads, pending = [], []
    for i, target in enumerate(targets):
        fp32 = target is not None and target.dtype == torch.float32
        if target is None or (fp32 and (target.is_contiguous() or (halves and i < 2))):
            main_grads.append(target)
            continue
        if target.dtype not in (torch.float32, torch.bfloat16):
            raise MoKInputError(
                f"main_grad must be torch.float32 or torch.bfloat16, got {target.dtype}"
            )
        scratch = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
        main_grads.append(scratch)
        pending.append((target, scratch))
    return tuple(main_grads), tuple(pending)


def _megatron_grads(weight_grads: list, params: list, main_grads: tuple) -> list:
    """Megatron-Core's convention for a gradient accumulated into `param.main_grad`: where the
    parameter carries `grad_added_to_main_grad` (Megatron's DDP sets it on every parameter), set
    it True and return a dummy gradient of the parameter's shape (zeros if it asks for
    `zero_out_wgrad`), so that DDP's backward hook, which runs when the parameter's gradient
    arrives, fires, skips its own add and drops the dummy; elsewhere None."""
    grads = list(weight_grads)
    for j, i in enumerate(MAIN_GRAD_ORDER):
        param = params[i]
        if main_grads[j] is None or not hasattr(param, "grad_added_to_main_grad"):
            continue
        param.grad_added_to_main_grad = True
        make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
        grads[i] = make(param.shape, dtype=param.dtype, device=param.device)
    return grads


def _module_order(grads, main_grads=None) -> tuple:
    """`functional.backward`'s (d_x, d_router, routed g/u/d, shared g/u/d) as MoKFunction's
    input gradients (d_x, d_router, shared g/u/d, routed g/u/d); None where a gradient went
    into its main_grad."""
    d_x, d_router, dr_gate, dr_up, dr_down, ds_gate, ds_up, ds_down = grads
    weight_grads = [ds_gate, ds_up, ds_down, dr_gate, dr_up, dr_down]
    if main_grads is not None:
        for i, main_grad in zip((3, 4, 5, 0, 1, 2), main_grads, strict=True):
            if main_grad is not None:
                weight_grads[i] = None  # accumulated into main_grad instead
    return (d_x, d_router, *weight_grads)


def moe(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    recompute: bool = False,
    accumulate_main_grad: bool = False,
) -> torch.Tensor:
    """Differentiable mok layer: `functional.forward` with autograd attached."""
    return MoKFunction.apply(
        config, workspace, schedule, swiglu_limit, recompute, accumulate_main_grad, None, x,
        router_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
        routed_gate_weights, routed_up_weights, routed_down_weights,
    )  # fmt: skip


class MoKExperts(nn.Module):
    """The routed experts (and optionally one shared expert) of an MoE block, run by mok.

    Args:
        num_experts: experts in the whole EP group (this rank holds num_experts / EP size).
        hidden_size, intermediate_size: H and I (multiples of 128).
        topk: experts per token.
        shared_expert: add a shared SwiGLU expert of width intermediate_size.
        group: EP process group (None: one device holds every expert).
        config: MoKConfig (default MoKConfig()).
        swiglu_limit: optional clamp (SEMANTICS §1).
        recompute: save only inputs and rebuild the forward context in backward.
        accumulate_main_grad: add weight gradients into each parameter's `main_grad`
            attribute (fp32 or bf16) where it has one, Megatron-Core's way (module docstring).

    forward(x bf16 [T, H], router_weights fp32 [T, k] (> 0), top_experts int64 [T, k]) -> bf16.
    A token may name an expert more than once in top_experts (each (t, j) is its own routed
    row: that expert's output is added once per occurrence, with that j's weight).
    Parameters: gate_weight, up_weight [E, I, H]; down_weight [E, H, I]; with a shared expert
    shared_gate_weight, shared_up_weight [I, H]; shared_down_weight [H, I]. Layout [out, in].
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        topk: int,
        *,
        shared_expert: bool = False,
        group: dist.ProcessGroup | None = None,
        config: MoKConfig | None = None,
        swiglu_limit: float | None = None,
        recompute: bool = False,
        accumulate_main_grad: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        # The rules every device holds (the GPU kernels' own, e.g. hidden_size a multiple of 256
        # on sm_90a, are checked by the first forward on the GPU).
        check_int("num_experts", num_experts, minimum=1)
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            check_int(name, size, minimum=FEATURE_ALIGNMENT, multiple_of=FEATURE_ALIGNMENT)
        check_int("topk", topk, minimum=1)
        if topk > MAX_TOPK:
            raise ValueError(f"topk must be <= {MAX_TOPK}, got {topk}")
        if topk > num_experts:
            raise ValueError(
                f"topk must be <= num_experts ({num_experts}): a router picks topk of the "
                f"num_experts experts, got topk={topk}"
            )
        config = MoKConfig() if config is None else config
        check_type("config", config, MoKConfig)
        config.validate()
        swiglu_limit = check_swiglu_limit(swiglu_limit)
        device = _check_module_device(device)
        if group is not None:
            check_type("group", group, dist.ProcessGroup)
        _, ep_size = group_rank_size(group)
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts must be a multiple of the EP group size {ep_size}, got {num_experts}"
            )
        if dtype != torch.bfloat16:
            raise MoKInputError(f"dtype must be torch.bfloat16, got {dtype}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // ep_size
        self.hidden_size, self.intermediate_size, self.topk = hidden_size, intermediate_size, topk
        self.group, self.config = group, config
        self.swiglu_limit, self.recompute = swiglu_limit, recompute
        self.accumulate_main_grad = accumulate_main_grad
        self._steps = LayerSteps()
        e, h, i = self.num_local_experts, hidden_size, intermediate_size
        kw = dict(device=device, dtype=dtype)
        self.gate_weight = nn.Parameter(torch.empty(e, i, h, **kw))
        self.up_weight = nn.Parameter(torch.empty(e, i, h, **kw))
        self.down_weight = nn.Parameter(torch.empty(e, h, i, **kw))
        if shared_expert:
            self.shared_gate_weight = nn.Parameter(torch.empty(i, h, **kw))
            self.shared_up_weight = nn.Parameter(torch.empty(i, h, **kw))
            self.shared_down_weight = nn.Parameter(torch.empty(h, i, **kw))
        else:
            self.shared_gate_weight = self.shared_up_weight = self.shared_down_weight = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal init with std 1/sqrt(fan_in) (fan_in: H for gate/up, I for down)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                fan_in = p.shape[-1]
                p.normal_(0.0, 1.0 / math.sqrt(fan_in))
                del name

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        """(shared gate, up, down, routed gate, up, down) in functional's argument order."""
        # Without a shared expert, the routed parameters straight from `_parameters`
        # (Module.__getattr__ costs ~0.5 us a weight, every step); the attributes otherwise, or
        # where one is not there (parametrized).
        params = self._parameters
        routed = params.get("gate_weight"), params.get("up_weight"), params.get("down_weight")
        no_shared = self.__dict__.get("shared_gate_weight", False) is None
        if no_shared and routed[0] is not None and routed[1] is not None and routed[2] is not None:
            return (None, None, None, *routed)
        return (
            self.shared_gate_weight, self.shared_up_weight, self.shared_down_weight,
            self.gate_weight, self.up_weight, self.down_weight,
        )  # fmt: skip

    def workspace(self, num_tokens: int, device: torch.device) -> MoKWorkspace:
        return workspace_from_handle(self._workspace_handle(num_tokens, device))

    @torch.compiler.assume_constant_result
    def _workspace_handle(self, num_tokens: int, device: torch.device) -> int:
        # Run for real when torch.compile traces (not traced into the graph): the workspace
        # must exist when the compiled graph's ops look its handle up.
        return _workspace_handle(self.config, self.group, device, num_tokens, self.hidden_size,
                                 self.topk, self.num_local_experts)  # fmt: skip

    def forward(
        self, x: torch.Tensor, router_weights: torch.Tensor, top_experts: torch.Tensor
    ) -> torch.Tensor:
        # A step whose key the full path ran before: its plans (mok/layer_plan.py).
        weights = self.weights()
        key = self._steps.key(self, x, router_weights, top_experts, weights)
        step = self._steps.get(key, self.config)
        if step is not None:
            return _step_apply(
                self.config, step.ws(), top_experts, self.swiglu_limit, False, False, step, x,
                router_weights, *weights,
            )  # fmt: skip
        # Checked before the workspace is made: a bad call leaves no workspace behind.
        self._check_inputs(x, router_weights, top_experts)
        ws = self.workspace(x.shape[0], x.device)
        schedule = functional.build_schedule(
            ws, self.config, top_experts, num_local_experts=self.num_local_experts
        )
        out = moe(
            self.config, ws, schedule, x, router_weights, *self.weights(),
            swiglu_limit=self.swiglu_limit, recompute=self.recompute,
            accumulate_main_grad=self.accumulate_main_grad,
        )  # fmt: skip
        self._steps.add(key, self, ws, schedule, x, router_weights, top_experts)
        return out

    def _check_inputs(self, x, router_weights, top_experts) -> None:
        check_type("x", x, torch.Tensor)
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(
                f"x must have shape [T, H] (num_tokens, hidden_size = {self.hidden_size}), got "
                f"{list(x.shape)}"
            )
        check_tensor("x", x, dtype=torch.bfloat16, shape=[None, self.hidden_size])
        weights_device = self.gate_weight.device
        if not same_device(x.device, weights_device):
            raise ValueError(
                f"x must be on the device of the module's weights ({weights_device}), got "
                f"{x.device}"
            )
        shape = [x.shape[0], self.topk]
        check_tensor("router_weights", router_weights, dtype=torch.float32, shape=shape,
                     device=x.device)  # fmt: skip
        check_tensor("top_experts", top_experts, dtype=torch.int64, shape=shape,
                     device=x.device)  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, "
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"topk={self.topk}, shared_expert={self.shared_gate_weight is not None}, "
            f"swiglu_limit={self.swiglu_limit}, recompute={self.recompute}"
        )


def _check_module_device(device) -> torch.device | None:
    """None (torch's default device) or a torch.device; a CUDA one must exist here."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise MoKInputError(
            f"device must be a torch.device, a device string or None, got {device!r} ({error})"
        ) from None
    if device.type == "cuda":
        check_cuda_available("device", device)
    return device
