"""The EP group's peer tables for the megakernels: for each symmetric buffer, a device int64 [P]
table of its address on every rank (`workspace.peer_ptrs`), uploaded once per workspace."""

from __future__ import annotations

import torch

from .checks import MAX_EP_SIZE

_ATTRIBUTE = "_mok_peer_tables"
NAMES = (
    "x_buffer",
    "combine_buffer",
    "d_y_buffer",
    "d_x_routed_buffer",
    "router_weight_buffer",
    "d_router_weight_buffer",
)


def peer_tables(workspace) -> dict[str, torch.Tensor] | None:
    """{buffer name: int64 [P] device table}, or None for an EP group of one (the kernels then
    read and write this rank's own tensors only, and never the tables)."""
    if workspace.ep_size == 1:
        return None
    tables = getattr(workspace, _ATTRIBUTE, None)
    if tables is None:
        if workspace.ep_size > MAX_EP_SIZE:
            raise ValueError(
                f"ep_size must be <= {MAX_EP_SIZE} on the GPU path, got {workspace.ep_size}"
            )
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the first EP call on a workspace must run outside CUDA graph capture (it uploads "
                "the peer tables): make one eager call (a warm-up) before capturing"
            )
        tables = {}
        for name in NAMES:
            pointers = workspace.peer_ptrs[name]
            if len(pointers) != workspace.ep_size:
                raise ValueError(
                    f"workspace.peer_ptrs[{name!r}] has {len(pointers)} entries, expected ep_size "
                    f"= {workspace.ep_size}"
                )
            # One-time setup: a blocking host-to-device copy is fine here.
            tables[name] = torch.tensor(pointers, dtype=torch.int64, device=workspace.device)
        setattr(workspace, _ATTRIBUTE, tables)
    return tables
