"""Device-side tile list of a grouped GEMM over the expert-major routed buffer (segments padded to
TILE_M). Tiles go expert by expert, m fastest, then n, so concurrent CTAs share weight tiles in L2:

    tile = tiles_before(e) + n * row_tiles(e) + m,   row_tiles(e) = tokens_per_expert[e] / 128

Walks only move forward, reading `tokens_per_expert` once per expert.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .tiles import TILE_M


@cute.jit
def segment_row_tiles(tokens_per_expert: cute.Tensor, expert: Int32, num_experts: Int32) -> Int32:
    """Row tiles of `expert`, or 0 past the last expert (no read out of bounds)."""
    rows = tokens_per_expert[cutlass.min(expert, num_experts - 1)]
    tiles = rows // TILE_M
    if expert >= num_experts:
        tiles = Int32(0)
    return tiles


class TileList(NamedTuple):
    """Padded segment sizes (device memory), number of experts, column tiles per expert."""

    tokens_per_expert: cute.Tensor
    num_experts: Int32
    col_tiles: Int32


@cute.jit
def locate_tile(tiles: TileList, tile: Int32, cursor: tuple, end_row=None):
    """Advance the cursor (expert, tile_base, row_base, row_tiles) to the expert owning `tile`.

    `tile` must not decrease between calls; `expert == num_experts` means past the end.
    `end_row` cuts the segments at a minibatch window's end (window_cursor)."""
    tokens_per_expert, num_experts, col_tiles = tiles
    expert, tile_base, row_base, row_tiles = cursor
    advance = (expert < num_experts) & (tile >= tile_base + row_tiles * col_tiles)
    while advance:
        tile_base = tile_base + row_tiles * col_tiles
        row_base = row_base + row_tiles * TILE_M
        expert = expert + 1
        row_tiles = segment_row_tiles(tokens_per_expert, expert, num_experts)
        if cutlass.const_expr(end_row is not None):
            row_tiles = cutlass.min(row_tiles, (end_row - row_base) // TILE_M)
        advance = (expert < num_experts) & (tile >= tile_base + row_tiles * col_tiles)
    return expert, tile_base, row_base, row_tiles


@cute.jit
def window_cursor(tiles: TileList, segment: tuple, first_row: Int32, end_row: Int32):
    """The tile list of rows first_row .. end_row - 1 (a minibatch), tiles numbered from 0.
    `segment` (expert, its first row) is where the previous window began (windows only move
    forward). Returns (this window's segment, cursor of its tile 0 for locate_tile)."""
    tokens_per_expert, num_experts, _ = tiles
    expert, segment_row = segment
    rows = segment_row_tiles(tokens_per_expert, expert, num_experts) * TILE_M
    while (expert < num_experts) & (segment_row + rows <= first_row):
        segment_row = segment_row + rows
        expert = expert + 1
        rows = segment_row_tiles(tokens_per_expert, expert, num_experts) * TILE_M
    row_tiles = (cutlass.min(segment_row + rows, end_row) - first_row) // TILE_M
    return (expert, segment_row), (expert, Int32(0), first_row, row_tiles)


@cute.jit
def locate_first_tile(tiles: TileList, tile: Int32):
    """The cursor (expert, tile_base, row_base, row_tiles) of a CTA's first tile, `tile`."""
    expert = Int32(0)
    tile_base = Int32(0)
    row_base = Int32(0)
    row_tiles = segment_row_tiles(tiles.tokens_per_expert, expert, tiles.num_experts)
    return locate_tile(tiles, tile, (expert, tile_base, row_base, row_tiles))
