"""Plain data types: the schedule and the forward context (`mok.functional` returns them), and
the launch settings of one pass (`PassConfig`, what the layer ops hand the launchers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .config import DEFAULT_WAIT_TIMEOUT_NS


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


class PassConfig(NamedTuple):
    """The launch settings of one forward or backward pass: one object down the launch path
    (mok/launchers), and part of every launch plan's key (a NamedTuple: hashable).

    swiglu_limit:    the SwiGLU clamp, or None
    num_comm_ctas:   CTAs that dispatch while the rest compute (0: every CTA dispatches its
                     share first); MoKConfig.fwd_num_comm_sms or bwd_num_comm_sms
    minibatch_size:  overlap granularity in routed rows (None: every row); never changes the
                     bits. The megakernel's `minibatch_tiles` is made from it in one place
                     (launchers/megakernel_walk.py, `walk_arguments`)
    macrobatch_size: routed rows held at once, an int for the layer ops (below T * k: ring
                     reuse, launchers/macrobatch.py); None where only a megakernel launches
    macrobatch_replay: MoKConfig.macrobatch_replay (the forward's context with ring reuse)
    timeout_ns:      bound of every device wait
    grid:            the megakernels' CTAs (None: the SM count)
    """

    swiglu_limit: float | None = None
    num_comm_ctas: int = 0
    minibatch_size: int | None = None
    macrobatch_size: int | None = None
    macrobatch_replay: str = "gate_up"
    timeout_ns: int = DEFAULT_WAIT_TIMEOUT_NS
    grid: int | None = None

    @classmethod
    def of_workspace(
        cls,
        workspace,
        *,
        swiglu_limit,
        num_comm_ctas,
        minibatch_size,
        macrobatch_size,
        macrobatch_replay="gate_up",
    ) -> PassConfig:
        """A pass's settings on `workspace` (its wait bound and megakernel grid) with the op's
        knobs, MoKConfig's fields as the op took them (by name: three of them are ints)."""
        return cls(
            swiglu_limit=swiglu_limit,
            num_comm_ctas=num_comm_ctas,
            minibatch_size=minibatch_size,
            macrobatch_size=macrobatch_size,
            macrobatch_replay=macrobatch_replay,
            timeout_ns=workspace.wait_timeout_ns,
            grid=workspace.megakernel_ctas,
        )
