"""What a new user meets on CPU: the bounded workspace cache (what it evicts, what it keeps,
handles that outlive an eviction), errors at construction instead of the first forward, clear
messages for wrong inputs, `python -m mok` argument errors, the public errors' imports, the
CPU path's macrobatch rule (the GPU path's), and DSL sources free of deprecated names."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import mok
from mok import functional as F
from mok import ops
from mok import workspace as W
from mok.__main__ import main as mok_main
from mok.config import MoKConfig
from mok.nn import MoKExperts
from mok.testing import WEIGHT_NAMES, make_inputs

ROOT = Path(__file__).resolve().parents[1]
SIZE = W.WORKSPACE_CACHE_SIZE


@pytest.fixture(autouse=True)
def empty_cache():
    F.clear_workspace_cache()
    yield
    F.clear_workspace_cache()


def get(num_tokens: int, hidden_size: int = 128, topk: int = 2) -> F.MoKWorkspace:
    return F.get_workspace(MoKConfig(), None, device="cpu", num_local_tokens=num_tokens,
                           hidden_size=hidden_size, topk=topk)  # fmt: skip


def cached_token_counts(hidden_size: int = 128) -> list[int]:
    return sorted(key[2] for key in W._CACHE if key[3] == hidden_size)


# --- 1. the workspace cache is bounded ------------------------------------------------------


def test_cache_keeps_at_most_its_size_per_layer_shape():
    made = [get(t) for t in range(1, SIZE + 1)]
    handles = [ws.handle for ws in made]
    del made
    for t in range(SIZE + 1, 3 * SIZE + 1):
        get(t)
    # The most recent token counts stay; the older ones were destroyed.
    assert cached_token_counts() == list(range(2 * SIZE + 1, 3 * SIZE + 1))
    assert all(h not in W._LIVE for h in handles)
    # Another layer shape has a bound of its own.
    get(7, hidden_size=256)
    assert cached_token_counts(256) == [7]
    assert len(cached_token_counts()) == SIZE


def test_a_hit_refreshes_the_entry():
    for t in range(1, SIZE + 1):
        get(t)
    get(1)  # now the most recently used
    get(SIZE + 1)
    assert 1 in cached_token_counts() and 2 not in cached_token_counts()


def test_a_workspace_in_use_is_never_evicted():
    held = get(1)
    captured = get(2)
    captured.graph_captured = True  # as a mok op under CUDA graph capture marks it
    handle = captured.handle
    del captured
    for t in range(3, 3 + 2 * SIZE):
        get(t)
    assert not held.destroyed and 1 in cached_token_counts()
    assert not W._LIVE[handle].destroyed and 2 in cached_token_counts()
    assert len(cached_token_counts()) == SIZE
    # Released, it goes at the next eviction.
    del held
    get(100)
    assert 1 not in cached_token_counts() and 2 in cached_token_counts()


def test_in_use_workspaces_hold_the_cache_above_its_size_until_released():
    held = [get(t) for t in range(1, SIZE + 3)]
    assert len(cached_token_counts()) == SIZE + 2
    del held
    get(100)
    assert len(cached_token_counts()) == SIZE


def test_an_evicted_workspace_handle_stays_valid():
    ws = get(5)
    handle = ws.handle
    ws.buffers["x_buffer"].fill_(3.0)
    ws.wait_timeout_ns = 123
    del ws
    for t in range(6, 6 + SIZE):
        get(t)
    assert handle not in W._LIVE and 5 not in cached_token_counts()
    # An op given the handle (a torch.compile graph bakes it in) gets the workspace made anew.
    again = W.workspace_from_handle(handle)
    assert again.handle == handle and not again.destroyed
    assert (again.num_local_tokens, again.hidden_size, again.topk) == (5, 128, 2)
    assert again.wait_timeout_ns == 123  # its settings kept
    assert torch.isnan(again.buffers["x_buffer"]).all()  # fresh buffers, poisoned
    assert get(5) is again and 5 in cached_token_counts()
    assert len(cached_token_counts()) == SIZE


def test_get_workspace_for_an_evicted_key_gives_the_same_handle_back():
    handle = get(5).handle
    for t in range(6, 6 + SIZE):
        get(t)
    assert 5 not in cached_token_counts()
    assert get(5).handle == handle


def test_a_compiled_style_handle_runs_a_layer_after_eviction():
    inputs = make_inputs(16, 128, 128, 4, 2, seed=3)
    layer = MoKExperts(4, 128, 128, 2)
    with torch.no_grad():
        for name, p in (("routed_gate", layer.gate_weight), ("routed_up", layer.up_weight),
                        ("routed_down", layer.down_weight)):  # fmt: skip
            p.copy_(inputs[name])
    args = (inputs["x"], inputs["router_weights"], inputs["top_experts"])
    with torch.no_grad():  # no autograd graph holding the workspace
        expected = layer(*args)
    handle = layer._workspace_handle(16, inputs["x"].device)
    for t in range(17, 17 + SIZE):
        get(t)
    assert handle not in W._LIVE
    # What a compiled graph does: the op looks the baked-in handle up.
    ws = W.workspace_from_handle(handle)
    schedule = F.build_schedule(ws, layer.config, inputs["top_experts"], num_local_experts=4)
    out, _ = F.forward(layer.config, ws, schedule, *args[:2], *layer.weights())
    assert torch.equal(out, expected)


def test_autograd_keeps_its_workspace_between_forward_and_backward():
    inputs = make_inputs(16, 128, 128, 4, 2, seed=4)
    layer = MoKExperts(4, 128, 128, 2)
    x = inputs["x"].clone().requires_grad_()
    out = layer(x, inputs["router_weights"], inputs["top_experts"])
    # More token counts than the cache holds run forward while the first awaits its backward.
    for t in range(17, 17 + 2 * SIZE):
        small = make_inputs(t, 128, 128, 4, 2, seed=t)
        layer(small["x"], small["router_weights"], small["top_experts"])
    out.backward(inputs["grad_output"])
    fresh = inputs["x"].clone().requires_grad_()
    F.clear_workspace_cache()
    layer(fresh, inputs["router_weights"], inputs["top_experts"]).backward(inputs["grad_output"])
    assert torch.equal(x.grad, fresh.grad)


def test_cleared_handles_are_dead_with_a_clear_error():
    handle = get(5).handle
    for t in range(6, 6 + SIZE):
        get(t)
    F.clear_workspace_cache()
    with pytest.raises(
        ValueError, match=rf"workspace_handle must name a live MoKWorkspace, got {handle}"
    ):
        W.workspace_from_handle(handle)


def test_destroy_forgets_the_launchers_state():
    ws = get(5)
    ws.comm_state = object()  # what the comm launchers keep on a workspace
    ws.destroy()
    assert ws.comm_state is None and not ws.buffers


@pytest.mark.parametrize(
    "kwargs",
    [dict(hidden_size=200), dict(num_local_tokens=0), dict(topk=0), dict(device="meta")],
)
def test_a_bad_get_workspace_leaves_nothing_behind(kwargs):
    args = dict(device="cpu", num_local_tokens=8, hidden_size=128, topk=2) | kwargs
    with pytest.raises(ValueError):
        F.get_workspace(MoKConfig(), None, **args)
    assert not W._CACHE and not W._EVICTED


def test_a_bad_forward_leaves_no_workspace_behind():
    layer = MoKExperts(4, 128, 128, 2)
    live = set(W._LIVE)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    weights = torch.rand(2, 8, 2)
    with pytest.raises(
        ValueError,
        match=r"x must have shape \[T, H\] \(num_tokens, hidden_size = 128\), got \[2, 8, 128\]",
    ):
        layer(x, weights, torch.zeros(2, 8, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"router_weights must have shape \[8, 2\], got \[4, 2\]"):
        layer(x[0], weights[0, :4], torch.zeros(8, 2, dtype=torch.int64))
    with pytest.raises(
        TypeError, match=r"top_experts must have dtype torch.int64, got torch.int32"
    ):
        layer(x[0], weights[0], torch.zeros(8, 2, dtype=torch.int32))
    assert not W._CACHE and set(W._LIVE) == live


def _ep_cache_worker(rank, world_size):
    group = torch.distributed.group.WORLD
    config = MoKConfig()

    def get_ep(t):
        return F.get_workspace(config, group, device="cpu", num_local_tokens=t, hidden_size=128,
                               topk=2)  # fmt: skip

    held = get_ep(1)
    if rank == 1:
        del held  # in use on rank 0 only
    for t in range(2, 2 + 2 * SIZE):
        get_ep(t)
    return sorted(key[2] for key in W._CACHE)


def test_ep_group_cache_is_bounded_on_every_rank():
    from ep_worker import run_on_gloo_group  # noqa: PLC0415

    # CPU EP workspaces are plain allocations, so each rank evicts what it does not use.
    counts = run_on_gloo_group(_ep_cache_worker, 2)
    newest = list(range(2 + SIZE, 2 + 2 * SIZE))
    assert counts[0] == [1, *newest[1:]] and counts[1] == newest


def test_ep_ranks_on_cuda_destroy_only_the_victims_every_rank_proposed():
    def key(t, capacity):
        return ("g", torch.device("cuda", 0), t, 128, 2, capacity)

    mine = [key(1, 256), key(3, 256), key(2, 512)]
    proposals = [[(1, 256), (3, 256), (2, 512)], [(2, 512), (3, 256)], [(3, 256), (2, 512)]]
    assert W.agreed_victims(mine, proposals) == [key(2, 512), key(3, 256)]
    assert W.agreed_victims(mine, [[(1, 256)], []]) == []


# --- 2. errors a new user meets -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(topk=0), ValueError, r"topk must be >= 1, got 0"),
        (dict(topk=33), ValueError, r"topk must be <= 32, got 33"),
        (dict(hidden_size=200), ValueError, r"hidden_size must be a multiple of 128, got 200"),
        (dict(hidden_size=0), ValueError, r"hidden_size must be >= 128, got 0"),
        (dict(intermediate_size=100), ValueError, r"intermediate_size must be >= 128, got 100"),
        (dict(num_experts=0), ValueError, r"num_experts must be >= 1, got 0"),
        (dict(num_experts=2.0), TypeError, r"num_experts must be an int, got float"),
        (dict(config="fast"), TypeError, r"config must be a MoKConfig, got str"),
        (dict(swiglu_limit=-1.0), ValueError, r"swiglu_limit must be a finite number > 0"),
        (dict(device="nonsense"), TypeError, r"device must be a torch.device, a device string or None, got 'nonsense'"),
    ],
)  # fmt: skip
def test_experts_check_their_arguments_at_construction(kwargs, exc, match):
    args = dict(num_experts=4, hidden_size=256, intermediate_size=256, topk=2) | kwargs
    with pytest.raises(exc, match=match):
        MoKExperts(**args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fwd_num_comm_sms=3), r"MoKConfig.fwd_num_comm_sms must be an even int >= 0, got 3"),
        (dict(bwd_num_comm_sms=-2), r"MoKConfig.bwd_num_comm_sms must be an even int >= 0, got -2"),
        (dict(minibatch_size=100), r"MoKConfig.minibatch_size must be a positive multiple of 256, got 100"),
        (dict(macrobatch_size=1000), r"MoKConfig.macrobatch_size must be a positive multiple of minibatch_size \(131072\), got 1000"),
        (dict(schedule_capacity_multiplier=0), r"schedule_capacity_multiplier must be a finite number > 0, got 0"),
    ],
)  # fmt: skip
def test_config_checks_its_fields_where_it_is_used(kwargs, match):
    # Made with any values, as the original's MoKConfig; the first use names the bad field.
    for config in (MoKConfig(**kwargs), dataclasses.replace(MoKConfig(), **kwargs)):
        with pytest.raises(ValueError, match=match):
            config.validate()
        with pytest.raises(ValueError, match=match):
            F.get_workspace(config, None, device="cpu", num_local_tokens=8, hidden_size=128,
                            topk=2)  # fmt: skip
        with pytest.raises(ValueError, match=match):
            MoKExperts(4, 128, 128, 2, config=config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_experts_on_cuda_without_a_gpu_is_a_clear_error(device):
    with pytest.raises(ValueError, match=r"device must be an available device, got cuda.* but "
                       r"torch.cuda.is_available\(\) is False"):  # fmt: skip
        MoKExperts(4, 256, 256, 2, device=device)


def test_experts_can_be_made_on_the_meta_device():
    layer = MoKExperts(4, 256, 256, 2, device="meta")
    assert layer.gate_weight.is_meta


def test_gpu_only_rules_are_named_when_they_apply():
    # hidden_size 128 runs on CPU; the sm_90a kernels need 256 and say so at the first GPU call.
    from mok.launchers.checks import check_gpu_layer  # noqa: PLC0415
    from mok.validation import HIDDEN_ALIGNMENT  # noqa: PLC0415

    ws = get(8, hidden_size=384)
    with pytest.raises(ValueError, match=rf"hidden_size must be a multiple of {HIDDEN_ALIGNMENT} "
                       r"on the sm_90a kernel path \(mok.ops.forward\), got 384"):  # fmt: skip
        check_gpu_layer(ws, "forward")


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: torch.randn(128, 128), TypeError, r"x_bf16 must have dtype torch.bfloat16, got torch.float32"),
        (lambda: torch.randn(256, 128, dtype=torch.bfloat16).t(), ValueError, r"x_bf16 must be contiguous, got strides \(1, 128\)"),
        (lambda: torch.randn(128, 200, dtype=torch.bfloat16), ValueError, r"x_bf16's last two dims must be multiples of 128, got \[128, 200\]"),
        (lambda: torch.randn(2, 200, 128, dtype=torch.bfloat16), ValueError, r"x_bf16's last two dims must be multiples of 128, got \[2, 200, 128\]"),
        (lambda: torch.randn(128, dtype=torch.bfloat16), ValueError, r"x_bf16 must be \[M, N\] or \[E, M, N\]"),
    ],
)  # fmt: skip
def test_mxfp8_quantize_checks_its_input(make, exc, match):
    with pytest.raises(exc, match=match):
        ops.mxfp8_quantize(make(), True, True)


def test_mxfp8_quantize_still_quantizes():
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    fp8, scales, fp8_t, scales_t = ops.mxfp8_quantize(x, True, True)
    assert fp8.shape == x.shape and fp8_t.shape == (2, 256, 128)
    assert scales.shape == (2, 2, 32, 16) and scales_t.shape == (4, 1, 32, 16)


def _layer(shared: bool, seed: int, num_tokens: int = 32):
    inputs = make_inputs(num_tokens, 128, 128, 4, 2, shared=shared, seed=seed)
    config = MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=num_tokens,
                         hidden_size=128, topk=2, num_local_experts=4)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=4)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    _, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    return config, ws, schedule, ctx, inputs


def _backward(config, ws, schedule, ctx, inputs, shared: bool):
    weights = [inputs[n] for n in WEIGHT_NAMES]
    if not shared:
        weights[:3] = [None, None, None]
    return F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                      inputs["router_weights"], *weights)  # fmt: skip


def test_backward_refuses_a_context_from_another_schedule():
    config, ws, schedule, ctx, inputs = _layer(False, seed=1)
    _, _, other_schedule, other_ctx, _ = _layer(False, seed=2)
    with pytest.raises(ValueError, match=r"forward_context must come from a forward with this "
                       r"schedule, got one a forward with another MoKSchedule returned"):  # fmt: skip
        _backward(config, ws, schedule, other_ctx, inputs, shared=False)
    # Its own schedule, or the same tensors in a new MoKSchedule, are fine.
    same = F.MoKSchedule(*(getattr(schedule, f.name) for f in dataclasses.fields(schedule)))
    assert torch.equal(_backward(config, ws, same, ctx, inputs, False)[0],
                       _backward(config, ws, schedule, ctx, inputs, False)[0])  # fmt: skip


def test_backward_refuses_a_context_from_another_workspace():
    # T=32, k=2 and T=64, k=1 with 4 experts have the same schedule capacity (640 rows).
    config, ws, schedule, ctx, inputs = _layer(False, seed=1)
    other = make_inputs(64, 128, 128, 4, 1, seed=5)
    ws64 = F.get_workspace(config, None, device="cpu", num_local_tokens=64, hidden_size=128,
                           topk=1, num_local_experts=4)  # fmt: skip
    assert ws64.schedule_capacity == ws.schedule_capacity
    schedule64 = F.build_schedule(ws64, config, other["top_experts"], num_local_experts=4)
    with pytest.raises(ValueError, match=r"forward_context must come from a forward with this"):
        _backward(config, ws64, schedule64, ctx, other, shared=False)


def test_backward_refuses_a_shared_expert_context_without_shared_weights():
    config, ws, schedule, ctx, inputs = _layer(True, seed=1)
    with pytest.raises(ValueError, match=r"forward_context.gate_shared must be None without "
                       r"shared expert weights, got a tensor of shape \[32, 128\]"):  # fmt: skip
        _backward(config, ws, schedule, ctx, inputs, shared=False)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--experts", "2", "--topk", "4"], r"--topk must be in \[1, 2\] \(at most --experts = 2"),
        (["--topk", "0"], r"--topk must be in \[1, 8\]"),
        (["--topk", "40", "--experts", "64"], r"--topk must be in \[1, 32\]"),
        (["--experts", "0"], r"--experts must be >= 1, got 0"),
        (["--hidden", "200"], r"--hidden must be a positive multiple of 128, got 200"),
        (["--intermediate", "0"], r"--intermediate must be a positive multiple of 128, got 0"),
        (["--tokens", "0"], r"--tokens must be >= 1, got 0"),
        (["--swiglu-limit", "-1"], r"--swiglu-limit must be a finite number > 0, got -1.0"),
    ],
)
def test_python_m_mok_argument_errors_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mok_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m mok") and "Traceback" not in err
    assert re.search(match, err), err


def test_python_m_mok_bad_topk_in_a_subprocess_prints_no_traceback():
    run = subprocess.run([sys.executable, "-m", "mok", "--experts", "2", "--topk", "4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--topk must be in [1, 2]" in run.stderr


def test_public_errors_import_from_mok_and_functional():
    from mok import MoKInputError, MoKKernelUnavailableError, MoKWaitTimeoutError  # noqa: PLC0415
    from mok.functional import MoKRuntimeError  # noqa: PLC0415
    from mok.functional import MoKWaitTimeoutError as functional_timeout  # noqa: PLC0415
    from mok.runtime import errors as runtime_errors  # noqa: PLC0415

    assert MoKWaitTimeoutError is functional_timeout is runtime_errors.MoKWaitTimeoutError
    assert issubclass(MoKWaitTimeoutError, MoKRuntimeError)
    assert (
        MoKInputError is F.MoKInputError
        and MoKKernelUnavailableError is F.MoKKernelUnavailableError
    )
    for name in mok.errors.PUBLIC_ERRORS:
        assert getattr(mok, name) is getattr(F, name) is getattr(mok.errors, name)
        assert name in F.__all__ and name in mok.errors.__all__
    with pytest.raises(AttributeError, match=r"no attribute 'MoKNoSuchError'"):
        mok.MoKNoSuchError  # noqa: B018


def test_importing_functional_does_not_import_the_runtime():
    code = "import sys, mok.functional; print('mok.runtime' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_cpu_path_applies_the_gpu_macrobatch_rule():
    from mok.validation import check_macrobatch  # noqa: PLC0415

    # T * k = 384 routed rows: a 256-row macrobatch runs ring reuse on both paths (the context
    # holds macrobatch 0), with the bits of every row at once.
    config = MoKConfig(minibatch_size=256, macrobatch_size=256)
    inputs = make_inputs(192, 128, 128, 4, 2, seed=1)
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=192, hidden_size=128,
                         topk=2, num_local_experts=4)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=4)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    assert check_macrobatch(256, 192, 2, "forward", 256) is True
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    assert ctx.x_routed.shape == (256, 128)
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights)  # fmt: skip
    every_row = MoKConfig(minibatch_size=256, macrobatch_size=512)
    out_all, ctx_all = F.forward(every_row, ws, schedule, inputs["x"], inputs["router_weights"],
                                 *weights)  # fmt: skip
    assert ctx_all.x_routed.shape == (schedule.capacity, 128)
    grads_all = F.backward(every_row, ws, schedule, ctx_all, inputs["grad_output"], inputs["x"],
                           inputs["router_weights"], *weights)  # fmt: skip
    assert torch.equal(out, out_all)
    for a, b in zip(grads, grads_all, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    # A macrobatch off the 128-row tiles (the op's ints are not a validated MoKConfig) is
    # refused with the GPU path's message, before the x buffer is written.
    ws.buffers["x_buffer"].fill_(float("nan"))
    sched = (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
             schedule.tokens_per_expert)  # fmt: skip
    with pytest.raises(ValueError) as cpu_error:
        ops.forward(ws.handle, *sched, inputs["x"], inputs["router_weights"], *weights, None, 0,
                    256, 320)  # fmt: skip
    with pytest.raises(ValueError) as rule:
        check_macrobatch(320, 192, 2, "forward", 256)
    assert str(cpu_error.value) == str(rule.value)
    assert "macrobatch_size must be a positive multiple of 128" in str(rule.value)
    assert torch.isnan(ws.buffers["x_buffer"]).all()


# --- 3. DSL sources use the DSL's current names ---------------------------------------------

DEPRECATED = ("warpgroup.OperandMajorMode", "utils.LayoutEnum", "utils.TensorMapUpdateMode",
              "utils.SmemPartition")  # fmt: skip


def test_dsl_sources_use_no_deprecated_names():
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "mok" / "dsl_kernels").rglob("*.py"))
        for name in DEPRECATED
        if name in path.read_text()
    ]
    assert not found


@pytest.mark.parametrize(
    "name", ["expert_gemm_gate_up_swiglu", "expert_gemm_bwd_d_x", "expert_gemm_bwd_weights"]
)
def test_sm90_gemms_compile_without_deprecation_warnings(name):
    pytest.importorskip("cutlass")
    from mok.dsl_kernels import build  # noqa: PLC0415
    from mok.dsl_kernels.registry import variants  # noqa: PLC0415

    variant = {v.name: v for v in variants()}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        entry, cubin, _ = build.compile_variant(variant, "sm_90a")
    assert cubin.startswith(b"\x7fELF") and entry["name"] == name
