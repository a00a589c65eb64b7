"""`mok.nn.MoKExperts` on the GPU: autograd, recompute (activation checkpointing), main_grad,
torch.compile(fullgraph=True) and a CUDA-graph-captured training step, against the CPU
reference path of the same module (the GPU kernels' results are held to the fp64 oracle in
test_forward_gpu.py / test_backward_gpu.py; here the module glue is what is checked)."""

from __future__ import annotations

import pytest
import torch
from graph_replay import check_replays

from mok.nn import MoKExperts
from mok.testing import make_inputs, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
T, H, I, E, K = 512, 256, 256, 8, 2


def _module(recompute=False, accumulate_main_grad=False):
    torch.manual_seed(0)
    return MoKExperts(E, H, I, K, shared_expert=True, recompute=recompute,
                      accumulate_main_grad=accumulate_main_grad, device=CUDA)  # fmt: skip


def _step(module, fn, inputs):
    """(out, *parameter grads, x.grad, w.grad) of loss = sum(out^2)."""
    x = inputs["x"].detach().clone().requires_grad_()
    w = inputs["router_weights"].detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = fn(x, w, inputs["top_experts"])
    out.float().pow(2).sum().backward()
    return [out, *(p.grad for p in module.parameters()), x.grad, w.grad]


@pytest.mark.parametrize("recompute", [False, True])
def test_module_on_gpu_matches_cpu_path_and_is_deterministic(recompute):
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=7, device=CUDA)
    module = _module(recompute)
    gpu = _step(module, module, inputs)
    again = _step(module, module, inputs)
    for a, b in zip(gpu, again, strict=True):
        assert torch.equal(a, b)
    cpu_module = _module(recompute).cpu()
    cpu_module.load_state_dict({k: v.cpu() for k, v in module.state_dict().items()})
    cpu_inputs = {k: (v.cpu() if v is not None else None) for k, v in inputs.items()}
    cpu = _step(cpu_module, cpu_module, cpu_inputs)
    # Both paths hold the same contract (each is checked against fp64 elsewhere): they differ
    # by bf16 rounding and summation order only.
    for a, b in zip(gpu, cpu, strict=True):
        err = rel_error(a.cpu(), b)
        assert err <= 2**-6, f"GPU vs CPU path: relative difference {err:.3e}"


def test_module_under_torch_compile_fullgraph():
    pytest.importorskip("triton")
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=8, device=CUDA)
    module = _module(recompute=True)
    eager = _step(module, module, inputs)
    torch._dynamo.reset()
    compiled = _step(module, torch.compile(module, fullgraph=True), inputs)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_main_grad_accumulation_on_gpu():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=9, device=CUDA)
    reference = _module()
    plain = _step(reference, reference, inputs)  # .grad from autograd
    module = _module(accumulate_main_grad=True)
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=CUDA)
    for _ in range(2):
        _step(module, module, inputs)
    for p, grad in zip(module.parameters(), plain[1:-2], strict=True):
        assert p.grad is None
        assert torch.equal(p.main_grad.to(torch.bfloat16), grad * 2)


def test_training_step_in_a_cuda_graph():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=10, device=CUDA)
    module = _module()
    params = list(module.parameters())
    x = inputs["x"].detach().clone().requires_grad_()
    w = inputs["router_weights"].detach().clone().requires_grad_()
    ids = inputs["top_experts"].clone()

    def step():
        out = module(x, w, ids)
        grads = torch.autograd.grad(out.float().pow(2).sum(), [x, w, *params])
        return (out, *grads)

    check_replays(step, ids, E, range(300, 302))


COLD_COMPILE_CUDA = """
import sys
import torch
from mok.nn import MoKExperts

torch.manual_seed(0)
cuda = torch.device("cuda")
experts = MoKExperts(num_experts=8, hidden_size=256, intermediate_size=256, topk=2, device=cuda)
x = torch.randn(512, 256, dtype=torch.bfloat16, device=cuda, requires_grad=True)
w = (torch.rand(512, 2, device=cuda) + 0.1).requires_grad_()
ids = torch.stack([torch.randperm(8, device=cuda)[:2] for _ in range(512)])


def loss(x, w, ids):
    return experts(x, w, ids).float().square().sum()


compiled = torch.compile(loss, fullgraph=True, backend=sys.argv[1])
got = compiled(x, w, ids)  # the first call of mok in this process
got.backward()
d_x = x.grad.clone()
x.grad = None
want = loss(x, w, ids)
want.backward()
assert torch.allclose(got, want, rtol=1e-5), (got, want)  # the loss' sum: inductor's order
assert torch.equal(d_x, x.grad)
print("COLD COMPILE OK")
"""


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_before_any_eager_call_on_cuda(backend):
    """A fresh process compiles MoKExperts before any eager call (issue 17, item 4): the
    workspace is made at trace time; compiled and eager steps give the same bits."""
    if backend == "inductor":
        pytest.importorskip("triton")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", COLD_COMPILE_CUDA, backend], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert "COLD COMPILE OK" in done.stdout, (done.stdout + done.stderr)[-3000:]


@pytest.mark.parametrize("grad_reduce_in_fp32", [True, False])
def test_megatron_ddp_accumulates_through_main_grad(grad_reduce_in_fp32):
    """Megatron-Core's own DistributedDataParallel (one rank, overlap_grad_reduce) around a
    MoKExperts with accumulate_main_grad: its hook finds every gradient, and main_grad (fp32 or
    bf16) holds the micro-batches' sum, as the CPU mimic in test_megatron_main_grad_cpu.py."""
    megatron = pytest.importorskip("megatron.core")
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    module = _module(accumulate_main_grad=True)
    reference = _module()
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2,
                               params_dtype=torch.bfloat16, bf16=True)  # fmt: skip
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True,
                                               grad_reduce_in_fp32=grad_reduce_in_fp32)  # fmt: skip
    ddp = DistributedDataParallel(config, ddp_config, module)
    total = {n: torch.zeros(p.shape, device=CUDA) for n, p in reference.named_parameters()}
    for seed in range(2):
        inputs = make_inputs(T, H, I, E, K, seed=seed, device=CUDA)
        args = (inputs["x"], inputs["router_weights"], inputs["top_experts"])
        ddp(*args).float().pow(2).sum().backward()
        reference.zero_grad(set_to_none=True)
        reference(*args).float().pow(2).sum().backward()
        for n, p in reference.named_parameters():
            total[n] += p.grad.float()
    ddp.finish_grad_sync()
    for n, p in module.named_parameters():
        assert p.grad is None and p.grad_added_to_main_grad, n
        assert rel_error(p.main_grad.float(), total[n]) < 2e-2, n
    del megatron
