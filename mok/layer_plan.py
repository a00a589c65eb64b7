"""A `MoKExperts` step's launcher plans, resolved once per key and then called directly.

An eager training step calls the layer with the same weights, shapes, settings and stream
every time. The first call of such a key takes the full path (`mok.functional`: every check,
then `mok.ops`, then the launchers, each keying its own plan) and then resolves the plans that
path made: the schedule op, and a forward op (checked as the full path's) whose megakernel
writes the schedule itself where it also sums the slots (a group of one without a shared
expert: then the schedule op only lends its layout); the first backward of a step resolves
the backward op (on autograd's thread, for its stream). A later call with the key calls those
plans directly: one key of the module's inputs, no re-check (the key holds what every check
looks at), the launches. What stays per call, as on the full path: the value-status words (a
bad value a kernel found is raised by the next call), and the workspace's life (a destroyed or
evicted workspace sends the call down the full path).

The full path is always taken under torch.compile, during CUDA graph capture (it marks the
workspace captured), for tensor subclasses and dispatch modes, on the CPU, for an EP group,
with `recompute`, `accumulate_main_grad` or macrobatch ring reuse.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .functional import backward_outputs
from .types import MoKSchedule, PassConfig
from .validation import tensor_key

_STEPS_MAX = 8  # keys per module (distinct token counts, streams, threads); cleared when full


_CUDA_KEYS = None


def _cuda_keys():
    """(capturing(), current_stream(index), MOK_ARCH token(), weight_key(t)), imported on
    first CUDA use."""
    global _CUDA_KEYS
    if _CUDA_KEYS is None:
        from . import launchers  # noqa: PLC0415 - the CUDA path's door, CUDA only
        from .runtime.module import arch_env_token  # noqa: PLC0415
        from .workspace import capturing  # noqa: PLC0415

        _CUDA_KEYS = (capturing, launchers.current_stream, arch_env_token, launchers.weight_key)
    return _CUDA_KEYS


class LayerSteps:
    """One module's resolved steps by key (bounded). Dropped on copy and pickling: plans hold
    launch buffers and weak references, remade by the copy's first call."""

    def __init__(self) -> None:
        self._steps: dict[tuple, LayerStep] = {}

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._steps = {}

    def __deepcopy__(self, memo) -> LayerSteps:
        return LayerSteps()

    def key(self, module, x, router_weights, top_experts, weights) -> tuple | None:
        """The step key of this call (`weights`: the module's `weights()`), or None when it
        must take the full path."""
        if (
            torch.compiler.is_compiling()
            or x.__class__ is not torch.Tensor
            or router_weights.__class__ is not torch.Tensor
            or top_experts.__class__ is not torch.Tensor
            or not x.is_cuda
            or module.group is not None
            or module.recompute
            or module.accumulate_main_grad
            or torch._C._len_torch_dispatch_stack()
        ):
            return None
        capturing, current_stream, arch, weight_key = _cuda_keys()
        if capturing():
            return None
        return (
            tensor_key(x), tensor_key(router_weights), tensor_key(top_experts),
            *map(weight_key, weights), id(module.config),
            module.swiglu_limit, module.num_local_experts, arch(),
            current_stream(x.get_device()), threading.get_ident(),
        )  # fmt: skip

    def get(self, key: tuple | None, config) -> LayerStep | None:
        step = self._steps.get(key) if key is not None else None
        if step is None or step.config is not config or not step.alive():
            return None
        return step

    def add(self, key: tuple | None, module, workspace, schedule, x, router_weights,
            top_experts) -> None:  # fmt: skip
        """After the full path ran this call: resolve its plans under `key` (when it has one
        and the call is one the step runs: a group of one without ring reuse)."""
        if key is None or workspace.ep_size != 1:
            return
        if module.config.macrobatch_size < x.shape[0] * router_weights.shape[1]:
            return
        if len(self._steps) >= _STEPS_MAX:
            self._steps.clear()
        self._steps[key] = LayerStep(module, workspace, schedule, x, router_weights, top_experts)


class LayerStep:
    """The schedule, forward and backward plans of one step key (see the module docstring).

    A step's schedule and routed context live in one allocation (`carve`: peer_rank,
    peer_token_idx, num_tokens, tokens_per_expert, x_routed, gate, up, hidden), which the
    kernels get by address; views of it are made only where the full path needs tensors."""

    def __init__(self, module, workspace, schedule, x, router_weights, top_experts):
        from . import launchers  # noqa: PLC0415 - the CUDA path's door, CUDA only

        config = self.config = module.config
        self.ws = weakref.ref(workspace)
        self.device = x.device
        self.raise_value_errors = launchers.value_error_check(x.device)
        self.has_shared = module.shared_gate_weight is not None
        limit = module.swiglu_limit
        self.grad_key = tensor_key(x)  # grad_output's, as the full path checks it
        self.schedule_op = launchers.schedule_op_plan(
            workspace, top_experts, module.num_local_experts, workspace.schedule_capacity,
            config.all_gather_top_experts_chunk_bytes,
        )  # fmt: skip
        # The full path's settings (mok.layer_ops makes them alike from the op's arguments).
        forward_pass_config = PassConfig.of_workspace(
            workspace, swiglu_limit=limit, num_comm_ctas=config.fwd_num_comm_sms,
            minibatch_size=config.minibatch_size, macrobatch_size=config.macrobatch_size,
            macrobatch_replay=config.macrobatch_replay,
        )  # fmt: skip
        self.backward_pass_config = PassConfig.of_workspace(
            workspace, swiglu_limit=limit, num_comm_ctas=config.bwd_num_comm_sms,
            minibatch_size=config.minibatch_size, macrobatch_size=config.macrobatch_size,
        )  # fmt: skip
        weights = module.weights()
        # Where its megakernel sums the slots, it also writes the schedule (`schedules`).
        self.forward_op = launchers.forward_op_plan(
            workspace, schedule, x, router_weights, weights[:3], weights[3:],
            forward_pass_config, schedule_ids=top_experts,
        )  # fmt: skip
        self.carve = launchers.Carve(self.schedule_op.layout() + self.forward_op.layout(), x.device)
        self.backward_ops: dict[tuple, object] = {}

    def alive(self) -> bool:
        ws = self.ws()
        return ws is not None and not ws.destroyed

    def _context(self, buffer) -> tuple:
        """(the schedule's four addresses, the routed context's four, a maker of context
        tensor i) of a step's buffer, as the ops take a layer step's context."""
        addresses, carve = self.carve.addresses(buffer), self.carve
        return addresses[:4], addresses[4:], lambda i: carve.view(buffer, 4 + i)

    def forward(self, top_experts, x, router_weights, weights):
        """(out, the context MoKFunction saves: the step's buffer, then shared 3 if any). The
        step's buffer (`carve`) is new; the forward writes the schedule into it itself, or the
        schedule is launched into it first."""
        self.raise_value_errors()
        buffer = self.carve.new()
        context = self._context(buffer)
        op = self.forward_op
        if not op.schedules:
            self.schedule_op(top_experts, context[0])
        if op.combine:  # the megakernel sums the slots: out is all
            return (op.combined(x, router_weights, weights[3:], context, top_experts.data_ptr()),
                    (buffer,))  # fmt: skip
        out, *shared_ctx = op(None, x, router_weights, weights[:3], weights[3:], context=context)
        return out, ((buffer, *shared_ctx) if self.has_shared else (buffer,))

    def full_context(self, saved_ctx) -> tuple:
        """(MoKSchedule, the full path's saved context: routed 4, then shared 3 if any) of a
        step's saved context: views of its buffer."""
        views = self.carve.views(saved_ctx[0])
        return MoKSchedule(*views[:4]), (*views[4:], *saved_ctx[1:])

    def _backward_key(self):
        return threading.get_ident(), _cuda_keys()[1](self.device.index)

    def backward(self, saved_ctx, grad_output, x, router_weights, weights):
        """`functional.backward`'s outputs, or None when this thread and stream has no plan yet
        (or grad_output is not what the plan was checked with): the caller takes the full path
        (`full_context`) and then `resolve_backward`."""
        op = self.backward_ops.get(self._backward_key())
        if op is None or tensor_key(grad_output) != self.grad_key or not self.alive():
            return None
        self.raise_value_errors()
        context = self._context(saved_ctx[0])
        if op.in_kernel_finish and op.in_launch:  # the megakernel writes every gradient
            return (*op.finished(grad_output, router_weights, context), None, None, None)
        # Without a shared expert the op reads no shared context: None in its places.
        shared_ctx = saved_ctx[1:] if self.has_shared else (None, None, None)
        grads = op(None, (None,) * 4 + tuple(shared_ctx), grad_output, x, router_weights,
                   weights[:3], (None,) * 6, weights[3:], context=context)  # fmt: skip
        return backward_outputs(grads, (None,) * 6, self.has_shared)

    def resolve_backward(self, schedule, saved_ctx, grad_output, x, router_weights, weights):
        """After the full path's backward ran on this thread and stream: keep its plan
        (`schedule` and `saved_ctx` as `full_context` gives them)."""
        from . import launchers  # noqa: PLC0415 - the CUDA path's door, CUDA only

        ws = self.ws()
        if ws is None or tensor_key(grad_output) != self.grad_key:
            return
        # The full path's context: empty shared tensors without a shared expert (its plan's key).
        ctx = saved_ctx if self.has_shared else (*saved_ctx, *(x.new_empty(0),) * 3)
        self.backward_ops[self._backward_key()] = launchers.backward_op_plan(
            ws, schedule, ctx, grad_output, x, router_weights, weights[:3], weights[3:],
            self.backward_pass_config, (None,) * 6,
        )  # fmt: skip
