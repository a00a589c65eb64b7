"""The EP process group as a (rank, size) pair, shared by the reference, the workspace and the
module (a neutral home: production code does not import the oracle)."""

from __future__ import annotations

import torch.distributed as dist


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in the EP group; `None` is a group of one."""
    if group is None:
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)
