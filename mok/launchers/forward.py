"""GPU forward for an EP group of one.

The routed experts run in the forward megakernel (mok/launchers/moe_forward.py: dispatch,
gate/up + SwiGLU and down to slots in one persistent launch; the default) or as the same steps
in a sequence of kernels (`set_forward_path("kernels")`), below; the shared expert and the
fixed-order combine are separate launches on the same stream, with no host sync:

    x_routed = x[peer_token_idx // k]  (padding rows zero)           gather_rows
    gate, up, hidden = SwiGLU(x_routed @ W_gate/up[e]^T)            expert_gemm_gate_up_swiglu
    slots[peer_token_idx[r]] = hidden[r] @ W_down[e]^T               expert_gemm_down_to_slots
                              (the down epilogue stores each row at its (token, j) slot)
    shared expert: the same two kernels on one 'expert' of T rows (padded to 128)
    out = y_shared + sum_j w[t, j] * slots[t*k + j]  (fixed j order)   moe_combine_forward

Every step is deterministic (no atomics, no split-K, each output element written by one
thread in a fixed order), so results are bitwise identical run to run. An EP group larger than
one raises MoKKernelUnavailableError: cross-GPU dispatch (peers in the megakernel's
communication warps) is not written yet.
"""

from __future__ import annotations

import torch

from ..errors import MoKKernelUnavailableError
from . import dispatch, epilogues, expert_gemm, moe_forward

ROW_TILE = expert_gemm.TILE_ROWS


def _require_group_of_one(ws, op: str) -> None:
    if ws.ep_size != 1:
        raise MoKKernelUnavailableError(
            f"mok.ops.{op} on CUDA with an EP group of {ws.ep_size}: the interim multi-kernel "
            f"GPU path runs a group of one only; EP > 1 comes with the forward megakernel "
            f"(issue 4). CPU tensors run the reference path for any EP size."
        )
    if ws.hidden_size % expert_gemm.DOWN_N_ALIGNMENT:
        raise ValueError(
            f"hidden_size must be a multiple of {expert_gemm.DOWN_N_ALIGNMENT} on the sm_90a "
            f"kernel path, got {ws.hidden_size}"
        )


def check_macrobatch(macrobatch_size: int, num_tokens: int, topk: int, op: str) -> None:
    """The GPU path holds every routed row at once (no ring reuse with replay yet): a
    macrobatch smaller than the T * k routed rows is rejected, not silently exceeded."""
    rows = num_tokens * topk
    if macrobatch_size < rows:
        raise ValueError(
            f"MoKConfig.macrobatch_size must be at least the routed rows T * k = "
            f"{num_tokens} * {topk} = {rows} on the GPU path ({op}): ring reuse of a smaller "
            f"macrobatch is not built yet; got {macrobatch_size} (pass a MoKConfig with "
            f"macrobatch_size >= {rows}, a multiple of its minibatch_size)"
        )


def gather_routed_rows(x: torch.Tensor, peer_rank, peer_token_idx, topk: int) -> torch.Tensor:
    """Dispatch for a group of one: x_routed[i] = x[peer_token_idx[i] // k], 0 for padding.

    Padding rows gather from one zero row appended to x (a copy of T rows), which is cheaper
    than zeroing them afterwards (C rows, C >= T*k).
    """
    num_tokens = x.shape[0]
    x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
    rows = torch.where(peer_rank >= 0, peer_token_idx.long() // topk, num_tokens)
    return x_ext.index_select(0, rows)


def scatter_to_slots(y: torch.Tensor, peer_rank, peer_token_idx, num_slots: int) -> torch.Tensor:
    """Combine for a group of one: slots[peer_token_idx[i]] = y[i] for every real row i.

    Real rows hold each slot 0..num_slots-1 exactly once, so their copies never collide: the
    result is deterministic. Padding rows (peer_rank -1) all go to one extra row, dropped.
    """
    keys = torch.where(peer_rank >= 0, peer_token_idx, num_slots).long()
    out = y.new_empty(num_slots + 1, *y.shape[1:])
    return out.index_copy_(0, keys, y)[:num_slots]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, ...] with zero rows appended up to `rows` (t itself when n == rows)."""
    return t if t.shape[0] == rows else torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


# How the routed experts of a forward run: "megakernel" (one persistent launch,
# mok/launchers/moe_forward.py, the default) or "kernels" (gather, gate/up, down as three
# launches). Both give the same bits. On the H200 they are within 2-4% of each other, either
# way by shape and run (docs/NOTES.md, session 4); benchmarks/mok_impls.py times both.
class PathSwitch:
    """A module-wide choice among named ways of running the routed experts."""

    def __init__(self, paths: tuple[str, ...], default: str):
        self.paths, self.path = paths, default

    def set(self, path: str) -> str:
        """Select `path`; returns the previous one."""
        if path not in self.paths:
            raise ValueError(f"path must be one of {self.paths}, got {path!r}")
        previous, self.path = self.path, path
        return previous


FORWARD_PATHS = ("kernels", "megakernel")
_forward = PathSwitch(FORWARD_PATHS, "megakernel")


def set_forward_path(path: str) -> str:
    """Select how forward runs the routed experts (FORWARD_PATHS); returns the previous one."""
    return _forward.set(path)


def _routed(ws, schedule, x, gate_w, up_w, down_w, limit, num_comm_ctas=0, minibatch_size=None):
    """(context, slots): the routed experts; slots bf16 [T * k, H] holds each routed row's
    output at its (token, j) slot, stored there by the down GEMM's epilogue (None without
    down_w). `num_comm_ctas`, `minibatch_size`: the megakernel's communication CTAs and
    minibatch (MoKConfig)."""
    if down_w is not None and _forward.path == "megakernel":
        return moe_forward.routed_forward(x, schedule, ws.topk, gate_w, up_w, down_w,
                                          swiglu_limit=limit, num_comm_ctas=num_comm_ctas,
                                          minibatch_size=minibatch_size)  # fmt: skip
    peer, slot = schedule.peer_rank, schedule.peer_token_idx
    x_routed = dispatch.gather_rows(x, peer, slot, schedule.num_tokens, ws.topk)
    gate, up, hidden = expert_gemm.gate_up_swiglu(
        x_routed, gate_w, up_w, schedule.tokens_per_expert, swiglu_limit=limit
    )
    if down_w is None:
        return (x_routed, gate, up, hidden), None
    num_slots = x.shape[0] * ws.topk
    slots = expert_gemm.down(hidden, down_w, schedule.tokens_per_expert,
                             slots=(peer, slot, num_slots))  # fmt: skip
    return (x_routed, gate, up, hidden), slots


def _shared(x, gate_w, up_w, down_w, limit):
    """The shared expert as one expert over all T rows (padded to the 128-row tile)."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // ROW_TILE) * ROW_TILE
    rows = pad_rows(x, padded)
    tokens = torch.full((1,), padded, dtype=torch.int32, device=x.device)
    gate, up, hidden = expert_gemm.gate_up_swiglu(
        rows, gate_w.unsqueeze(0), up_w.unsqueeze(0), tokens, swiglu_limit=limit
    )
    y = None
    if down_w is not None:
        y = expert_gemm.down(hidden, down_w.unsqueeze(0), tokens)[:num_tokens]
    return gate[:num_tokens], up[:num_tokens], hidden[:num_tokens], y


def forward(
    ws, schedule, x, router_weights, shared_gate, shared_up, shared_down, routed_gate,
    routed_up, routed_down, swiglu_limit, fwd_num_comm_sms, minibatch_size, macrobatch_size,
):  # fmt: skip
    _require_group_of_one(ws, "forward")
    check_macrobatch(macrobatch_size, x.shape[0], router_weights.shape[1], "forward")
    routed_ctx, slots = _routed(ws, schedule, x, routed_gate, routed_up, routed_down, swiglu_limit,
                                fwd_num_comm_sms, minibatch_size)  # fmt: skip
    # Distinct empty tensors: custom-op outputs may not alias each other.
    shared_ctx, y_shared = tuple(x.new_empty(0) for _ in range(3)), None
    if shared_gate is not None:
        *shared_ctx, y_shared = _shared(x, shared_gate, shared_up, shared_down, swiglu_limit)
    out = epilogues.fwd_epilogue(y_shared, slots, router_weights)
    return (out, *routed_ctx, *shared_ctx)


def recompute_forward_context(
    ws, schedule, x, shared_gate, shared_up, routed_gate, routed_up, swiglu_limit
):
    _require_group_of_one(ws, "recompute_forward_context")
    routed_ctx, _ = _routed(ws, schedule, x, routed_gate, routed_up, None, swiglu_limit)
    shared_ctx = tuple(x.new_empty(0) for _ in range(3))
    if shared_gate is not None:
        shared_ctx = _shared(x, shared_gate, shared_up, None, swiglu_limit)[:3]
    return (*routed_ctx, *shared_ctx)
