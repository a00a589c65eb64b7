"""Where a layer pass's GPU time goes at a benchmark shape, beside the pass's byte and FLOP floors.

    python -m tools.phase_times [--shape qwen3-30b-a3b] [--tokens 2048,4096] [--reps 20]

For each token count, on one random routing (`mok.testing.make_inputs`), the median over `--reps`
calls of each call between CUDA events (benchmarks.timing, as the benchmark times), in ms:

- `schedule`, `forward`, `backward`: the `mok.functional` calls a training step makes;
- each kernel's GPU time inside one schedule + forward + backward (torch.profiler), so host
  gaps between launches show as the difference;
- the pieces of the megakernels as separate kernels, on the forward's own schedule and
  context: the dispatch (`gather_rows`), gate/up + SwiGLU, down, the sums (`fwd_epilogue`); the
  backward's d_hidden (+ SwiGLU backward), d_x and the three weight gradients (bf16); and
  gate/up and down with the routed rows spread evenly over the experts (`T * k / E` rows each,
  rounded up to 128): what the GEMMs cost without the schedule's 128-row padding of uneven
  experts. The megakernel against the sum of its pieces is what running them as one kernel
  gains or loses;
- `weights once`: the weight bytes over the copy bandwidth measured here (read + write of a
  2 GiB copy, benchmarks.timing): the least time any forward can take to read the weights;
- the pass's FLOPs over the bf16 GEMM rate measured here (8192^3 matmuls, benchmarks.timing).

Nothing here is asserted; it prints one table per token count.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.shapes import SHAPES, scale_for_run
from benchmarks.timing import TimingConfig, copy_bandwidth_gbs, gemm_ceiling_tflops, time_ms
from mok import functional as F
from mok.launchers import dispatch, epilogues, expert_gemm, expert_gemm_bwd
from mok.testing import make_inputs

CUDA = torch.device("cuda")
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def _time(fn, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls, each between CUDA events (benchmarks.timing)."""
    return statistics.median(time_ms(CUDA, TimingConfig(warmup=3, reps=reps), lambda _: fn()))


def layer(shape_name: str, tokens: int):
    """(shape, inputs, config, workspace, schedule) of one layer at a benchmark shape (EP = 1)
    on random inputs (`mok.testing.make_inputs`), its schedule built."""
    shape = scale_for_run({s.name: s for s in SHAPES}[shape_name], 1, quick=False)
    h, i, e, k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.topk
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=tokens, hidden_size=h,
                         topk=k, num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    return shape, inputs, config, ws, schedule


def _kernel_times(step) -> dict[str, float]:
    """GPU ms of each kernel name in one call of `step` (torch.profiler)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:  # torch before device_time_total
            total = event.cuda_time_total
        if total > 0:
            times[event.key] = total / 1e3
    return times


def even_rows(tokens: int, topk: int, num_experts: int) -> tuple[int, torch.Tensor]:
    """(rows an expert, its tokens_per_expert on the GPU): the routed rows spread evenly over
    the experts, `T * k / E` rounded up to the 128-row tile, no other padding."""
    even = -(-tokens * topk // num_experts // 128) * 128
    return even, torch.full((num_experts,), even, dtype=torch.int32, device="cuda")


def run(shape_name: str, tokens: int, reps: int, copy_gbs: float, tflops: float):
    shape, inputs, config, ws, schedule = layer(shape_name, tokens)
    h, i, e, k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.topk
    weights = [inputs[n] for n in WEIGHTS]
    x, rw, top = inputs["x"], inputs["router_weights"], inputs["top_experts"]
    dy = inputs["grad_output"]
    out, ctx = F.forward(config, ws, schedule, x, rw, *weights)

    def sched():
        F.build_schedule(ws, config, top, num_local_experts=e)

    def fwd():
        F.forward(config, ws, schedule, x, rw, *weights)

    def bwd():
        F.backward(config, ws, schedule, ctx, dy, x, rw, *weights)

    def step():
        s = F.build_schedule(ws, config, top, num_local_experts=e)
        o, c = F.forward(config, ws, s, x, rw, *weights)
        F.backward(config, ws, s, c, dy, x, rw, *weights)

    rows = ctx.x_routed.shape[0]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    gate, up, hidden, d_gate, d_up = (torch.empty(rows, i, **bf16) for _ in range(5))
    y, d_x_rows, gathered = (torch.empty(rows, h, **bf16) for _ in range(3))
    dy_rows = torch.randn(rows, h, device="cuda").to(torch.bfloat16)
    slots = torch.randn(tokens * k, h, device="cuda").to(torch.bfloat16)
    gw, uw, dw = inputs["routed_gate"], inputs["routed_up"], inputs["routed_down"]
    tpe = schedule.tokens_per_expert
    ids = (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens)
    even, tpe_even = even_rows(tokens, k, e)
    x_even = torch.randn(even * e, h, device="cuda").to(torch.bfloat16)
    h_even = torch.randn(even * e, i, device="cuda").to(torch.bfloat16)
    g2, u2, hid2 = (torch.empty(even * e, i, **bf16) for _ in range(3))
    y2 = torch.empty(even * e, h, **bf16)

    def gather():
        dispatch.gather_rows(x, *ids, k, out=gathered)

    def gate_up():
        expert_gemm.gate_up_swiglu(ctx.x_routed, gw, uw, tpe, gate=gate, up=up, hidden=hidden)

    def down():
        expert_gemm.down(ctx.hidden_routed, dw, tpe, out=y)

    def sums():
        epilogues.fwd_epilogue(None, slots, rw)

    def d_hidden():
        expert_gemm_bwd.d_hidden_swiglu(dy_rows, dw, ctx.gate_routed, ctx.up_routed, tpe,
                                        d_gate=d_gate, d_up=d_up)  # fmt: skip

    def d_x():
        expert_gemm_bwd.d_x(d_gate, d_up, gw, uw, tpe, out=d_x_rows)

    def weight_grads():
        for a, b in ((d_gate, ctx.x_routed), (d_up, ctx.x_routed), (dy_rows, ctx.hidden_routed)):
            expert_gemm_bwd.weight_gradient(a, b, tpe, output="bf16")

    def gate_up_even():
        expert_gemm.gate_up_swiglu(x_even, gw, uw, tpe_even, gate=g2, up=u2, hidden=hid2)

    def down_even():
        expert_gemm.down(h_even, dw, tpe_even, out=y2)

    rows_routed = tokens * k
    padded = int(tpe.sum().item())
    fwd_flops = 2 * rows_routed * 3 * h * i
    weight_bytes = 3 * e * h * i * 2
    calls = [
        ("schedule", sched), ("forward", fwd), ("backward", bwd),
        ("dispatch alone (gather_rows)", gather), ("gate_up alone", gate_up),
        ("down alone", down), ("sums alone (fwd_epilogue)", sums), ("d_hidden alone", d_hidden),
        ("d_x alone", d_x), ("weight gradients alone (3, bf16)", weight_grads),
        (f"gate_up alone, {even} rows each", gate_up_even),
        (f"down alone, {even} rows each", down_even),
    ]  # fmt: skip
    rows_table = [(name, _time(fn, reps)) for name, fn in calls]
    print(f"\n== {shape_name}, {tokens} tokens: {rows_routed} routed rows, {padded} after padding "
          f"({padded / rows_routed:.2f}x), {e} experts")  # fmt: skip
    print(f"weights once (bytes over the copy rate): {weight_bytes / copy_gbs / 1e6:.3f} ms; "
          f"forward FLOPs at {tflops:.0f} TFLOP/s: {fwd_flops / tflops / 1e9:.3f} ms, "
          f"with the padding {fwd_flops * padded / rows_routed / tflops / 1e9:.3f} ms")  # fmt: skip
    for name, ms in rows_table:
        print(f"  {name:<34} {ms:8.3f} ms")
    print("  kernels in one schedule + forward + backward (torch.profiler):")
    kernels = _kernel_times(step)
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {name[:60]:<60} {ms:8.3f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.phase_times", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s.name for s in SHAPES])
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    config = TimingConfig(warmup=3, reps=args.reps)
    copy_gbs = copy_bandwidth_gbs(CUDA, 2 << 30, config)
    tflops = gemm_ceiling_tflops(CUDA, 8192, config)
    print(f"copy {copy_gbs:.0f} GB/s (read + write), bf16 matmul {tflops:.1f} TFLOP/s")
    for tokens in (int(t) for t in args.tokens.split(",")):
        run(args.shape, tokens, args.reps, copy_gbs, tflops)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
