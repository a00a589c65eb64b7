"""The copy probe (mok/dsl_kernels/sm90/copy_probe.py) copies what tools/copy_probe.py times:
every destination row is its source row bit for bit, for both modes, on 1, 3 and every SM, with
more rows than a CTA's staging holds (the bulk mode's slots refilled), the destination poisoned
first."""

import pytest
import torch

from tools import copy_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


CASES = [(mode, rows) for mode in copy_probe.MODES for rows in (7, 1000)]


@pytest.mark.parametrize(("mode", "rows"), CASES)
def test_probe_copies_every_row_exactly(mode, rows):
    src, index = copy_probe.make_rows(rows, torch.device("cuda"), seed=rows)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    for ctas in (1, 3, sms):
        assert copy_probe.check(mode, src, index, ctas), (mode, rows, ctas)
