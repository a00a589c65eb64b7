"""The wgmma probe (mok/dsl_kernels/sm90/wgmma_probe.py) computes what its engine claims: every
CTA's 128 x 128 tile equals the fp64 tile exactly (operands and scales exact in fp32 sums), for
each engine, on 2 CTAs and on every SM, after 1 and 5 passes, the output poisoned first."""

import pytest
import torch

from tools import wgmma_probe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("engine", wgmma_probe.ENGINES)
@pytest.mark.parametrize("iterations", [1, 5])
def test_probe_tile_is_exact(engine, iterations):
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for num_ctas in (2, sms):
        assert wgmma_probe.check(engine, device, num_ctas, iterations), (engine, num_ctas)


def test_promotion_changes_the_tile():
    """The scales reach the sums: the three fp8 engines' tiles differ from one another."""
    tiles = [wgmma_probe.expected_tile(e, 1) for e in ("fp8", "fp8_promote1", "fp8_promote2")]
    assert not torch.equal(tiles[0], tiles[1]) and not torch.equal(tiles[0], tiles[2])
