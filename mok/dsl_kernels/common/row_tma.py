"""Rows gathered by any lane: TMA copies with coordinates of its own (a row a box), and 16-byte
`cp.async` copies completing on an mbarrier.

The DSL issues every TMA copy of `cute.copy` from one lane it elects, so 128 rows with 128
different source coordinates would be 128 elected copies in a row. These helpers are the PTX
instructions themselves: each lane of a warp that calls one issues its own copy. The
descriptor is a kernel parameter (a `cute.CopyAtom` argument, 128 bytes in param space, as the
runtime passes every TMA descriptor); `descriptor_address` is its generic address.

With the 128-byte swizzle, TMA places a box by the shared address it writes, so a one-row box
(64 bf16, 128 bytes) written at byte 128 r of a 1024-byte aligned stage lands where row r of a
128-row box would: the layout wgmma reads (tests/gpu/test_row_tma_probe_gpu.py checks this on
the GPU, sm90/row_tma_probe.py). Used by the probe only: a stage of one-row boxes, and one
warp's `cp.async`, fill a stage far slower than one 128-row box (docs/NOTES.md §18 item 9).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir
from cutlass.cute.core import _cute_ir, _to_mlir_address_space
from cutlass.cute.typing import AddressSpace
from cutlass.cutlass_dsl import dsl_user_op

from .bounded_wait import _i32, _i64, side_effect_asm

# A row coordinate past every tensor the megakernels gather from (they have < 2^30 rows, the
# engine's MAX_ROWS): its box is out of bounds, so TMA writes zeros and still counts its bytes.
ROW_OUT_OF_BOUNDS = 1 << 30


@dsl_user_op
def descriptor_address(atom: cute.CopyAtom, *, loc=None, ip=None) -> Int64:
    """The generic address of the TMA descriptor that `atom` (a kernel parameter) holds."""
    pointer_type = _cute_ir.PtrType.get(
        Int64.mlir_type, _to_mlir_address_space(AddressSpace.generic), 64, None
    )
    exec_atom = _cute_nvgpu_ir.atom_make_exec_tma(atom._trait.value, loc=loc, ip=ip)
    return _cute_nvgpu_ir.get_tma_desc_addr(pointer_type, exec_atom, loc=loc, ip=ip).toint(
        loc=loc, ip=ip
    )


@dsl_user_op
def load_box_2d(descriptor: Int64, smem: Int32, barrier: Int32, col: Int32, row: Int32, *,
                loc=None, ip=None) -> None:  # fmt: skip
    """This lane's TMA load of the box at (col, row) (innermost first) to shared byte address
    `smem`, its bytes completing on the mbarrier at shared address `barrier`."""
    side_effect_asm(
        None,
        [_i32(smem, loc, ip), _i64(descriptor, loc, ip), _i32(col, loc, ip),
         _i32(row, loc, ip), _i32(barrier, loc, ip)],
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[$0], [$1, {$2, $3}], [$4];",
        "r,l,r,r,r,~{memory}",
        loc,
        ip,
    )  # fmt: skip


@dsl_user_op
def cp_async_16(smem: Int32, source: Int64, size: Int32, *, loc=None, ip=None) -> None:
    """This lane's 16-byte `cp.async` global -> shared (L2 only); `size` 0 writes 16 zero bytes
    and reads nothing, `size` 16 copies."""
    side_effect_asm(
        None,
        [_i32(smem, loc, ip), _i64(source, loc, ip), _i32(size, loc, ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def cp_async_arrive_noinc(barrier: Int32, *, loc=None, ip=None) -> None:
    """An arrival on the mbarrier at shared address `barrier` once every `cp.async` this lane
    issued before is complete; the barrier's expected count includes it (`.noinc`)."""
    side_effect_asm(
        None,
        [_i32(barrier, loc, ip)],
        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
        "r,~{memory}",
        loc,
        ip,
    )


@cute.jit
def gather_k_tile(stage_at: Int32, table, src_at: Int64, row_bytes: Int64, col: Int32,
                  first_row: Int32 = 0, rows: int = 128):  # fmt: skip
    """One warp: one k-tile of `rows` rows from `first_row` (a multiple of 8; 64 bf16 from column
    `col`) into the 128-byte-swizzled K-major stage at shared byte address `stage_at`
    (1024-byte aligned) by 16-byte `cp.async`: lane l copies chunk l % 8 of rows first_row +
    l // 8 + 4 j (j < rows / 4), so each instruction reads four whole 128-byte row pieces; row
    r's source is row `table[r]` (shared Int32 [128]; negative: zeros) of the row-major tensor
    at global address `src_at`, `row_bytes` a row. The caller makes the copies complete on a
    barrier (`cp_async_arrive_noinc`)."""
    lane = cute.arch.lane_idx()
    chunk = lane % 8
    group = lane // 8
    for j in cutlass.range_constexpr(rows // 4):
        r = first_row + group + 4 * j
        source = table[r]
        size = cutlass.select_(source >= 0, Int32(16), Int32(0))
        at = src_at + Int64(cutlass.max(source, 0)) * row_bytes + Int64(2 * col + 16 * chunk)
        # Row r's chunk c sits at chunk c ^ (r % 8) of its 128 bytes; r % 8 = group + 4 (j % 2).
        cp_async_16(stage_at + r * 128 + ((chunk ^ (group + 4 * (j % 2))) * 16), at, size)
