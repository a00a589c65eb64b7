"""FLOPs, bytes and the roofline floor of one MoE layer pass on one GPU.

The floor of a forward or a backward is the larger of its FLOPs over the sustained bf16 GEMM
rate and its bytes over the copy bandwidth (bytes read + written), both measured in the same
run (benchmarks/timing.py): no implementation of the pass can be faster on that device. A
forward + backward's floor is the forward's plus the backward's.

The bytes are the least every implementation must move through device memory, each counted
once: the local experts' weights (gate, up, down; + the shared expert's with ``--shared``),
read in the forward and again in the backward, their gradients written by the backward (bf16,
like the weights), and the activations in and out: x, the router weights (fp32) and the expert
ids (int64) read and out written in the forward; dY, x (the gate and up gradients need it) and
the routing read, d_x and d_router_weights written in the backward. With EP, the floor is one
rank's: its T tokens and its E / P experts (the traffic to and from peers is not in it).

Reported beside the floor, never in it: the forward context mok keeps for its backward, x_routed,
gate, up and hidden of every routed row in bf16 (2H + 6I bytes a row). An implementation that
recomputes instead of saving does not move those bytes; one that saves them does, both ways.
"""

from __future__ import annotations

from benchmarks.shapes import RunShape

BF16_BYTES = 2
ROUTER_WEIGHT_BYTES = 4  # fp32, as every implementation gets them (SEMANTICS.md §1)
EXPERT_ID_BYTES = 8  # int64
# FLOPs of a pass in units of the forward's: backward = d_x and d_weight GEMMs = 2x forward.
PASS_FLOP_FACTOR = {"fwd": 1, "fwdbwd": 3, "bwd": 2}


def flops(shape: RunShape, num_tokens: int, shared: bool, pass_name: str) -> float:
    """2 * T * k * 3HI per forward (+ 2 * T * 3HI with a shared expert), times the pass factor."""
    per_token = shape.topk + (1 if shared else 0)
    forward = 2 * num_tokens * per_token * 3 * shape.hidden_size * shape.intermediate_size
    return forward * PASS_FLOP_FACTOR[pass_name]


def weight_bytes(shape: RunShape, shared: bool) -> int:
    """bf16 bytes of this rank's gate, up and down weights (and the shared expert's)."""
    experts = shape.experts_per_rank + (1 if shared else 0)
    return experts * 3 * shape.hidden_size * shape.intermediate_size * BF16_BYTES


def pass_bytes(shape: RunShape, num_tokens: int, shared: bool, pass_name: str) -> dict[str, int]:
    """The bytes one forward (``fwd``) or one backward (``bwd``) must move, by what they are."""
    activation = num_tokens * shape.hidden_size * BF16_BYTES
    routing = {
        "router_weights_read": num_tokens * shape.topk * ROUTER_WEIGHT_BYTES,
        "expert_ids_read": num_tokens * shape.topk * EXPERT_ID_BYTES,
    }
    weights = weight_bytes(shape, shared)
    if pass_name == "fwd":
        return {"weights_read": weights, "x_read": activation, "out_written": activation,
                **routing}  # fmt: skip
    if pass_name == "bwd":
        return {
            "weights_read": weights,
            "weight_grads_written": weights,
            "grad_output_read": activation,
            "x_read": activation,
            "d_x_written": activation,
            **routing,
            "d_router_weights_written": num_tokens * shape.topk * ROUTER_WEIGHT_BYTES,
        }
    raise ValueError(f"pass_name: expected 'fwd' or 'bwd', got {pass_name!r}")


def saved_context_bytes(shape: RunShape, num_tokens: int) -> int:
    """bf16 bytes of mok's forward context: x_routed, gate, up, hidden per routed row."""
    per_row = (shape.hidden_size + 3 * shape.intermediate_size) * BF16_BYTES
    return num_tokens * shape.topk * per_row


def _one_floor(shape, num_tokens, shared, pass_name, gemm_tflops, copy_gbs) -> dict:
    num_bytes = pass_bytes(shape, num_tokens, shared, pass_name)
    work = flops(shape, num_tokens, shared, pass_name)
    total = sum(num_bytes.values())
    compute_ms = work / (gemm_tflops * 1e12) * 1e3
    memory_ms = total / (copy_gbs * 1e9) * 1e3
    return {
        "ms": max(compute_ms, memory_ms),
        "bound": "compute" if compute_ms >= memory_ms else "memory",
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
        "flops": work,
        "bytes": num_bytes,
        "bytes_total": total,
    }


def pass_floor(
    shape: RunShape, num_tokens: int, shared: bool, pass_name: str, ceilings: dict
) -> dict | None:
    """The floor of one pass against this run's ceilings (``None`` where one was not measured).

    ``ms`` is the floor; ``bytes`` lists what it counts and ``saved_context_bytes`` what it does
    not. A ``fwdbwd`` floor holds its ``fwd`` and ``bwd`` parts, its bytes summed by name.
    """
    gemm_tflops = ceilings.get("gemm_bf16_sustained_tflops")
    copy_gbs = ceilings.get("copy_gbs")
    if not gemm_tflops or not copy_gbs:
        return None
    context = saved_context_bytes(shape, num_tokens)
    if pass_name != "fwdbwd":
        floor = _one_floor(shape, num_tokens, shared, pass_name, gemm_tflops, copy_gbs)
        return {**floor, "saved_context_bytes": context}
    parts = {p: _one_floor(shape, num_tokens, shared, p, gemm_tflops, copy_gbs)
             for p in ("fwd", "bwd")}  # fmt: skip
    summed: dict[str, int] = {}
    for part in parts.values():
        for name, value in part["bytes"].items():
            summed[name] = summed.get(name, 0) + value
    return {
        "ms": parts["fwd"]["ms"] + parts["bwd"]["ms"],
        "flops": parts["fwd"]["flops"] + parts["bwd"]["flops"],
        "bytes": summed,
        "bytes_total": sum(summed.values()),
        "saved_context_bytes": context,
        "parts": parts,
    }
