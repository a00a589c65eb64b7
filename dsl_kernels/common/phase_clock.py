"""Per-CTA phase clock stamps for the megakernels (a diagnostic, off unless asked for).

A megakernel given a non-zero `clock` address (an int64 [grid, SLOTS] tensor, zeroed by the
launcher) writes `%globaltimer` (ns) into clock[cta, slot] when one thread of a role reaches
a phase boundary; with address 0 every stamp is a skipped branch. The slot numbering is the
same for both megakernels (the slots below); tools/diag_phase_clock.py reads them back.

    CLOCK_START          thread 0, kernel entry
    CLOCK_DISPATCHED     thread 0, after the dispatch phase (its CTA barrier)
    CLOCK_PHASE_1/2/3    the first consumer thread, after its tasks of GEMM phase 1, 2, 3
                         (forward: gate/up, down; backward: d_hidden, d_x, weights)
    CLOCK_CREW_DONE      the crew's first thread, after its last store
    CLOCK_PRODUCER_DONE  thread 0 (the TMA producer), after its last load was consumed
"""

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from .bounded_wait import _i64, global_timer_ns, side_effect_asm

SLOTS = 8
CLOCK_START = 0
CLOCK_DISPATCHED = 1
CLOCK_PHASE_1 = 2
CLOCK_PHASE_2 = 3
CLOCK_PHASE_3 = 4
CLOCK_CREW_DONE = 5
CLOCK_PRODUCER_DONE = 6


@dsl_user_op
def st_global_b64(address: Int64, value: Int64, *, loc=None, ip=None) -> None:
    """`st.global.b64`: one weak 8-byte store."""
    side_effect_asm(
        None, [_i64(address, loc, ip), _i64(value, loc, ip)], "st.global.b64 [$0], $1;",
        "l,l,~{memory}", loc, ip,
    )  # fmt: skip


@cute.jit
def stamp(clock: Int64, cta: Int32, slot: int):
    """clock[cta, slot] = %globaltimer, when `clock` is not 0 (call from one thread)."""
    if clock != 0:
        st_global_b64(clock + Int64(8) * Int64(cta * SLOTS + slot), global_timer_ns())
