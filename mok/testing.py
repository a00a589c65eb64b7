"""Helpers shared by the tests, `python -m mok` and the benchmarks: random MoE problems and the
error bound every float result is held to.

The bound (DESIGN §5): a result's error against an fp64 oracle may be at most
`BF16_ERROR_FACTOR` times the error of the same computation done by PyTorch in bf16, plus a
small absolute floor; NaN never passes.
"""

from __future__ import annotations

import torch

BF16_ERROR_FACTOR = 2.0
ERROR_FLOOR = 1e-6
ROUTINGS = ("random", "one_expert", "empty_experts", "first_experts")


def make_routing(
    num_tokens: int, num_experts: int, topk: int, routing: str, generator: torch.Generator
) -> torch.Tensor:
    """Global expert ids int64 [T, k], distinct per token, on the generator's device.

    random: top-k of random logits. one_expert: expert 0 is every token's first choice (all
    tokens reach it). empty_experts: only the first half of the experts are ever chosen.
    first_experts: every token picks experts 0..k-1 (with k = E, every expert gets every token).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    on = generator.device
    logits = torch.randn(num_tokens, num_experts, generator=generator, device=on)
    if routing == "one_expert":
        logits[:, 0] = 1e9
    elif routing == "empty_experts":
        if topk > num_experts // 2:
            raise ValueError(f"empty_experts routing needs topk <= {num_experts // 2}, got {topk}")
        logits[:, num_experts // 2 :] = -1e9
    elif routing == "first_experts":
        logits = -torch.arange(num_experts, dtype=torch.float32, device=on)
        logits = logits.expand(num_tokens, -1).clone()
    return logits.topk(topk, dim=-1).indices.contiguous()


def make_inputs(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    topk: int,
    *,
    shared: bool = False,
    routing: str = "random",
    seed: int = 0,
    device: torch.device | str = "cpu",
    generate_on_device: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Random bf16 inputs of one MoE layer (weights scaled to keep activations O(1)), drawn
    on the CPU and moved to `device`, so a seed gives the same values on every device.
    `generate_on_device`: drawn on `device` by its own generator instead (other values; fast on
    a GPU for the coarse shapes' billions of weights)."""
    on = torch.device(device) if generate_on_device else torch.device("cpu")
    gen = torch.Generator(device=on).manual_seed(seed)
    t, h, i, e = num_tokens, hidden_size, intermediate_size, num_experts

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=on) / shape[-1] ** 0.5).to(torch.bfloat16)

    probs = torch.rand(t, topk, generator=gen, device=on) + 0.05
    inputs = {
        "x": torch.randn(t, h, generator=gen, device=on).to(torch.bfloat16),
        "router_weights": probs / probs.sum(dim=1, keepdim=True),
        "top_experts": make_routing(t, e, topk, routing, gen),
        "routed_gate": w(e, i, h),
        "routed_up": w(e, i, h),
        "routed_down": w(e, h, i),
        "shared_gate": w(i, h) if shared else None,
        "shared_up": w(i, h) if shared else None,
        "shared_down": w(h, i) if shared else None,
        "grad_output": torch.randn(t, h, generator=gen, device=on).to(torch.bfloat16),
    }
    return {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}


WEIGHT_NAMES = (
    "shared_gate",
    "shared_up",
    "shared_down",
    "routed_gate",
    "routed_up",
    "routed_down",
)


def run_layer(inputs: dict, num_experts: int, config=None, swiglu_limit=None, main_grads=None):
    """One forward and backward through `mok.functional` of a layer made by `make_inputs`,
    then `check_errors` (which syncs). Returns (out, context, grads, schedule)."""
    from mok import functional as F  # noqa: PLC0415

    config = F.MoKConfig() if config is None else config
    t, h = inputs["x"].shape
    ws = F.get_workspace(config, None, device=inputs["x"].device, num_local_tokens=t,
                         hidden_size=h, topk=inputs["top_experts"].shape[1],
                         num_local_experts=num_experts)  # fmt: skip
    result = _layer_step(config, ws, inputs, num_experts, swiglu_limit, main_grads)
    F.check_errors(ws)
    return result


def rank_inputs(inputs: dict, rank: int, size: int) -> dict:
    """Rank `rank`'s share of a global layer made by `make_inputs` in an EP group of `size`:
    tokens split contiguously, the routed experts split contiguously (rank p owns experts
    p * E / P ..), the shared expert on every rank. Routing ids stay global."""
    num_tokens, num_experts = inputs["x"].shape[0], inputs["routed_gate"].shape[0]
    if num_tokens % size or num_experts % size:
        raise ValueError(
            f"tokens ({num_tokens}) and experts ({num_experts}) must split evenly over {size} ranks"
        )
    tokens = slice(rank * num_tokens // size, (rank + 1) * num_tokens // size)
    experts = slice(rank * num_experts // size, (rank + 1) * num_experts // size)
    local = {}
    for name, value in inputs.items():
        if value is None or name.startswith("shared_"):
            local[name] = value
        elif name.startswith("routed_"):
            local[name] = value[experts]
        else:
            local[name] = value[tokens]
    return local


def run_layer_step(config, ws, inputs: dict, num_local_experts: int, swiglu_limit=None,
                   main_grads=None):  # fmt: skip
    """Schedule, forward and backward of one rank through `mok.functional`, with no host sync
    (usable inside a VirtualEPGroup's `run`): (out, context, 8 gradients). `main_grads`: as
    `mok.functional.backward` takes them."""
    return _layer_step(config, ws, inputs, num_local_experts, swiglu_limit, main_grads)[:3]


def _layer_step(config, ws, inputs, num_local_experts, swiglu_limit, main_grads=None):
    """(out, context, grads, schedule) of one schedule + forward + backward, no sync."""
    from mok import functional as F  # noqa: PLC0415

    weights = [inputs[n] for n in WEIGHT_NAMES]
    x, router_weights = inputs["x"], inputs["router_weights"]
    schedule = F.build_schedule(ws, config, inputs["top_experts"],
                                num_local_experts=num_local_experts)  # fmt: skip
    out, ctx = F.forward(config, ws, schedule, x, router_weights, *weights,
                         swiglu_limit=swiglu_limit)  # fmt: skip
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], x, router_weights,
                       *weights, swiglu_limit=swiglu_limit, main_grads=main_grads)  # fmt: skip
    return out, ctx, grads, schedule


def virtual_group_step(config, inputs: dict, num_experts: int, size: int, swiglu_limit=None):
    """One training step of a global layer (`make_inputs`) on a virtual EP group of `size`
    ranks on the current GPU (mok.virtual_ep): (per rank (out, 8 gradients), the workspaces),
    every rank's value-status words checked."""
    from mok import functional as F  # noqa: PLC0415
    from mok.virtual_ep import VirtualEPGroup  # noqa: PLC0415

    group = VirtualEPGroup(size)
    t, h = inputs["x"].shape
    spaces = group.workspaces(config, num_local_tokens=t // size, hidden_size=h,
                              topk=inputs["top_experts"].shape[1],
                              num_local_experts=num_experts // size)  # fmt: skip
    shards = [rank_inputs(inputs, rank, size) for rank in range(size)]
    results = group.run(
        lambda rank: run_layer_step(
            config, spaces[rank], shards[rank], num_experts // size, swiglu_limit=swiglu_limit
        )
    )
    group.join()
    for ws in spaces:
        F.check_errors(ws)
    return [(out, *grads) for out, _, grads in results], spaces


def context_values(ctx, rows: int | None = None) -> tuple:
    """A forward context's 7 fields as bf16 tensors (an MXFP8 context's pairs dequantised,
    exact), the routed ones cut to their first `rows` rows (the contract's) if given."""
    from .mxfp8_context import dequantised_context, flat, is_quantised  # noqa: PLC0415

    if is_quantised(ctx):
        ctx = dequantised_context(flat(ctx, ctx.x_routed[0]))
    fields = ctx.tensors()
    if rows is None:
        return fields
    return tuple(t[:rows] if i < 4 else t for i, t in enumerate(fields))


def poison_cuda_allocator(nbytes: int = 1 << 28) -> None:
    """Fill a block of torch's CUDA caching allocator with 0xFF bytes and free it, so that the
    next `torch.empty` outputs of that size start as NaN (0xFFFF is a bf16 NaN, 0xFFFFFFFF an
    fp32 NaN, 0xFF an E4M3 NaN): an output a kernel does not write shows up."""
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block


def rel_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """||got - truth|| / ||truth|| in fp64 (inf if got has a NaN)."""
    got64, truth64 = got.double().cpu(), truth.double().cpu()
    if not torch.isfinite(got64).all():
        return float("inf")
    denom = truth64.norm().item()
    diff = (got64 - truth64).norm().item()
    return diff / denom if denom > 0 else diff


def within_bf16_bound(
    got: torch.Tensor, truth: torch.Tensor, bf16: torch.Tensor
) -> tuple[bool, float, float]:
    """(ok, error of got, error of PyTorch's bf16 computation), both against the fp64 truth."""
    err, base = rel_error(got, truth), rel_error(bf16, truth)
    return err <= BF16_ERROR_FACTOR * base + ERROR_FLOOR, err, base


# The 9 results of a forward + backward (out, then mok.functional.backward's 8), and the name
# of each in mok.reference.naive_moe_with_grads' gradient dict (None: the forward output).
OUTPUT_NAMES = (
    "out", "d_x", "d_router_weights", "d_routed_gate", "d_routed_up", "d_routed_down",
    "d_shared_gate", "d_shared_up", "d_shared_down",
)  # fmt: skip
NAIVE_NAMES = (
    None, "x", "router_weights", "routed_gate", "routed_up", "routed_down",
    "shared_gate", "shared_up", "shared_down",
)  # fmt: skip


def oracle_errors(
    results, inputs: dict, *, swiglu_limit=None
) -> list[tuple[str, bool, float, float]]:
    """(name, ok, error, PyTorch bf16 error) of each non-None result of a forward + backward
    (`results` in OUTPUT_NAMES order) against the fp64 autograd oracle on `inputs`' CPU copies."""
    from . import reference  # noqa: PLC0415

    cpu = {n: (v.cpu() if v is not None else None) for n, v in inputs.items()}
    truth_out, truth_grads = reference.naive_moe_with_grads(
        cpu, cpu["grad_output"], swiglu_limit=swiglu_limit
    )
    bf16_out, bf16_grads = reference.naive_moe_with_grads(
        cpu, cpu["grad_output"], swiglu_limit=swiglu_limit, dtype=torch.bfloat16
    )
    rows = []
    for name, naive_name, got in zip(OUTPUT_NAMES, NAIVE_NAMES, results, strict=True):
        if got is None:
            continue
        truth = truth_out if naive_name is None else truth_grads[naive_name]
        bf16 = bf16_out if naive_name is None else bf16_grads[naive_name]
        rows.append((name, *within_bf16_bound(got, truth, bf16)))
    return rows
