"""d_x GEMM to slots (SEMANTICS §2): for every routed row r of expert e with peer_rank[r] >= 0,

    slots[peer_token_idx[r]] = bf16(d_gate[r] @ W_gate[e] + d_up[r] @ W_up[e])

one fused K loop over 2 I (the gate half, then the up half, a fixed order). The weights are
read as stored ([I, H]: K rows, N contiguous), so B is MN-major. The crew stores each row at its
(token, j) slot (epilogue_warps.slot_stores), where the backward combine reads it.
"""

from . import gemm_engine as engine
from .gemm_engine import TILE_K, TILE_M


def producer_loads(ring, smem, tma, intermediate_size, gate_up_expert_rows):
    """Producer warp: `load(state, expert, col_tile, row_tile)` of one d_x task, over `tma` =
    (tma_dg, mDg, tma_du, mDu, tma_wg, mWg, tma_wu, mWu) into `smem` = (sA, sB0, sB1); the
    weights' [rows, H] views hold expert e's rows from e * gate_up_expert_rows."""
    sA, sB0, sB1 = smem
    tma_dg, mDg, tma_du, mDu, tma_wg, mWg, tma_wu, mWu = tma
    tDGsA, tDGgA = engine.partition_tma_load(tma_dg, sA, mDg, (TILE_M, TILE_K))
    tDUsA, tDUgA = engine.partition_tma_load(tma_du, sA, mDu, (TILE_M, TILE_K))
    tWGsB0, tWGsB1, tWGgB = engine.partition_tma_load_pair(tma_wg, sB0, sB1, mWg)
    tWUsB0, tWUsB1, tWUgB = engine.partition_tma_load_pair(tma_wu, sB0, sB1, mWu)
    halves = (
        (tma_dg, tDGgA, tDGsA, tma_wg, tWGgB, tWGsB0, tWGsB1),
        (tma_du, tDUgA, tDUsA, tma_wu, tWUgB, tWUsB0, tWUsB1),
    )

    def load(state, expert, col_tile, row_tile):
        b_k_base = expert * (gate_up_expert_rows // TILE_K)
        for half in range(2):  # unrolled at trace time
            tma_a, tAgA, tAsA, tma_b, tBgB, tBsB0, tBsB1 = halves[half]
            loads = (
                (tma_a, tAgA, row_tile, None, tAsA),
                (tma_b, tBgB, 2 * col_tile, b_k_base, tBsB0),
                (tma_b, tBgB, 2 * col_tile + 1, b_k_base, tBsB1),
            )
            state = engine.load_k_tiles(ring, state, intermediate_size // TILE_K, loads)
        return state

    return load
