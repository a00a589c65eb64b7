"""MXFP8 weights in the SM90 engine, dequantised to bf16 (issue 18's first engine; the choice and
its measurements are in docs/NOTES.md, "MXFP8 forward on the GPU").

The producer's TMA brings each stage's A tile (bf16, already the MXFP8 round trip of x or
hidden) and the two weight tiles as E4M3 bytes (128 x 64, 64-byte swizzle) into a ring of
`stages`; the consumers turn a stage's bytes into bf16 times their UE8M0 scales (exact,
common/mxfp8_values.py) in one of two bf16 buffers, which the bf16 wgmma reads. Consumer thread
c (0 .. 255) converts row c % 128 of weight tile c // 128, reading its scale word from global
memory (SWIZZLE_32_4_4, mok.reference.mxfp8_quantize). Tile k + 1 is converted while tile k's
wgmmas run; the two warpgroups meet on DEQUANT_BARRIER after each tile's wgmmas completed and
the next tile is written, so a buffer is rewritten only after both finished reading it.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8, Uint32

from ..common.mxfp8_values import dequantize_word, scale_bits_of
from .gemm_phases import (
    NUM_CONSUMER_WARPGROUPS,
    THREADS_PER_WARPGROUP,
    TILE_K,
    TILE_M,
    TILE_N,
    fence_accumulators,
    k_major_smem_layout,
)

BF16_BUFFERS = 2
DEQUANT_BARRIER = 7  # named barrier of the 256 consumer threads (epilogue_warps uses 3 .. 6)
CONSUMER_THREADS = NUM_CONSUMER_WARPGROUPS * THREADS_PER_WARPGROUP
# Ring stages beside the crew: A + two E4M3 tiles (32 KiB) per stage and two 32 KiB bf16
# buffers leave room for 3 next to the crew's swizzled 64.5 KiB hand-off blocks (225.6 KiB of
# the 227; the padded 68.5 KiB ones would need 229.6).
MAX_STAGES_WITH_CREW = 3
SCALE_GROUP = 128  # K elements of one 4-byte scale word (4 blocks of 32)
WORDS_PER_CHUNK = 4  # 16 bytes


def fp8_smem_layout(stages: int):
    """Staged (TILE_N, TILE_K, stages) K-major E4M3 tiles with the 64-byte swizzle (a row is
    64 bytes): the TMA's layout, read back by `dequantize_row`."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        cute.nvgpu.warpgroup.SmemLayoutAtomKind.K_SW64, Uint8
    )
    return cute.tile_to_shape(atom, (TILE_N, TILE_K, stages), order=(0, 1, 2))


def bf16_buffer_layout():
    """The two bf16 weight buffers the wgmma reads: the BF16 engine's stage layout."""
    return k_major_smem_layout(TILE_N, BF16_BUFFERS)


def fp8_tma_spec(param: str) -> dict:
    """A manifest descriptor spec of an E4M3 weight view [rows, K]: box 64 x 128, 64B swizzle."""
    return {
        "param": param,
        "dtype": "fp8_e4m3",
        "rank": 2,
        "box": [TILE_K, TILE_N],
        "swizzle": "64B",
        "l2_promotion": "128B",
        "oob_fill": "none",
    }


def stage_tx_bytes() -> int:
    """Bytes one ring stage receives: the bf16 A tile and two E4M3 weight tiles."""
    return 2 * TILE_M * TILE_K + 2 * TILE_N * TILE_K


def fp8_rings(storage, f_layout):
    """(sF0, sF1): the E4M3 rings of `gemm_phases.allocate_operand_ring_storage(...,
    fp8_layout=f_layout)`, swizzled as the TMA writes them."""
    return tuple(
        f.get_tensor(f_layout.outer, swizzle=f_layout.inner) for f in (storage.sF0, storage.sF1)
    )


class WeightScales(NamedTuple):
    """A weight's UE8M0 scales as 4-byte words (SWIZZLE_32_4_4 over its [rows, K] view) and
    K / 128."""

    words: cute.Tensor
    k_groups: Int32


def weight_scales(address: Int64, k_size: Int32) -> WeightScales:
    """`WeightScales` of the uint8 scales at global `address` of a [rows, k_size] weight view."""
    words = cute.make_tensor(
        cute.make_ptr(Uint32, address, cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout(1 << 30),
    )
    return WeightScales(words, k_size // SCALE_GROUP)


class Dequantizer(NamedTuple):
    """A consumer thread's share: raw 4-byte views of its weight operand's E4M3 ring (4 words,
    4 chunks, 128 rows, stages) and bf16 buffers (4 words, 8 chunks, 128 rows, 2), its row."""

    fp8_words: cute.Tensor
    bf16_words: cute.Tensor
    row: Int32


def make_dequantizer(storage, tidx, stages: int) -> Dequantizer:
    """The calling consumer's `Dequantizer`: thread c = tidx - 128 converts row c % 128 of
    operand c // 128 (warpgroup 1 the first weight tile, warpgroup 2 the second)."""
    c = tidx - THREADS_PER_WARPGROUP
    operand = c // TILE_N
    f_ptr = cutlass.select_(
        operand == 0, storage.sF0.data_ptr().toint(), storage.sF1.data_ptr().toint()
    )
    b_ptr = cutlass.select_(
        operand == 0, storage.sB0.data_ptr().toint(), storage.sB1.data_ptr().toint()
    )
    fp8_words = cute.make_tensor(
        cute.make_ptr(Uint32, f_ptr, cute.AddressSpace.smem, assumed_align=1024),
        cute.make_layout((WORDS_PER_CHUNK, 4, TILE_N, stages),
                         stride=(1, WORDS_PER_CHUNK, TILE_K // 4, TILE_N * TILE_K // 4)),
    )  # fmt: skip
    bf16_words = cute.make_tensor(
        cute.make_ptr(Uint32, b_ptr, cute.AddressSpace.smem, assumed_align=1024),
        cute.make_layout((WORDS_PER_CHUNK, 8, TILE_N, BF16_BUFFERS),
                         stride=(1, WORDS_PER_CHUNK, TILE_K // 2, TILE_N * TILE_K // 2)),
    )  # fmt: skip
    return Dequantizer(fp8_words, bf16_words, c % TILE_N)


@cute.jit
def scale_word(dq: Dequantizer, scales: WeightScales, weight_tile: Int32, pair: Int32) -> Uint32:
    """The scales of this thread's row for K tiles 2 pair, 2 pair + 1 (4 blocks of 32)."""
    n = dq.row
    return scales.words[(weight_tile * scales.k_groups + pair) * 128 + (n % 32) * 4 + n // 32]


@cute.jit
def dequantize_row(dq: Dequantizer, stage: Int32, buffer: Int32, word: Uint32, k_tile: Int32):
    """This thread's row of one weight tile, K tile `k_tile` (its scales in `word`): E4M3
    bytes of ring `stage` times their scales into bf16 `buffer`, both in their swizzled places."""
    n = dq.row
    shift = Uint32((k_tile % 2) * 16)
    fp8 = cute.make_rmem_tensor((WORDS_PER_CHUNK,), Uint32)
    halves = (
        cute.make_rmem_tensor((WORDS_PER_CHUNK,), Uint32),
        cute.make_rmem_tensor((WORDS_PER_CHUNK,), Uint32),
    )
    for q in cutlass.range_constexpr(4):
        # 16 bytes = K 16q .. 16q + 15, in 32-element block q // 2; the 64B swizzle XORs the
        # chunk with row bits 1-2, the 128B one of the bf16 rows with row bits 0-2.
        bits = scale_bits_of(word >> (shift + Uint32(8 * (q // 2))))
        fp8.store(dq.fp8_words[None, q ^ ((n >> 1) & 3), n, stage].load())
        for w in cutlass.range_constexpr(WORDS_PER_CHUNK):
            # bytes 4w .. 4w + 3: elements 4w .. 4w + 3 of the 16, two bf16x2 words
            dequantize_word(fp8[w], bits, halves[w // 2], 2 * (w % 2))
        for h in cutlass.range_constexpr(2):
            chunk = (2 * q + h) ^ (n & 7)
            dq.bf16_words[None, chunk, n, buffer].store(halves[h].load())


@cute.jit
def meet_after_dequant():
    """Both consumer warpgroups: the bf16 tile written (visible to the wgmma's async proxy)."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=DEQUANT_BARRIER, number_of_threads=CONSUMER_THREADS)


@cute.jit
def mma_k_tiles_dequant(tiled_mma, ring, read_state, release_state, k_tiles: Int32,
                        operands: tuple, accumulators: tuple, dq: Dequantizer,
                        scales: WeightScales, weight_tile: Int32):  # fmt: skip
    """acc0 = A @ B0, acc1 = A @ B1 over `k_tiles` (>= 1) stages from zero, B from the bf16
    buffers: this thread's row of weight tile `weight_tile` (`scales`) is dequantised into
    buffer k % 2 while tile k - 1's wgmmas run; each scale word is loaded a K tile pair ahead.
    Returns (read, release)."""
    tCrA, tCrB0, tCrB1 = operands
    acc0, acc1 = accumulators
    k_blocks = cute.size(tCrA, mode=[2])
    last_pair = (k_tiles - 1) // 2
    acc0.fill(0.0)
    acc1.fill(0.0)
    fence_accumulators(accumulators)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    word = scale_word(dq, scales, weight_tile, Int32(0))
    ahead = scale_word(dq, scales, weight_tile, cutlass.min(Int32(1), last_pair))
    ring.consumer_wait(read_state)
    dequantize_row(dq, read_state.index, Int32(0), word, Int32(0))
    meet_after_dequant()
    for k_tile in cutlass.range(k_tiles, unroll=1):
        buffer = k_tile % BF16_BUFFERS
        cute.nvgpu.warpgroup.fence()
        for k_block in cutlass.range_constexpr(k_blocks):
            a = (None, None, k_block, read_state.index)
            b = (None, None, k_block, buffer)
            cute.gemm(tiled_mma, acc0, tCrA[a], tCrB0[b], acc0)
            cute.gemm(tiled_mma, acc1, tCrA[a], tCrB1[b], acc1)
        cute.nvgpu.warpgroup.commit_group()
        read_state.advance()
        following = k_tile + 1
        if following < k_tiles:
            if following % 2 == 0:
                word = ahead
                ahead = scale_word(
                    dq, scales, weight_tile, cutlass.min(following // 2 + 1, last_pair)
                )
            ring.consumer_wait(read_state)
            dequantize_row(dq, read_state.index, 1 - buffer, word, following)
        cute.nvgpu.warpgroup.wait_group(0)
        ring.consumer_release(release_state)
        release_state.advance()
        meet_after_dequant()
    fence_accumulators(accumulators)
    return read_state, release_state
