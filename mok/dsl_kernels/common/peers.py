"""Addresses of the EP group's buffers: this rank's own pointer, or a peer's from the one peer
table.

The workspace's peer table (`MoKWorkspace.peer_table`, mok/workspace.py) is int64
[buffers, PEER_TABLE_ROW]: row b holds the address of symmetric buffer b on every rank, in
`mok.workspace.BUFFER_NAMES` order (the rows below; a CPU test checks that the two agree). A
kernel takes the table once and finds any buffer on any rank in it.
"""

import cutlass.cute as cute
from cutlass import Int64

# A routed row's (rank, row) packed in one int32 as rank * RANK_UNIT + row: the launchers keep
# T * k < 2^24 and the EP size <= MAX_EP_SIZE.
RANK_UNIT = 1 << 24
MAX_EP_SIZE = 127
PEER_TABLE_ROW = 128  # int64 entries a row of the peer table: one per rank, up to MAX_EP_SIZE

# Rows of the peer table (mok.workspace.BUFFER_NAMES order).
X_BUFFER = 0
COMBINE_BUFFER = 1
D_Y_BUFFER = 2
D_X_ROUTED_BUFFER = 3
ROUTER_WEIGHT_BUFFER = 4
D_ROUTER_WEIGHT_BUFFER = 5
ALL_GATHER_TOP_EXPERTS_BUFFER = 6
BARRIER_BUFFER = 7
PEER_TABLE_ROWS = 8


def peer_table(table_ptr, row: int) -> cute.Tensor:
    """Row `row` of the peer table at `table_ptr`: the int64 [P] addresses of one buffer on
    every rank."""
    return cute.make_tensor(table_ptr + row * PEER_TABLE_ROW, cute.make_layout(PEER_TABLE_ROW))


def peer_row_address(table_ptr, row: int) -> Int64:
    """The address of row `row` of the peer table at `table_ptr` (for code that loads the
    entries itself, common/barrier_arrivals.py)."""
    return table_ptr.toint() + Int64(row * PEER_TABLE_ROW * 8)


@cute.jit
def rank_address(local_ptr, table, ep_rank, rank):
    """Byte address of rank `rank`'s buffer: `local_ptr` for this rank, else the table's entry."""
    base = local_ptr.toint()
    if rank != ep_rank:
        base = table[rank]
    return base
