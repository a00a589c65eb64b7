"""Seeded random inputs of one MoE layer call: tokens, synthetic routing, weights, grad_output.

Every rank draws the inputs of the whole EP group from the same seed and keeps its own slice,
so that the reference can check weight gradients (which sum over every rank's tokens) locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.shapes import RunShape


@dataclass
class MoeInputs:
    """One layer call on this rank; ``*_all`` are the whole group's tensors (for the reference).

    Layouts follow SEMANTICS.md §1: x [T, H] bf16, top_experts [T, k] int64 global ids,
    router_weights [T, k] fp32 normalised, gate/up [E, I, H], down [E, H, I] bf16 (local experts),
    shared_* ([I, H], [I, H], [H, I]) or None.
    """

    shape: RunShape
    rank: int
    world_size: int
    num_tokens: int
    x: torch.Tensor
    top_experts: torch.Tensor
    router_weights: torch.Tensor
    grad_output: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    x_all: torch.Tensor | None
    top_experts_all: torch.Tensor | None
    router_weights_all: torch.Tensor | None
    grad_output_all: torch.Tensor | None
    gate_all: torch.Tensor | None
    up_all: torch.Tensor | None
    down_all: torch.Tensor | None

    def release_group_tensors(self) -> None:
        """Drop the whole group's tensors (only the reference needs them) before timing."""
        self.x_all = self.top_experts_all = self.router_weights_all = None
        self.grad_output_all = self.gate_all = self.up_all = self.down_all = None

    @property
    def expert_offset(self) -> int:
        """Global id of this rank's first expert (expert e lives on rank e // E_local)."""
        return self.rank * self.shape.experts_per_rank


def synthetic_routing(
    num_tokens: int, num_experts: int, topk: int, generator: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random router: softmax of random logits, top-k, renormalised (weights > 0)."""
    logits = torch.randn(num_tokens, num_experts, generator=generator, device=device)
    probs = torch.softmax(logits, dim=-1)
    top_probs, top_experts = torch.topk(probs, topk, dim=-1)
    router_weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return top_experts.to(torch.int64), router_weights.to(torch.float32)


def _randn(shape, scale: float, generator, device) -> torch.Tensor:
    out = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
    return out.mul_(scale)


def make_inputs(
    shape: RunShape,
    num_tokens: int,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    seed: int,
    shared: bool,
) -> MoeInputs:
    """Draw the group's inputs from ``seed`` (same on every rank) and slice this rank's part.

    Weights are scaled by 1/sqrt(fan_in) so that activations stay O(1) through the layer.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = shape.hidden_size, shape.intermediate_size
    total_tokens = num_tokens * world_size
    top_all, weights_all = synthetic_routing(
        total_tokens, shape.num_experts, shape.topk, generator, device
    )
    x_all = _randn((total_tokens, hidden), 1.0, generator, device)
    dy_all = _randn((total_tokens, hidden), 1.0, generator, device)
    gate_all = _randn((shape.num_experts, inter, hidden), hidden**-0.5, generator, device)
    up_all = _randn((shape.num_experts, inter, hidden), hidden**-0.5, generator, device)
    down_all = _randn((shape.num_experts, hidden, inter), inter**-0.5, generator, device)
    shared_weights = None
    if shared:
        shared_weights = (
            _randn((inter, hidden), hidden**-0.5, generator, device),
            _randn((inter, hidden), hidden**-0.5, generator, device),
            _randn((hidden, inter), inter**-0.5, generator, device),
        )
    tokens = slice(rank * num_tokens, (rank + 1) * num_tokens)
    experts = slice(rank * shape.experts_per_rank, (rank + 1) * shape.experts_per_rank)
    return MoeInputs(
        shape=shape,
        rank=rank,
        world_size=world_size,
        num_tokens=num_tokens,
        x=x_all[tokens].contiguous(),
        top_experts=top_all[tokens].contiguous(),
        router_weights=weights_all[tokens].contiguous(),
        grad_output=dy_all[tokens].contiguous(),
        gate=gate_all[experts].contiguous(),
        up=up_all[experts].contiguous(),
        down=down_all[experts].contiguous(),
        shared=shared_weights,
        x_all=x_all,
        top_experts_all=top_all,
        router_weights_all=weights_all,
        grad_output_all=dy_all,
        gate_all=gate_all,
        up_all=up_all,
        down_all=down_all,
    )
