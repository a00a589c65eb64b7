"""Launchers' argument dicts against the shipped manifest, on CPU (dispatch, megakernel),
through tests/fake_kernels.py's FakeKernel.
"""

from __future__ import annotations

import pytest
import torch
from fake_kernels import FakeErrorRecord, FakeKernel, fake_kernels

from mok.launchers import checks, dispatch


@pytest.fixture()
def kernels(monkeypatch):
    """{name: FakeKernel} of every kernel a launcher asks the runtime for."""
    return fake_kernels(monkeypatch)


def test_gather_rows_launch_packs(kernels):
    t, h, k, capacity = 300, 256, 2, 1024
    src = torch.zeros(t, h, dtype=torch.bfloat16)
    peer = torch.zeros(capacity, dtype=torch.int32)
    slot = torch.zeros(capacity, dtype=torch.int32)
    dispatch.gather_rows(src, peer, slot, torch.tensor([600], dtype=torch.int32), k)
    ((name, kernel),) = kernels.items()
    assert name == "gather_rows"
    ((grid, args),) = kernel.launches
    assert grid == (1, capacity // 4, 1) and args["num_rows"] == capacity
    # The next call of the same shapes (a later macrobatch's replay) reuses the bound launch:
    # no kernel lookup, the new addresses written.
    out = torch.empty(capacity, h, dtype=torch.bfloat16)
    counts = torch.tensor([256], dtype=torch.int32)
    dispatch.gather_rows(src, peer, slot, counts, k, out=out)
    assert kernels["gather_rows"] is kernel and len(kernel.launches) == 2
    _, again = kernel.launches[1]
    assert again["out_ptr"] == out.data_ptr() and again["num_tokens_ptr"] == counts.data_ptr()
    assert (again["num_rows"], again["topk"], again["hidden_size"]) == (capacity, k, h)


def _expert_weights_on_cpu(name, tensor, dtype, shape):
    """checks.check_expert_weights minus "on CUDA": the rows per expert of a checked layout."""
    assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
    return checks.expert_rows(name, tensor)


def _forward_launcher_on_cpu(monkeypatch):
    """mok.launchers.forward_megakernel with its CUDA-only checks and lookups made CPU-safe."""
    from mok.launchers import device_args, megakernel_walk
    from mok.launchers import forward_megakernel as moe_forward

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    monkeypatch.setattr(moe_forward, "sm_count", lambda device: 132)

    def check_on_cpu(name, tensor, dtype, shape):  # the launcher's check, minus "on CUDA"
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name

    monkeypatch.setattr(moe_forward, "check_cuda", check_on_cpu)
    monkeypatch.setattr(megakernel_walk, "check_cuda", check_on_cpu)
    monkeypatch.setattr(checks, "check_expert_weights", _expert_weights_on_cpu)
    device_args.clear_descriptor_cache()
    return moe_forward


def test_forward_megakernel_launch_packs(monkeypatch, kernels):
    from mok import reference as R
    from mok.launchers import comm, device_args

    moe_forward = _forward_launcher_on_cpu(monkeypatch)
    t, h, i, e, k = 256, 256, 128, 4, 2
    ids = torch.randint(0, e, (t, k))
    schedule = R.make_schedule(ids, num_local_experts=e, capacity=t * k + e * 128)
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    gate_w = torch.zeros(e, i, h, dtype=torch.bfloat16)
    down_w = torch.zeros(e, h, i, dtype=torch.bfloat16)
    (x_routed, *_), slots = moe_forward.routed_forward(x, schedule, k, gate_w, gate_w, down_w,
                                                       num_comm_ctas=16,
                                                       minibatch_size=256)  # fmt: skip
    device_args.clear_descriptor_cache()
    ((grid, args),) = kernels["moe_forward"].launches
    assert grid == (132, 1, 1) and args["timeout_ns"] == comm.DEFAULT_TIMEOUT_NS
    assert slots.shape == (t * k, h) and x_routed.shape == (schedule.capacity, h)
    sizes = {"num_experts": e, "hidden_size": h, "intermediate_size": i, "topk": k,
             "ep_rank": 0, "capacity": schedule.capacity, "has_limit": 0}  # fmt: skip
    assert {name: args[name] for name in sizes} == sizes
    # 16 communication CTAs (tasks by a dynamic ticket). Counters: dispatched and hidden_done
    # per row tile, then the task ticket, the dispatch ticket, the down tiles stored and the
    # exit word, all zero. No in-kernel combine (routed_forward never asks for it).
    assert args["num_comm_ctas"] == 16
    assert args["minibatch_tiles"] == 2  # 256 routed rows
    assert args["counters_ptr"].shape == (2 * (-(-schedule.capacity // 128)) + 8,)
    assert args["combine_tokens"] == 0 and args["out_ptr"] == 0
    assert args["schedule_entries"] == 0 and args["ids_ptr"] == 0  # the schedule given
    assert args["counters_ptr"].count_nonzero() == 0


def _mxfp8_forward_operands():
    """((T, H, I, E, k), schedule, x, the three MXFP8 weight pairs) of a small routed forward."""
    from mok import reference as R

    t, h, i, e, k = 256, 256, 128, 4, 2
    schedule = R.make_schedule(torch.randint(0, e, (t, k)), num_local_experts=e,
                               capacity=t * k + e * 128)  # fmt: skip
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    pairs = [R.mxfp8_quantize(torch.randn(e, n, kk).to(torch.bfloat16))
             for n, kk in ((i, h), (i, h), (h, i))]  # fmt: skip
    return (t, h, i, e, k), schedule, x, pairs


def test_mxfp8_forward_megakernel_launch_packs(monkeypatch, kernels):
    from mok.launchers import device_args
    from mok.runtime.tma import tma_encode_args

    moe_forward = _forward_launcher_on_cpu(monkeypatch)
    (t, h, i, e, k), schedule, x, pairs = _mxfp8_forward_operands()
    encoded = []

    def descriptor(self, tensor):  # the TMA spec must take the view's dtype and shape
        spec = self.kernel.variant.tma_spec(self.param)
        tma_encode_args(spec, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, 1 << 20)
        encoded.append((self.param, tensor.dtype, tuple(tensor.shape), tensor.data_ptr()))
        return device_args.tma_descriptor(self.kernel, self.param, tensor)

    monkeypatch.setattr(moe_forward.Descriptors, "get", descriptor)
    # Both calls' outputs stay alive: the first launch's scratch was live beside the first's.
    calls = [moe_forward.routed_forward(x, schedule, k, *pairs) for _ in range(2)]
    (x_routed, gate, _, hidden), _ = calls[0]
    device_args.clear_descriptor_cache()
    assert "moe_forward" not in kernels
    (_, args), *_ = kernels["moe_forward_mxfp8"].launches
    # The weights: their bf16 values, dequantised on every call and bound per launch (the
    # plan's binding, then each of the two launches).
    assert "mxfp8_dequantize_rowwise" in kernels
    assert len([p for p, *_ in encoded if p.startswith("tma_w")]) == 9
    weights = {(p, d, s) for p, d, s, _ in encoded if p.startswith("tma_w")}
    assert weights == {("tma_wg", torch.bfloat16, (e * i, h)), ("tma_wu", torch.bfloat16, (e * i, h)),
                       ("tma_wd", torch.bfloat16, (e * h, i))}  # fmt: skip
    # The GEMMs' A operands: per-call scratch of the context's shapes, not the context itself.
    rounded = (args["x_rounded_ptr"], args["hidden_rounded_ptr"])
    assert all(isinstance(a, int) and a != 0 for a in rounded)
    assert rounded[0] not in (x_routed.data_ptr(), gate.data_ptr(), hidden.data_ptr())
    assert rounded[1] not in (x_routed.data_ptr(), gate.data_ptr(), hidden.data_ptr())
    with pytest.raises(ValueError, match="must be all bf16 tensors or all MXFP8 pairs"):
        moe_forward.routed_forward(x, schedule, k, pairs[0][0], *pairs[1:])
    with pytest.raises(ValueError, match="gate_weights must be an MXFP8 pair"):
        moe_forward.routed_forward(x, schedule, k, pairs[0][:1], *pairs[1:])


def test_a_failed_mxfp8_forward_leaves_no_weights_behind(monkeypatch, kernels):
    """An MXFP8 plan dequantises the weights to bind itself, and each launch its own: a call
    that fails after the plan was made (out of memory, say) must leave none of those bf16
    weights alive (the plan stays cached; a big layer's would hold gigabytes)."""
    import gc
    import weakref

    from mok.launchers import device_args, plans

    moe_forward = _forward_launcher_on_cpu(monkeypatch)
    plans.clear_plans()
    (_, _, _, _, k), schedule, x, pairs = _mxfp8_forward_operands()
    made = []
    dequantized = moe_forward.mxfp8.dequantized_weights

    def recorded(weights):
        values = dequantized(weights)
        made.extend(weakref.ref(v) for v in values)
        return values

    monkeypatch.setattr(moe_forward.mxfp8, "dequantized_weights", recorded)
    outputs = moe_forward._ForwardPlan._outputs
    calls = []

    def out_of_memory_on_the_call(self):  # the plan's own outputs, then the call's
        calls.append(None)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected: the call's context")
        return outputs(self)

    monkeypatch.setattr(moe_forward._ForwardPlan, "_outputs", out_of_memory_on_the_call)
    try:
        moe_forward.routed_forward(x, schedule, k, *pairs)
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the injected failure did not happen")
    assert len(calls) == 2 and made  # the plan was made (and cached), then the call failed
    assert any(isinstance(p, moe_forward._ForwardPlan) for p in plans.plans_of_thread().values())
    for kernel in kernels.values():
        kernel.launches.clear()  # the fakes' records hold their arguments
    device_args.clear_descriptor_cache()
    gc.collect()
    assert [r() for r in made if r() is not None] == []
    plans.clear_plans()


def _backward_launcher_on_cpu(monkeypatch):
    """mok.launchers.backward_megakernel with its CUDA-only checks and lookups made CPU-safe."""
    from mok.launchers import backward_megakernel as moe_backward
    from mok.launchers import device_args, megakernel_walk

    def check_on_cpu(name, tensor, dtype, shape, **_):  # the launcher's checks, minus "on CUDA"
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    monkeypatch.setattr(moe_backward, "sm_count", lambda device: 132)
    monkeypatch.setattr(moe_backward, "check_cuda", check_on_cpu)
    monkeypatch.setattr(megakernel_walk, "check_cuda", check_on_cpu)
    monkeypatch.setattr(checks, "check_expert_weights", _expert_weights_on_cpu)
    monkeypatch.setattr(moe_backward, "check_arg", check_on_cpu)
    device_args.clear_descriptor_cache()
    return moe_backward


BACKWARD_SIZES = (256, 256, 256, 4, 2)  # t, h, i, e, k


def _backward_operands():
    """(schedule, dY, w, x_routed, gate, up, hidden) of a routed backward at BACKWARD_SIZES."""
    from mok import reference as R

    t, h, i, e, k = BACKWARD_SIZES
    schedule = R.make_schedule(torch.randint(0, e, (t, k)), num_local_experts=e,
                               capacity=t * k + e * 128)  # fmt: skip
    c = schedule.capacity
    dy, w = torch.zeros(t, h, dtype=torch.bfloat16), torch.ones(t, k)
    x_routed = torch.zeros(c, h, dtype=torch.bfloat16)
    gate, up, hidden = (torch.zeros(c, i, dtype=torch.bfloat16) for _ in range(3))
    return schedule, dy, w, x_routed, gate, up, hidden


@pytest.mark.parametrize("weight_grads", [True, False])
def test_backward_megakernel_launch_packs(monkeypatch, kernels, weight_grads):
    from mok.launchers import comm, device_args

    moe_backward = _backward_launcher_on_cpu(monkeypatch)
    t, h, i, e, k = BACKWARD_SIZES
    schedule, dy, w, x_routed, gate, up, hidden = _backward_operands()
    c = schedule.capacity
    gate_w = torch.zeros(e, i, h, dtype=torch.bfloat16)
    down_w = torch.zeros(e, h, i, dtype=torch.bfloat16)
    *_, d_weights = moe_backward.routed_backward(
        dy, w, schedule, x_routed, gate, up, hidden, gate_w, gate_w, down_w,
        weight_grads=weight_grads,
    )  # fmt: skip
    device_args.clear_descriptor_cache()
    ((grid, args),) = kernels["moe_backward"].launches
    assert grid == (132, 1, 1) and args["timeout_ns"] == comm.DEFAULT_TIMEOUT_NS
    assert args["weight_gemms"] == (3 if weight_grads else 0)
    assert args["num_comm_ctas"] == 0
    assert args["minibatch_tiles"] == -(-c // 128)  # no minibatch_size: one minibatch
    sizes = {"num_experts": e, "hidden_size": h, "intermediate_size": i, "topk": k,
             "ep_rank": 0, "capacity": c, "has_limit": 0}  # fmt: skip
    assert {name: args[name] for name in sizes} == sizes
    # dispatched and dgu_done per row tile, then the two whole-phase counters, the task ticket,
    # the dispatch ticket, the d_x tiles stored and the exit word. No in-kernel finish
    # (routed_backward never asks for it).
    assert args["counters_ptr"].shape == (2 * (-(-c // 128)) + 6,)
    assert args["finish_tokens"] == 0 and args["d_x_ptr"] == 0
    assert args["counters_ptr"].count_nonzero() == 0
    if weight_grads:
        assert [tuple(d.shape) for d in d_weights] == [(e, i, h), (e, i, h), (e, h, i)]
        assert args["d_w_down_ptr"] == d_weights[2].data_ptr()
        assert args["d_w_gate_ptr"] == d_weights[0].data_ptr()
    else:
        assert d_weights is None


def test_window_backward_megakernel_launch_packs(monkeypatch, kernels):
    """One macrobatch's launch with its weight tasks (WeightWindow): the window variant, the
    whole schedule's segments, the macrobatch's first row, the partials and the gradients the
    caller holds (fused halves: gate and up rows 2 I apart), all rewritten per launch."""
    moe_backward = _backward_launcher_on_cpu(monkeypatch)
    monkeypatch.setattr(moe_backward, "check_expert_weights", _expert_weights_on_cpu)
    monkeypatch.setattr(moe_backward, "check_counts",
                        lambda name, t, size: None if t.shape == (size,) else pytest.fail(name))  # fmt: skip
    t, h, i, e, k = BACKWARD_SIZES
    schedule, dy, w, x_routed, gate, up, hidden = _backward_operands()
    c = schedule.capacity
    gate_w = torch.zeros(e, i, h, dtype=torch.bfloat16)
    down_w = torch.zeros(e, h, i, dtype=torch.bfloat16)
    fused = torch.zeros(e, 2 * i, h, dtype=torch.bfloat16)
    d_weights = (fused[:, :i], fused[:, i:], torch.zeros(e, h, i, dtype=torch.bfloat16))
    whole = torch.full((e,), 1024, dtype=torch.int32)
    partials = torch.zeros(2, 3, h * i)
    for m, first_row in enumerate((0, 2048)):
        window = moe_backward.WeightWindow(whole, first_row, d_weights, partials[m % 2],
                                           partials[(m + 1) % 2])  # fmt: skip
        *_, got = moe_backward.launch_routed_backward(
            dy, w, schedule, (x_routed, gate, up, hidden), (gate_w, gate_w, down_w),
            moe_backward.PassConfig(), weight_grads=False, window=window,
        )  # fmt: skip
        assert [g.data_ptr() for g in got] == [g.data_ptr() for g in d_weights]
    assert "moe_backward" not in kernels
    launches = kernels["moe_backward_window"].launches
    assert len(launches) == 2
    for m, (_, args) in enumerate(launches):
        assert args["weight_gemms"] == 3 and args["d_w_gate_up_rows"] == 2 * i
        assert args["window_rows"] == c and args["window_first_row"] == 2048 * m
        assert args["schedule_tokens_per_expert_ptr"] == whole.data_ptr()
        assert args["tokens_per_expert_ptr"] == schedule.tokens_per_expert.data_ptr()
        assert args["partial_in_ptr"] == partials[m % 2].data_ptr()
        assert args["partial_out_ptr"] == partials[(m + 1) % 2].data_ptr()
        assert [args[f"d_w_{n}_ptr"] for n in ("gate", "up", "down")] == [
            g.data_ptr() for g in d_weights
        ]
    operands = (dy, w, schedule, (x_routed, gate, up, hidden), (gate_w, gate_w, down_w),
                moe_backward.PassConfig())  # fmt: skip
    bad = (
        ({"weight_grads": True}, "weight_grads must be False"),
        ({"window": window._replace(first_row=64)}, r"window.first_row must be a multiple of 128 "
                                                    r">= 0, got 64"),
        ({"window": window._replace(partial_out=window.partial_in)},
         "partial_in and window.partial_out must be different buffers"),
        ({"window": window._replace(d_weights=d_weights[:2])},
         r"window.d_weights must be \(dW_gate, dW_up, dW_down\), got 2 tensors"),
    )  # fmt: skip
    for change, message in bad:
        kwargs = {"weight_grads": False, "window": window, **change}
        with pytest.raises(ValueError, match=message):
            moe_backward.launch_routed_backward(*operands, **kwargs)
    with pytest.raises(ValueError, match="MXFP8 backward megakernel computes no weight"):
        moe_backward.launch_routed_backward(*operands, weight_grads=False, window=window,
                                            mxfp8=True)  # fmt: skip


def test_mxfp8_backward_megakernel_launch_packs(monkeypatch, kernels):
    from mok.launchers import device_args

    moe_backward = _backward_launcher_on_cpu(monkeypatch)
    encoded = []
    real_descriptor = device_args.tma_descriptor

    def descriptor(kernel, param, tensor):
        encoded.append((param, tensor.data_ptr()))
        return real_descriptor(kernel, param, tensor)

    monkeypatch.setattr(moe_backward, "tma_descriptor", descriptor)
    monkeypatch.setattr(moe_backward.Descriptors, "get",
                        lambda self, t: descriptor(self.kernel, self.param, t))  # fmt: skip
    device_args.clear_descriptor_cache()
    t, h, i, e, k = BACKWARD_SIZES
    schedule, dy, w, x_routed, gate, up, hidden = _backward_operands()

    def weights():  # the dequantised bf16 weights: new tensors on every call
        return (torch.zeros(e, i, h, dtype=torch.bfloat16),
                torch.zeros(e, i, h, dtype=torch.bfloat16),
                torch.zeros(e, h, i, dtype=torch.bfloat16))  # fmt: skip

    calls = [weights(), weights()]
    for call in calls:
        dy_e, d_gate, d_up, _, _, d_weights = moe_backward.routed_backward(
            dy, w, schedule, x_routed, gate, up, hidden, *call, weight_grads=False, mxfp8=True
        )
        assert d_weights is None
    device_args.clear_descriptor_cache()
    assert "moe_backward" not in kernels
    (_, args), *_ = kernels["moe_backward_mxfp8"].launches
    assert args["weight_gemms"] == 0
    rounded = [args[n] for n in ("dy_rounded_ptr", "d_gate_rounded_ptr", "d_up_rounded_ptr")]
    assert all(isinstance(a, int) and a != 0 for a in rounded) and len(set(rounded)) == 3
    # Every call's weights are encoded for its own launch.
    for call in calls:
        for param, weight in zip(("tma_wg", "tma_wu", "tma_wd"), call, strict=True):
            assert (param, weight.data_ptr()) in encoded
    with pytest.raises(ValueError, match="weight_grads must be False"):
        moe_backward.routed_backward(dy, w, schedule, x_routed, gate, up, hidden, *weights(),
                                     weight_grads=True, mxfp8=True)  # fmt: skip


def test_comm_count_is_clamped_below_the_grid():
    from mok.launchers.megakernel_walk import walk_arguments
    from mok.types import PassConfig

    class _Schedule:
        peer_rank = peer_token_idx = num_tokens = tokens_per_expert = torch.zeros(8)

    counters = torch.zeros(3, dtype=torch.int32)
    rows, gate_w = torch.zeros(4, 256), torch.zeros(2, 128, 256)
    import mok.launchers.megakernel_walk as walk

    original = walk.get_error_record
    walk.get_error_record = lambda device: FakeErrorRecord()
    try:
        for comm, want in ((16, 16), (0, 0), (500, 131)):  # never all CTAs: at most grid - 1
            settings = PassConfig(num_comm_ctas=comm, minibatch_size=256, timeout_ns=1)
            args = walk_arguments(_Schedule(), counters, rows, gate_w, 2, settings, 132)
            assert args["num_comm_ctas"] == want
            # The minibatch's one conversion: routed rows to 128-row tiles of the 8 rows.
            assert args["minibatch_tiles"] == 1 and args["timeout_ns"] == 1
    finally:
        walk.get_error_record = original


def test_minibatch_row_tiles_caps():
    from mok.launchers.megakernel_walk import minibatch_row_tiles

    assert minibatch_row_tiles(None, 1000) == 8  # all of it: ceil(1000 / 128)
    assert minibatch_row_tiles(256, 1000) == 2
    assert minibatch_row_tiles(131072, 1000) == 8  # at most the routed buffer


def test_router_grad_push_launch_packs(monkeypatch, kernels):
    from mok import reference as R
    from mok.launchers import backward_megakernel

    monkeypatch.setattr(backward_megakernel, "check_arg", lambda *a, **k: None)
    monkeypatch.setattr(
        backward_megakernel, "status_ptr", lambda device: FakeErrorRecord.status_ptr
    )
    t, k, e = 256, 2, 4
    schedule = R.make_schedule(torch.randint(0, e, (t, k)), num_local_experts=e,
                               capacity=t * k + e * 128)  # fmt: skip
    partials = torch.zeros(schedule.capacity, 4)
    w, d_router = torch.ones(t, k), torch.zeros(t, k)
    table = torch.zeros(8, 128, dtype=torch.int64)
    backward_megakernel.push_router_grads(partials, schedule, w, d_router, peers=(1, table))
    ((grid, args),) = kernels["router_grad_push"].launches
    assert grid == (-(-schedule.capacity // 128), 1, 1) and args["peer_table_ptr"] is table
    assert args["ep_rank"] == 1 and args["blocks"] == 4 and args["num_rows"] == schedule.capacity
    assert args["status_ptr"] == FakeErrorRecord.status_ptr


def test_forward_megakernel_packs_the_peer_table(monkeypatch, kernels):
    from mok import reference as R
    from mok.launchers import device_args, megakernel_walk
    from mok.launchers import forward_megakernel as moe_forward

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    monkeypatch.setattr(moe_forward, "check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(megakernel_walk, "check_cuda", lambda *a, **k: None)
    monkeypatch.setattr(checks, "check_expert_weights", _expert_weights_on_cpu)
    device_args.clear_descriptor_cache()
    t, h, i, e, k = 256, 256, 128, 4, 2
    schedule = R.make_schedule(torch.randint(0, e, (t, k)), num_local_experts=e,
                               capacity=t * k + e * 128)  # fmt: skip
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    gate_w = torch.zeros(e, i, h, dtype=torch.bfloat16)
    down_w = torch.zeros(e, h, i, dtype=torch.bfloat16)
    table = torch.zeros(8, 128, dtype=torch.int64)
    slots = torch.zeros(t * k, h, dtype=torch.bfloat16)
    _, got = moe_forward.routed_forward(x, schedule, k, gate_w, gate_w, down_w,
                                        peers=(3, table), slots=slots,
                                        grid=32)  # fmt: skip
    device_args.clear_descriptor_cache()
    ((grid, args),) = kernels["moe_forward"].launches
    assert got is slots and grid == (32, 1, 1) and args["ep_rank"] == 3
    assert args["peer_table_ptr"] is table


def test_backward_megakernel_packs_the_peer_table(monkeypatch, kernels):
    from mok.launchers import backward_megakernel as moe_backward
    from mok.launchers import device_args, megakernel_walk

    def check_on_cpu(*_, **__):
        return None

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    monkeypatch.setattr(moe_backward, "check_cuda", check_on_cpu)
    monkeypatch.setattr(megakernel_walk, "check_cuda", check_on_cpu)
    monkeypatch.setattr(checks, "check_expert_weights", _expert_weights_on_cpu)
    monkeypatch.setattr(moe_backward, "check_arg", check_on_cpu)
    device_args.clear_descriptor_cache()
    t, h, i, e, k = BACKWARD_SIZES
    schedule, dy, w, x_routed, gate, up, hidden = _backward_operands()
    gate_w, down_w = (
        torch.zeros(e, i, h, dtype=torch.bfloat16),
        torch.zeros(e, h, i, dtype=torch.bfloat16),
    )
    table = torch.ones(8, 128, dtype=torch.int64)
    slots = torch.zeros(t * k, h, dtype=torch.bfloat16)
    *_, got_slots, _ = moe_backward.routed_backward(
        dy, w, schedule, x_routed, gate, up, hidden, gate_w, gate_w, down_w,
        peers=(1, table), slots=slots, grid=64,
    )  # fmt: skip
    device_args.clear_descriptor_cache()
    ((grid, args),) = kernels["moe_backward"].launches
    assert got_slots is slots and grid == (64, 1, 1) and args["ep_rank"] == 1
    assert args["peer_table_ptr"] is table


def test_gpu_layer_limits_are_clear_errors():
    from mok.errors import MoKKernelUnavailableError
    from mok.launchers.checks import check_gpu_layer

    class _Workspace:
        hidden_size, ep_size, num_local_tokens, topk = 512, 2, 1024, 8

    check_gpu_layer(_Workspace(), "forward")
    ws = _Workspace()
    ws.hidden_size = 384
    with pytest.raises(ValueError, match="hidden_size must be a multiple of 256"):
        check_gpu_layer(ws, "forward")
    ws = _Workspace()
    ws.ep_size = 128
    with pytest.raises(MoKKernelUnavailableError, match="at most 127 ranks"):
        check_gpu_layer(ws, "backward")
    ws = _Workspace()
    ws.num_local_tokens = 1 << 22
    with pytest.raises(ValueError, match=r"num_local_tokens \* topk must be below 16777216"):
        check_gpu_layer(ws, "forward")


def test_forward_plan_is_reused_and_rechecked(monkeypatch, kernels):
    """A second call with new activations reuses the plan (one bind) and writes their addresses;
    a tensor that differs in anything but its address gets a new plan, whose checks raise."""
    from mok import reference as R
    from mok.launchers import device_args, megakernel_walk, plans
    from mok.launchers import forward_megakernel as moe_forward

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    monkeypatch.setattr(moe_forward, "sm_count", lambda device: 132)
    monkeypatch.setattr(moe_forward, "check_cuda", lambda name, t, dtype, shape: None)
    monkeypatch.setattr(megakernel_walk, "check_cuda", lambda name, t, dtype, shape: None)
    monkeypatch.setattr(checks, "check_expert_weights",
                        lambda name, t, dtype, shape: t.stride(0) // t.shape[2])  # fmt: skip
    plans.clear_plans()
    device_args.clear_descriptor_cache()
    t, h, i, e, k = 256, 256, 128, 4, 2
    schedule = R.make_schedule(torch.randint(0, e, (t, k)), num_local_experts=e,
                               capacity=t * k + e * 128)  # fmt: skip
    gate_w = torch.zeros(e, i, h, dtype=torch.bfloat16)
    down_w = torch.zeros(e, h, i, dtype=torch.bfloat16)
    binds = []
    original_bind = FakeKernel.bind
    monkeypatch.setattr(FakeKernel, "bind", lambda self, *a, **kw: binds.append(1)
                        or original_bind(self, *a, **kw))  # fmt: skip
    xs = [torch.randn(t, h).to(torch.bfloat16) for _ in range(2)]
    for x in xs:
        moe_forward.routed_forward(x, schedule, k, gate_w, gate_w, down_w)
    launches = kernels["moe_forward"].launches
    assert len(binds) == 1 and len(launches) == 2
    assert [args["x_ptr"] for _, args in launches] == [x.data_ptr() for x in xs]
    with pytest.raises(ValueError, match="hidden_size must be a positive multiple of 256"):
        moe_forward.routed_forward(xs[0][:, :128], schedule, k, gate_w, gate_w, down_w)
    plans.clear_plans()
