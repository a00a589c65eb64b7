"""Macrobatch ring reuse with replay on the GPU (mok/launchers/macrobatch.py): a macrobatch
below the routed rows T * k runs the megakernels once per macrobatch over a window of the
schedule, the forward's context holds macrobatch 0, the backward replays the others, and the
weight-gradient sums go on across macrobatches from fp32 partials.

- The two new kernels against mok.reference: `macrobatch_schedule` exactly (up to 1000 local
  experts: the multi-warp scan); the window weight-gradient kernels in one pass bitwise the
  default path's kernels (expert_gemm_bwd.weight_gradient, bf16 and fp32 accumulate), and
  macrobatch by macrobatch bitwise their own one pass.
- The layer through mok.functional: out and all 8 gradients bitwise the same for macrobatches
  of 1/16, 1/8 and 1/4 of the routed rows (the original's 4096 / 8192 / 16384 of 57344 scaled)
  and for every row at once, run twice with outputs poisoned; Qwen3-30B-A3B widths (fewer
  experts), the shared expert on and off, a clamp, fp32 main_grads, one expert that crosses
  every macrobatch edge, empty experts; MoKExperts with recompute; a virtual EP group of two.
- Memory and time at Qwen3-30B-A3B's and the DeepSeek-V3 slice's benchmark shapes (16384
  tokens): peak memory (torch.cuda.max_memory_allocated) and the context a forward leaves,
  against the prediction in docs/NOTES.md; fwd + bwd time printed (run with -s).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from bitwise import assert_bitwise, bits
from graph_replay import check_replays

from mok import functional as F
from mok import reference as R
from mok.launchers import expert_gemm_bwd
from mok.nn import MoKExperts
from mok.testing import (
    WEIGHT_NAMES,
    make_inputs,
    oracle_errors,
    poison_cuda_allocator,
    rank_inputs,
    run_layer_step,
)
from mok.virtual_ep import VirtualEPGroup

macrobatch = importlib.import_module("mok.launchers.macrobatch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def config_of(macrobatch_size=None):
    if macrobatch_size is None:
        return F.MoKConfig()
    return F.MoKConfig(minibatch_size=min(macrobatch_size, 4096), macrobatch_size=macrobatch_size)


def step(inputs, num_experts, config, limit=None, main=False):
    """(out, context, 8 gradients or main_grads, schedule) of one poisoned, synced step."""
    t, h = inputs["x"].shape
    k = inputs["top_experts"].shape[1]
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=num_experts)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    main_grads = None
    if main:
        gen = torch.Generator().manual_seed(1)
        order = (3, 4, 5, 0, 1, 2)
        main_grads = tuple(
            None if weights[i] is None else torch.randn(weights[i].shape, generator=gen).to(CUDA)
            for i in order
        )
    poison_cuda_allocator()
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights, swiglu_limit=limit,
                       main_grads=main_grads)  # fmt: skip
    torch.cuda.synchronize()
    F.check_errors(ws)
    return out, ctx, grads, schedule


# ----------------------------------------------------------------------------------------------
# the new kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts,tokens,topk", [(8, 512, 2), (128, 2048, 8), (1000, 1024, 4)])
def test_macrobatch_schedule_kernel_equals_the_reference(experts, tokens, topk):
    inputs = make_inputs(tokens, 256, 128, experts, topk, seed=experts, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=tokens, hidden_size=256,
                         topk=topk, num_local_experts=experts)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=experts)
    cpu = R.MoKSchedule(*(t.cpu() for t in (schedule.peer_rank, schedule.peer_token_idx,
                                             schedule.num_tokens, schedule.tokens_per_expert)))  # fmt: skip
    for size in (256, 1024, 4096, schedule.capacity):
        got = macrobatch.window_schedules(schedule, size)
        torch.cuda.synchronize()
        want = R.macrobatch_schedules(cpu.num_tokens, cpu.tokens_per_expert, window_rows=size,
                                      capacity=cpu.capacity)  # fmt: skip
        assert len(got) == want[0].shape[0], size
        for m, (first, window) in enumerate(got):
            assert first == m * size
            assert torch.equal(window.num_tokens.cpu(), want[0][m : m + 1]), (size, m)
            assert torch.equal(window.tokens_per_expert.cpu(), want[1][m]), (size, m)
            assert torch.equal(window.peer_rank.cpu(), cpu.peer_rank[first : first + size])


@pytest.mark.parametrize("output", ["bf16", "accumulate"])
def test_window_weight_kernels_give_the_default_kernels_bits(output):
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([1024, 0, 128, 2048, 256, 0, 384, 1152], dtype=torch.int32)
    rows = int(sizes.sum()) + 512  # rows past the last segment (never read)
    m_size, n_size = 768, 2048  # dW_gate of Qwen3-30B-A3B: M = I, N = H
    a = torch.randn(rows, m_size, generator=gen).to(torch.bfloat16).to(CUDA)
    b = torch.randn(rows, n_size, generator=gen).to(torch.bfloat16).to(CUDA)
    tokens = sizes.to(CUDA)
    initial = torch.randn(len(sizes), m_size, n_size, generator=gen).to(CUDA)
    initial[1, 0, :8] = -0.0  # an empty expert: old + 0 turns -0.0 into +0.0 on both paths
    if output == "bf16":
        want = expert_gemm_bwd.weight_gradient(a, b, tokens, output="bf16")
    else:
        want = expert_gemm_bwd.weight_gradient(a, b, tokens, output="accumulate",
                                               out=initial.clone())  # fmt: skip
    truth = R.weight_gradient_window(
        a.cpu(), b.cpu(), sizes, 0, initial.cpu().clone() if output == "accumulate"
        else torch.empty(want.shape, dtype=torch.bfloat16), torch.zeros(m_size, n_size),
        torch.zeros(m_size, n_size), output=output,
    )  # fmt: skip

    def run(window_rows):
        poison_cuda_allocator()
        out = initial.clone() if output == "accumulate" else torch.empty_like(want)
        partials = torch.empty(2, m_size, n_size, device=CUDA)
        for m, first in enumerate(range(0, rows, window_rows)):
            window = slice(first, min(first + window_rows, rows))
            macrobatch.weight_gradient_window(a[window], b[window], tokens, first, out,
                                              partials[m % 2], partials[(m + 1) % 2],
                                              output=output)  # fmt: skip
        torch.cuda.synchronize()
        return out

    one_pass = run(rows)
    assert torch.equal(bits(one_pass), bits(want))
    err = (one_pass.float().cpu() - truth.float()).norm() / truth.float().norm()
    assert err < 2**-7
    for window_rows in (128, 256, 1024, 1536):
        assert torch.equal(bits(run(window_rows)), bits(want)), window_rows


# ----------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------

CASES = [
    # (T, H, I, E, k, shared, limit, main, routing)
    (2048, 2048, 768, 32, 8, True, None, False, "random"),  # Qwen3-30B-A3B widths
    (2048, 2048, 768, 32, 8, False, None, True, "random"),
    (2048, 512, 256, 8, 2, True, 0.5, True, "one_expert"),  # one expert crosses every edge
    (2048, 512, 256, 8, 2, False, None, False, "empty_experts"),
    # One local expert: macrobatch m's tokens_per_expert row lies 4 m bytes into its table (the
    # original's one-expert backward case, once refused as not 16-byte aligned).
    (4096, 256, 256, 1, 1, False, None, False, "random"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-"
                         f"{c[8]}{'-shared' if c[5] else ''}{'-clamp' if c[6] else ''}"
                         f"{'-main_grad' if c[7] else ''}")  # fmt: skip
def test_layer_is_bitwise_the_same_for_every_macrobatch_size(case):
    t, h, i, e, k, shared, limit, main, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + e, device=CUDA)
    out, ctx, grads, schedule = step(inputs, e, config_of(), limit, main)
    assert ctx.x_routed.shape[0] == schedule.capacity
    if not main:
        failures = [f"{name}: {err:.3e} > 2x bf16 {base:.3e}"
                    for name, ok, err, base in oracle_errors((out, *grads), inputs,
                                                             swiglu_limit=limit) if not ok]  # fmt: skip
        assert not failures, "; ".join(failures)
    routed_rows = t * k
    for size in (routed_rows // 16, routed_rows // 8, routed_rows // 4):
        for _ in range(2):
            got = step(inputs, e, config_of(size), limit, main)
            assert_bitwise((got[0], *got[2]), (out, *grads), size)
            routed = got[1].tensors()[:4]
            assert [tuple(r.shape)[0] for r in routed] == [size] * 4  # macrobatch 0 only
            rows = min(size, int(schedule.num_tokens))
            assert_bitwise([r[:rows] for r in routed],
                           [r[:rows] for r in ctx.tensors()[:4]], size)  # fmt: skip


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["qwen-widths", "one-expert-clamp"])
def test_layer_replaying_x_only_gives_the_default_bits(case):
    """MoKConfig.macrobatch_replay "gather": the context keeps gate, up and hidden of every row
    (written there by each macrobatch's forward launch), the backward pulls x's rows again and
    runs no gate/up GEMM; every output and gradient bitwise the default path's, twice."""
    t, h, i, e, k, shared, limit, main, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + e, device=CUDA)
    out, ctx, grads, schedule = step(inputs, e, config_of(), limit, main)
    routed_rows = int(schedule.num_tokens)
    for size in (t * k // 16, t * k // 4):
        config = dataclasses.replace(config_of(size), macrobatch_replay="gather")
        for _ in range(2):
            got = step(inputs, e, config, limit, main)
            assert_bitwise((got[0], *got[2]), (out, *grads), size)
            x_rows, *kept = got[1].tensors()[:4]
            assert x_rows.shape[0] == size and [r.shape[0] for r in kept] == [schedule.capacity] * 3
            first = min(size, routed_rows)
            assert_bitwise([x_rows[:first], *(r[:routed_rows] for r in kept)],
                           [ctx.x_routed[:first], *(r[:routed_rows] for r in ctx.tensors()[1:4])],
                           size)  # fmt: skip


@pytest.mark.parametrize("recompute", [False, True])
def test_module_with_ring_reuse_gives_the_default_bits(recompute):
    inputs = make_inputs(1024, 512, 256, 8, 4, seed=5, device=CUDA)

    def run(config):
        torch.manual_seed(0)
        module = MoKExperts(8, 512, 256, 4, shared_expert=True, config=config,
                            recompute=recompute, accumulate_main_grad=True, device=CUDA)  # fmt: skip
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape, device=CUDA)
        x = inputs["x"].clone().requires_grad_()
        w = inputs["router_weights"].clone().requires_grad_()
        out = module(x, w, inputs["top_experts"])
        out.float().pow(2).sum().backward()
        torch.cuda.synchronize()
        return [out, x.grad, w.grad] + [p.main_grad for p in module.parameters()]

    want = run(config_of())
    for size in (256, 1024):
        assert_bitwise(run(config_of(size)), want, size)


def test_virtual_ep_group_of_two_with_ring_reuse_gives_the_default_bits():
    inputs = make_inputs(2048, 512, 512, 16, 4, shared=True, seed=6, device=CUDA)

    def group_step(config):
        group = VirtualEPGroup(2)
        spaces = group.workspaces(config, num_local_tokens=1024, hidden_size=512, topk=4,
                                  num_local_experts=8)  # fmt: skip
        shards = [rank_inputs(inputs, rank, 2) for rank in range(2)]
        results = group.run(lambda rank: run_layer_step(config, spaces[rank], shards[rank], 8))
        group.join()
        for ws in spaces:
            F.check_errors(ws)
        return [(out, ctx.x_routed.shape[0], *grads) for out, ctx, grads in results]

    want = group_step(config_of())
    got = group_step(config_of(512))  # 4096 routed rows per rank
    for rank in range(2):
        assert got[rank][1] == 512
        assert_bitwise((got[rank][0], *got[rank][2:]), (want[rank][0], *want[rank][2:]), rank)


def test_ring_reuse_step_replays_in_a_cuda_graph():
    """Schedule + forward + backward with ring reuse captured once, replayed with new routing:
    the same bits as eager (every macrobatch's sub-schedule is made on the device)."""
    t, h, i, e, k = 1024, 512, 256, 8, 4
    inputs = make_inputs(t, h, i, e, k, shared=True, seed=9, device=CUDA)
    config = config_of(512)
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    ids = inputs["top_experts"].clone()

    def run():
        schedule = F.build_schedule(ws, config, ids, num_local_experts=e)
        out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                             *weights)  # fmt: skip
        grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                           inputs["router_weights"], *weights)  # fmt: skip
        return (out, *grads)

    check_replays(run, ids, e, range(300, 303), lambda: F.check_errors(ws))


# ----------------------------------------------------------------------------------------------
# memory and time at the benchmark shapes
# ----------------------------------------------------------------------------------------------

# name: (experts on one GPU, H, I, k), 16384 tokens (benchmarks/shapes.py).
FULL_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (32, 7168, 2048, 8)}
TOKENS = 16384


def predicted_saving(capacity, macrobatch_size, hidden, inter):
    """Bytes the ring saves: (context held from forward to backward, backward peak). Context
    rows cost 2H + 6I bytes (x_routed, gate, up, hidden); the backward's scratch 2H + 4I + 4I/128
    (dY_e, d_gate, d_up, router partials). The ring keeps macrobatch 0's context, one replay
    ring, one macrobatch of scratch and two fp32 partials of 3 H I (docs/NOTES.md)."""
    context, scratch = 2 * hidden + 6 * inter, 2 * hidden + 4 * inter + 4 * (inter // 128)
    saved_context = (capacity - macrobatch_size) * context
    ring = 2 * macrobatch_size * context + macrobatch_size * scratch + 2 * 3 * hidden * inter * 4
    return saved_context, capacity * (context + scratch) - ring


def measure(inputs, num_experts, config, reps=3):
    """(context bytes after forward, forward peak, backward peak, median fwd+bwd ms, results)."""
    t, h = inputs["x"].shape
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h,
                         topk=inputs["top_experts"].shape[1], num_local_experts=num_experts)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                             *weights)  # fmt: skip
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        fwd_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                           inputs["router_weights"], *weights)  # fmt: skip
        end.record()
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated() - base
        if rep:  # the first step loads the kernels and makes the plans
            times.append(start.elapsed_time(end))
        results = (out, *grads)
        del ctx
    F.check_errors(ws)
    return held, fwd_peak, bwd_peak, sorted(times)[len(times) // 2], results, schedule


@pytest.mark.parametrize("name", list(FULL_SHAPES))
def test_memory_saved_and_time_cost_at_the_benchmark_shapes(name):
    experts, hidden, inter, topk = FULL_SHAPES[name]
    inputs = make_inputs(TOKENS, hidden, inter, experts, topk, seed=7, device=CUDA)
    rows = {}
    base = measure(inputs, experts, config_of())
    capacity = base[5].capacity
    print(f"\n{name}: T {TOKENS}, capacity {capacity} rows, routed {int(base[5].num_tokens)}")
    print("  macrobatch | context held MB | fwd peak MB | bwd peak MB | fwd+bwd ms")
    for size in (None, 16384, 4096, "16384 gather"):
        config = config_of(size) if not isinstance(size, str) else dataclasses.replace(
            config_of(16384), macrobatch_replay="gather")  # fmt: skip
        got = base if size is None else measure(inputs, experts, config)
        rows[size] = got
        held, fwd_peak, bwd_peak, ms = got[:4]
        print(f"  {size or 'all':>10} | {held / 2**20:15.1f} | {fwd_peak / 2**20:11.1f} | "
              f"{bwd_peak / 2**20:11.1f} | {ms:10.3f} ({ms / base[3] - 1:+.1%})")  # fmt: skip
        assert_bitwise(got[4], base[4], size)
    # "gather" holds macrobatch 0's x rows and gate, up and hidden of every row.
    kept = capacity * 6 * inter + 16384 * 2 * hidden
    assert abs(rows["16384 gather"][0] - kept) <= 0.1 * kept, (rows["16384 gather"][0], kept)
    for size in (16384, 4096):
        saved_context, saved_peak = predicted_saving(capacity, size, hidden, inter)
        assert base[0] - rows[size][0] >= 0.9 * saved_context, (size, base[0], rows[size][0])
        assert base[2] - rows[size][2] >= 0.7 * saved_peak, (size, base[2], rows[size][2])


def test_a_macrobatch_of_every_row_launches_what_it_did(monkeypatch):
    """macrobatch_size >= T * k keeps the default path: no macrobatch launcher call."""
    called = []
    monkeypatch.setattr(macrobatch, "forward", lambda *a: called.append("forward"))
    monkeypatch.setattr(macrobatch, "backward", lambda *a: called.append("backward"))
    inputs = make_inputs(512, 256, 256, 8, 2, seed=8, device=CUDA)
    step(inputs, 8, dataclasses.replace(F.MoKConfig(), macrobatch_size=1024, minibatch_size=1024))
    assert called == []
