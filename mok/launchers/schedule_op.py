"""`mok::build_schedule` on CUDA: routing all-gather, then the three schedule kernels, no host sync.

The all-gather checks the expert ids and the placement records a capacity overflow in the
device's value-status words (launchers/status.py): the next mok op on the device (or
`mok.functional.check_errors`) raises the ValueError, with no copy or event per call.
"""

from __future__ import annotations

from ..config import MoKConfig
from . import comm, schedule_kernels
from .status import status_ptr

_CONFIGS: dict[int, MoKConfig] = {}  # by chunk size: made (and validated) once


def build_schedule(
    ws, top_experts, num_local_experts: int, capacity: int, chunk_bytes: int
):  # fmt: skip
    config = _CONFIGS.get(chunk_bytes)
    if config is None:
        config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
        _CONFIGS[chunk_bytes] = config
    gathered = comm.all_gather_top_experts(
        ws, config, top_experts, timeout_ns=ws.wait_timeout_ns,
        num_experts=num_local_experts * ws.ep_size,
    )  # fmt: skip
    peer_rank, peer_token_idx, num_tokens, tokens_per_expert, _ = (
        schedule_kernels.build_schedule_gpu(
            gathered, ep_rank=ws.ep_rank, num_local_experts=num_local_experts, capacity=capacity,
            status=status_ptr(top_experts.device),
        )
    )  # fmt: skip
    return peer_rank, peer_token_idx, num_tokens, tokens_per_expert
