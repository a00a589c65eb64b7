"""Gather of the routed rows for the recomputed forward context: each row pulled from its token's
rank (this rank's `src`, or a peer's `x_buffer` through the peer table)."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from ..common.params import Bf16Pointer, Int32Pointer, Int64Pointer
from ..common.peers import X_BUFFER, peer_table, rank_address
from ..common.row_chunks import VECTOR, chunked_row_views


class GatherRowsArgs(NamedTuple):
    """`GatherRows`'s parameters, in order."""

    out_ptr: Bf16Pointer  # bf16 [num_rows, hidden_size]
    src_ptr: Bf16Pointer  # bf16 [num_src_rows, hidden_size]: this rank's rows
    # int64 [buffers, 128]: the EP group's peer table (common/peers.py); a peer's rows are its
    # x_buffer
    peer_table_ptr: Int64Pointer
    peer_rank_ptr: Int32Pointer  # int32 [num_rows], the schedule's
    peer_token_idx_ptr: Int32Pointer  # int32 [num_rows], the schedule's
    # int32 [1], the schedule's routed-row count, read on the device: rows at or past it are
    # not written
    num_tokens_ptr: Int32Pointer
    num_rows: Int32
    num_src_rows: Int32
    hidden_size: Int32
    topk: Int32
    ep_rank: Int32


@dataclass(frozen=True)
class GatherRows:
    """out[r, :] = src[peer_token_idx[r] // topk, :] for every routed row r < num_tokens with
    peer_rank[r] >= 0, and zeros for padding rows (peer_rank[r] < 0).

    Kernel parameters: `GatherRowsArgs`; `__call__` takes the grid's y extent (`grid_y`) too.

    Work split (as the combine kernels): a thread owns 8 consecutive columns (16-byte loads
    and stores) of `rows_per_cta` consecutive rows, issues every load of its rows before any
    store, and walks row blocks with a stride of grid.y (so any number of rows fits the
    65535 grid.y limit).

    Constraints (the launcher checks them): hidden_size % 64 == 0; out and src 16-byte
    aligned and contiguous; the schedule's peer_token_idx // topk < num_src_rows for real rows.
    Launch: grid (ceil(hidden_size / (8 * threads)), min(ceil(num_rows / rows_per_cta), 65535),
    1), block (threads, 1, 1), no dynamic shared memory.
    """

    threads: int = 128
    rows_per_cta: int = 4

    def validate(self) -> None:
        if self.threads not in (64, 128, 256, 512):
            raise ValueError(f"threads must be one of 64, 128, 256, 512, got {self.threads}")
        if self.rows_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"rows_per_cta must be one of 1, 2, 4, 8, got {self.rows_per_cta}")

    @cute.jit
    def __call__(self, args: GatherRowsArgs, grid_y: Int32):
        columns_per_cta = VECTOR * self.threads
        self.kernel(args).launch(
            grid=[(args.hidden_size + columns_per_cta - 1) // columns_per_cta, grid_y, 1],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(self, args: GatherRowsArgs):
        rows_per_cta = self.rows_per_cta
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        _, grid_y, _ = cute.arch.grid_dim()
        chunks, (mOut,) = chunked_row_views(args.hidden_size, (args.out_ptr, args.num_rows))
        row_bytes = cute.assume(Int64(args.hidden_size) * Int64(2), divby=128)
        table = peer_table(args.peer_table_ptr, X_BUFFER)
        rank = cute.make_tensor(args.peer_rank_ptr, cute.make_layout(args.num_rows))
        slot = cute.make_tensor(args.peer_token_idx_ptr, cute.make_layout(args.num_rows))
        rows = cutlass.min(
            args.num_rows, cute.make_tensor(args.num_tokens_ptr, cute.make_layout(1))[0]
        )

        chunk = bidx * self.threads + tidx
        blocks = (rows + rows_per_cta - 1) // rows_per_cta
        rIn = cute.make_rmem_tensor((VECTOR, rows_per_cta), BFloat16)
        # Only `chunk < chunks` can diverge, in the last column block.
        if chunk < chunks:
            for block in cutlass.range(bidy, blocks, grid_y, unroll=1):
                first = block * rows_per_cta
                # ---- load: every row of the block, before any store ----
                for t in cutlass.range_constexpr(rows_per_cta):
                    row = first + t
                    rIn[None, t].fill(0.0)
                    if row < rows:
                        if rank[row] >= 0:
                            base = rank_address(args.src_ptr, table, args.ep_rank, rank[row])
                            offset = Int64(slot[row] // args.topk) * row_bytes
                            src = cute.make_tensor(
                                cute.make_ptr(BFloat16, base + offset, cute.AddressSpace.gmem,
                                              assumed_align=16),
                                cute.make_layout((VECTOR, chunks), stride=(1, VECTOR)),
                            )  # fmt: skip
                            rIn[None, t].store(src[None, chunk].load())
                # ---- store (padding rows: zeros) ----
                for t in cutlass.range_constexpr(rows_per_cta):
                    row = first + t
                    if row < rows:
                        mOut[None, chunk, row].store(rIn[None, t].load())
