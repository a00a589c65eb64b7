"""Megatron-Core's gradient convention through `MoKExperts(accumulate_main_grad=True)`.

Megatron-Core's DistributedDataParallel builds its gradient buffers on CUDA, so on CPU its
backward hook runs here as an exact mimic: `_make_backward_post_hook` of
megatron/core/distributed/distributed_data_parallel.py (megatron-core 0.16.1, lines 427-446),
registered as DDP registers it (lines 340-345: on the parameter's gradient accumulator, via
`param.expand_as(param).grad_fn.next_functions[0][0]`). `tests/gpu/test_nn_gpu.py` runs the
real DDP where megatron-core is installed.
"""

from __future__ import annotations

import pytest
import torch

from mok.nn import MoKExperts
from mok.testing import make_inputs

T, H, I, E, K = 64, 128, 128, 4, 2


class MegatronDDPHooks:
    """DDP's backward post-hook on every parameter, with overlap_grad_reduce=True."""

    def __init__(self, module: torch.nn.Module, main_grad_dtype: torch.dtype):
        self.ready = []
        self.grad_accs = []
        for param in module.parameters():
            # DDP.__init__: every parameter gets main_grad and grad_added_to_main_grad.
            param.main_grad = torch.zeros(param.shape, dtype=main_grad_dtype)
            param.grad_added_to_main_grad = False
            param_tmp = param.expand_as(param)
            grad_acc = param_tmp.grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_backward_post_hook(param))
            self.grad_accs.append(grad_acc)

    def _make_backward_post_hook(self, param):
        def hook(*unused):
            assert param.requires_grad
            # overlap_grad_reduce: the gradient must have arrived.
            assert param.grad is not None, (
                "param.grad being None is not safe when overlap_grad_reduce is True"
            )
            if param.grad is not None and (
                not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)
            ):
                param.main_grad.add_(param.grad.data)
            param.grad = None
            self.ready.append(param)

        return hook

    def zero_grad_buffer(self, module):
        for param in module.parameters():
            param.main_grad.zero_()
            param.grad_added_to_main_grad = False


def _grads(main_grad_dtype, zero_out_wgrad=False, microbatches=2):
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, shared_expert=True, accumulate_main_grad=True)
    ddp = MegatronDDPHooks(module, main_grad_dtype)
    if zero_out_wgrad:
        for p in module.parameters():
            p.zero_out_wgrad = True
    for mb in range(microbatches):
        inp = make_inputs(T, H, I, E, K, seed=mb)
        out = module(inp["x"], inp["router_weights"], inp["top_experts"])
        out.float().square().sum().backward()
    return module, ddp


def _reference_grads(microbatches=2):
    """The same module's gradients summed over micro-batches in fp32, as plain autograd."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, shared_expert=True)
    total = {n: torch.zeros(p.shape) for n, p in module.named_parameters()}
    for mb in range(microbatches):
        inp = make_inputs(T, H, I, E, K, seed=mb)
        module.zero_grad(set_to_none=True)
        module(
            inp["x"], inp["router_weights"], inp["top_experts"]
        ).float().square().sum().backward()
        for n, p in module.named_parameters():
            total[n] += p.grad.float()
    return total


@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16])
def test_megatron_ddp_hook_sees_every_gradient_once(main_grad_dtype):
    module, ddp = _grads(main_grad_dtype)
    params = list(module.parameters())
    # The hook fired for every parameter on each micro-batch, found a gradient and left none.
    assert len(ddp.ready) == 2 * len(params)
    assert all(p.grad is None for p in params)
    assert all(p.grad_added_to_main_grad for p in params)
    want = _reference_grads()
    for name, p in module.named_parameters():
        assert p.main_grad.dtype == main_grad_dtype
        err = (p.main_grad.float() - want[name]).norm() / want[name].norm()
        # fp32: the layer's fp32 sums against bf16-rounded autograd gradients; bf16 adds one
        # rounding per micro-batch.
        assert err < (2e-2 if main_grad_dtype == torch.bfloat16 else 1e-2), (name, err)


def test_zero_out_wgrad_adds_zeros_once():
    """With zero_out_wgrad the hook adds the dummy, which must be zeros."""
    fp32, _ = _grads(torch.float32)
    zeroed, _ = _grads(torch.float32, zero_out_wgrad=True)
    for a, b in zip(fp32.parameters(), zeroed.parameters(), strict=True):
        assert torch.equal(a.main_grad, b.main_grad)


def test_without_megatron_attribute_no_gradient_is_returned():
    """A main_grad without grad_added_to_main_grad (not Megatron's DDP): added in place, no
    .grad, as before."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, accumulate_main_grad=True)
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape)
    inp = make_inputs(T, H, I, E, K)
    module(inp["x"], inp["router_weights"], inp["top_experts"]).float().sum().backward()
    for p in module.parameters():
        assert p.grad is None and p.main_grad.abs().sum() > 0
        assert not hasattr(p, "grad_added_to_main_grad")


def test_main_grad_of_another_dtype_is_refused():
    module = MoKExperts(E, H, I, K, accumulate_main_grad=True)
    module.gate_weight.main_grad = torch.zeros(module.gate_weight.shape, dtype=torch.float16)
    inp = make_inputs(T, H, I, E, K)
    out = module(inp["x"], inp["router_weights"], inp["top_experts"])
    with pytest.raises(TypeError, match=r"main_grad must be torch.float32 or torch.bfloat16, "
                       r"got torch.float16"):  # fmt: skip
        out.float().sum().backward()
