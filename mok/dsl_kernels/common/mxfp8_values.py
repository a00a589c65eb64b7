"""MXFP8 values inside the GEMM kernels (SEMANTICS §5): dequantising E4M3 bytes into bf16 and
the bf16 round trip of a 32-element block, both exact.

An E4M3 value times a power-of-two UE8M0 scale has at most 4 significant bits and an exponent in
fp32's range, so it is a bf16: `e4m3x2_to_bf16x2` gives the exact values `mok.reference`'s
`mxfp8_dequantize` gives, and `round_trip_chunk` the values of `mxfp8_round_trip` (quantised as
kernels/mxfp8_quantize_rowwise.py quantises, then dequantised).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint16, Uint32
from cutlass.cute.arch import inline_ptx
from cutlass.cutlass_dsl import dsl_user_op

from .ptx import cvt_e4m3x2_rn_satfinite, mul_rn, mxfp8_scale_from_amax

BLOCK = 32  # elements sharing one scale
CHUNK = 8  # bf16 elements per 16-byte chunk: a block is 4 chunks in 4 adjacent lanes


@dsl_user_op
def e4m3x2_to_bf16x2(pair: Uint16, scale_bits: Uint32, *, loc=None, ip=None) -> Uint32:
    """Two E4M3 bytes (low byte first) times the fp32 whose bits are `scale_bits` (a power of
    two, or 0), as packed bf16x2 (low half first). Exact: E4M3 -> f16 -> f32 are exact, the
    product is exact (mul.rn), and it is a bf16."""
    return inline_ptx(
        "{\n"
        ".reg .b32 p;\n"
        ".reg .f16 a, b;\n"
        ".reg .f32 x, y;\n"
        "cvt.rn.f16x2.e4m3x2 p, {$r0};\n"
        "mov.b32 {a, b}, p;\n"
        "cvt.f32.f16 x, a;\n"
        "cvt.f32.f16 y, b;\n"
        "mul.rn.f32 x, x, {$r1};\n"
        "mul.rn.f32 y, y, {$r1};\n"
        "cvt.rn.bf16x2.f32 {$w0}, y, x;\n"
        "}",
        write_only_types=[Uint32],
        read_only_args=[Uint16(pair), Uint32(scale_bits)],
        loc=loc,
        ip=ip,
    )


@cute.jit
def dequantize_word(word: Uint32, scale_bits: Uint32, out: cute.Tensor, at: int):
    """out[at], out[at + 1] (Uint32 bf16x2) = the 4 E4M3 bytes of `word` times the scale."""
    out[at] = e4m3x2_to_bf16x2(Uint16(word & Uint32(0xFFFF)), scale_bits)
    out[at + 1] = e4m3x2_to_bf16x2(Uint16(word >> Uint32(16)), scale_bits)


@cute.jit
def scale_bits_of(byte: Uint32) -> Uint32:
    """The fp32 bits of a UE8M0 scale byte's value 2^(byte - 127) (byte 0: +0.0, as
    mok.reference.mxfp8_dequantize builds it)."""
    return (byte & Uint32(0xFF)) << Uint32(23)


@cute.jit
def block_amax(values: cute.Tensor, lane_stride: cutlass.Constexpr[int] = 1) -> Float32:
    """max |v| of a 32-element block whose 8-element chunks (this lane's fp32 `values`) are in 4
    lanes: the adjacent ones (lane bits 0 and 1), or those `lane_stride` apart (stride 8: lane
    bits 3 and 4), every one of which must call this together."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(CHUNK):
        amax = cute.arch.fmax(amax, cute.arch.fmax(values[i], -values[i]))
    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=lane_stride))
    return cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=2 * lane_stride))


@cute.jit
def quantize_chunk(values: cute.Tensor, packed: cute.Tensor,
                   lane_stride: cutlass.Constexpr[int] = 1):  # fmt: skip
    """`packed` (Uint32 [2]) = this lane's 8 fp32 `values` as E4M3 bytes (element 0 lowest)
    under its block's scale (the lanes as `block_amax`'s); returns the UE8M0 scale byte. The
    quantisers' math (kernels/mxfp8_quantize_rowwise.py)."""
    scale_byte, inv_scale = mxfp8_scale_from_amax(block_amax(values, lane_stride))
    for w in cutlass.range_constexpr(CHUNK // 4):
        lo = cvt_e4m3x2_rn_satfinite(
            mul_rn(values[4 * w], inv_scale), mul_rn(values[4 * w + 1], inv_scale)
        )
        hi = cvt_e4m3x2_rn_satfinite(
            mul_rn(values[4 * w + 2], inv_scale), mul_rn(values[4 * w + 3], inv_scale)
        )
        packed[w] = Uint32(lo) | (Uint32(hi) << 16)
    return scale_byte


@cute.jit
def round_trip_chunk(values: cute.Tensor, out: cute.Tensor,
                     lane_stride: cutlass.Constexpr[int] = 1):  # fmt: skip
    """`out` (Uint32 [4], bf16x2) = the MXFP8 round trip of this lane's 8 fp32 `values` (bf16
    values widened), its block's lanes as `block_amax`'s."""
    scale_byte, inv_scale = mxfp8_scale_from_amax(block_amax(values, lane_stride))
    scale_bits = scale_bits_of(scale_byte)
    for w in cutlass.range_constexpr(CHUNK // 2):
        pair = cvt_e4m3x2_rn_satfinite(
            mul_rn(values[2 * w], inv_scale), mul_rn(values[2 * w + 1], inv_scale)
        )
        out[w] = e4m3x2_to_bf16x2(pair, scale_bits)


@cute.jit
def store_round_trip(chunk, rounded_ptr: cute.Pointer, at: Int64):
    """Store the MXFP8 round trip of `chunk` (this lane's 8 bf16 values of a 32-element block,
    as `round_trip_chunk` takes them) at element `at` (a multiple of 8) of bf16 `rounded_ptr`."""
    widened = cute.make_rmem_tensor((CHUNK,), Float32)
    widened.store(chunk.to(Float32))
    words = cute.make_rmem_tensor((CHUNK // 2,), Uint32)
    round_trip_chunk(widened, words)
    word_at = cute.assume(at // Int64(2), divby=4)
    rounded = cute.make_tensor(cute.recast_ptr(rounded_ptr, dtype=Uint32) + word_at,
                               cute.make_layout(CHUNK // 2))  # fmt: skip
    rounded.store(words.load())


def transpose_halves(first: Uint32, second: Uint32):
    """The 2x2 transpose of two bf16x2 words: (low halves, high halves), each as a bf16x2 word
    (low half from `first`). Turns two words along one axis into two along the other."""
    low = (first & Uint32(0x0000FFFF)) | (second << Uint32(16))
    high = (first >> Uint32(16)) | (second & Uint32(0xFFFF0000))
    return low, high
