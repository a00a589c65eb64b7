"""`mok::build_schedule` on CUDA: the routing all-gather (EP > 1), then the schedule kernel (count
and placement tasks in one launch), no host sync.

A group of one has nothing to gather: its schedule kernel (the `ids64` variant) reads the
caller's int64 ids in place of the all-gather's int32 copy, one launch fewer. The all-gather
(a group of one: the placement) checks the expert ids and the placement records a capacity
overflow in the device's value-status words (launchers/status.py): the next mok op on the device
(or `mok.functional.check_errors`) raises the ValueError, with no copy or event per call.
"""

from __future__ import annotations

import weakref

import torch

from ..config import MoKConfig
from . import comm, schedule_kernels
from .plans import current_stream, new_tensors, plan, tensor_key
from .status import status_ptr

_CONFIGS: dict[int, MoKConfig] = {}  # by chunk size: made (and validated) once


def build_schedule(
    ws, top_experts, num_local_experts: int, capacity: int, chunk_bytes: int
):  # fmt: skip
    return schedule_op(ws, top_experts, num_local_experts, capacity, chunk_bytes)(top_experts)


def schedule_op(ws, top_experts, num_local_experts: int, capacity: int, chunk_bytes: int):
    """The plan of `build_schedule` for these arguments (checked when made): op(top_experts)
    -> (peer_rank, peer_token_idx, num_tokens, tokens_per_expert)."""
    ws.require_alive()  # a plan holds the workspace's addresses
    key = ("build_schedule", ws.handle, tensor_key(top_experts), num_local_experts, capacity,
           chunk_bytes, current_stream(top_experts.get_device()))  # fmt: skip
    return plan(
        key,
        lambda: _ScheduleOp(ws, top_experts, num_local_experts, capacity, chunk_bytes),
        # Not one made for an evicted workspace whose handle this one took over.
        current=lambda op: op.ws() is ws,
    )


class _ScheduleOp:
    """The all-gather's bound launch (EP > 1), then the schedule kernel's plan into new outputs. The
    workspace by weak reference (the cache evicts only workspaces nothing else holds)."""

    def __init__(self, ws, top_experts, num_local_experts, capacity, chunk_bytes):
        self.ws = weakref.ref(ws)
        if ws.ep_size == 1:  # the schedule kernel reads (and checks) the caller's ids
            comm.check_top_experts(ws, top_experts)
            self.gather, ids = None, top_experts
        else:
            config = _CONFIGS.get(chunk_bytes)
            if config is None:
                config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
                _CONFIGS[chunk_bytes] = config
            self.gather = comm.all_gather_plan(
                ws, config, top_experts, timeout_ns=ws.wait_timeout_ns,
                num_experts=num_local_experts * ws.ep_size,
            )  # fmt: skip
            ids = ws.buffers["all_gather_top_experts_buffer"]
            self.gathered_at = ids.data_ptr()  # the workspace's buffer: fixed for its life
        self.device, self.device_index = top_experts.device, top_experts.get_device()
        self.sizes = (capacity, num_local_experts)
        outputs = self._outputs()
        self.status = status_ptr(top_experts.device)
        self.place = schedule_kernels.schedule_plan(
            ids, *outputs, self.status, ws.ep_rank, num_local_experts
        )

    def _outputs(self):
        return new_tensors(self.layout(), self.device)

    def __call__(self, top_experts, outputs_at=None):
        """The schedule's four new tensors; with `outputs_at` (the addresses of the four, as
        `Carve.addresses` gives a layer step's) it launches into those and returns None."""
        ids_at = top_experts.data_ptr()
        if self.gather is not None:
            self.gather.launch(ids_at, stream=current_stream(self.device_index))
            ids_at = self.gathered_at
        outputs = None
        if outputs_at is None:
            outputs = self._outputs()
            outputs_at = tuple(t.data_ptr() for t in outputs)
        self.place.launch(ids_at, outputs_at, self.status)
        return outputs

    def layout(self) -> list:
        """(dtype, shape) of the four outputs (peer_rank, peer_token_idx, num_tokens,
        tokens_per_expert), as MoKSchedule orders them."""
        capacity, num_local_experts = self.sizes
        return [(torch.int32, (size,)) for size in (capacity, capacity, 1, num_local_experts)]
