"""Placeholder arguments for compiling a kernel with no GPU and no tensors.

`compile_arguments(kernel)` (common/params.py) gives each pointer field of its parameter
bundles a null pointer that carries only the element type and the alignment the kernel may
assume, and each scalar a typed zero (its value is a runtime parameter of the cubin).
"""

import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr


def global_pointer(dtype, assumed_align: int) -> cute.Pointer:
    """A null global-memory pointer with `assumed_align` bytes of alignment (compile only)."""
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=assumed_align)
