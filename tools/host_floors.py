"""Host cost of the primitives a mok step is made of, on this machine (microseconds per call).

    python -m tools.host_floors

Each row is the median of 10 batches of 200 calls, with the GPU kept busy by nothing but the
calls themselves (small kernels; a sync between batches). These are the floors under
`benchmarks.host_time`: a step's launches, allocations and autograd cannot cost less. The rows
marked "GPU busy" enqueue work before each batch that outlasts it (a spinning kernel, or a
bandwidth-bound copy, as a megakernel is while the host enqueues the next step's launches): the
same calls made while the GPU runs something else.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch

QWEN = (4096, 2048, 768, 128, 8)  # T, H, I, E, k: Qwen3-30B-A3B's layer at 4096 tokens


def _per_call(fn, calls: int = 200, batches: int = 10, busy=None) -> float:
    """Median over batches of a call's host microseconds; `busy()` (untimed) before each batch."""
    samples = []
    for _ in range(batches):
        torch.cuda.synchronize()
        if busy is not None:
            busy()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad, None


def main() -> None:
    from mok.launchers.plans import current_stream, zero_async
    from mok.runtime import _driver, get_kernel

    device = torch.device("cuda", torch.cuda.current_device())
    cu = _driver.driver()
    rows = {}
    small = torch.empty(256, dtype=torch.int32, device=device)
    rows["torch.empty (4 MB bf16)"] = _per_call(
        lambda: torch.empty(1024, 2048, dtype=torch.bfloat16, device=device)
    )
    rows["Tensor.new_empty(0)"] = _per_call(lambda: small.new_empty(0))
    rows["Tensor.data_ptr"] = _per_call(small.data_ptr)
    rows["torch.zero_ (1 KB)"] = _per_call(small.zero_)
    stream = current_stream(device.index)
    rows["cuMemsetD32Async (cuda-python)"] = _per_call(lambda: zero_async(small, stream))
    rows["cuCtxGetCurrent (cuda-python)"] = _per_call(cu.cuCtxGetCurrent)
    kernel = get_kernel("schedule", device=device)
    counts = torch.zeros(64, dtype=torch.int32, device=device)
    expert = torch.zeros(32, dtype=torch.int32, device=device)
    words = torch.zeros(8, dtype=torch.int32, device=device)  # counters (left zero), status
    # No entries, capacity 0: one count task and one placement task, nothing placed.
    args = {"ids_ptr": counts, "counts_ptr": counts, "expert_counts_ptr": expert,
            "counters_ptr": words, "peer_rank_ptr": counts, "peer_token_idx_ptr": counts,
            "num_tokens_ptr": counts, "tokens_per_expert_ptr": expert,
            "status_ptr": words[4:], "error_record_ptr": None, "timeout_ns": 10**9,
            "num_entries": 0, "entries_per_rank": 0, "ep_rank": 0, "num_local_experts": 32,
            "capacity": 0}  # fmt: skip
    rows["Kernel.launch (16 params, checked)"] = _per_call(lambda: kernel.launch((1, 1, 1), args))
    bound = kernel.bind((1, 1, 1), args, dynamic=("counts_ptr", "expert_counts_ptr"))
    c_at, e_at = counts.data_ptr(), expert.data_ptr()
    rows["BoundLaunch.launch (2 dynamic)"] = _per_call(
        lambda: bound.launch(c_at, e_at, stream=stream)
    )
    config = bound._config
    packed = bound._packed
    function = kernel.function
    rows["cuLaunchKernelEx alone (cuda-python)"] = _per_call(
        lambda: cu.cuLaunchKernelEx(config, function, packed.address, 0)
    )
    # Work that outlasts a batch (200 calls at up to ~50 us): ~20 ms of spinning, or 16 copies
    # of 2 GiB (~1 ms each at ~4 TB/s).
    source = torch.empty(2**30, dtype=torch.int16, device=device)
    target = torch.empty_like(source)

    def spin():
        torch.cuda._sleep(40_000_000)

    def copy():
        for _ in range(16):
            target.copy_(source)

    for label, busy in (("spinning", spin), ("copying", copy)):
        rows[f"cuLaunchKernelEx alone, GPU busy {label}"] = _per_call(
            lambda: cu.cuLaunchKernelEx(config, function, packed.address, 0), busy=busy
        )
        rows[f"torch.empty (4 MB bf16), GPU busy {label}"] = _per_call(
            lambda: torch.empty(1024, 2048, dtype=torch.bfloat16, device=device), busy=busy
        )
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p,
                                                                  ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    f_handle = int(function)
    rows["cuLaunchKernel via ctypes (no cluster attribute)"] = _per_call(
        lambda: launch(f_handle, 1, 1, 1, 1024, 1, 1, 0, stream, packed.address, None)
    )
    x = torch.randn(256, 256, device=device, requires_grad=True)
    w = torch.randn(256, device=device, requires_grad=True)
    g = torch.randn(256, 256, device=device)

    def autograd_step():
        _Identity.apply(x, w).backward(g)
        x.grad = None

    rows["autograd.Function apply + backward (no kernels)"] = _per_call(autograd_step, 100)
    rows.update(_megakernel_rows(device, cu, stream))
    rows.update(_layer_rows(device))
    for name, us in rows.items():
        print(f"{name:52s} {us:8.2f} us")


def _megakernel_rows(device, cu, stream) -> dict:
    """The driver call of a resolved Qwen3-30B-A3B step's forward megakernel (T = 4096: 384
    threads, 219 KiB of shared memory, 40 params with 5 TMA descriptors), 16 launches a batch,
    each the same launch again (its counters are left zero by the kernel), with and without the
    launch config's cluster attribute ([1, 1, 1]; the runtime launches 1x1x1 kernels without
    it, as the small kernel's row above)."""
    from mok.nn import MoKExperts  # noqa: PLC0415
    from mok.testing import make_inputs  # noqa: PLC0415

    t, h, i, e, k = QWEN
    module = MoKExperts(e, h, i, k, device=device)
    inputs = make_inputs(t, h, i, e, k, device=device)
    x, w, top = inputs["x"], inputs["router_weights"], inputs["top_experts"]
    for _ in range(3):  # the full path, then the resolved step
        module(x, w, top)
    weights = module.weights()
    step = module._steps.get(module._steps.key(module, x, w, top, weights), module.config)
    if step is None or not step.forward_op.combine:
        return {}
    op = step.forward_op
    buffer = step.carve.new()  # held, with out, while the launch is repeated into them
    out = op.combined(x, w, weights[3:], step._context(buffer), top.data_ptr())
    bound = op.routed.bound  # its packed params are that launch's
    big = bound.kernel
    with_attribute = _config_of(big, bound.grid, stream, True)
    plain = _config_of(big, bound.grid, stream, False)
    result = cu.cuLaunchKernelEx(plain, big.function, bound._packed.address, 0)
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{big.variant.name} without a launch attribute: {result[0]}")
    rows = {
        "moe_forward cuLaunchKernelEx (cluster attribute)": _per_call(
            lambda: cu.cuLaunchKernelEx(with_attribute, big.function, bound._packed.address, 0),
            16,
            20,
        ),
        "moe_forward cuLaunchKernelEx, no attribute": _per_call(
            lambda: cu.cuLaunchKernelEx(plain, big.function, bound._packed.address, 0), 16, 20
        ),
    }
    del buffer, out
    return rows


def _config_of(kernel, grid, stream, cluster_attribute: bool):
    """A launch config of `kernel` on `stream`, with or without its cluster attribute."""
    config = kernel._launch_config(grid, stream)
    config.attrs = [kernel._cluster_attribute] if cluster_attribute else []
    config.numAttrs = int(cluster_attribute)
    return config


def _layer_rows(device) -> dict:
    """The functional pieces of one Qwen3-30B-A3B-shaped step (T = 4096), each timed alone."""
    import mok.functional as F  # noqa: PLC0415
    from mok.testing import make_inputs  # noqa: PLC0415

    t, h, i, e, k = QWEN
    inputs = make_inputs(t, h, i, e, k, device=device)
    weights = (None, None, None, inputs["routed_gate"], inputs["routed_up"], inputs["routed_down"])
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=device, num_local_tokens=t, hidden_size=h,
                         topk=k, num_local_experts=e)  # fmt: skip
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    _, ctx = F.forward(config, ws, schedule, x, w, *weights)
    rows = {
        "layer: functional.build_schedule": _per_call(
            lambda: F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e), 20
        ),
        "layer: functional.forward": _per_call(
            lambda: F.forward(config, ws, schedule, x, w, *weights), 20
        ),
        "layer: functional.backward": _per_call(
            lambda: F.backward(config, ws, schedule, ctx, dy, x, w, *weights), 20
        ),
    }
    from mok.launchers import forward_op  # noqa: PLC0415
    from mok.types import PassConfig  # noqa: PLC0415

    settings = PassConfig.of_workspace(ws, swiglu_limit=None, num_comm_ctas=0,
                                       minibatch_size=config.minibatch_size,
                                       macrobatch_size=config.macrobatch_size)  # fmt: skip
    rows["layer: launchers forward_op.forward"] = _per_call(
        lambda: forward_op.forward(ws, schedule, x, w, weights[:3], weights[3:], settings), 20
    )
    # The engine row syncs before each step: beside it the same call on the main thread, also
    # with the GPU idle at its start, so the two differ only in the thread.
    rows["layer: functional.backward, GPU idle at the start"] = _idle_start(
        lambda: F.backward(config, ws, schedule, ctx, dy, x, w, *weights)
    )
    rows["layer: functional.backward run by autograd's engine"] = _backward_in_engine(
        lambda: F.backward(config, ws, schedule, ctx, dy, x, w, *weights)
    )
    return rows


def _idle_start(fn, steps: int = 50) -> float:
    """Median time of one `fn()` call on this thread, the GPU synchronised before each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[5:])


def _backward_in_engine(run_backward, steps: int = 50) -> float:
    """Median time of `run_backward` when autograd's engine calls it (on torch's device thread
    for CUDA tensors), to set beside the same call on the main thread."""
    inside = []

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor):
            return anchor.clone()

        @staticmethod
        def backward(ctx, grad):
            t0 = time.perf_counter()
            run_backward()
            inside.append((time.perf_counter() - t0) * 1e6)
            return grad

    anchor = torch.zeros(1, device="cuda", requires_grad=True)
    for _ in range(steps):
        _Probe.apply(anchor).backward(torch.ones(1, device="cuda"))
        torch.cuda.synchronize()
    return statistics.median(inside[5:])


if __name__ == "__main__":
    main()
