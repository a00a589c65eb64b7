"""A virtual EP group: P logical expert-parallel ranks in one process on one GPU.

Each rank has its own workspace (plain allocations on the one GPU) whose peer table points at
the other ranks' buffers, its own CUDA stream, and a megakernel grid of (SM count - P) // P
CTAs, so the P ranks' megakernels and their P barrier kernels are resident side by side and the
ranks run concurrently, as real ranks do. The ranks go
through the same kernels and the same launch code as real ranks; only the allocation and the
peer table differ. It proves the EP protocol
(pull dispatch, push combine, device barriers) on one GPU; it cannot show NVLink's timing or
memory ordering between GPUs.

    group = VirtualEPGroup(4)
    workspaces = group.workspaces(config, num_local_tokens=T, hidden_size=H, topk=k,
                                  num_local_experts=E // 4)
    outs = group.run(lambda rank: forward_of(rank, workspaces[rank]))
    group.synchronize()

`run(fn)` calls fn(rank) for every rank in turn with that rank's stream current. Ops of one
rank must not wait on the host for another rank's work (no `.item()` in `fn`): the host
issues rank 0's ops before rank 1's, and a cross-rank device wait resolves only once every
rank's ops are queued.
"""

from __future__ import annotations

import os

import torch

from .config import MoKConfig
from .validation import check_int, check_type
from .workspace import allocate_workspace, upload_peer_table

# CUDA's default for CUDA_DEVICE_MAX_CONNECTIONS: more streams than this share hardware queues.
# It is read when CUDA initialises, so it must be set before.
DEFAULT_MAX_CONNECTIONS = 8


class VirtualEPGroup:
    """P logical EP ranks on one CUDA device (see the module docstring)."""

    def __init__(self, size: int, device: torch.device | str | None = None):
        check_int("size", size, minimum=1)
        if not torch.cuda.is_available():
            raise ValueError(
                "a VirtualEPGroup needs a CUDA device; torch.cuda.is_available() is False"
            )
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        device = torch.device(device) if isinstance(device, str) else device
        check_type("device", device, torch.device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", DEFAULT_MAX_CONNECTIONS))
        if size > 1 and connections <= size:
            raise ValueError(
                f"CUDA_DEVICE_MAX_CONNECTIONS is {connections}, not above the group size {size}: "
                f"the ranks' streams and the caller's would share hardware queues, and a rank "
                f"queued behind a peer's barrier waits for ever (set it to >= {size + 1} before "
                f"CUDA is initialised)"
            )
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if size > 1 and (sms - size) // size < 1:
            raise ValueError(
                f"size must leave every rank's megakernel at least one CTA beside the P barrier "
                f"CTAs on the {sms} SMs (size <= {sms // 2}), got {size}"
            )
        self.size = size
        self.device = device
        # Each rank's spinning barrier kernel may hold an SM of its own: P megakernels plus P
        # barrier CTAs fit at once, so the ranks run concurrently.
        self.megakernel_ctas = sms if size == 1 else (sms - size) // size
        self.streams = [torch.cuda.Stream(device) for _ in range(size)]

    def workspaces(
        self,
        config: MoKConfig,
        *,
        num_local_tokens: int,
        hidden_size: int,
        topk: int,
        num_local_experts: int | None = None,
    ) -> list:
        """One MoKWorkspace per rank, each rank's peer table pointing at every rank's
        buffers. Destroy them with `ws.destroy()` on each."""
        check_type("config", config, MoKConfig)
        config.validate()
        capacity = config.schedule_capacity(
            num_local_tokens=num_local_tokens, topk=topk, ep_size=self.size,
            num_local_experts=num_local_experts or 0,
        )  # fmt: skip
        spaces = [
            allocate_workspace(
                None,
                rank,
                self.size,
                self.device,
                num_local_tokens,
                hidden_size,
                topk,
                capacity,
                plain=True,
            )
            for rank in range(self.size)
        ]
        for ws in spaces:
            ws.megakernel_ctas = self.megakernel_ctas
            ws.peer_ptrs = {
                name: [other.buffers[name].data_ptr() for other in spaces] for name in ws.buffers
            }
            upload_peer_table(ws)
        _prepare(spaces)
        # The buffers' initial fill, before any rank's stream uses them.
        torch.cuda.synchronize(self.device)
        return spaces

    def run(self, fn) -> list:
        """[fn(rank) for each rank], each call with that rank's stream current."""
        caller = torch.cuda.current_stream(self.device)
        results = []
        for rank in range(self.size):
            stream = self.streams[rank]
            stream.wait_stream(caller)  # the caller's inputs are ready before a rank reads them
            with torch.cuda.stream(stream):
                results.append(fn(rank))
        return results

    def join(self) -> None:
        """Make the caller's current stream wait for every rank's queued work (no host sync)."""
        caller = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            caller.wait_stream(stream)

    def synchronize(self) -> None:
        for stream in self.streams:
            stream.synchronize()


# The ops of a layer step, whose kernels are loaded up front: a module load (or a blocking host
# copy) issued while one rank's stream waits for a peer not yet queued would wait for ever.
LAYER_OPS = ("build_schedule", "forward", "recompute_forward_context", "backward")


def _prepare(spaces) -> None:
    """The one-time setup each rank's first ops would otherwise do mid-step: the comm state
    (error record, barrier tables) and the kernels' modules."""
    from . import launchers  # noqa: PLC0415 - the CUDA path's door
    from .runtime import get_kernel  # noqa: PLC0415

    for ws in spaces:
        launchers.prepare_comm(ws)
    for name in sorted({v for op in LAYER_OPS for v in launchers.KERNELS_BY_OP[op][0]}):
        get_kernel(name, device=spaces[0].device)
