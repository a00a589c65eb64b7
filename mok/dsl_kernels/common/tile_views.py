"""Row-major views of the MXFP8 tile kernels (quantisers, round trips, dequantisers) over
matrices whose dims are multiples of TILE.

Row strides are 64-bit (rows * cols may pass int32) and known to be multiples of the tile's
row, so CuTe can prove every 16-byte chunk of a tile aligned.
"""

import cutlass.cute as cute
from cutlass import Int64, Uint32

TILE = 128  # rows and columns of one CTA tile


def matrix(ptr: cute.Pointer, num_rows, num_cols) -> cute.Tensor:
    """The [num_rows, num_cols] row-major matrix at `ptr`, in its own element type."""
    return cute.make_tensor(
        ptr,
        cute.make_layout(
            (num_rows, num_cols), stride=(cute.assume(Int64(num_cols), divby=TILE), 1)
        ),
    )


def word_matrix(ptr: cute.Pointer, num_rows, num_cols, per_word: int) -> cute.Tensor:
    """The [num_rows, num_cols] row-major matrix at `ptr` (`per_word` elements to a 32-bit
    word) as 32-bit words: [num_rows, num_cols / per_word] Uint32."""
    words_per_row = num_cols // per_word
    return cute.make_tensor(
        cute.recast_ptr(ptr, dtype=Uint32),
        cute.make_layout(
            (num_rows, words_per_row),
            stride=(cute.assume(Int64(words_per_row), divby=TILE // per_word), 1),
        ),
    )


def tile_entry(num_rows, num_cols):
    """A tile kernel's (thread, tile column, tile row, grid z, num_rows, num_cols): the sizes
    assumed multiples of TILE, which lets CuTe prove every chunk of a tile aligned (the
    kernels' documented constraint; the launchers check it)."""
    tidx, _, _ = cute.arch.thread_idx()
    tile_col, tile_row, z = cute.arch.block_idx()
    num_cols = cute.assume(num_cols, divby=TILE)
    num_rows = cute.assume(num_rows, divby=TILE)
    return tidx, tile_col, tile_row, z, num_rows, num_cols


def tile_chunks(mat: cute.Tensor, coords: tuple, cols: int, chunk: int) -> cute.Tensor:
    """The [TILE, cols] tile of `mat` at (tile row, tile column) `coords`, in chunks of `chunk`
    consecutive elements of a row: (1, chunk, TILE rows, cols / chunk chunks)."""
    return cute.flat_divide(cute.local_tile(mat, (TILE, cols), coords), (1, chunk))
