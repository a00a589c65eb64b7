"""Input-value checks fused into the kernels that load the values anyway.

A bad value stores a nonzero word into the value-status words (mapped host memory, layout in
mok/launchers/status.py) and the kernel goes on: nothing it writes depends on the check, and
every index it forms stays in bounds whatever the value. Plain weak stores: the host reads the
words at its next call, and after a sync in check_errors, which orders them.
"""

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from .bounded_wait import _i32, _i64, side_effect_asm

# Word indices (mok/launchers/status.py mirrors them; tests/test_value_checks_build.py compares).
STATUS_SCHEDULE_OVERFLOW = 0
STATUS_BAD_EXPERT_ID = 4
STATUS_BAD_WEIGHT_FORWARD = 6
STATUS_BAD_WEIGHT_BACKWARD = 7

# The largest finite fp32: a router weight must be > 0 and at most this (NaN fails both).
FP32_MAX_BITS = "0f7F7FFFFF"


@dsl_user_op
def load_checked_id(
    address: Int64, num_ids: Int64, status_address: Int64, *, loc=None, ip=None
) -> Int32:
    """Load one int64 expert id and return its low 32 bits; an id outside [0, num_ids) (one
    unsigned compare covers negatives) stores [1, num_ids] at `status_address`."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [
                _i64(address, loc, ip),
                _i64(num_ids, loc, ip),
                _i64(status_address, loc, ip),
                _i32(cutlass.Int32(1), loc, ip),
            ],
            "{\n.reg .b64 wide;\n.reg .b32 limit;\n.reg .pred bad;\n"
            "ld.global.nc.s64 wide, [$1];\n"
            "setp.ge.u64 bad, wide, $2;\n"
            "cvt.u32.u64 $0, wide;\n"
            "cvt.u32.u64 limit, $2;\n"
            "@bad st.global.b32 [$3], $4;\n"
            "@bad st.global.b32 [$3+4], limit;\n}",
            "=r,l,l,l,r,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def flag_unless_positive_finite(
    value: Float32, status_address: Int64, flag: Int32, *, loc=None, ip=None
) -> None:
    """Store `flag` at `status_address` unless 0 < value <= FP32_MAX (NaN and inf are bad)."""
    side_effect_asm(
        None,
        [
            Float32(value).ir_value(loc=loc, ip=ip),
            _i64(status_address, loc, ip),
            _i32(flag, loc, ip),
        ],
        "{\n.reg .pred ok;\n"
        "setp.gt.f32 ok, $0, 0f00000000;\n"
        f"setp.le.and.f32 ok, $0, {FP32_MAX_BITS}, ok;\n"
        "@!ok st.global.b32 [$1], $2;\n}",
        "f,l,r,~{memory}",
        loc,
        ip,
    )
