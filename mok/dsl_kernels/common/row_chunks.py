"""Row-chunk views shared by the epilogue kernels: [rows, hidden] bf16 as 16-byte chunks."""

import cutlass.cute as cute
from cutlass import Int32, Int64

VECTOR = 8  # bf16 per 16-byte load
HIDDEN_ALIGN = 64  # documented alignment of hidden_size


def chunked_row_views(hidden_size: Int32, *views):
    """(chunks per row, one (8, hidden/8, rows) tensor per (pointer, rows) in `views`).

    The documented alignment lets CuTe prove every 8-element chunk is 16-byte aligned; 64-bit
    row strides keep row * hidden_size from overflowing int32.
    """
    hidden_size = cute.assume(hidden_size, divby=HIDDEN_ALIGN)
    row_stride = cute.assume(Int64(hidden_size), divby=HIDDEN_ALIGN)
    chunks = hidden_size // VECTOR
    tensors = [
        cute.make_tensor(
            ptr, cute.make_layout((VECTOR, chunks, num_rows), stride=(1, VECTOR, row_stride))
        )
        for ptr, num_rows in views
    ]
    return chunks, tensors
