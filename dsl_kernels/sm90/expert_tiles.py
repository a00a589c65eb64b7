"""Device-side tile list of a grouped GEMM over the expert-major routed buffer.

The routed buffer holds each local expert's rows contiguously, expert 0 first, each segment
padded to a multiple of `TILE_ROWS` rows; `tokens_per_expert[e]` (int32, device memory) is the
padded size of segment e. A grouped GEMM's tiles are numbered expert by expert; inside one
expert, m (row tile) runs fastest and n (column tile) slowest:

    tile = tiles_before(e) + n * row_tiles(e) + m,   row_tiles(e) = tokens_per_expert[e] / 128

m fastest keeps the CTAs that run at the same time on a few column tiles of the same expert,
so each weight tile is read from HBM about once and then served from L2 (a wave of 132 tiles of
Mixtral's gate/up GEMM touches ~4 weight tiles and ~32 row tiles instead of 132 weight tiles).

Every CTA walks its own tiles in increasing order (tile = CTA index, then + grid size; in the
megakernels, the tickets it takes: tickets.py), so a cursor (expert, tiles before it, rows
before it) only ever moves forward: the whole walk reads `tokens_per_expert` once per expert,
whatever the number of tiles. Which CTA runs a tile never changes what the tile computes:
results are deterministic.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TILE_ROWS = 128


@cute.jit
def segment_row_tiles(tokens_per_expert: cute.Tensor, expert: Int32, num_experts: Int32) -> Int32:
    """Row tiles of `expert`, or 0 past the last expert (no read out of bounds)."""
    rows = tokens_per_expert[cutlass.min(expert, num_experts - 1)]
    tiles = rows // TILE_ROWS
    if expert >= num_experts:
        tiles = Int32(0)
    return tiles


class TileList(NamedTuple):
    """What numbers a grouped GEMM's tiles: the padded segment sizes (device memory), the
    number of experts, and the column tiles of every expert."""

    tokens_per_expert: cute.Tensor
    num_experts: Int32
    col_tiles: Int32


@cute.jit
def locate_tile(tiles: TileList, tile: Int32, cursor: tuple, end_row=None):
    """Advance the cursor (expert, tile_base, row_base, row_tiles) to the expert owning `tile`.

    `tile` must not be smaller than the tile of the previous call (the cursor only moves
    forward). Returns the new cursor; `expert == num_experts` means `tile` is past the end.
    With `end_row` (a minibatch's window, see window_cursor) the segments are cut at that
    row: the tiles are those of the window's rows only.
    """
    tokens_per_expert, num_experts, col_tiles = tiles
    expert, tile_base, row_base, row_tiles = cursor
    advance = (expert < num_experts) & (tile >= tile_base + row_tiles * col_tiles)
    while advance:
        tile_base = tile_base + row_tiles * col_tiles
        row_base = row_base + row_tiles * TILE_ROWS
        expert = expert + 1
        row_tiles = segment_row_tiles(tokens_per_expert, expert, num_experts)
        if cutlass.const_expr(end_row is not None):
            row_tiles = cutlass.min(row_tiles, (end_row - row_base) // TILE_ROWS)
        advance = (expert < num_experts) & (tile >= tile_base + row_tiles * col_tiles)
    return expert, tile_base, row_base, row_tiles


@cute.jit
def window_cursor(tiles: TileList, segment: tuple, first_row: Int32, end_row: Int32):
    """The tile list of rows first_row .. end_row - 1 only (a minibatch: tickets.py), its
    tiles numbered from 0 in the same order (expert by expert, m fastest, then n).
    `segment` (expert, its first row) is where the previous window of the same walk began
    (0, 0 at first): windows only move forward, so the walk over all windows reads
    `tokens_per_expert` about once per expert. Returns (segment of this window, cursor of
    its tile 0 for locate_tile with `end_row`)."""
    tokens_per_expert, num_experts, _ = tiles
    expert, segment_row = segment
    rows = segment_row_tiles(tokens_per_expert, expert, num_experts) * TILE_ROWS
    while (expert < num_experts) & (segment_row + rows <= first_row):
        segment_row = segment_row + rows
        expert = expert + 1
        rows = segment_row_tiles(tokens_per_expert, expert, num_experts) * TILE_ROWS
    row_tiles = (cutlass.min(segment_row + rows, end_row) - first_row) // TILE_ROWS
    return (expert, segment_row), (expert, Int32(0), first_row, row_tiles)


@cute.jit
def locate_first_tile(tiles: TileList, tile: Int32):
    """The cursor (expert, tile_base, row_base, row_tiles) of a CTA's first tile, `tile`."""
    expert = Int32(0)
    tile_base = Int32(0)
    row_base = Int32(0)
    row_tiles = segment_row_tiles(tiles.tokens_per_expert, expert, tiles.num_experts)
    return locate_tile(tiles, tile, (expert, tile_base, row_base, row_tiles))
