"""Addresses of the EP group's buffers: this rank's own pointer, or a peer table's entry."""

import cutlass.cute as cute

# A routed row's (rank, row) packed in one int32 as rank * RANK_UNIT + row: the launchers keep
# T * k < 2^24 and the EP size <= MAX_EP_SIZE.
RANK_UNIT = 1 << 24
MAX_EP_SIZE = 127


def peer_table(table_ptr) -> cute.Tensor:
    """The int64 [P] table of one buffer's address on every rank."""
    return cute.make_tensor(table_ptr, cute.make_layout(MAX_EP_SIZE))


@cute.jit
def rank_address(local_ptr, table, ep_rank, rank):
    """Byte address of rank `rank`'s buffer: `local_ptr` for this rank, else the table's entry."""
    base = local_ptr.toint()
    if rank != ep_rank:
        base = table[rank]
    return base
