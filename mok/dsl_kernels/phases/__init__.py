"""The megakernels' arch-independent phases (`@cute.jit` helpers, no kernel class): the schedule,
dispatch, tickets, tile lists, minibatch steps, the task walk and the in-kernel sums. Integer
work, copies, atomics and bounded waits only: no MMA, no register reallocation, no accumulator
layout. They import common/ only; the GEMM work goes through an arch folder's engine (sm90/),
whose ring and crew they take as arguments (docs/DESIGN.md §4, "The arch boundary")."""
