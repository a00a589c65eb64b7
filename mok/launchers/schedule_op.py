"""`mok::build_schedule` on CUDA: routing all-gather, then the three schedule kernels, no host sync.

A capacity overflow's status words are copied to pinned host memory behind an event; the next mok
op on this workspace (or `mok.functional.check_errors`) raises the reference's ValueError.
"""

from __future__ import annotations

import torch

from ..config import MoKConfig
from . import comm, schedule_kernels


def build_schedule(
    ws, top_experts: torch.Tensor, num_local_experts: int, capacity: int, chunk_bytes: int
):
    raise_pending_errors(ws, wait=False)
    config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
    gathered = comm.all_gather_top_experts(ws, config, top_experts, timeout_ns=ws.wait_timeout_ns)
    peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status = (
        schedule_kernels.build_schedule_gpu(
            gathered, ep_rank=ws.ep_rank, num_local_experts=num_local_experts, capacity=capacity
        )
    )
    if not torch.cuda.is_current_stream_capturing():
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        host.copy_(status, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        ws.pending_schedule_status = (event, host)
    return peer_rank, peer_token_idx, num_tokens, tokens_per_expert


def raise_pending_errors(ws, *, wait: bool) -> None:
    """Raise a schedule overflow recorded on this workspace (wait=True syncs; False only looks)."""
    pending = getattr(ws, "pending_schedule_status", None)
    if pending is None:
        return
    if not wait and torch.cuda.is_current_stream_capturing():
        # An event may not be queried while a stream captures; the status stays pending and
        # the first mok op after the capture raises it.
        return
    event, host = pending
    if not wait and not event.query():
        return
    event.synchronize()
    ws.pending_schedule_status = None
    overflow, total, ep_rank, capacity = (int(v) for v in host.tolist())
    if overflow:
        raise ValueError(schedule_kernels.overflow_message(ep_rank, total, capacity))
