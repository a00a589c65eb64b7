"""mok.functional and mok.nn on CPU: equal to the reference and the naive loop, main_grad
accumulation, workspace life cycle, torch.compile tracing, and `python -m mok`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mok import functional as F
from mok import reference as R
from mok.config import ROUTED_ROW_ALIGNMENT
from mok.nn import MoKExperts
from mok.testing import WEIGHT_NAMES, make_inputs, run_layer, within_bf16_bound

T, H, I, E, K = 96, 128, 256, 6, 3
GRADS = ("x", "router_weights", "routed_gate", "routed_up", "routed_down",
         "shared_gate", "shared_up", "shared_down")  # fmt: skip


def functional_step(inputs, limit=None, main_grads=None):
    out, ctx, grads, _ = run_layer(inputs, E, swiglu_limit=limit, main_grads=main_grads)
    return out, ctx, grads


@pytest.mark.parametrize("shared,limit", [(True, None), (False, 0.5)])
def test_functional_equals_reference_and_naive(shared, limit):
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=1)
    out, ctx, grads = functional_step(inputs, limit)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E,
                               capacity=2 * T * K + E * ROUTED_ROW_ALIGNMENT)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    ref_out, ref_ctx = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights,
                                 swiglu_limit=limit)  # fmt: skip
    assert torch.equal(out, ref_out)
    ref_grads = R.backward(schedule, ref_ctx, inputs["grad_output"], inputs["x"],
                           inputs["router_weights"], *weights, swiglu_limit=limit)  # fmt: skip
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want if want.dtype == got.dtype else want.to(got.dtype))
    truth_out, truth = R.naive_moe_with_grads(inputs, inputs["grad_output"], swiglu_limit=limit)
    bf_out, bf = R.naive_moe_with_grads(inputs, inputs["grad_output"], swiglu_limit=limit,
                                        dtype=torch.bfloat16)  # fmt: skip
    assert within_bf16_bound(out, truth_out, bf_out)[0]
    for name, got in zip(GRADS, grads, strict=True):
        if got is not None:
            assert within_bf16_bound(got, truth[name], bf[name])[0], name


def test_deterministic_across_runs():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=2)
    first = functional_step(inputs)
    for _ in range(2):
        again = functional_step(inputs)
        assert torch.equal(first[0], again[0])
        for a, b in zip(first[2], again[2], strict=True):
            assert torch.equal(a, b)


def test_main_grad_accumulation_equals_sum_of_returned_gradients():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=3)
    _, _, grads = functional_step(inputs)
    # The reference's fp32 weight gradients: returned grads are their bf16 rounding, main_grad
    # accumulation adds them in fp32.
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E,
                               capacity=2 * T * K + E * ROUTED_ROW_ALIGNMENT)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    _, ctx = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights)
    fp32_grads = R.backward(schedule, ctx, inputs["grad_output"], inputs["x"],
                            inputs["router_weights"], *weights)[2:]  # fmt: skip
    main = tuple(torch.full(inputs[n].shape, 0.5) for n in WEIGHT_NAMES[3:] + WEIGHT_NAMES[:3])
    for _ in range(2):
        _, _, acc = functional_step(inputs, main_grads=main)
        for i, m in enumerate(main):
            assert acc[2 + i] is m
    for i, (m, g) in enumerate(zip(main, fp32_grads, strict=True)):
        assert torch.equal(grads[2 + i], g.to(torch.bfloat16))
        assert torch.equal(m, (0.5 + g) + g)


def test_workspace_cache_size_report_and_destroy():
    config = F.MoKConfig()
    a = F.get_workspace(config, None, device="cpu", num_local_tokens=32, hidden_size=128, topk=2)
    b = F.get_workspace(config, None, device="cpu", num_local_tokens=32, hidden_size=128, topk=2)
    assert a is b
    assert a.nbytes == sum(t.numel() * t.element_size() for t in a.buffers.values())
    report = a.describe()
    assert "combine_buffer" in report and f"{a.nbytes:,d} B" in report
    a.destroy()
    assert a.destroyed and not a.buffers
    c = F.get_workspace(config, None, device="cpu", num_local_tokens=32, hidden_size=128, topk=2)
    assert c is not a
    F.clear_workspace_cache()
    assert c.destroyed


def test_compile_fullgraph_forward_backward_step():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=4)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]

    def step(top_experts, x, router_weights, dy, *weights):
        schedule = F.build_schedule(ws, config, top_experts, num_local_experts=E)
        out, ctx = F.forward(config, ws, schedule, x, router_weights, *weights)
        grads = F.backward(config, ws, schedule, ctx, dy, x, router_weights, *weights)
        return out, grads

    args = (inputs["top_experts"], inputs["x"], inputs["router_weights"], inputs["grad_output"])
    eager = step(*args, *weights)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")(*args, *weights)
    assert torch.equal(eager[0], compiled[0])
    for a, b in zip(eager[1], compiled[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("recompute", [False, True])
def test_moe_experts_module_autograd_and_compile(recompute):
    torch.manual_seed(0)
    module = MoKExperts(E, H, I, K, shared_expert=True, recompute=recompute)
    inputs = make_inputs(T, H, I, E, K, seed=5)
    x = inputs["x"].requires_grad_()
    w = inputs["router_weights"].requires_grad_()

    def run(fn):
        module.zero_grad(set_to_none=True)
        x.grad = w.grad = None
        out = fn(x, w, inputs["top_experts"])
        out.float().pow(2).sum().backward()
        return [out] + [p.grad for p in module.parameters()] + [x.grad, w.grad]

    eager = run(module)
    torch._dynamo.reset()
    compiled = run(torch.compile(module, fullgraph=True, backend="eager"))
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    # Same gradients as the functional API.
    params = dict(module.named_parameters())
    fi = dict(inputs, routed_gate=params["gate_weight"].detach(),
              routed_up=params["up_weight"].detach(), routed_down=params["down_weight"].detach(),
              shared_gate=params["shared_gate_weight"].detach(),
              shared_up=params["shared_up_weight"].detach(),
              shared_down=params["shared_down_weight"].detach(),
              x=x.detach(), router_weights=w.detach(),
              grad_output=(2 * eager[0].detach().float()).to(torch.bfloat16))  # fmt: skip
    _, _, grads = functional_step(fi)
    assert torch.equal(eager[-2], grads[0]) and torch.equal(eager[-1], grads[1])


def test_module_main_grad_attribute():
    module = MoKExperts(E, H, I, K, accumulate_main_grad=True)
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape)
    inputs = make_inputs(T, H, I, E, K, seed=6)
    module(inputs["x"], inputs["router_weights"], inputs["top_experts"]).float().sum().backward()
    for p in module.parameters():
        assert p.grad is None and torch.count_nonzero(p.main_grad) > 0


def test_python_dash_m_mok_runs_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "mok", "--device", "cpu", "--tokens", "128"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "path   : PyTorch reference (CPU path)" in proc.stdout
    assert proc.stdout.strip().endswith("PASS")


COLD_COMPILE = """
import sys
import torch
from mok.nn import MoKExperts

torch.manual_seed(0)
experts = MoKExperts(num_experts=4, hidden_size=128, intermediate_size=128, topk=2)
x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
w = (torch.rand(64, 2) + 0.1).requires_grad_()
ids = torch.randint(0, 4, (64, 2))


def loss(x, w, ids):
    return experts(x, w, ids).float().square().sum()


compiled = torch.compile(loss, fullgraph=True, backend=sys.argv[1])
got = compiled(x, w, ids)  # the first call of mok in this process
got.backward()
d_x = x.grad.clone()
x.grad = None
want = loss(x, w, ids)
want.backward()
assert torch.allclose(got, want, rtol=1e-5), (got, want)
assert torch.equal(d_x, x.grad)
print("COLD COMPILE OK")
"""


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_of_mok_experts_in_a_fresh_process(backend):
    # A fresh process: compiling before any eager call creates the workspace at trace time.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", COLD_COMPILE, backend], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert "COLD COMPILE OK" in done.stdout, (done.stdout + done.stderr)[-3000:]
