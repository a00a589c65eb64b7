"""Forward progress of both megakernels with fewer resident CTAs than their grid (DESIGN §4;
mok/dsl_kernels/phases/dispatch_phase.py): a concurrent kernel (mok/dsl_kernels/kernels/sm_holder.py) holds
every SM but a few, as a data-parallel NCCL kernel on a side stream does in training, while a
training step runs its forward and backward megakernels with the full grid. The step must
finish and give the bits of the same step without the holder.

The holder keeps its SMs until the megakernels have finished: the host launches the step only
once every holder CTA has started, and sets the holder's flag (mapped host memory) only after
the step's stream has synchronised; a holder that gave up on its own (bounded) fails the test.
Each holder CTA takes more than half of an SM's shared memory, so no two share an SM and no
megakernel CTA fits beside one: at most `free_sms` megakernel CTAs are resident at a time.

Before dispatch was taken by ticket, CTA c copied row tiles c, c + grid, ...: with every CTA
dispatching, the resident CTAs' GEMM tasks waited for row tiles of CTAs that could not start
while they held the free SMs, the bounded wait gave up after `wait_timeout_ns` and the
forward megakernel trapped (MoKWaitTimeoutError, dispatch phase). The step runs in a
subprocess: a trapped kernel ends its CUDA context.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = textwrap.dedent(
    """
    import ctypes, dataclasses, sys, time
    import torch
    from mok import functional as F
    from mok.runtime import _driver, get_kernel
    from mok.testing import make_inputs, run_layer_step

    free_sms, comm_ctas, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cuda = torch.device("cuda")
    # 8192 routed rows (64 row tiles and padding): more row tiles than resident CTAs.
    tokens, hidden, intermediate, experts, topk = 4096, 512, 512, 8, 2
    config = dataclasses.replace(F.MoKConfig(), fwd_num_comm_sms=comm_ctas,
                                 bwd_num_comm_sms=comm_ctas)
    inputs = make_inputs(tokens, hidden, intermediate, experts, topk, seed=7, device=cuda)
    ws = F.get_workspace(config, None, device=cuda, num_local_tokens=tokens, hidden_size=hidden,
                         topk=topk, num_local_experts=experts)
    ws.wait_timeout_ns = 5_000_000_000  # a stuck megakernel wait gives up after 5 s
    holder_limit_ns = 60_000_000_000  # the holder lets go on its own after 60 s (a failure)
    work = torch.cuda.Stream()

    def functional_step():
        # Schedule, forward and backward with no host sync, on `work`, the full grid.
        with torch.cuda.stream(work):
            out, _, grads = run_layer_step(config, ws, inputs, experts)
        return [out, *(g for g in grads if g is not None)]

    if mode == "module":  # a resolved step: the forward megakernel writes the schedule
        from mok.nn import MoKExperts

        torch.manual_seed(0)
        module = MoKExperts(experts, hidden, intermediate, topk, config=config, device=cuda)
        ws = module.workspace(tokens, cuda)
        ws.wait_timeout_ns = 5_000_000_000

    def module_step():
        with torch.cuda.stream(work):
            module.zero_grad(set_to_none=True)
            x = inputs["x"].detach().requires_grad_()
            w = inputs["router_weights"].detach().requires_grad_()
            out = module(x, w, inputs["top_experts"])
            out.backward(inputs["grad_output"])
        return [out, x.grad, w.grad, *(p.grad for p in module.parameters())]

    step = module_step if mode == "module" else functional_step
    if mode == "module":
        for _ in range(2):  # the full path, then a resolved step
            step()
            work.synchronize()
        assert len(module._steps._steps) == 1

    # A step to load every kernel and fill the caching allocator's pool of `work` (no module
    # load or cudaMalloc while the holder runs), then the step without the holder.
    torch.cuda.synchronize()  # the inputs, made on the default stream
    step()
    work.synchronize()
    expected = step()
    work.synchronize()
    F.check_errors(ws)

    cu = _driver.driver()
    holder = get_kernel("sm_holder", device=cuda)
    index = torch.cuda.current_device()
    device = _driver.check(cu.cuDeviceGet(index), "cuDeviceGet")
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    per_sm = _driver.check(cu.cuDeviceGetAttribute(attribute, device), "cuDeviceGetAttribute")
    reserved = 1024  # shared memory the hardware keeps per CTA
    hold = holder.variant.dynamic_smem_bytes + reserved
    for name in ("moe_forward", "moe_backward"):
        mega = get_kernel(name, device=cuda).variant.dynamic_smem_bytes + reserved
        assert 2 * hold > per_sm and hold + mega > per_sm, (name, hold, mega, per_sm)

    # Mapped host memory: the flag at byte 0, counts (started, released, timed out) at 64.
    flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
    host = int(_driver.check(cu.cuMemHostAlloc(128, flags), "cuMemHostAlloc"))
    mapped = int(_driver.check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
    ctypes.memset(host, 0, 128)
    flag = ctypes.c_int32.from_address(host)
    counts = (ctypes.c_int32 * 3).from_address(host + 64)

    holders = torch.cuda.get_device_properties(index).multi_processor_count - free_sms
    hold_stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    holder.launch((holders, 1, 1), {"flag_ptr": mapped, "counts_ptr": mapped + 64,
                                    "expected": 1, "timeout_ns": holder_limit_ns},
                  stream=hold_stream)
    deadline = time.monotonic() + 30
    while counts[0] < holders and time.monotonic() < deadline:
        time.sleep(0.001)
    if counts[0] < holders:
        flag.value = 1
        print(f"FAIL: only {counts[0]} of {holders} holder CTAs started within 30 s")
        sys.exit(1)

    start = time.monotonic()
    try:
        got = step()
        work.synchronize()
    except Exception as error:
        flag.value = 1
        try:  # the wait that gave up, from the error record
            F.check_errors(ws)
        except Exception as named:
            error = named
        print(f"FAIL: the step did not finish: {type(error).__name__}: {error}")
        sys.exit(1)
    seconds = time.monotonic() - start
    flag.value = 1
    hold_stream.synchronize()
    if counts[1] != holders or counts[2] != 0:
        print(f"FAIL: holders released by the flag {counts[1]}, gave up {counts[2]}, of "
              f"{holders}: the SMs were not held until the step finished")
        sys.exit(1)
    F.check_errors(ws)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if not torch.equal(a, b):
            print(f"FAIL: result {i} differs from the step without the holder")
            sys.exit(1)
    print(f"PASS: {holders} SMs held, {free_sms} free, step {seconds:.3f} s")
    """
)


# 1 free SM: one megakernel CTA at a time; 8: several at once (the old dispatch trapped in
# both). 2 comm CTAs: the compute CTAs wait for rows only CTAs 0 and 1 copy, which the hardware
# starts first (the old dispatch passed this one: CTAs 0 and 1 copied every row tile).
# "module": a resolved MoKExperts step, whose forward megakernel writes the schedule first
# (phases/schedule_phase.py: its tasks taken by ticket too).
@pytest.mark.parametrize("free_sms,comm_ctas,mode", [(1, 0, "functional"), (8, 0, "functional"),
                                                     (4, 2, "functional"), (1, 0, "module"),
                                                     (8, 0, "module")])  # fmt: skip
def test_megakernels_finish_with_most_sms_held(free_sms, comm_ctas, mode):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_sms), str(comm_ctas), mode],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "PASS" in done.stdout, output[-3000:]
