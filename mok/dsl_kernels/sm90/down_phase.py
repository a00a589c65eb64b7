"""Down GEMM to slots (SEMANTICS §2): for every routed row r of expert e with peer_rank[r] >= 0,

    slots[peer_token_idx[r]] = bf16(hidden[r] @ W_down[e].T)

One 128 x 256 tile is two adjacent 128-column blocks of W_down (B0, B1); the crew stores each
row at its (token, j) slot (epilogue_warps.slot_stores), where the combine reads it.
"""

from . import gemm_engine as engine
from .gemm_engine import TILE_K, TILE_M, TILE_N


def producer_loads(ring, smem, tma, hidden_size, intermediate_size):
    """Producer: `load(state, expert, col_tile, row_tile)` of a down task over `tma` = (tma_h, mH,
    tma_wd, mWd) into `smem` = (sA, sB0, sB1)."""
    sA, sB0, sB1 = smem
    tma_h, mH, tma_wd, mWd = tma
    tHsH, tHgH = engine.partition_tma_load(tma_h, sA, mH, (TILE_M, TILE_K))
    tDsD0, tDgD = engine.partition_tma_load(tma_wd, sB0, mWd, (TILE_N, TILE_K))
    tDsD1, _ = engine.partition_tma_load(tma_wd, sB1, mWd, (TILE_N, TILE_K))

    def load(state, expert, col_tile, row_tile):
        weight_tile = expert * (hidden_size // TILE_N) + 2 * col_tile
        loads = (
            (tma_h, tHgH, row_tile, None, tHsH),
            (tma_wd, tDgD, weight_tile, None, tDsD0),
            (tma_wd, tDgD, weight_tile + 1, None, tDsD1),
        )
        return engine.load_k_tiles(ring, state, intermediate_size // TILE_K, loads)

    return load
