"""Gather of the routed rows for the recomputed forward context: each row pulled from its token's
rank (this rank's `src`, or a peer's symmetric buffer through the peer table)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from ..common.args import global_pointer
from ..common.peers import peer_table, rank_address
from ..common.row_chunks import VECTOR, chunked_row_views


@dataclass(frozen=True)
class GatherRows:
    """out[r, :] = src[peer_token_idx[r] // topk, :] for every routed row r < num_tokens with
    peer_rank[r] >= 0, and zeros for padding rows (peer_rank[r] < 0).

    Kernel parameters (in this order): `out_ptr` (bf16 [num_rows, hidden_size]), `src_ptr`
    (bf16 [num_src_rows, hidden_size]), `peer_rank_ptr`, `peer_token_idx_ptr` (int32 [num_rows], the
    schedule's), `num_tokens_ptr` (int32 [1], the schedule's routed-row count, read on the
    device: rows at or past it are not written), `num_rows`, `num_src_rows`, `hidden_size`,
    `topk`.

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

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),  # out_ptr
            global_pointer(BFloat16, 16),  # src_ptr
            global_pointer(Int64, 8),  # src_ptrs
            global_pointer(Int32, 4),  # peer_rank_ptr
            global_pointer(Int32, 4),  # peer_token_idx_ptr
            global_pointer(Int32, 4),  # num_tokens_ptr
            Int32(0),  # num_rows
            Int32(0),  # num_src_rows
            Int32(0),  # hidden_size
            Int32(1),  # topk
            Int32(0),  # ep_rank
            Int32(1),  # grid_y
        )

    @cute.jit
    def __call__(
        self,
        out_ptr: cute.Pointer,
        src_ptr: cute.Pointer,
        src_ptrs: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        num_rows: Int32,
        num_src_rows: Int32,
        hidden_size: Int32,
        topk: Int32,
        ep_rank: Int32,
        grid_y: Int32,
    ):
        columns_per_cta = VECTOR * self.threads
        self.kernel(
            out_ptr,
            src_ptr,
            src_ptrs,
            peer_rank_ptr,
            peer_token_idx_ptr,
            num_tokens_ptr,
            num_rows,
            num_src_rows,
            hidden_size,
            topk,
            ep_rank,
        ).launch(
            grid=[(hidden_size + columns_per_cta - 1) // columns_per_cta, grid_y, 1],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(
        self,
        out_ptr: cute.Pointer,
        src_ptr: cute.Pointer,
        src_ptrs: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        num_rows: Int32,
        num_src_rows: Int32,
        hidden_size: Int32,
        topk: Int32,
        ep_rank: Int32,
    ):
        rows_per_cta = self.rows_per_cta
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        _, grid_y, _ = cute.arch.grid_dim()
        chunks, (mOut,) = chunked_row_views(hidden_size, (out_ptr, num_rows))
        row_bytes = cute.assume(Int64(hidden_size) * Int64(2), divby=128)
        table = peer_table(src_ptrs)
        rank = cute.make_tensor(peer_rank_ptr, cute.make_layout(num_rows))
        slot = cute.make_tensor(peer_token_idx_ptr, cute.make_layout(num_rows))
        rows = cutlass.min(num_rows, cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0])

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
                            base = rank_address(src_ptr, table, ep_rank, rank[row])
                            src = cute.make_tensor(
                                cute.make_ptr(BFloat16, base + Int64(slot[row] // topk) * row_bytes,
                                              cute.AddressSpace.gmem, assumed_align=16),
                                cute.make_layout((VECTOR, chunks), stride=(1, VECTOR)),
                            )  # fmt: skip
                            rIn[None, t].store(src[None, chunk].load())
                # ---- store (padding rows: zeros) ----
                for t in cutlass.range_constexpr(rows_per_cta):
                    row = first + t
                    if row < rows:
                        mOut[None, chunk, row].store(rIn[None, t].load())
