"""mok's ops as torch.library custom ops (`mok::...`), with fake implementations: mok's own
layer ops (mok/layer_ops.py: `build_schedule`, `forward`, `recompute_forward_context`,
`backward`, their `*_mxfp8` forms, `mxfp8_quantize`, `fwd_epilogue`, `bwd_epilogue`, and
`call`, which `mok.functional` runs them through) and the original's raw op set
(mok/original/ops.py, built on mok's). This module only gathers the two.

Each op takes tensors, ints, floats and strings only: the workspace enters as its integer
handle and the EP group as its name. CPU tensors run the PyTorch reference (`mok.reference`);
CUDA tensors run the shipped kernels (`mok.launchers`, the CUDA path's door), or raise
MoKKernelUnavailableError where the kernel has not landed. The fake implementations give output
shapes from input shapes alone, so `torch.compile(fullgraph=True)` traces a whole MoE step with
no graph break.
"""

from __future__ import annotations

from .layer_ops import *  # noqa: F403
from .original.ops import *  # noqa: F403
