"""The megakernels' exit: the grid's last CTA zeroes the launch's counters for the next launch.

Every counter of a megakernel launch (per-row-tile flags, tickets, totals) starts at zero. The
launcher zeroes them once, when it makes them; each launch then leaves them zero again: every
CTA, once all its roles are done (no thread of it reads or adds to a counter any more), counts
itself on the exit word, the counters' last int32 (`atom.acq_rel.gpu` after a CTA barrier and
a GPU-scope fence, so it covers every thread's accesses); the CTA that counts last (old value =
grid - 1) has seen every other CTA's exit and zeroes all the words, the exit word included.
The next launch on the stream starts after this one ends, so it sees the zeros. A launch that
traps (a timed-out wait) leaves them as they were, with the CUDA context unusable anyway.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import atom_add_acq_rel_gpu_s32, fence_acq_rel_sys, st_global_b32


@cute.jit
def retire_cta(counters: Int64, num_words: Int32, warp_idx: Int32, grid_size: Int32):
    """Every thread of the CTA, at the kernel's end: count the CTA on the exit word (word
    num_words - 1 at `counters`); the grid's last CTA zeroes words 0 .. num_words - 1 (warp 0)."""
    cute.arch.sync_threads()
    if warp_idx == 0:
        lane = cute.arch.lane_idx()
        old = Int32(0)
        if lane == 0:
            fence_acq_rel_sys()
            old = atom_add_acq_rel_gpu_s32(counters + Int64(4) * Int64(num_words - 1), Int32(1))
        old = cute.arch.shuffle_sync(old, 0)
        if old == grid_size - 1:
            for word in cutlass.range(lane, num_words, 32):
                st_global_b32(counters + Int64(4) * Int64(word), Int32(0))
