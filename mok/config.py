"""`MoKConfig`: the only knob surface of mok, and the constants every layer agrees on."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .errors import MoKInputError

# Routed rows of one expert are padded to this many rows: the M height of the GEMM tile, so
# that no GEMM tile ever straddles two experts.
ROUTED_ROW_ALIGNMENT = 128
# Bound of every device wait (barriers, megakernel dependencies): long enough for a slow peer,
# short enough that a lost peer becomes MoKWaitTimeoutError instead of a hang.
DEFAULT_WAIT_TIMEOUT_NS = 10_000_000_000
# hidden_size and intermediate_size must be multiples of this: one 128-wide K block of the
# GEMM mainloop and one 128x128 MXFP8 scale tile.
FEATURE_ALIGNMENT = 128
# MoKConfig.macrobatch_replay's values.
MACROBATCH_REPLAYS = ("gate_up", "gather")
# Largest top-k the epilogues keep in registers.
MAX_TOPK = 32


def check_macrobatch_replay(value, name: str = "macrobatch_replay") -> str:
    """`value` if it is one of MACROBATCH_REPLAYS, else MoKInputError (not a str) or ValueError,
    naming `name` (MoKConfig's field, or a layer op's argument)."""
    if not isinstance(value, str):
        raise MoKInputError(f"{name} must be a str, got {type(value).__name__}")
    if value not in MACROBATCH_REPLAYS:
        raise ValueError(f"{name} must be one of {MACROBATCH_REPLAYS}, got {value!r}")
    return value


@dataclass(frozen=True)
class MoKConfig:
    """Launch configuration of the mok megakernels (frozen: it is a compile and cache key).

    Fields (names as in the original Mixture-of-Kittens API):
        fwd_num_comm_sms: communication CTAs of the forward megakernel (even, >= 0, < SM count;
            0: every CTA dispatches its share of the rows before its GEMM tasks).
        bwd_num_comm_sms: the same for the backward megakernel.
        minibatch_size: overlap granularity in routed rows (multiple of 256).
        macrobatch_size: routed rows held at once (multiple of minibatch_size).
        schedule_capacity_multiplier: worst-case share of all routed rows of the EP group that
            lands on one rank (> 0); see `schedule_capacity`.
        all_gather_top_experts_chunk_bytes: chunk of the routing all-gather (multiple of 16).
        macrobatch_replay (beyond the original): what the backward redoes for the macrobatches
            after the first when macrobatch_size is below the routed rows. "gate_up" (default):
            the context holds macrobatch 0 and each later one's x rows are gathered again and
            its gate/up GEMM and SwiGLU rerun; "gather": the context also holds gate, up and
            hidden of every routed row (6 * intermediate_size bytes a row), so only x's rows
            are gathered again. The same bits either way.

    Made as the original's is, with any values: every field is checked where the config is
    used (`validate`: get_workspace, build_schedule, forward, backward, recompute), so
    code that makes a config and then catches the first call's error, as the original's own
    tests do, keeps working. The original's defaults
    (40/28/4096/131072/0.5/2048) were tuned for 148-SM Blackwell.
    On the H200 both communication CTA counts default to 0 (every CTA dispatches first):
    dedicated communication CTAs were not faster in either megakernel (docs/NOTES.md). The
    minibatch defaults to the macrobatch, one minibatch for up to 131072 routed rows: on one
    GPU there is no communication for smaller minibatches to overlap, and they were slower.
    """

    fwd_num_comm_sms: int = 0
    bwd_num_comm_sms: int = 0
    minibatch_size: int = 131072
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    all_gather_top_experts_chunk_bytes: int = 2048
    macrobatch_replay: str = "gate_up"

    def validate(self, num_sms: int | None = None) -> MoKConfig:
        """Raise ValueError/TypeError naming the field, what is allowed and what was given.

        `num_sms` (the device's SM count) bounds the communication CTA counts when known.
        Returns self so calls can chain.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "macrobatch_replay":
                check_macrobatch_replay(value, f"MoKConfig.{f.name}")
            elif f.name == "schedule_capacity_multiplier":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise MoKInputError(
                        f"MoKConfig.{f.name} must be a float, got {type(value).__name__}"
                    )
                if not math.isfinite(value) or value <= 0:
                    raise ValueError(
                        f"MoKConfig.{f.name} must be a finite number > 0, got {value!r}"
                    )
            elif isinstance(value, bool) or not isinstance(value, int):
                raise MoKInputError(
                    f"MoKConfig.{f.name} must be an int, got {type(value).__name__}"
                )
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            # Communication CTAs work in pairs (one pulls, one pushes), so the count is even.
            if value < 0 or value % 2:
                raise ValueError(f"MoKConfig.{name} must be an even int >= 0, got {value}")
            if num_sms is not None and value >= num_sms:
                raise ValueError(
                    f"MoKConfig.{name} must be < the device's SM count {num_sms} (leave compute "
                    f"SMs), got {value}"
                )
        if self.minibatch_size <= 0 or self.minibatch_size % 256:
            raise ValueError(
                f"MoKConfig.minibatch_size must be a positive multiple of 256, "
                f"got {self.minibatch_size}"
            )
        if self.macrobatch_size <= 0 or self.macrobatch_size % self.minibatch_size:
            raise ValueError(
                f"MoKConfig.macrobatch_size must be a positive multiple of minibatch_size "
                f"({self.minibatch_size}), got {self.macrobatch_size}"
            )
        chunk = self.all_gather_top_experts_chunk_bytes
        if chunk <= 0 or chunk % 16:
            raise ValueError(
                f"MoKConfig.all_gather_top_experts_chunk_bytes must be a positive multiple of 16, "
                f"got {chunk}"
            )
        return self

    def schedule_capacity(
        self, *, num_local_tokens: int, topk: int, ep_size: int, num_local_experts: int = 0
    ) -> int:
        """Routed rows (padding included) one rank's schedule can hold.

        The original's `T * k * max(2, ceil(P * multiplier))` rows. With the number of local
        experts known, the factor is also capped at P (a rank never receives more than the
        group's P*T*k rows) and E * 127 rows are added for every expert's padding to the tile
        height: for one GPU that is exactly the worst case, T*k + E*127.
        """
        factor = max(2, math.ceil(ep_size * self.schedule_capacity_multiplier))
        if num_local_experts:
            factor = min(ep_size, factor)
        rows = num_local_tokens * topk * factor + num_local_experts * (ROUTED_ROW_ALIGNMENT - 1)
        return -(-rows // ROUTED_ROW_ALIGNMENT) * ROUTED_ROW_ALIGNMENT
