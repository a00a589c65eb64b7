"""What an EP rank moves to and from other GPUs per pass, and the peer-copy bandwidth beside it.

mok's protocol (SEMANTICS §4): the owner of an expert pulls the x rows of other ranks' tokens
routed to it and pushes their expert outputs into the token's rank (forward); in backward it
pulls their dY rows and router weights and pushes their d_x rows and d_router values. Rows
whose token and expert are on one rank stay local. So the bytes a rank's kernels move over
NVLink per pass are its remote routed rows times:

    fwd     2 * H * 2            (x pulled, y pushed; bf16)
    bwd     2 * H * 2 + 2 * 4    (dY pulled, d_x pushed; fp32 weight pulled, d_router pushed)
    fwdbwd  the sum

The peer-copy bandwidth is measured with the same memory mok's EP kernels use (torch symmetric
memory, unicast: no multicast): every rank copies a buffer into the next rank's at once, bytes
written over the time of the slowest rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.timing import TimingConfig, max_over_ranks, median, time_ms

PEER_COPY_BYTES = 1 << 30


def remote_rows_per_rank(owner_by_rank: list[torch.Tensor], world_size: int) -> list[int]:
    """Rows each rank's experts get from other ranks' tokens. `owner_by_rank[s]`: the rank
    owning each routed row (any shape) of rank s's tokens."""
    received = torch.zeros(world_size, dtype=torch.int64)
    for source, owner in enumerate(owner_by_rank):
        remote = owner.flatten().cpu()
        remote = remote[remote != source]
        received += torch.bincount(remote, minlength=world_size)
    return received.tolist()


def pass_bytes(remote_rows: int, hidden_size: int) -> dict[str, int]:
    """Bytes a rank's kernels move to and from peers per pass (the module docstring)."""
    forward = remote_rows * 2 * hidden_size * 2
    backward = remote_rows * (2 * hidden_size * 2 + 2 * 4)
    return {"fwd": forward, "bwd": backward, "fwdbwd": forward + backward}


def rank_pass_bytes(top_experts: torch.Tensor, num_local_experts: int, hidden_size: int,
                    group) -> dict[str, int]:  # fmt: skip
    """`pass_bytes` of the rank that moves the most (every rank gets the same answer); a
    collective over `group`."""
    world_size = dist.get_world_size(group)
    owner = (top_experts // num_local_experts).contiguous()
    owners = [torch.empty_like(owner) for _ in range(world_size)]
    dist.all_gather(owners, owner, group=group)
    return pass_bytes(max(remote_rows_per_rank(owners, world_size)), hidden_size)


def peer_copy_gbs(device: torch.device, group, config: TimingConfig,
                  num_bytes: int = PEER_COPY_BYTES) -> float:  # fmt: skip
    """GB/s of every rank writing `num_bytes` into the next rank's symmetric buffer at once
    (bytes written by one rank over the slowest rank's median time)."""
    import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415 - CUDA EP only

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    buffer = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    peer = handle.get_buffer((rank + 1) % world_size, (num_bytes,), torch.uint8)
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    times = time_ms(device, config, lambda _state: peer.copy_(source))
    ms = median(max_over_ranks(times, device, group))
    dist.barrier(group=group)  # no rank frees its buffer while a peer still writes it
    return num_bytes / (ms * 1e-3) / 1e9
