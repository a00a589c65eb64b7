"""Plain data types returned by `mok.functional`: the schedule and the forward context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoKSchedule:
    """This rank's receive schedule (SEMANTICS §3).

    peer_rank:         int32 [C]  source EP rank of each routed row, -1 for padding
    peer_token_idx:    int32 [C]  `token * topk + j` on the source rank, -1 for padding
    num_tokens:        int32 [1]  routed rows including padding (rows past it are -1)
    tokens_per_expert: int32 [E]  padded routed rows of each local expert
    """

    peer_rank: torch.Tensor
    peer_token_idx: torch.Tensor
    num_tokens: torch.Tensor
    tokens_per_expert: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.peer_rank.shape[0]

    @property
    def num_local_experts(self) -> int:
        return self.tokens_per_expert.shape[0]


@dataclass(frozen=True)
class MoKForwardContext:
    """What backward needs from forward.

    BF16 mode, all bf16:
    x_routed:      [C, H]  routed input rows in schedule order (padding rows zero)
    gate_routed:   [C, I]  gate projection before the clamp
    up_routed:     [C, I]  up projection before the clamp
    hidden_routed: [C, I]  SwiGLU output, the down GEMM's operand
    gate_shared, up_shared, hidden_shared: [T, I] for the shared expert, or None without one.

    MXFP8 mode (the original's): each routed field an (E4M3 data, UE8M0 scales) pair of
    `mok.ops.mxfp8_quantize`'s layouts: x_routed and hidden_routed quantised along the routed
    rows (data [H, C] and [I, C]), gate_routed and up_routed along I (data [C, I]); the shared
    ones bf16 (mok/mxfp8_context.py). mok's MXFP8 backward also takes a bf16 context.

    Rows at or past `schedule.num_tokens` are not part of the contract.
    Bytes per routed row: 2*H + 6*I (x, gate, up, hidden), e.g. 8,704 B for Qwen3-30B-A3B; in
    MXFP8 (H + 3*I) * 33/32, 4,488 B there.
    """

    x_routed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    gate_routed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    up_routed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    hidden_routed: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    gate_shared: torch.Tensor | None = None
    up_shared: torch.Tensor | None = None
    hidden_shared: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.x_routed,
            self.gate_routed,
            self.up_routed,
            self.hidden_routed,
            self.gate_shared,
            self.up_shared,
            self.hidden_shared,
        )
