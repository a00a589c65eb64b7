"""One-row TMA boxes and 16-byte cp.async (mok/dsl_kernels/sm90/row_tma_probe.py,
mok/dsl_kernels/common/row_tma.py) fill a 128-byte-swizzled stage as one 128-row box does: the
stage a 128-row box writes is the swizzle of its rows (the layout wgmma reads), and so are the
stages of 128 one-row boxes and of cp.async from random rows, out-of-bounds rows zero. `out`
is poisoned first."""

import pytest
import torch

from tools import row_tma_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("src_rows", "hidden", "seed"), [(300, 128, 0), (4096, 2048, 1)])
def test_one_row_boxes_fill_the_swizzled_stage(src_rows, hidden, seed):
    src, index = row_tma_probe.make_inputs(src_rows, hidden, 128, torch.device("cuda"), seed)
    index[3::7] = -1
    assert row_tma_probe.check(src, index) == (True, True, True)
