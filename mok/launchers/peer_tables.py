"""The EP group's peer tables for the megakernels: for each symmetric buffer, the device int64
[P] table of its address on every rank (`workspace.peer_tables`, made with the workspace)."""

from __future__ import annotations

import torch

from ..workspace import DATA_BUFFER_NAMES as NAMES


def peer_tables(workspace) -> dict[str, torch.Tensor] | None:
    """{buffer name: int64 [P] device table}, or None for an EP group of one (the kernels then
    read and write this rank's own tensors only, and never the tables). The EP size limit is
    checks.check_gpu_layer's, which every op runs first."""
    if workspace.ep_size == 1:
        return None
    missing = [name for name in NAMES if name not in workspace.peer_tables]
    if missing:
        raise ValueError(f"workspace.peer_tables lacks {missing}: make EP workspaces with "
                         "get_workspace or VirtualEPGroup.workspaces")  # fmt: skip
    return {name: workspace.peer_tables[name] for name in NAMES}
