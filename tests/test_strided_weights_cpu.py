"""Routed gate/up weights as the halves of one fused [E, 2 I, H] tensor (as Hugging Face and
TorchTitan hold them), on CPU: the layout helper and its errors, the public checks, the plan
keys, the launch packing of the new rows-per-expert parameters (tests/fake_kernels.py), and the
reference path computing with the views."""

from __future__ import annotations

import pytest
import torch
from fake_kernels import FakeErrorRecord, fake_kernels

from mok import functional as F
from mok.launchers import checks
from mok.testing import WEIGHT_NAMES, make_inputs, run_layer
from mok.validation import check_tensor, tensor_key

E, I, H = 4, 256, 256


def fused_halves(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) as the two halves of one new [E, 2 I, H] tensor holding their values."""
    gate_up = torch.cat([gate, up], dim=1)
    inter = gate.shape[1]
    return gate_up[:, :inter], gate_up[:, inter:]


def test_expert_rows_view_of_contiguous_weights_is_the_flat_view():
    w = torch.randn(E, I, H).to(torch.bfloat16)
    view, rows = checks.expert_rows_view("gate_weights", w)
    assert rows == I
    assert view.shape == (E * I, H) and view.stride() == (H, 1)
    assert view.data_ptr() == w.data_ptr() and torch.equal(view, w.view(-1, H))


def test_expert_rows_view_of_fused_halves_reads_them_in_place():
    gate_up = torch.randn(E, 2 * I, H).to(torch.bfloat16)
    gate, up = gate_up[:, :I], gate_up[:, I:]
    for name, half, first in (("gate_weights", gate, 0), ("up_weights", up, I)):
        view, rows = checks.expert_rows_view(name, half)
        assert rows == 2 * I
        assert view.shape == ((E - 1) * 2 * I + I, H) and view.stride() == (H, 1)
        assert view.data_ptr() == half.data_ptr()
        assert view.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
        flat = gate_up.view(-1, H)
        assert torch.equal(view, flat[first : first + view.shape[0]])
        for e in range(E):  # expert e's rows start at e * rows
            assert torch.equal(view[e * rows : e * rows + I], half[e])


@pytest.mark.parametrize(
    "make,strides",
    [
        (lambda: torch.zeros(E, H, I, dtype=torch.bfloat16).transpose(1, 2), f"({I * H}, 1, {I})"),
        (lambda: torch.zeros(E, I, 2 * H, dtype=torch.bfloat16)[:, :, :H], f"({2 * I * H}, "),
        (lambda: torch.zeros(I, H, dtype=torch.bfloat16).expand(E, I, H), f"(0, {H}, 1)"),
        # 320 rows per expert: not on the 128-row weight tiles
        (lambda: torch.zeros(E, I + 64, H, dtype=torch.bfloat16)[:, :I], f"({(I + 64) * H}, "),
    ],
)
def test_expert_rows_rejects_other_layouts_naming_argument_and_strides(make, strides):
    w = make()
    with pytest.raises(ValueError, match=r"up_weights must have strides \(R \* 256, 256, 1\)") as e:
        checks.expert_rows_view("up_weights", w)
    assert f"got strides {tuple(w.stride())}" in str(e.value) and strides in str(e.value)


def test_public_check_accepts_fused_halves_only_where_allowed():
    gate, _ = fused_halves(torch.zeros(E, I, H), torch.zeros(E, I, H))
    check_tensor("routed_gate_weights", gate, dtype=torch.float32, shape=[E, I, H],
                 expert_strided=True)  # fmt: skip
    with pytest.raises(ValueError, match="shared_gate_weights must be contiguous"):
        check_tensor("shared_gate_weights", gate, dtype=torch.float32, shape=[E, I, H])
    transposed = torch.zeros(E, H, I).transpose(1, 2)
    with pytest.raises(ValueError, match=r"routed_up_weights must be contiguous or have strides"):
        check_tensor("routed_up_weights", transposed, dtype=torch.float32, shape=[E, I, H],
                     expert_strided=True)  # fmt: skip


def test_plan_keys_tell_fused_halves_from_contiguous_weights():
    from mok.launchers.plans import weight_key

    contiguous = torch.zeros(E, I, H, dtype=torch.bfloat16)
    gate, _ = fused_halves(contiguous, contiguous)
    assert tensor_key(gate) != tensor_key(contiguous)
    assert weight_key(gate)[1:] != weight_key(contiguous)[1:]


def test_functional_rejects_fused_down_and_bad_gate_strides():
    inputs = make_inputs(128, H, I, E, 2, seed=3)
    inputs["routed_gate"] = torch.zeros(E, H, I, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="routed_gate_weights must be contiguous or have strides"):
        run_layer(inputs, E)
    inputs = make_inputs(128, H, I, E, 2, seed=3)
    down = torch.cat([inputs["routed_down"]] * 2, dim=1)
    inputs["routed_down"] = down[:, :H]
    with pytest.raises(ValueError, match="routed_down_weights must be contiguous"):
        run_layer(inputs, E)


@pytest.mark.parametrize("shared,limit", [(False, None), (True, 0.5)])
def test_reference_path_with_fused_views_equals_contiguous_weights(shared, limit):
    inputs = make_inputs(128, H, I, E, 2, shared=shared, seed=4)
    fused = dict(inputs)
    fused["routed_gate"], fused["routed_up"] = fused_halves(inputs["routed_gate"],
                                                            inputs["routed_up"])  # fmt: skip
    assert not fused["routed_gate"].is_contiguous()
    out, ctx, grads, _ = run_layer(inputs, E, swiglu_limit=limit)
    out_f, ctx_f, grads_f, _ = run_layer(fused, E, swiglu_limit=limit)
    assert torch.equal(out, out_f)
    for a, b in zip(ctx.tensors(), ctx_f.tensors(), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(grads, grads_f, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    # The fused weights' gradients: the two halves of one new [E, 2 I, H] bf16 tensor.
    d_gate, d_up = grads_f[2], grads_f[3]
    assert d_gate._base is not None and d_up._base is d_gate._base
    assert d_gate._base.shape == (E, 2 * I, H) and d_gate._base.dtype == torch.bfloat16
    assert d_up.data_ptr() == d_gate.data_ptr() + I * H * 2
    assert grads[2]._base is None and grads[3]._base is None  # separate: two tensors


def test_fused_gate_up_tells_halves_of_one_tensor_from_other_layouts():
    """By strides only (the op's fake under torch.compile sees no storage): halves' layouts."""
    from mok.validation import fused_gate_up

    gate_up = torch.zeros(E, 2 * I, H)
    assert fused_gate_up(gate_up[:, :I], gate_up[:, I:])
    other = torch.zeros(E, 2 * I, H)
    assert fused_gate_up(gate_up[:, :I], other[:, I:])  # halves' layout: the gradient is new
    separate = torch.zeros(E, I, H)
    assert not fused_gate_up(separate, separate)
    assert not fused_gate_up(gate_up[:, :I], separate)  # one half, one contiguous
    wider = torch.zeros(E, 3 * I, H)
    assert not fused_gate_up(wider[:, :I], wider[:, I : 2 * I])  # experts 3 I rows apart


def test_fake_backward_gives_the_fused_gradient_shape():
    """torch.compile traces the op's fake: the fused [E, 2 I, H] gradient in gate's place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mok.ops  # noqa: F401 - registers mok::backward

    t, k = 8, 2
    with FakeTensorMode():
        bf16 = dict(dtype=torch.bfloat16)
        gate_up = torch.empty(E, 2 * I, H, **bf16)
        i32 = torch.empty(1, dtype=torch.int32)
        ctx = [torch.empty(0, **bf16)] * 7
        x, w = torch.empty(t, H, **bf16), torch.empty(t, k)
        for gate, up, fused in ((gate_up[:, :I], gate_up[:, I:], True),
                                (torch.empty(E, I, H, **bf16), torch.empty(E, I, H, **bf16),
                                 False)):  # fmt: skip
            grads = torch.ops.mok.backward(
                0, i32, i32, i32, i32, *ctx, x, x, w, None, None, None, gate, up,
                torch.empty(E, H, I, **bf16), None, 0, 128, 1 << 20, None, None, None, None,
                None, None,
            )  # fmt: skip
            gate_shape = (E, 2 * I, H) if fused else (E, I, H)
            assert tuple(grads[2].shape) == gate_shape
            assert tuple(grads[3].shape) == ((0,) if fused else (E, I, H))


def test_reference_path_accumulates_into_fused_main_grads():
    inputs = make_inputs(128, H, I, E, 2, seed=5)
    fused = dict(inputs)
    fused["routed_gate"], fused["routed_up"] = fused_halves(inputs["routed_gate"],
                                                            inputs["routed_up"])  # fmt: skip
    start = torch.randn(E, 2 * I, H)
    separate = [start[:, :I].clone(), start[:, I:].clone()]
    main = start.clone()
    run_layer(inputs, E, main_grads=(*separate, None, None, None, None))
    grads = run_layer(fused, E, main_grads=(main[:, :I], main[:, I:], None, None, None, None))[2]
    assert torch.equal(main[:, :I], separate[0]) and torch.equal(main[:, I:], separate[1])
    assert grads[2].data_ptr() == main.data_ptr()
    assert grads[3].data_ptr() == main[:, I:].data_ptr()


# ---- launch packing: the rows-per-expert parameters, descriptors over the views ----


@pytest.fixture()
def kernels(monkeypatch):
    return fake_kernels(monkeypatch)


def _check_on_cpu(name, tensor, dtype, shape, **_):
    assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shape), name


def _expert_weights_on_cpu(name, tensor, dtype, shape):
    _check_on_cpu(name, tensor, dtype, shape)
    return checks.expert_rows(name, tensor)


def _on_cpu(monkeypatch, *modules):
    """Make the launchers' CUDA-only checks and lookups CPU-safe in `modules`."""
    from mok.launchers import device_args, megakernel_walk

    monkeypatch.setattr(megakernel_walk, "get_error_record", lambda device: FakeErrorRecord())
    for module in (checks, megakernel_walk, *modules):
        for name, fake in (("check_cuda", _check_on_cpu), ("check_arg", _check_on_cpu),
                           ("check_expert_weights", _expert_weights_on_cpu),
                           ("sm_count", lambda device: 132),
                           ("persistent_grid", lambda device, rows, cols: 132)):  # fmt: skip
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)
    device_args.clear_descriptor_cache()


def _record_descriptors(monkeypatch, *modules):
    """[(param, data_ptr, shape, strides)] of every TMA descriptor the launchers encode."""
    from mok.launchers import device_args, plans

    encoded = []
    real = device_args.tma_descriptor

    def descriptor(kernel, param, tensor):
        encoded.append((param, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())))
        return real(kernel, param, tensor)

    monkeypatch.setattr(plans, "tma_descriptor", descriptor)
    for module in modules:
        if hasattr(module, "tma_descriptor"):
            monkeypatch.setattr(module, "tma_descriptor", descriptor)
    return encoded


def _schedule(t: int, k: int):
    """A schedule of random routing over the E experts, with room for every expert's padding."""
    from mok import reference as R

    return R.make_schedule(torch.randint(0, E, (t, k)), num_local_experts=E,
                           capacity=t * k + E * 128)  # fmt: skip


def _weights(fused: bool):
    gate, up = torch.zeros(E, I, H, dtype=torch.bfloat16), torch.ones(E, I, H, dtype=torch.bfloat16)
    return fused_halves(gate, up) if fused else (gate, up)


@pytest.mark.parametrize("fused", [False, True])
def test_forward_megakernel_packs_the_rows_per_expert(monkeypatch, kernels, fused):
    from mok.launchers import forward_megakernel

    _on_cpu(monkeypatch, forward_megakernel)
    encoded = _record_descriptors(monkeypatch, forward_megakernel)
    t, k = 256, 2
    schedule = _schedule(t, k)
    gate, up = _weights(fused)
    down = torch.zeros(E, H, I, dtype=torch.bfloat16)
    forward_megakernel.routed_forward(torch.zeros(t, H, dtype=torch.bfloat16), schedule, k, gate,
                                      up, down)  # fmt: skip
    ((_, args),) = kernels["moe_forward"].launches
    rows = 2 * I if fused else I
    assert args["gate_up_expert_rows"] == rows and args["intermediate_size"] == I
    views = {param: rest for param, *rest in encoded}
    extent = (E - 1) * rows + I
    assert views["tma_wg"] == [gate.data_ptr(), (extent, H), (H, 1)]
    assert views["tma_wu"] == [up.data_ptr(), (extent, H), (H, 1)]
    assert views["tma_wd"] == [down.data_ptr(), (E * H, I), (I, 1)]


@pytest.mark.parametrize("fused", [False, True])
def test_backward_megakernel_packs_the_rows_per_expert(monkeypatch, kernels, fused):
    from mok.launchers import backward_megakernel

    _on_cpu(monkeypatch, backward_megakernel)
    encoded = _record_descriptors(monkeypatch, backward_megakernel)
    t, k = 256, 2
    schedule = _schedule(t, k)
    c = schedule.capacity
    gate, up = _weights(fused)
    down = torch.zeros(E, H, I, dtype=torch.bfloat16)
    rows_c = [torch.zeros(c, n, dtype=torch.bfloat16) for n in (H, I, I, I)]
    backward_megakernel.routed_backward(
        torch.zeros(t, H, dtype=torch.bfloat16), torch.ones(t, k), schedule, *rows_c, gate, up,
        down, weight_grads=False,
    )  # fmt: skip
    ((_, args),) = kernels["moe_backward"].launches
    rows = 2 * I if fused else I
    assert args["gate_up_expert_rows"] == rows
    views = {param: rest for param, *rest in encoded}
    extent = (E - 1) * rows + I
    assert views["tma_wg"] == [gate.data_ptr(), (extent, H), (H, 1)]
    assert views["tma_wu"] == [up.data_ptr(), (extent, H), (H, 1)]


@pytest.mark.parametrize("fused", [False, True])
def test_backward_megakernel_writes_fused_gradient_halves(monkeypatch, kernels, fused):
    from mok.launchers import backward_megakernel

    _on_cpu(monkeypatch, backward_megakernel)
    t, k = 256, 2
    schedule = _schedule(t, k)
    c = schedule.capacity
    gate, up = _weights(fused)
    rows_c = [torch.zeros(c, n, dtype=torch.bfloat16) for n in (H, I, I, I)]
    *_, d_weights = backward_megakernel.routed_backward(
        torch.zeros(t, H, dtype=torch.bfloat16), torch.ones(t, k), schedule, *rows_c, gate, up,
        torch.zeros(E, H, I, dtype=torch.bfloat16), weight_grads=True, fused_grads=fused,
    )  # fmt: skip
    ((_, args),) = kernels["moe_backward"].launches
    d_gate, d_up, d_down = d_weights
    assert args["d_w_gate_up_rows"] == (2 * I if fused else I)
    assert args["d_w_gate_ptr"] == d_gate.data_ptr() and args["d_w_up_ptr"] == d_up.data_ptr()
    assert d_gate.shape == d_up.shape == (E, I, H) and d_down.shape == (E, H, I)
    if fused:
        assert d_gate._base is d_up._base and d_gate._base.shape == (E, 2 * I, H)
        assert d_up.data_ptr() == d_gate.data_ptr() + I * H * 2
    else:
        assert d_gate.is_contiguous() and d_up.is_contiguous() and d_gate._base is None


@pytest.mark.parametrize("fused", [False, True])
def test_recompute_gemm_packs_the_rows_per_expert(monkeypatch, kernels, fused):
    from mok.launchers import expert_gemm

    _on_cpu(monkeypatch, expert_gemm)
    encoded = _record_descriptors(monkeypatch, expert_gemm)
    gate, up = _weights(fused)
    tokens = torch.full((E,), 128, dtype=torch.int32)
    expert_gemm.gate_up_swiglu(torch.zeros(E * 128, H, dtype=torch.bfloat16), gate, up, tokens)
    ((_, args),) = kernels["expert_gemm_gate_up_swiglu"].launches
    rows = 2 * I if fused else I
    assert args["b_expert_rows"] == rows and args["n_size"] == I
    views = {param: rest for param, *rest in encoded}
    assert views["tma_b0"] == [gate.data_ptr(), ((E - 1) * rows + I, H), (H, 1)]
    assert views["tma_b1"] == [up.data_ptr(), ((E - 1) * rows + I, H), (H, 1)]
    expert_gemm.down(torch.zeros(E * 128, I, dtype=torch.bfloat16),
                     torch.zeros(E, H, I, dtype=torch.bfloat16), tokens)  # fmt: skip
    ((_, args),) = kernels["expert_gemm_down"].launches
    assert args["b_expert_rows"] == H


def test_recompute_gemm_refuses_gate_and_up_of_different_strides(monkeypatch, kernels):
    from mok.launchers import expert_gemm

    _on_cpu(monkeypatch, expert_gemm)
    gate, _ = _weights(True)
    up = torch.zeros(E, I, H, dtype=torch.bfloat16)
    tokens = torch.full((E,), 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="gate_weights and up_weights must have the same strides"):
        expert_gemm.gate_up_swiglu(torch.zeros(E * 128, H, dtype=torch.bfloat16), gate, up,
                                   tokens)  # fmt: skip


@pytest.mark.parametrize("output", ["bf16", "accumulate"])
def test_weight_gradient_writes_a_fused_half_in_place(monkeypatch, kernels, output):
    from mok.launchers import expert_gemm_bwd

    _on_cpu(monkeypatch, expert_gemm_bwd)
    dtype = torch.bfloat16 if output == "bf16" else torch.float32
    fused = torch.zeros(E, 2 * I, H, dtype=dtype)
    tokens = torch.full((E,), 128, dtype=torch.int32)
    a, b = (
        torch.zeros(E * 128, I, dtype=torch.bfloat16),
        torch.zeros(E * 128, H, dtype=torch.bfloat16),
    )
    for half in (fused[:, :I], fused[:, I:]):
        assert expert_gemm_bwd.weight_gradient(a, b, tokens, output=output, out=half) is half
    name = "expert_gemm_bwd_weights_" + ("bf16" if output == "bf16" else "accumulate")
    ((_, args),) = kernels[name].launches
    assert args["out_expert_rows"] == 2 * I and args["m_size"] == I
    assert args["out_ptr"].data_ptr() == fused[:, I:].data_ptr()


@pytest.mark.parametrize("output", ["bf16", "accumulate"])
def test_window_weight_gradient_writes_a_fused_half_in_place(monkeypatch, kernels, output):
    from mok.launchers import macrobatch

    _on_cpu(monkeypatch, macrobatch)
    dtype = torch.bfloat16 if output == "bf16" else torch.float32
    fused = torch.zeros(E, 2 * I, H, dtype=dtype)
    tokens = torch.full((E,), 128, dtype=torch.int32)
    a, b = torch.zeros(256, I, dtype=torch.bfloat16), torch.zeros(256, H, dtype=torch.bfloat16)
    partials = torch.zeros(2, I, H)
    macrobatch.weight_gradient_window(a, b, tokens, 0, fused[:, I:], partials[0], partials[1],
                                      output=output)  # fmt: skip
    ((_, args),) = kernels[macrobatch.WINDOW_KERNELS[output][0]].launches
    assert args["out_expert_rows"] == 2 * I and args["m_size"] == I
    # A launch plan writes the dynamic params as addresses (ints).
    assert args["out_ptr"] == fused[:, I:].data_ptr()


def test_weight_names_order_is_what_the_tests_assume():
    assert WEIGHT_NAMES[3:5] == ("routed_gate", "routed_up")
    assert F.backward.__doc__ is not None


# ---- mok.nn.moe_fused: the halves as views, the layer's fused gradient, main_grad in place ----


def _fused_layer(accumulate_main_grad: bool, seed: int):
    """(config, workspace, schedule, inputs, gate_up, down) of a CPU layer, gate_up fused."""
    t, k = 128, 2
    inp = make_inputs(t, H, I, E, k, seed=seed)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=t, hidden_size=H, topk=k,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=E)
    gate_up = torch.cat((inp["routed_gate"], inp["routed_up"]), 1).requires_grad_()
    down = inp["routed_down"].clone().requires_grad_()
    return config, ws, schedule, inp, gate_up, down


def test_moe_fused_passes_views_and_returns_the_layers_fused_gradient(monkeypatch):
    from mok import nn as mok_nn

    config, ws, schedule, inp, gate_up, down = _fused_layer(False, seed=21)
    seen = {}
    forward, backward = F.forward, F.backward

    def spy_forward(*args, **kw):
        seen["forward"] = args[8:10]  # routed gate, up
        return forward(*args, **kw)

    def spy_backward(*args, **kw):
        seen["backward"] = args[10:12]
        seen["whole"] = kw.get("whole_gate_up_grad")
        grads = backward(*args, **kw)
        seen["grads"] = grads
        return grads

    monkeypatch.setattr(F, "forward", spy_forward)
    monkeypatch.setattr(F, "backward", spy_backward)
    out = mok_nn.moe_fused(config, ws, schedule, inp["x"], inp["router_weights"], gate_up, down)
    out.backward(torch.randn_like(out))
    for step in ("forward", "backward"):
        gate, up = seen[step]
        assert gate.data_ptr() == gate_up.data_ptr(), f"{step}: gate must be a view, no copy"
        assert up.data_ptr() == gate_up[:, I:].data_ptr(), f"{step}: up must be a view, no copy"
    assert seen["whole"] is True
    d_gate_up, d_up = seen["grads"][2], seen["grads"][3]
    assert d_up is None and d_gate_up.shape == (E, 2 * I, H)  # the layer's one tensor, whole
    assert torch.equal(gate_up.grad, d_gate_up)


def test_moe_fused_adds_into_fp32_main_grad_halves_in_place(monkeypatch):
    from mok import nn as mok_nn

    config, ws, schedule, inp, gate_up, down = _fused_layer(True, seed=22)
    gate_up.main_grad = torch.randn(E, 2 * I, H)
    down.main_grad = torch.zeros(E, H, I)
    seen = {}
    backward = F.backward

    def spy_backward(*args, **kw):
        seen["main_grads"] = kw["main_grads"]
        return backward(*args, **kw)

    monkeypatch.setattr(F, "backward", spy_backward)
    out = mok_nn.moe_fused(config, ws, schedule, inp["x"], inp["router_weights"], gate_up, down,
                           accumulate_main_grad=True)  # fmt: skip
    out.backward(torch.randn_like(out))
    main_gate, main_up = seen["main_grads"][:2]
    assert main_gate.data_ptr() == gate_up.main_grad.data_ptr()  # in place: no scratch
    assert main_up.data_ptr() == gate_up.main_grad[:, I:].data_ptr()


def test_recompute_gemm_relaunches_its_plan_with_the_ticket_zeroed(monkeypatch, kernels):
    """The replay's gate/up GEMM, macrobatch after macrobatch: one bound launch per shapes and
    weights; each call zeroes the plan's tile ticket first (the kernel never resets it)."""
    from mok.launchers import expert_gemm, plans

    _on_cpu(monkeypatch, expert_gemm)
    gate, up = _weights(False)
    tokens = torch.full((E,), 128, dtype=torch.int32)
    rows = torch.zeros(E * 128, H, dtype=torch.bfloat16)
    expert_gemm.gate_up_swiglu(rows, gate, up, tokens)
    kernel = kernels["expert_gemm_gate_up_swiglu"]
    ((_, first),) = kernel.launches
    (plan,) = [
        p for p in plans.plans_of_thread().values() if isinstance(p, expert_gemm._GateUpPlan)
    ]
    plan.ticket.fill_(5)  # as a finished launch leaves it
    outs = [torch.empty(E * 128, I, dtype=torch.bfloat16) for _ in range(3)]
    expert_gemm.gate_up_swiglu(rows, gate, up, tokens, gate=outs[0], up=outs[1], hidden=outs[2])
    assert kernels["expert_gemm_gate_up_swiglu"] is kernel and len(kernel.launches) == 2
    _, second = kernel.launches[1]
    assert int(plan.ticket) == 0 and second["ticket_ptr"] is first["ticket_ptr"]
    assert (second["gate_ptr"], second["up_ptr"], second["out_ptr"]) == tuple(
        t.data_ptr() for t in outs
    )
