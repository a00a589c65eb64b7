"""The original's API where its own test suite uses it, on the CPU: a MoKWorkspace built from
the original's fields (real CPU tensors, and fake CUDA tensors under FakeTensorMode and
torch.compile, which need no GPU), the barrier's counters, the raw ops' argument checks before
their workspace lookup, the epilogues' top-k range and the workspace cache's reuse rule."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mok import functional, ops
from mok.workspace import ORIGINAL_FIELDS

T, H, I, E, K = 512, 1024, 256, 4, 2
CAPACITY = 4096
CONFIG = functional.MoKConfig(minibatch_size=256, macrobatch_size=512)


def _original_fields(device, *, ep_size: int, pointers: list[int] | None = None) -> dict:
    """The original's workspace fields over new tensors (made-up pointers by default)."""
    pointers = pointers if pointers is not None else list(range(1, ep_size + 1))

    def empty(*shape, dtype=torch.bfloat16):
        return torch.zeros(shape, dtype=dtype, device=device)

    fields = dict(group_name="original-group", ep_rank=0, ep_size=ep_size, device=device,
                  num_local_tokens=T, hidden_size=H, topk=K, schedule_capacity=CAPACITY)  # fmt: skip
    buffers = {
        "x_buffer": empty(T, H),
        "combine_buffer": empty(T * K, H),
        "d_y_buffer": empty(T, H),
        "d_x_routed_buffer": empty(T * K, H),
        "router_weight_buffer": empty(T, K, dtype=torch.float32),
        "d_router_weight_buffer": empty(T, K, dtype=torch.float32),
        "all_gather_top_experts_buffer": empty(ep_size, T, K, dtype=torch.int32),
        "barrier_buffer": empty(1, dtype=torch.int32),
    }
    for name, tensor in buffers.items():
        fields[name], fields[f"{name}_handle"] = tensor, None
        if name != "all_gather_top_experts_buffer":
            fields[f"{name}_ptrs"] = pointers
    fields.update(all_gather_top_experts_buffer_multicast_ptr=7, barrier_buffer_multicast_ptr=7,
                  barrier_target=empty(1, dtype=torch.int32))  # fmt: skip
    return fields


def _fake_workspace(ep_size: int = 4) -> functional.MoKWorkspace:
    """Under an active FakeTensorMode: a workspace of fake CUDA tensors, the original's way."""
    return functional.MoKWorkspace(**_original_fields(torch.device("cuda", 0), ep_size=ep_size))


def _cuda_empty(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=torch.device("cuda", 0))


# ----------------------------------------------------------------------------------------------
# the original's constructor
# ----------------------------------------------------------------------------------------------


def test_constructor_takes_the_original_fields_in_order_and_by_name():
    fields = _original_fields(torch.device("cpu"), ep_size=1, pointers=[11])
    assert list(inspect.signature(functional.MoKWorkspace).parameters) == list(ORIGINAL_FIELDS)
    assert set(fields) == set(ORIGINAL_FIELDS)
    by_name = functional.MoKWorkspace(**fields)
    by_order = functional.MoKWorkspace(*(fields[n] for n in ORIGINAL_FIELDS))
    for ws in (by_name, by_order):
        assert (ws.group_name, ws.ep_rank, ws.ep_size) == ("original-group", 0, 1)
        assert (ws.num_local_tokens, ws.hidden_size, ws.topk) == (T, H, K)
        assert ws.schedule_capacity == CAPACITY and ws.caller_buffers
        assert ws.x_buffer is fields["x_buffer"] and ws.x_buffer_ptrs == [11]
        assert ws.barrier_target is fields["barrier_target"]
        assert ws.barrier_buffer_multicast_ptr == 7
        assert ws.all_gather_top_experts_buffer_multicast_ptr == 7
        assert ws.combine_buffer_handle is None
    with pytest.raises(TypeError, match="unexpected keyword argument 'group'"):
        functional.MoKWorkspace(**fields, group=None)
    del fields["barrier_target"]
    with pytest.raises(TypeError, match="barrier_target"):
        functional.MoKWorkspace(**fields)


def test_a_caller_built_workspace_runs_the_raw_ops_at_ep_size_one():
    ws = functional.MoKWorkspace(**_original_fields(torch.device("cpu"), ep_size=1, pointers=[3]))
    routing = torch.arange(T * K, dtype=torch.int32).remainder(E).view(T, K)
    ops.all_gather_top_experts(routing, ws.all_gather_top_experts_buffer,
                               ws.all_gather_top_experts_buffer_multicast_ptr, 0, 2048)  # fmt: skip
    assert torch.equal(ws.all_gather_top_experts_buffer[0], routing)
    ops.barrier_all(ws.barrier_buffer, ws.barrier_buffer_ptrs, ws.barrier_buffer_multicast_ptr,
                    ws.barrier_target)  # fmt: skip
    assert ws.barrier_buffer.tolist() == [1] and ws.barrier_target.tolist() == [1]
    peer_rank, _, num_tokens, tokens_per_expert = ops.schedule(
        ws.all_gather_top_experts_buffer, E, ws.schedule_capacity, 0
    )
    assert tokens_per_expert.tolist() == [256] * E and num_tokens.item() == T * K
    assert int((peer_rank == 0).sum()) == T * K


def test_a_caller_built_ep_group_workspace_is_refused_for_a_real_run():
    ws = functional.MoKWorkspace(**_original_fields(torch.device("cpu"), ep_size=2))
    with pytest.raises(ValueError, match="runs only with ep_size 1"):
        ops.barrier_all(ws.barrier_buffer, ws.barrier_buffer_ptrs, 7, ws.barrier_target)


# ----------------------------------------------------------------------------------------------
# fake tensors: the raw ops' metadata with a fake EP group of four
# ----------------------------------------------------------------------------------------------


def test_raw_ops_give_metadata_for_a_fake_workspace_of_the_original_fields():
    with FakeTensorMode():
        ws = _fake_workspace(ep_size=4)
        pointers = ws.x_buffer_ptrs
        top_experts = _cuda_empty(T, K, dtype=torch.int32)
        assert (ops.all_gather_top_experts(top_experts, ws.all_gather_top_experts_buffer,
                                           ws.all_gather_top_experts_buffer_multicast_ptr, 0,
                                           1024) is None)  # fmt: skip
        assert (ops.barrier_all(ws.barrier_buffer, pointers, ws.barrier_buffer_multicast_ptr,
                                ws.barrier_target) is None)  # fmt: skip
        schedule = ops.schedule(ws.all_gather_top_experts_buffer, E, CAPACITY, 0)
        assert [tuple(t.shape) for t in schedule] == [(CAPACITY,), (CAPACITY,), (1,), (E,)]
        assert all(t.dtype == torch.int32 and t.device.type == "cuda" for t in schedule)

        x = _cuda_empty(T, H)
        shared = (_cuda_empty(I, H), _cuda_empty(I, H), _cuda_empty(H, I))
        routed = (_cuda_empty(E, I, H), _cuda_empty(E, I, H), _cuda_empty(E, H, I))
        launch = (K, None, 2, 512, 256)
        fwd = ops.dispatch_mlp_swiglu_combine_fwd_bf16(
            x, pointers, ws.combine_buffer, pointers, shared[0], routed[0], shared[1],
            routed[1], shared[2], routed[2], *schedule, *launch,
        )  # fmt: skip
        # mok's routed context rows number the capacity (README: Differences from the original).
        assert [tuple(t.shape) for t in fwd] == [
            (CAPACITY, H), (T, I), (CAPACITY, I), (T, I), (CAPACITY, I), (T, I), (CAPACITY, I),
            (T, H), (0,),
        ]  # fmt: skip
        out = ops.fwd_epilogue(fwd[-2], ws.combine_buffer, ws.router_weight_buffer)
        assert tuple(out.shape) == (T, H) and out.device.type == "cuda"
        bwd = ops.dispatch_mlp_swiglu_combine_bwd_bf16(
            ws.d_y_buffer, pointers, ws.d_x_routed_buffer, pointers, ws.router_weight_buffer,
            pointers, ws.d_router_weight_buffer, pointers, shared[0], routed[0], shared[1],
            routed[1], shared[2], routed[2], *fwd[:7], x, pointers, *schedule, *launch,
        )  # fmt: skip
        assert tuple(bwd[0].shape) == (T, H)
        assert [tuple(t.shape) for t in bwd[-6:]] == [
            (I, H), (E, I, H), (I, H), (E, I, H), (H, I), (E, H, I),
        ]  # fmt: skip
        d_x = ops.bwd_epilogue(bwd[0], ws.d_x_routed_buffer)
        assert tuple(d_x.shape) == (T, H)

        quantised = [ops.mxfp8_quantize(w, True, True) for w in routed]
        mx_fwd = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(
            x, pointers, ws.combine_buffer, pointers, shared[0], *quantised[0][:2], shared[1],
            *quantised[1][:2], shared[2], *quantised[2][:2], *schedule, *launch,
        )  # fmt: skip
        assert tuple(mx_fwd[0].shape) == (H, CAPACITY) and mx_fwd[0].dtype == torch.float8_e4m3fn
        mx_bwd = ops.dispatch_mlp_swiglu_combine_bwd_mxfp8(
            ws.d_y_buffer, pointers, ws.d_x_routed_buffer, pointers, ws.router_weight_buffer,
            pointers, ws.d_router_weight_buffer, pointers, shared[0], *quantised[0][2:],
            shared[1], *quantised[1][2:], shared[2], *quantised[2][2:], *mx_fwd[:11], x,
            pointers, *quantised[0][:2], *quantised[1][:2], *schedule, *launch,
        )  # fmt: skip
        assert [tuple(t.shape) for t in mx_bwd[-6:]] == [
            (I, H), (E, I, H), (I, H), (E, I, H), (H, I), (E, H, I),
        ]  # fmt: skip


def test_functional_step_over_a_fake_workspace_compiles_to_one_graph():
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph_module, _example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    with FakeTensorMode():
        ws = _fake_workspace(ep_size=4)

        def step(x, top_experts, router_weights, grad_output, *weights):
            schedule = functional.build_schedule(ws, CONFIG, top_experts, num_local_experts=E)
            out, ctx = functional.forward(CONFIG, ws, schedule, x, router_weights, *weights)
            grads = functional.backward(CONFIG, ws, schedule, ctx, grad_output, x,
                                        router_weights, *weights)  # fmt: skip
            return out, *grads

        args = (_cuda_empty(T, H), _cuda_empty(T, K, dtype=torch.int64),
                _cuda_empty(T, K, dtype=torch.float32), _cuda_empty(T, H), _cuda_empty(I, H),
                _cuda_empty(I, H), _cuda_empty(H, I), _cuda_empty(E, I, H), _cuda_empty(E, I, H),
                _cuda_empty(E, H, I))  # fmt: skip
        torch._dynamo.reset()
        try:
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            outputs = compiled(*args)
            compiled(*args)
        finally:
            torch._dynamo.reset()
    assert len(graphs) == 1
    expected = [(T, H), (T, H), (T, K), (E, I, H), (E, I, H), (E, H, I), (I, H), (I, H), (H, I)]
    assert [tuple(t.shape) for t in outputs] == expected
    assert all(t.device.type == "cuda" for t in outputs)


# ----------------------------------------------------------------------------------------------
# the barrier's counters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_barrier_counts_arrivals_in_buffer_and_target(compiled):
    ws = functional.create_workspace(CONFIG, None, device="cpu", num_local_tokens=T,
                                     hidden_size=256, topk=1)  # fmt: skip

    def barrier():
        ops.barrier_all(ws.barrier_buffer, ws.barrier_buffer_ptrs,
                        ws.barrier_buffer_multicast_ptr, ws.barrier_target)  # fmt: skip

    try:
        assert tuple(ws.barrier_target.shape) == (1,) and ws.barrier_target.dtype == torch.int32
        assert ws.barrier_buffer.item() == 0 and ws.barrier_target.item() == 0
        torch._dynamo.reset()
        run = torch.compile(barrier, backend="inductor", fullgraph=True) if compiled else barrier
        run()
        run()
        # Two barriers of a group of one: 2 * ep_size, as the original's counters hold.
        assert ws.barrier_buffer.item() == 2 * ws.ep_size
        assert ws.barrier_target.item() == 2 * ws.ep_size
    finally:
        torch._dynamo.reset()
        ws.destroy()


# ----------------------------------------------------------------------------------------------
# the dispatch ops' size checks come before the workspace lookup
# ----------------------------------------------------------------------------------------------


def _forward_over_made_up_pointers(hidden: int, inter: int, num_comm_sms: int) -> None:
    """The BF16 forward op on fake CUDA tensors and pointers no workspace has (not the small
    integers other tests build fake workspaces over, which may still be alive)."""
    pointers = [0x7E57_0000 + 0x100 * i for i in range(4)]
    ops.dispatch_mlp_swiglu_combine_fwd_bf16(
        _cuda_empty(T, hidden), pointers, _cuda_empty(T * K, hidden), pointers,
        _cuda_empty(inter, hidden), _cuda_empty(1, inter, hidden), _cuda_empty(inter, hidden),
        _cuda_empty(1, inter, hidden), _cuda_empty(hidden, inter), _cuda_empty(1, hidden, inter),
        _cuda_empty(CAPACITY, dtype=torch.int32), _cuda_empty(CAPACITY, dtype=torch.int32),
        _cuda_empty(1, dtype=torch.int32), _cuda_empty(1, dtype=torch.int32),
        K, None, num_comm_sms, 512, 256,
    )  # fmt: skip


@pytest.mark.parametrize("hidden, inter", [(7168, 2048), (2048, 768), (1280, 1280)])
def test_an_odd_num_comm_sms_is_named_before_the_workspace_is_looked_up(hidden, inter):
    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"num_comm_sms must be a multiple of 2, got 1"):
            _forward_over_made_up_pointers(hidden, inter, num_comm_sms=1)
        # Sizes fine: then the pointer lists are looked up.
        with pytest.raises(ValueError, match=r"x_ptrs must be the x_buffer_ptrs of a live"):
            _forward_over_made_up_pointers(hidden, inter, num_comm_sms=2)


@pytest.mark.parametrize(
    "hidden, inter, message",
    [
        (640, 640, r"hidden_size \(x.shape\[1\]\) must be a positive multiple of 256 on the GPU"),
        (1920, 1920, r"hidden_size .* got 1920"),
        (128, 256, r"hidden_size .* got 128"),
        (0, 256, r"hidden_size .* got 0"),
        (256, 0, r"intermediate_size \(w_routed_gate.shape\[1\]\) must be a positive multiple"),
    ],
)
def test_unsupported_sizes_are_named_before_the_workspace_is_looked_up(hidden, inter, message):
    with FakeTensorMode():
        with pytest.raises(ValueError, match=message):
            _forward_over_made_up_pointers(hidden, inter, num_comm_sms=2)


def test_the_cpu_path_takes_hidden_sizes_of_128():
    # The 256 alignment is the sm_90a GEMMs': CPU tensors get as far as the workspace lookup.
    x, pointers = torch.zeros(T, 640, dtype=torch.bfloat16), [1, 2]
    weights = (torch.zeros(640, 640, dtype=torch.bfloat16), torch.zeros(1, 640, 640,
               dtype=torch.bfloat16))  # fmt: skip
    with pytest.raises(ValueError, match=r"x_ptrs must be the x_buffer_ptrs of a live"):
        ops.dispatch_mlp_swiglu_combine_fwd_bf16(
            x, pointers, torch.zeros(T * K, 640, dtype=torch.bfloat16), pointers, *weights,
            *weights, *weights, torch.zeros(CAPACITY, dtype=torch.int32),
            torch.zeros(CAPACITY, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), K, None, 2, 512, 256,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the epilogues' argument checks
# ----------------------------------------------------------------------------------------------


def _epilogue_inputs(topk: int):
    gen = torch.Generator().manual_seed(topk)
    shared = torch.randn(T, 256, generator=gen).to(torch.bfloat16)
    slots = torch.randn(T * topk, 256, generator=gen).to(torch.bfloat16)
    return shared, slots, torch.rand(T, topk, generator=gen) + 0.1


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s, c, w: (s, c[:0], w[:, :0]),
            r"topk must be in \[1, 255\] \(fwd_epilogue\), got 0",
        ),
        (lambda s, c, w: (s, c, w.new_empty(T, 256)), r"topk must be in \[1, 255\].* got 256"),
        (lambda s, c, w: (s.unsqueeze(0), c, w), r"y_shared must have shape \[512, 256\]"),
        (lambda s, c, w: (s[:256], c, w), r"y_shared must have shape \[512, 256\]"),
        (lambda s, c, w: (s[:, :128], c, w), r"y_shared must have shape \[512, 256\]"),
        (lambda s, c, w: (s, c[:-1], w), r"combine_buffer must have shape \[28160, 256\]"),
    ],
    ids=["topk-0", "topk-256", "shared-rank", "shared-tokens", "shared-hidden", "slots"],
)
def test_fwd_epilogue_raises_value_error_on_every_path(change, message):
    shared, slots, weights = change(*_epilogue_inputs(55))
    with pytest.raises(ValueError, match=message):
        ops.fwd_epilogue(shared, slots, weights)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=message):
        ops.fwd_epilogue(shared, slots, weights)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s, c: (s, c[:0]), r"topk must be in \[1, 255\] \(bwd_epilogue\), got 0"),
        (lambda s, c: (s.unsqueeze(0), c), r"topk must be in \[1, 255\].* got 28160"),
        (lambda s, c: (s, c.flatten()), r"topk must be in \[1, 255\]"),
        (lambda s, c: (s[:, :128], c), r"d_x_shared must have shape \[512, 256\]"),
        (lambda s, c: (s, c[:-1]), r"must be a multiple of the tokens of d_x_shared \(512\)"),
    ],
    ids=["topk-0", "shared-rank", "slots-rank", "shared-hidden", "slots"],
)
def test_bwd_epilogue_raises_value_error_on_every_path(change, message):
    shared, slots = change(*_epilogue_inputs(55)[:2])
    with pytest.raises(ValueError, match=message):
        ops.bwd_epilogue(shared, slots)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=message):
        ops.bwd_epilogue(shared, slots)


def test_epilogues_take_any_token_count_and_top_k_up_to_255():
    from mok import reference

    shared, slots, weights = _epilogue_inputs(255)
    assert torch.equal(ops.fwd_epilogue(shared, slots, weights),
                       reference.fwd_epilogue(shared, slots, weights))  # fmt: skip
    # mok takes any T >= 1 (README: Differences from the original); the original asks for
    # T >= 512: these 256 tokens of k = 110 are a valid call here.
    assert torch.equal(ops.bwd_epilogue(shared[:256], slots[: 256 * 110]),
                       reference.bwd_epilogue(shared[:256], slots[: 256 * 110], 110))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the workspace cache: reuse and isolation
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path):
    """torch.distributed's default group, of this process alone (gloo), and a second group of
    the same rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD, dist.new_group(ranks=[0])
    finally:
        functional.clear_workspace_cache()
        dist.destroy_process_group()


def test_cache_reuses_by_capacity_and_isolates_groups(world_of_one):
    world, duplicate = world_of_one
    shapes = dict(device="cpu", num_local_tokens=T, hidden_size=256, topk=1)
    larger = functional.MoKConfig(minibatch_size=256, macrobatch_size=512,
                                  schedule_capacity_multiplier=3.0)  # fmt: skip
    equal = functional.MoKConfig(minibatch_size=256, macrobatch_size=512,
                                 schedule_capacity_multiplier=1.5)  # fmt: skip
    created = functional.create_workspace(CONFIG, world, **shapes)
    try:
        default = functional.get_workspace(CONFIG, world, **shapes)
        assert created is not default  # create_workspace is never cached
        assert functional.get_workspace(CONFIG, world, **shapes) is default
        # The original's capacity, T * k * max(2, ceil(P * multiplier)), keys the cache: a
        # multiplier of 3 at P = 1 is a larger schedule, one of 1.5 the same (the original's
        # key holds that factor, 2 for both 0.5 and 1.5 at P = 1).
        assert default.schedule_capacity == T * 2
        larger_ws = functional.get_workspace(larger, world, **shapes)
        assert larger_ws is not default and larger_ws.schedule_capacity == T * 3
        assert functional.get_workspace(equal, world, **shapes) is default
        other_group = functional.get_workspace(CONFIG, duplicate, **shapes)
        assert other_group is not default
        assert other_group.group_name == duplicate.group_name != default.group_name
    finally:
        created.destroy()


# ----------------------------------------------------------------------------------------------
# MoKConfig: made with any values, checked where it is used
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(fwd_num_comm_sms=1), "fwd_num_comm_sms"),
        (dict(bwd_num_comm_sms=1), "bwd_num_comm_sms"),
        (dict(minibatch_size=128, macrobatch_size=256), "minibatch_size"),
        (dict(minibatch_size=256, macrobatch_size=384), "macrobatch_size"),
        (dict(all_gather_top_experts_chunk_bytes=15), "all_gather_top_experts_chunk_bytes"),
    ],
    ids=["fwd-sms", "bwd-sms", "minibatch", "macrobatch", "chunk"],
)
def test_a_bad_config_is_made_freely_and_refused_by_build_schedule(bad, field):
    # A list of bad configs built up front, then each passed to build_schedule inside its own
    # try: the original raises at that call, never where the config is made.
    config = functional.MoKConfig(**(dict(minibatch_size=256, macrobatch_size=256) | bad))
    ws = functional.create_workspace(CONFIG, None, device="cpu", num_local_tokens=T,
                                     hidden_size=256, topk=1)  # fmt: skip
    try:
        top_experts = torch.zeros(T, 1, dtype=torch.int64)
        with pytest.raises(ValueError, match=field):
            functional.build_schedule(ws, config, top_experts, num_local_experts=1)
        # The workspace is untouched: the good config still builds a schedule on it.
        schedule = functional.build_schedule(ws, CONFIG, top_experts, num_local_experts=1)
        assert int(schedule.num_tokens.item()) >= T
    finally:
        ws.destroy()


# ----------------------------------------------------------------------------------------------
# the all-gather's checks that need no workspace come first
# ----------------------------------------------------------------------------------------------


def _routing_workspace(topk: int = 1):
    return functional.create_workspace(CONFIG, None, device="cpu", num_local_tokens=T,
                                       hidden_size=256, topk=topk)  # fmt: skip


def test_all_gather_names_a_buffer_of_the_wrong_dtype_as_a_type_error():
    ws = _routing_workspace()
    try:
        # A converted copy is held by no workspace: its dtype is the error, not the lookup.
        with pytest.raises(TypeError, match="all_gather_top_experts_buffer must have dtype"):
            ops.all_gather_top_experts(torch.zeros(T, 1, dtype=torch.int32),
                                       ws.all_gather_top_experts_buffer.to(torch.int64),
                                       ws.all_gather_top_experts_buffer_multicast_ptr, 0, 16)  # fmt: skip
    finally:
        ws.destroy()


@pytest.mark.parametrize("chunk", [48, 1024 + 16])
def test_a_chunk_that_does_not_divide_the_routes_is_refused(chunk):
    # 512 tokens * top-1 * 4 bytes = 2048 route bytes: 48 and 1040 leave a ragged last chunk.
    ws = _routing_workspace()
    top_experts = torch.zeros(T, 1, dtype=torch.int64)
    try:
        with pytest.raises(ValueError, match="must divide one rank's route bytes"):
            ops.all_gather_top_experts(top_experts.to(torch.int32),
                                       ws.all_gather_top_experts_buffer,
                                       ws.all_gather_top_experts_buffer_multicast_ptr, 0, chunk)  # fmt: skip
        config = functional.MoKConfig(minibatch_size=256, macrobatch_size=512,
                                      all_gather_top_experts_chunk_bytes=chunk)  # fmt: skip
        with pytest.raises(ValueError, match="must divide one rank's route bytes"):
            functional.build_schedule(ws, config, top_experts, num_local_experts=1)
        # A dividing chunk runs, and a token count the original refuses takes any chunk.
        ops.all_gather_top_experts(top_experts.to(torch.int32), ws.all_gather_top_experts_buffer,
                                   ws.all_gather_top_experts_buffer_multicast_ptr, 0, 512)  # fmt: skip
    finally:
        ws.destroy()
    small = functional.create_workspace(CONFIG, None, device="cpu", num_local_tokens=100,
                                        hidden_size=256, topk=1)  # fmt: skip
    try:
        config = functional.MoKConfig(minibatch_size=256, macrobatch_size=512,
                                      all_gather_top_experts_chunk_bytes=chunk)  # fmt: skip
        functional.build_schedule(small, config, torch.zeros(100, 1, dtype=torch.int64),
                                  num_local_experts=1)  # fmt: skip
    finally:
        small.destroy()
