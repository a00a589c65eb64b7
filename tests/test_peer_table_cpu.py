"""The EP group's one peer table (mok/workspace.py `peer_table_of`, read by the kernels through
mok/dsl_kernels/common/peers.py): its rows are the workspace's buffers in one order on both
sides, and it holds exactly the addresses in `peer_ptrs`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mok import workspace
from mok.launchers.peer_table import peer_table


def _workspace(ep_size: int, peer_ptrs: dict, table=None):
    return SimpleNamespace(ep_size=ep_size, peer_ptrs=peer_ptrs, device=torch.device("cpu"),
                           peer_table=table)  # fmt: skip


def test_the_kernels_rows_are_the_workspace_buffers_in_order():
    pytest.importorskip(
        "cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])"
    )
    from mok.dsl_kernels.common import peers

    rows = {name: getattr(peers, name.upper()) for name in workspace.BUFFER_NAMES}
    assert list(rows.values()) == list(range(len(workspace.BUFFER_NAMES)))
    assert peers.PEER_TABLE_ROWS == len(workspace.BUFFER_NAMES)
    assert peers.PEER_TABLE_ROW == workspace.PEER_TABLE_ROW > peers.MAX_EP_SIZE


def test_the_table_holds_every_rank_address_of_every_buffer():
    ep_size = 3
    ptrs = {name: [(row + 1) << 32 | rank << 8 for rank in range(ep_size)]
            for row, name in enumerate(workspace.BUFFER_NAMES)}  # fmt: skip
    del ptrs["all_gather_top_experts_buffer"]  # a buffer without addresses: a zero row
    table = workspace.peer_table_of(_workspace(ep_size, ptrs))
    assert table.dtype == torch.int64
    assert tuple(table.shape) == (len(workspace.BUFFER_NAMES), workspace.PEER_TABLE_ROW)
    for row, name in enumerate(workspace.BUFFER_NAMES):
        want = ptrs.get(name, [0] * ep_size) + [0] * (workspace.PEER_TABLE_ROW - ep_size)
        assert table[row].tolist() == want, name


def test_a_wrong_count_of_addresses_is_refused_by_name():
    ptrs = {"x_buffer": [1, 2]}
    with pytest.raises(
        ValueError, match=r"peer_ptrs\['x_buffer'\] has 2 entries, expected ep_size = 3"
    ):
        workspace.peer_table_of(_workspace(3, ptrs))


def test_the_megakernels_get_the_table_only_for_a_group():
    assert peer_table(_workspace(1, {})) is None
    table = torch.zeros(len(workspace.BUFFER_NAMES), workspace.PEER_TABLE_ROW, dtype=torch.int64)
    assert peer_table(_workspace(2, {}, table)) is table
    with pytest.raises(ValueError, match="workspace.peer_table is missing"):
        peer_table(_workspace(2, {}))
