"""`mok.launchers.plans`' carve (pieces of one allocation by address) and alignment checks."""

from __future__ import annotations

import pytest
import torch

from mok.launchers.plans import Carve, Descriptors, all_aligned


def test_carve_pieces_are_aligned_disjoint_and_viewed_where_they_are_addressed():
    pieces = [(torch.int32, (5,)), (torch.bfloat16, (3, 7)), (torch.float32, (2, 3)),
              (torch.int32, (1,))]  # fmt: skip
    carve = Carve(pieces, torch.device("cpu"))
    buffer = carve.new()
    assert buffer.dtype == torch.uint8 and buffer.numel() == carve.nbytes
    addresses = carve.addresses(buffer)
    assert all(offset % 256 == 0 for offset in carve.offsets)
    views = carve.views(buffer)
    for (dtype, shape), view, address in zip(pieces, views, addresses, strict=True):
        assert view.dtype == dtype and tuple(view.shape) == shape and view.is_contiguous()
        assert view.data_ptr() == address
    ends = [a + v.numel() * v.element_size() for a, v in zip(addresses, views, strict=True)]
    assert all(end <= start for end, start in zip(ends, addresses[1:], strict=False))
    assert ends[-1] <= buffer.data_ptr() + carve.nbytes
    for i, view in enumerate(views):  # writes land in the buffer's bytes, piece by piece
        view.fill_(i + 1)
    assert all(torch.all(carve.view(buffer, i) == i + 1) for i in range(len(pieces)))


def test_all_aligned_names_the_first_misaligned_address():
    all_aligned(("a", "b"), (256, 512))
    with pytest.raises(ValueError, match="b must be 16-byte aligned, got address 0x208"):
        all_aligned(("a", "b", "c"), (256, 520, 4))


def test_descriptors_make_a_tensor_only_for_an_address_not_seen():
    made = []

    class FakeKernel:  # tma_descriptor's lookups, not reached: the cache is filled by hand
        pass

    cache = Descriptors(FakeKernel(), "tma_x")
    cache._by_address[4096] = "descriptor"
    assert cache.at(4096, lambda: made.append(1)) == "descriptor"
    assert not made
