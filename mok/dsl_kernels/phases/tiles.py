"""The tile geometry the phases and every GEMM engine share (docs/DESIGN.md §4).

A task is one TILE_M-row tile of the expert-major routed buffer (whose segments are padded to
TILE_M rows: mok/launchers/device_args.TILE_ROWS) by a phase's column tile, which the engine
hands to the crew as blocks of TILE_M x TILE_N. Task numbers, row-tile counters and crew store
offsets are counted in these units, so an engine must compute exactly these tiles.
"""

TILE_M = 128  # rows per task tile (an engine's M per CTA)
TILE_N = 128  # columns per hand-off block (each of the engine's two accumulators)
