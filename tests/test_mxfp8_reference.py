"""mok.reference.mxfp8_quantize against an element-by-element Python model of SEMANTICS §5.

Exact: scale bytes and E4M3 bits must equal the model's. The model uses Python floats (fp64,
exact for these operations) and looks the scale byte up by the documented layout formula.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from mok import reference as R


def fp32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def model_scale_exponent(block: list[float]) -> int:
    """Biased exponent of the block's power-of-two scale, from the rule in words."""
    amax = max(abs(v) for v in block)
    q = max(fp32(amax / 448.0), fp32(1e-12))  # fp32 division, then the floor
    mantissa, exponent = math.frexp(q)  # q = mantissa * 2**exponent, mantissa in [0.5, 1)
    power = exponent - 1 if mantissa == 0.5 else exponent  # round up to a power of two
    return power + 127


def scale_byte_offset(r: int, c_block: int, num_cols: int) -> int:
    tile = (r // 128) * (num_cols // 128) + (c_block * 32) // 128
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c_block % 4


@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_matches_elementwise_model(transpose):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(256, 128, generator=gen) * torch.logspace(-3, 3, 128)).to(torch.bfloat16)
    x[5, :32] = 0.0  # all-zero block: scale is the clamp's power of two
    x[9, 32:64] = 448.0 * 4  # amax exactly 448 * 2^2: scale exactly 4
    data, scales = R.mxfp8_quantize(x, transpose=transpose)
    rows = (x.t() if transpose else x).float()
    flat_scales = scales.reshape(-1)
    num_rows, num_cols = rows.shape
    for r in range(0, num_rows, 7):  # a spread of rows keeps the Python loop quick
        for cb in range(num_cols // 32):
            block = rows[r, cb * 32 : (cb + 1) * 32].tolist()
            exponent = model_scale_exponent(block)
            assert int(flat_scales[scale_byte_offset(r, cb, num_cols)]) == exponent, (r, cb)
            inv = 2.0 ** (127 - exponent)
            expected = torch.tensor([max(-448.0, min(448.0, v * inv)) for v in block])
            got = data.reshape(num_rows, num_cols)[r, cb * 32 : (cb + 1) * 32]
            assert torch.equal(
                got.view(torch.uint8), expected.to(torch.float8_e4m3fn).view(torch.uint8)
            )


def test_special_blocks():
    x = torch.zeros(128, 128, dtype=torch.bfloat16)
    x[1, 32:64] = 448.0 * 4
    data, scales = R.mxfp8_quantize(x)
    flat = scales.reshape(-1)
    assert int(flat[scale_byte_offset(0, 0, 128)]) == 127 - 39  # 1e-12 rounds up to 2^-39
    assert int(flat[scale_byte_offset(1, 1, 128)]) == 127 + 2
    assert (data[1, 32:64].float() == 448.0).all()


def test_layout_and_shapes_for_3d_weights():
    w = torch.randn(3, 256, 128).to(torch.bfloat16)
    data, scales = R.mxfp8_quantize(w)
    assert data.shape == (3, 256, 128) and data.dtype == torch.float8_e4m3fn
    assert scales.shape == (6, 1, 32, 16) and scales.dtype == torch.uint8
    data_t, scales_t = R.mxfp8_quantize(w, transpose=True)
    assert data_t.shape == (3, 128, 256) and scales_t.shape == (3, 2, 32, 16)
    # The expert index folds into rows: expert 1's rows are rows 256..511 of the 2-D quantisation.
    d2, s2 = R.mxfp8_quantize(w.reshape(768, 128))
    assert torch.equal(d2.view(torch.uint8), data.reshape(768, 128).view(torch.uint8))
    assert torch.equal(s2, scales)


@pytest.mark.parametrize("transpose", [False, True])
def test_dequantize_round_trip(transpose):
    x = torch.randn(2, 128, 256).to(torch.bfloat16)
    back = R.mxfp8_dequantize(*R.mxfp8_quantize(x, transpose=transpose), transpose=transpose)
    assert back.shape == x.shape
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for values in its normal range.
    err = (back - x.float()).abs()
    assert (err <= x.float().abs() * 2**-4 + 2**-6 * x.float().abs().amax()).all()
