"""The EP group's peer table for the megakernels: every symmetric buffer's address on every rank
in one device int64 [buffers, 128] table (`workspace.peer_table`, made with the workspace; rows
in `mok.workspace.BUFFER_NAMES` order, mok/dsl_kernels/common/peers.py)."""

from __future__ import annotations

import torch


def peer_table(workspace) -> torch.Tensor | None:
    """The workspace's device peer table, or None for an EP group of one (the kernels then read
    and write this rank's own tensors only, and never the table). The EP size limit is
    checks.check_gpu_layer's, which every op runs first."""
    if workspace.ep_size == 1:
        return None
    if workspace.peer_table is None:
        raise ValueError("workspace.peer_table is missing: make EP workspaces with get_workspace "
                         "or VirtualEPGroup.workspaces")  # fmt: skip
    return workspace.peer_table
