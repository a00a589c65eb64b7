"""The compute ceiling of each candidate MXFP8 GEMM engine on Hopper, measured without memory.

Each CTA holds one 128 x 128 output tile (two warpgroups of 64 rows, m64n128 wgmma) and one
stage of A [128, K] and B [128, K] in shared memory (128 bytes of K a row: 64 bf16 or 128 E4M3,
four wgmma K-blocks), and runs `iterations` passes over that stage: no global loads, no
barriers, so its time is the tensor cores' and the CUDA cores' alone. Engines (compile time):

- `bf16`: bf16 wgmma accumulating in fp32, the engine mok runs (the MXFP8 operands
  dequantised to bf16 are exact, DESIGN.md §4).
- `fp8`: E4M3 wgmma accumulating in fp32 with no scales: the FP8 tensor-core ceiling, which no
  MXFP8 engine reaches (MXFP8 needs a scale per 32 of K, Hopper's wgmma has none).
- `fp8_promote1`: each 32-deep K-block into a fresh fp32 partial (ACCUMULATE off), added to
  the accumulator with one `fma.rn.f32` by one uniform scale: one op per accumulator per
  K-block, below any real MXFP8 engine (whose scale differs per row and column).
- `fp8_promote2`: the real promotion: the partial times row scale x column scale (the two
  operands' 2^e of that K-block, fp32 in shared memory, loaded once a K-block per row and
  column the thread holds), `mul.rn.f32` then `fma.rn.f32`: two ops per accumulator.

The promoting engines wait for each K-block's partial before adding it (one warpgroup's adds
overlap the other's wgmma); a second partial in flight while the first is added made ptxas
serialise the wgmma (its warning C7514), so that is not built.

Kernel parameters: `WgmmaProbeArgs`. Operands, written by the kernel (exact in E4M3 and
bf16): A[r, k] = ((7 r + 3 k) % 5 - 2) / 2, B[c, k] = ((5 c + k) % 5 - 2) / 2; `fp8_promote2`'s
scales of K-block j: rows 2^((r + j) % 3 - 1), columns 2^((5 c + j) % 3 - 1). Every CTA
computes the same tile; with these values every sum is exact in fp32 for iterations <= 1000
(`mok.reference`-free: tests/gpu/test_wgmma_probe_gpu.py builds the expected tile in fp64).

Launch: grid (n, 1, 1), block (256, 1, 1), cluster (1, 1, 1); one CTA an SM at n = SM count.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint8, Uint16

from ..common.params import aligned_pointer
from ..common.ptx import fma_rn, mul_rn
from .gemm_engine import fence_accumulators, k_major_smem_layout, make_tiled_mma

ENGINES = ("bf16", "fp8", "fp8_promote1", "fp8_promote2")
TILE = 128  # rows (two warpgroups x 64) and columns of the output tile
ROW_BYTES = 128  # bytes of K per operand row: one 128-byte swizzle atom row
THREADS = 256
SCALES = 2 * TILE  # fp32 scales per K-block: rows, then columns
FRAGMENT = 64  # fp32 accumulator elements per thread of an m64n128 tile
# The operands' values: ((a * index + b * k) % 5 - 2) / 2 as E4M3 and bf16 bits, by residue.
E4M3_HALVES = (0xB8, 0xB0, 0x00, 0x30, 0x38)  # -1, -0.5, 0, 0.5, 1
BF16_HALVES = (0xBF80, 0xBF00, 0x0000, 0x3F00, 0x3F80)

OutPointer = aligned_pointer(Float32, 16)


class WgmmaProbeArgs(NamedTuple):
    """`Sm90WgmmaProbe`'s parameters, in order."""

    # fp32 [grid, 128, 128], row-major: each CTA's accumulator (16-byte aligned)
    out_ptr: OutPointer
    iterations: Int32  # > 0
    scale: Float32  # `fp8_promote1`'s


@dataclass(frozen=True)
class Sm90WgmmaProbe:
    engine: str = "bf16"

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def dtype(self):
        return BFloat16 if self.engine == "bf16" else Float8E4M3FN

    @property
    def tile_k(self) -> int:
        return ROW_BYTES // (2 if self.engine == "bf16" else 1)

    @cute.jit
    def __call__(self, args: WgmmaProbeArgs):
        self.kernel(args).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1
        )  # the runtime launches the cubin with its own grid

    @cute.kernel
    def kernel(self, args: WgmmaProbeArgs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        K = cute.nvgpu.OperandMajorMode.K
        tiled_mma = make_tiled_mma(K, K, self.dtype)
        layout = k_major_smem_layout(TILE, 1, self.dtype, self.tile_k)

        @cute.struct
        class SharedStorage:
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
            scales: cute.struct.Align[cute.struct.MemRange[Float32, 4 * SCALES], 16]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        self._write_operands(storage, layout, tidx)
        sA = storage.sA.get_tensor(layout.outer, swizzle=layout.inner)
        sB = storage.sB.get_tensor(layout.outer, swizzle=layout.inner)
        sS = storage.scales.get_tensor(cute.make_layout(4 * SCALES))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc_shape = thr_mma.partition_shape_C((TILE, TILE))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        assert cute.size(acc) == FRAGMENT, "the loops below assume the m64n128 fragment"
        acc.fill(0.0)
        coords = thr_mma.partition_C(cute.make_identity_tensor((TILE, TILE)))
        if cutlass.const_expr(self.engine in ("bf16", "fp8")):
            self._accumulate(tiled_mma, tCrA, tCrB, acc, args.iterations)
        else:
            self._promote_blocks(
                tiled_mma, tCrA, tCrB, acc, args.iterations, args.scale, sS, coords
            )

        gC = cute.make_tensor(
            args.out_ptr + bidx * TILE * TILE, cute.make_layout((TILE, TILE), stride=(TILE, 1))
        )
        tCgC = thr_mma.partition_C(gC)
        for chunk in cutlass.range_constexpr(FRAGMENT // 4):
            for v in cutlass.range_constexpr(4):
                tCgC[4 * chunk + v] = acc[4 * chunk + v]

    @cute.jit
    def _write_operands(self, storage, layout, tidx: Int32):
        """A, B (by logical coordinate, through the swizzled layout) and the scales."""
        bits = Uint16 if cutlass.const_expr(self.engine == "bf16") else Uint8
        halves = BF16_HALVES if cutlass.const_expr(self.engine == "bf16") else E4M3_HALVES
        sA = storage.sA.get_tensor(layout.outer, swizzle=layout.inner, dtype=bits)
        sB = storage.sB.get_tensor(layout.outer, swizzle=layout.inner, dtype=bits)
        for index in cutlass.range(tidx, TILE * self.tile_k, THREADS, unroll=1):
            row = index // self.tile_k
            k = index % self.tile_k
            sA[(row, k, 0)] = _pick((7 * row + 3 * k) % 5, halves, bits)
            sB[(row, k, 0)] = _pick((5 * row + k) % 5, halves, bits)
        sS = storage.scales.get_tensor(cute.make_layout(4 * SCALES))
        for index in cutlass.range(tidx, 4 * SCALES, THREADS, unroll=1):
            block = index // SCALES
            i = index % SCALES
            residue = (i + block) % 3
            if i >= TILE:
                residue = (5 * (i - TILE) + block) % 3
            sS[index] = _pick(residue, (0.5, 1.0, 2.0), Float32)

    @cute.jit
    def _accumulate(self, tiled_mma, tCrA, tCrB, acc, iterations: Int32):
        """acc += A B^T `iterations` times: every wgmma accumulates, one batch in flight."""
        k_blocks = cute.size(tCrA, mode=[2])
        fence_accumulators((acc,))
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        for _ in cutlass.range(iterations, unroll=1):
            for k_block in cutlass.range_constexpr(k_blocks):
                coord = (None, None, k_block, 0)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
        cute.nvgpu.warpgroup.wait_group(0)
        fence_accumulators((acc,))

    @cute.jit
    def _promote_blocks(self, tiled_mma, tCrA, tCrB, acc, iterations: Int32, scale: Float32, sS,
                        coords):  # fmt: skip
        """acc += s_j * (A_j B_j^T) per K-block j: each block's partial by its own wgmma
        (ACCUMULATE off), waited for, then added; the other warpgroup's wgmma runs meanwhile."""
        k_blocks = cute.size(tCrA, mode=[2])
        partial = cute.make_rmem_tensor(acc.shape, Float32)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        for _ in cutlass.range(iterations, unroll=1):
            for k_block in cutlass.range_constexpr(k_blocks):
                fence_accumulators((partial,))
                cute.nvgpu.warpgroup.fence()
                coord = (None, None, k_block, 0)
                cute.gemm(tiled_mma, partial, tCrA[coord], tCrB[coord], partial)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                fence_accumulators((partial,))
                self._add(acc, partial, k_block, scale, sS, coords)

    @cute.jit
    def _add(self, acc, partial, k_block: int, scale: Float32, sS, coords):
        """acc += s * partial: s = `scale` (fp8_promote1), or the K-block's row scale times
        column scale. The m64n128 accumulator fragment: element v0 + 2 v1 + 4 v2 is row v1
        (of the thread's two) and column v0 + 2 v2 (of its 32); each scale loaded once."""
        if cutlass.const_expr(self.engine == "fp8_promote1"):
            for chunk in cutlass.range_constexpr(FRAGMENT // 4):
                for v in cutlass.range_constexpr(4):
                    i = 4 * chunk + v
                    acc[i] = fma_rn(partial[i], scale, acc[i])
        else:
            base = k_block * SCALES
            rows = cute.make_rmem_tensor((2,), Float32)
            cols = cute.make_rmem_tensor((FRAGMENT // 2,), Float32)
            for v1 in cutlass.range_constexpr(2):
                rows[v1] = sS[base + coords[2 * v1][0]]
            for v2 in cutlass.range_constexpr(FRAGMENT // 4):
                for v0 in cutlass.range_constexpr(2):
                    cols[v0 + 2 * v2] = sS[base + TILE + coords[v0 + 4 * v2][1]]
            for v2 in cutlass.range_constexpr(FRAGMENT // 4):
                for v1 in cutlass.range_constexpr(2):
                    for v0 in cutlass.range_constexpr(2):
                        i = v0 + 2 * v1 + 4 * v2
                        both = mul_rn(rows[v1], cols[v0 + 2 * v2])
                        acc[i] = fma_rn(partial[i], both, acc[i])


@cute.jit
def _pick(index, values: tuple, dtype):
    """dtype(values[index]) for a dynamic index in range (a select chain, no local table)."""
    chosen = dtype(values[0])
    for i in cutlass.range_constexpr(1, len(values)):
        if index == i:
            chosen = dtype(values[i])
    return chosen
