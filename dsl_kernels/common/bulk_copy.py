"""Bulk (non-tensor) asynchronous copies between global and shared memory, as inline PTX.

`cp.async.bulk` moves a contiguous run of bytes (a multiple of 16, both addresses 16-byte
aligned) on the TMA engine: one thread issues it, no registers hold the data, and many can be
in flight. The load completes on an mbarrier (transaction bytes); the store joins the issuing
thread's bulk async-group, waited for with `cp.async.bulk.wait_group[.read]` (the DSL's
`cute.arch.cp_async_bulk_commit_group` / `cp_async_bulk_wait_group`). The DSL has no op for the
non-tensor form, hence the asm (bounded_wait.side_effect_asm). Shared addresses are 32-bit
`shared::cta` addresses.
"""

from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from .bounded_wait import side_effect_asm


@dsl_user_op
def bulk_load_to_shared(
    smem_address: Int32, gmem_address: Int64, size: Int32, mbarrier: Int32, *, loc=None, ip=None
) -> None:
    """`size` bytes global -> shared; completes `size` transaction bytes on `mbarrier` (whose
    expected count the issuer raised first, e.g. with `mbarrier_arrive_and_expect_tx`)."""
    side_effect_asm(
        None,
        [
            Int32(smem_address).ir_value(loc=loc, ip=ip),
            Int64(gmem_address).ir_value(loc=loc, ip=ip),
            Int32(size).ir_value(loc=loc, ip=ip),
            Int32(mbarrier).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def bulk_store_from_shared(
    gmem_address: Int64, smem_address: Int32, size: Int32, *, loc=None, ip=None
) -> None:
    """`size` bytes shared -> global, in the issuing thread's current bulk async-group."""
    side_effect_asm(
        None,
        [
            Int64(gmem_address).ir_value(loc=loc, ip=ip),
            Int32(smem_address).ir_value(loc=loc, ip=ip),
            Int32(size).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
        "l,r,r,~{memory}",
        loc,
        ip,
    )
