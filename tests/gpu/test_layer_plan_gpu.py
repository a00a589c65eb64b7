"""`MoKExperts`' resolved steps (mok/layer_plan.py) on the GPU: after a key's first call (and
its first backward) the module calls the launcher plans directly. Every output and gradient of
such a step must be bitwise the full path's (`mok.nn.moe` over `mok.functional`, checked on
every call), and what the full path guarantees per call must still hold: a bad value a kernel
found is raised by the next call, a new weight tensor or token count or a destroyed workspace
sends the call down the full path."""

from __future__ import annotations

import pytest
import torch

import mok.functional as F
from mok.nn import MoKExperts, moe
from mok.testing import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
H, I, E, K = 256, 256, 8, 2


def _poison_allocator() -> None:
    """Fill cached allocator blocks with NaN: outputs a plan allocates start as garbage."""
    junk = torch.full((1 << 24,), float("nan"), dtype=torch.float32, device=CUDA)
    del junk


def _full_path(module):
    def run(x, w, top):
        ws = module.workspace(x.shape[0], x.device)
        schedule = F.build_schedule(ws, module.config, top,
                                    num_local_experts=module.num_local_experts)  # fmt: skip
        return moe(module.config, ws, schedule, x, w, *module.weights(),
                   swiglu_limit=module.swiglu_limit)  # fmt: skip

    return run


def _step(module, fn, inputs, grad):
    """(out, *parameter grads, x.grad, w.grad) of out.backward(grad)."""
    _poison_allocator()
    x = inputs["x"].detach().clone().requires_grad_()
    w = inputs["router_weights"].detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = fn(x, w, inputs["top_experts"])
    out.backward(grad)
    return [out, *(p.grad for p in module.parameters()), x.grad, w.grad]


def _resolved(module) -> list:
    return list(module._steps._steps.values())


@pytest.mark.parametrize("shared,limit", [(False, None), (True, 1.5)])
def test_resolved_steps_are_bitwise_the_full_path(shared, limit):
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, shared_expert=shared, swiglu_limit=limit, device=CUDA)
    for seed, tokens in enumerate((512, 512, 384, 512, 384, 512, 384)):
        inputs = make_inputs(tokens, H, I, E, K, shared=shared, seed=seed, device=CUDA)
        grad = torch.randn(tokens, H, dtype=torch.bfloat16, device=CUDA)
        fast = _step(module, module, inputs, grad)
        full = _step(module, _full_path(module), inputs, grad)
        for a, b in zip(fast, full, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    steps = _resolved(module)
    assert len(steps) == 2  # one per token count
    assert all(len(step.backward_ops) == 1 for step in steps)  # autograd's thread and stream


def _resolved_step(seed: int):
    """A step (eager forward + backward, grads set to None) of a new module whose key has been
    resolved: three steps run first (the full path, then resolved steps)."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, device=CUDA)
    inputs = make_inputs(512, H, I, E, K, seed=seed, device=CUDA)
    x = inputs["x"].detach().clone().requires_grad_()
    w = inputs["router_weights"].detach().clone().requires_grad_()
    grad = torch.randn(512, H, dtype=torch.bfloat16, device=CUDA)

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = w.grad = None
        module(x, w, inputs["top_experts"]).backward(grad)

    for _ in range(3):
        step()
    assert len(_resolved(module)) == 1
    return step


def test_a_resolved_step_allocates_its_outputs_context_and_scratch_only():
    """One eager forward + backward of a resolved step, grads set to None: the step's buffer
    (schedule, x_routed, gate, up, hidden) and out; d_router, the backward megakernel's scratch
    (dy_e, d_gate, d_up, router-grad partials: one), three weight gradients, d_x. 8
    allocations; the slots are the workspace's."""
    step = _resolved_step(seed=5)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step()
    torch.cuda.synchronize()
    count = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    print(f"\nallocations per resolved step: {count}")
    assert count == 8, count


def test_a_resolved_step_launches_two_kernels(monkeypatch):
    """One eager forward + backward of a resolved step of a group of one without a shared
    expert: the forward megakernel (its first phase the schedule, reading the caller's int64
    ids; its last the combine into out), the backward megakernel (its last phase the d_x sum and
    the router-gradient push). Each runs once, in that order."""
    from mok.runtime import module as runtime_module  # noqa: PLC0415

    step = _resolved_step(seed=6)
    launched = []
    launch_packed = runtime_module.Kernel.launch_packed

    def counted(kernel, *args):
        launched.append(kernel.variant.name)
        return launch_packed(kernel, *args)

    monkeypatch.setattr(runtime_module.Kernel, "launch_packed", counted)
    step()
    torch.cuda.synchronize()
    print(f"\nlaunches per resolved step: {launched}")
    assert launched == ["moe_forward", "moe_backward"], launched


def _stepped_module(seed: int):
    """(module, inputs, grad) after three training steps of 512 tokens: its key resolved."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, device=CUDA)
    inputs = make_inputs(512, H, I, E, K, seed=seed, device=CUDA)
    grad = torch.randn(512, H, dtype=torch.bfloat16, device=CUDA)
    for _ in range(3):
        _step(module, module, inputs, grad)
    assert len(_resolved(module)) == 1
    return module, inputs, grad


def test_a_resolved_step_reads_its_context_where_saved_tensor_hooks_put_it():
    """The step's buffer is saved for backward; hooks that move saved tensors (here: a copy)
    give the backward a buffer at a new address, which it must read (bitwise the full path)."""
    module, inputs, grad = _stepped_module(seed=7)
    copies = []

    def pack(t):
        copy = t.clone()
        copies.append(copy)
        return copy

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fast = _step(module, module, inputs, grad)
    assert copies  # the hooks saw the step's saved tensors
    full = _step(module, _full_path(module), inputs, grad)
    for a, b in zip(fast, full, strict=True):
        assert torch.equal(a, b)


def test_new_weights_and_a_destroyed_workspace_take_the_full_path():
    module, inputs, grad = _stepped_module(seed=4)
    with torch.no_grad():
        module.gate_weight.data = module.gate_weight.data * 2  # a new tensor: a new key
    fast = _step(module, module, inputs, grad)
    full = _step(module, _full_path(module), inputs, grad)
    for a, b in zip(fast, full, strict=True):
        assert torch.equal(a, b)
    F.clear_workspace_cache()  # destroys the workspace the resolved steps were made on
    assert not any(step.alive() for step in _resolved(module))
    fast = _step(module, module, inputs, grad)
    full = _step(module, _full_path(module), inputs, grad)
    for a, b in zip(fast, full, strict=True):
        assert torch.equal(a, b)


def _step_schedule(module, out):
    """The schedule a resolved step's forward wrote: views of the buffer it saved."""
    (step,) = _resolved(module)
    buffer = out.grad_fn.saved_tensors[-1]
    return step.carve.views(buffer)[:4]


@pytest.mark.parametrize("tokens,topk,skew", [(512, 2, False), (5000, 2, False),
                                              (3000, 4, True)])  # fmt: skip
def test_the_forward_writes_the_schedule_kernels_schedule(tokens, topk, skew):
    """A resolved step's forward megakernel writes the schedule itself (phases/schedule_phase.py):
    bitwise the schedule kernel's (`build_schedule`: peer_rank, peer_token_idx with its padding
    rows, num_tokens, tokens_per_expert), over one chunk and several (4096 entries each), and
    with every token routed to the same experts 3 .. 3 + k - 1 (skew). Then the step's
    outputs are the full path's, bitwise."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, topk, device=CUDA)
    inputs = make_inputs(tokens, H, I, E, topk, seed=11, device=CUDA)
    if skew:
        inputs["top_experts"] = torch.arange(topk, device=CUDA).repeat(tokens, 1) + 3
    x, w, top = inputs["x"], inputs["router_weights"], inputs["top_experts"]
    grad = torch.randn(tokens, H, dtype=torch.bfloat16, device=CUDA)
    for _ in range(3):
        _step(module, module, inputs, grad)
    assert len(_resolved(module)) == 1
    _poison_allocator()
    out = module(x.detach().requires_grad_(), w.detach().requires_grad_(), top)
    ws = module.workspace(tokens, x.device)
    expected = F.build_schedule(ws, module.config, top, num_local_experts=E)
    names = ("peer_rank", "peer_token_idx", "num_tokens", "tokens_per_expert")
    got = _step_schedule(module, out)
    for name, a in zip(names, got, strict=True):
        assert torch.equal(a, getattr(expected, name)), name
    fast = _step(module, module, inputs, grad)
    full = _step(module, _full_path(module), inputs, grad)
    for a, b in zip(fast, full, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "name,where,value,message,seed",
    [("router_weights", (7, 1), float("nan"), "router_weights must be finite and > 0", 3),
     ("top_experts", (100, 1), E, "top_experts must hold expert ids", 12)],
)  # fmt: skip
def test_bad_value_on_a_resolved_step_is_raised_by_the_next_call(name, where, value, message,
                                                                  seed):  # fmt: skip
    """A resolved step's kernels check the values they read into the value-status words (a
    router weight: the megakernel's combine; an expert id against [0, E): the forward's
    schedule phase, as the schedule kernel does): the next call raises, and then runs as the
    full path."""
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, device=CUDA)
    inputs = make_inputs(512, H, I, E, K, seed=seed, device=CUDA)
    x, w, top = inputs["x"], inputs["router_weights"], inputs["top_experts"]
    for _ in range(3):
        module(x, w, top)
    assert len(_resolved(module)) == 1
    bad = dict(router_weights=w, top_experts=top)
    bad[name] = bad[name].clone()
    bad[name][where] = value
    module(x, bad["router_weights"], bad["top_experts"])  # the resolved step records it
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=message):
        module(x, w, top)
    torch.testing.assert_close(module(x, w, top), _full_path(module)(x, w, top), rtol=0, atol=0)
