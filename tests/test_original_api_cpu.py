"""The original's functional and workspace surface on the CPU path: create_workspace,
validate_workspace_args, validate_inputs, the workspace's buffer attributes, and input errors
that are both ValueError and TypeError."""

from __future__ import annotations

import pytest
import torch

from mok import functional as F
from mok.errors import MoKInputError
from mok.testing import make_inputs

T, H, K, E = 64, 128, 2, 4


def test_create_workspace_is_new_each_call_and_get_workspace_is_cached():
    config = F.MoKConfig()
    args = dict(device="cpu", num_local_tokens=T, hidden_size=H, topk=K)
    a, b = F.create_workspace(config, None, **args), F.create_workspace(config, None, **args)
    assert a is not b and a.handle != b.handle
    assert F.get_workspace(config, None, **args) is F.get_workspace(config, None, **args)
    a.destroy()
    b.destroy()


def test_workspace_has_the_original_fields_and_buffers():
    ws = F.get_workspace(F.MoKConfig(), None, device="cpu", num_local_tokens=T, hidden_size=H,
                         topk=K)  # fmt: skip
    assert (ws.group_name, ws.ep_rank, ws.ep_size) == ("", 0, 1)
    assert (ws.num_local_tokens, ws.hidden_size, ws.topk) == (T, H, K)
    assert ws.schedule_capacity > 0 and ws.device == torch.device("cpu")
    shapes = {
        "x_buffer": (T, H),
        "combine_buffer": (T * K, H),
        "d_y_buffer": (T, H),
        "d_x_routed_buffer": (T * K, H),
        "router_weight_buffer": (T, K),
        "d_router_weight_buffer": (T, K),
        "all_gather_top_experts_buffer": (1, T, K),
    }
    for name, shape in shapes.items():
        buffer = getattr(ws, name)
        assert tuple(buffer.shape) == shape, name
        assert getattr(ws, f"{name}_ptrs") == [buffer.data_ptr()], name
        assert getattr(ws, f"{name}_handle") is None, name  # plain allocations
    assert ws.barrier_buffer.dtype == torch.int32 and ws.barrier_target.dtype == torch.int32
    # Multicast is never used: the original's pointers exist and are never a live address.
    assert ws.all_gather_top_experts_buffer_multicast_ptr == 0
    assert ws.barrier_buffer_multicast_ptr == 0


def test_validate_workspace_args_raises_what_get_workspace_would():
    config = F.MoKConfig()
    F.validate_workspace_args(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                              topk=K)  # fmt: skip
    with pytest.raises(ValueError, match="hidden_size"):
        F.validate_workspace_args(config, None, device="cpu", num_local_tokens=T, hidden_size=100,
                                  topk=K)  # fmt: skip
    with pytest.raises(ValueError, match="topk"):
        F.validate_workspace_args(config, None, device="cpu", num_local_tokens=T, hidden_size=H,
                                  topk=0)  # fmt: skip
    with pytest.raises(TypeError, match="config"):
        F.validate_workspace_args("config", None, device="cpu", num_local_tokens=T,
                                  hidden_size=H, topk=K)  # fmt: skip


def test_validate_inputs_and_errors_that_are_both_value_and_type_errors():
    inputs = make_inputs(T, H, 128, E, K, seed=2)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    F.validate_inputs(config, ws, schedule, inputs["x"], inputs["router_weights"])
    F.validate_inputs(config, ws, schedule, inputs["x"], inputs["router_weights"],
                      inputs["grad_output"])  # fmt: skip
    wrong_dtype = inputs["x"].float()
    for caught in (ValueError, TypeError, MoKInputError):  # the original raises ValueError here
        with pytest.raises(caught, match=r"x must have dtype torch.bfloat16, got torch.float32"):
            F.validate_inputs(config, ws, schedule, wrong_dtype, inputs["router_weights"])
    with pytest.raises(ValueError, match=r"router_weights must have shape \[64, 2\]"):
        F.validate_inputs(config, ws, schedule, inputs["x"], inputs["router_weights"][:10])
    with pytest.raises(ValueError, match="grad_output"):
        F.validate_inputs(config, ws, schedule, inputs["x"], inputs["router_weights"],
                          inputs["grad_output"][:, :64])  # fmt: skip


def test_epilogue_ops_take_the_original_arguments():
    from mok import ops
    from mok import reference as R

    gen = torch.Generator().manual_seed(3)
    shared = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    slots = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen) + 0.1
    got = ops.fwd_epilogue(y_shared=shared, combine_buffer=slots, topk_weights=w)
    assert torch.equal(got, R.fwd_epilogue(shared, slots, w))
    # The original's two-argument call: k from the shared rows.
    assert torch.equal(ops.bwd_epilogue(shared, slots), R.bwd_epilogue(shared, slots, K))
    assert torch.equal(ops.bwd_epilogue(None, slots, K), R.bwd_epilogue(None, slots, K))
    with pytest.raises(ValueError, match="needs topk when d_x_shared is None"):
        ops.bwd_epilogue(None, slots)


@pytest.mark.parametrize("shape", [(256, 128), (2, 128, 256), (1, 256, 256), (1, 128, 256)])
def test_mxfp8_quantize_returns_the_original_four_tuple(shape):
    from mok import ops
    from mok import reference as R

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x_fp8, x_sc, x_fp8_t, x_sc_t = ops.mxfp8_quantize(x, True, True)
    for (data, scales), transpose in (((x_fp8, x_sc), False), ((x_fp8_t, x_sc_t), True)):
        want_data, want_scales = R.mxfp8_quantize(x, transpose=transpose)
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scales, want_scales)
        # Contiguous, as mok's MXFP8 weight checks (and the original's kernels) take them;
        # a single matrix's transposed data once came back strided.
        assert data.is_contiguous() and want_data.is_contiguous()
    only_t = ops.mxfp8_quantize(x, False, True)
    assert only_t[0] is None and only_t[1] is None and torch.equal(only_t[3], x_sc_t)
    with pytest.raises(ValueError, match="both False"):
        ops.mxfp8_quantize(x, False, False)
    with pytest.raises(ValueError, match="multiples of 128"):
        ops.mxfp8_quantize(x[..., :64], True, False)
