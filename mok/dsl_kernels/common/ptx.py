"""Exact-rounding device helpers written as inline PTX.

Why inline PTX: a plain `a * b` or `a + b` on Float32 lowers to `mul.f32` / `add.f32`, which
ptxas is allowed to contract into `fma.rn.f32`; `a / b` may lower to an approximate division.
Kernels whose results must match a PyTorch reference bit for bit use these helpers instead,
whose PTX spells the rounding mode (`.rn`), which forbids contraction and approximation.
"""

from cutlass import Float32, Uint16, Uint32
from cutlass.cute.arch import inline_ptx
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`a * b` rounded to nearest even, never fused into an fma, subnormals kept."""
    return inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Float32],
        read_only_args=[Float32(a), Float32(b)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`a + b` rounded to nearest even, never fused into an fma, subnormals kept."""
    return inline_ptx(
        "add.rn.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Float32],
        read_only_args=[Float32(a), Float32(b)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """`a * b + c` with one rounding to nearest even (`fma.rn.f32`), never split or reordered."""
    return inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};",
        write_only_types=[Float32],
        read_only_args=[Float32(a), Float32(b), Float32(c)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cvt_e4m3x2_rn_satfinite(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint16:
    """Two fp32 -> packed E4M3x2 (RNE, satfinite: +-448 on overflow); `lo` in the low byte."""
    # PTX puts the first source operand in the upper byte; the low byte is the lower address.
    return inline_ptx(
        "cvt.rn.satfinite.e4m3x2.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Uint16],
        read_only_args=[Float32(hi), Float32(lo)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def mxfp8_scale_from_amax(amax: Float32, *, loc=None, ip=None) -> tuple[Uint32, Float32]:
    """UE8M0 scale byte and exact inverse scale of one MXFP8 block, from its amax.

    q = amax / 448 (div.rn.f32), q = max(q, 1e-12f), scale = q rounded up to a power of two
    (next power of two when q's mantissa bits are nonzero), byte = biased exponent of scale,
    inverse = 2^(127 - byte) built from bits (exact: byte is in [88, 246], so 254 - byte is a
    normal exponent).
    """
    # 0f43E00000 = 448.0 (largest finite E4M3); 0f2B8CBCCC = 1e-12 rounded to fp32.
    return inline_ptx(
        "{\n"
        ".reg .b32 q, m;\n"
        ".reg .pred p;\n"
        "div.rn.f32 q, {$r0}, 0f43E00000;\n"
        "max.f32 q, q, 0f2B8CBCCC;\n"
        "and.b32 m, q, 0x007FFFFF;\n"
        "setp.ne.u32 p, m, 0;\n"
        "@p add.u32 q, q, 0x00800000;\n"
        "shr.u32 {$w0}, q, 23;\n"
        "sub.u32 m, 254, {$w0};\n"
        "shl.b32 {$w1}, m, 23;\n"
        "}",
        write_only_types=[Uint32, Float32],
        read_only_args=[Float32(amax)],
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def fence_operand(value: Float32, *, loc=None, ip=None) -> Float32:
    """`value`, passed through an empty volatile asm (CUTLASS's warpgroup_fence_operand).

    LLVM may move plain arithmetic on a wgmma accumulator across `wgmma.wait_group`, which is an
    asm it cannot see the registers of: reading an accumulator before its wgmma completed. ptxas
    then serialises every wgmma of the kernel (warning C7514) to stay correct. Routing each
    accumulator register through this fence right after the wait (and before the first wgmma)
    pins the order: the fence is ordered after the wait (both have side effects), and every
    later use depends on the fence's result.
    """
    from cutlass._mlir.dialects import llvm  # noqa: PLC0415

    result = llvm.inline_asm(
        Float32.mlir_type,
        [Float32(value).ir_value(loc=loc, ip=ip)],
        "",
        "=f,0",
        has_side_effects=True,
        loc=loc,
        ip=ip,
    )
    return Float32(result)


@dsl_user_op
def prefetch_l2(address, *, loc=None, ip=None) -> None:
    """`prefetch.global.L2 [address]`: bring the 128-byte line at a global byte address into
    L2 (a hint: no result, no fault on any address)."""
    from cutlass import Int64  # noqa: PLC0415

    from .bounded_wait import side_effect_asm  # noqa: PLC0415

    side_effect_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip)],
        "prefetch.global.L2 [$0];",
        "l",
        loc,
        ip,
    )
