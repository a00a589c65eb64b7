"""A `gather_first_column` diagnostic build of the megakernels gathers only its own rank's rows
(NOTES §18 item 17): the launchers refuse such a cubin in a group of more than one, by its
config in the manifest. Checked on the shipped manifest's variant records (no GPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from mok.launchers.megakernel_walk import check_gathering_build
from mok.runtime.manifest import load_manifest


@pytest.mark.parametrize("name", ["moe_forward", "moe_backward"])
def test_a_gathering_build_is_refused_with_peers_only(name):
    shipped = load_manifest().variant(name, "sm_90a")
    gathering = dataclasses.replace(shipped, config={**shipped.config, "gather_first_column": True})
    # The launchers' kernels expose the manifest record as `variant`.
    check_gathering_build(SimpleNamespace(variant=shipped), peers=(0, 12345))
    check_gathering_build(SimpleNamespace(variant=gathering), peers=None)
    with pytest.raises(ValueError, match=rf"peers: this {name} cubin .*gather_first_column"):
        check_gathering_build(SimpleNamespace(variant=gathering), peers=(1, 12345))
