"""The MXFP8 round-trip and dequantiser launchers (mok/launchers/mxfp8.py) on CPU.

A fake kernel checks each launch against the kernel it stands for (the registry kernel's
parameter names in order, the grid formula, grid.y <= 65535, 16-byte aligned pointers) and then
runs that kernel's documented contract, `mok.reference` on the rows it was given. So the tests
check the launchers' folding of leading dims, their chunking into launches and their pointer
offsets bitwise against the reference on the whole tensor, and every argument check.
"""

from __future__ import annotations

import math

import pytest
import torch

import mok.runtime as runtime
from mok import reference as R
from mok.launchers import mxfp8

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install -e .[dev])")

from mok.dsl_kernels.build import python_params  # noqa: E402
from mok.dsl_kernels.registry import variants  # noqa: E402


def _matrix(pointer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] row-major matrix a kernel sees at `pointer` (a contiguous view)."""
    return pointer.reshape(-1)[: rows * cols].view(rows, cols)


def _round_trip(along_rows: bool):
    def run(args: dict, rows: int, cols: int) -> None:
        x = _matrix(args["input_ptr"], rows, cols)
        _matrix(args["output_ptr"], rows, cols).copy_(R.mxfp8_round_trip(x, along_rows=along_rows))

    return run


def _dequantize(args: dict, rows: int, cols: int) -> None:
    data = _matrix(args["input_ptr"], rows, cols).view(torch.float8_e4m3fn)
    scale_bytes = args["scale_ptr"].reshape(-1)[: rows * cols // 32]
    scales = scale_bytes.view(rows // 128, cols // 128, 32, 16)
    values = R.mxfp8_dequantize(data, scales).to(torch.bfloat16)
    _matrix(args["output_ptr"], rows, cols).copy_(values)


CONTRACTS = {
    "mxfp8_round_trip_rowwise": _round_trip(along_rows=False),
    "mxfp8_round_trip_columns": _round_trip(along_rows=True),
    "mxfp8_dequantize_rowwise": _dequantize,
}


class _EmulatedKernel:
    def __init__(self, name: str):
        variant = next(v for v in variants() if v.name == name)
        self.name = name
        self.params = python_params(variant.kernel(**variant.config))
        self.grids = []

    def launch(self, grid, args):
        assert list(args) == [name for name, _ in self.params], self.name
        for name, kind in self.params:
            if kind == "pointer":
                assert isinstance(args[name], torch.Tensor) and args[name].is_contiguous(), name
                assert args[name].data_ptr() % 16 == 0, name
            else:
                assert kind == "int32" and isinstance(args[name], int), name
        rows, cols = args["num_rows"], args["num_cols"]
        assert rows > 0 and cols > 0 and rows % 128 == 0 and cols % 128 == 0
        assert tuple(grid) == (cols // 128, rows // 128, 1) and grid[1] <= 65535
        self.grids.append(tuple(grid))
        CONTRACTS[self.name](args, rows, cols)


@pytest.fixture()
def kernels(monkeypatch):
    """{name: _EmulatedKernel} of every kernel a launcher asks the runtime for."""
    made = {}

    def fake_get_kernel(name, device=None, **_):
        made.setdefault(name, _EmulatedKernel(name))
        return made[name]

    monkeypatch.setattr(runtime, "get_kernel", fake_get_kernel)
    return made


def spread_bf16(*shape: int, seed: int) -> torch.Tensor:
    """Random nonzero values whose magnitudes span 2^-20 .. 2^20 from block to block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-20, 21, shape, generator=gen)
    return x.to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# Small shapes keep the CPU reference quick; a 2-tile chunk limit makes every shape with more
# than two row tiles take several launches.
SHAPES = [(128, 128), (384, 256), (3, 256, 128), (2, 2, 128, 384)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("along_rows", [False, True])
def test_round_trip_equals_reference(kernels, monkeypatch, shape, along_rows):
    monkeypatch.setattr(mxfp8, "MAX_ROW_TILES_PER_LAUNCH", 2)
    x = spread_bf16(*shape, seed=sum(shape))
    x.view(-1, shape[-1])[:32, 0] = 0.0  # an all-zero block in either direction
    x.view(-1, shape[-1])[0, 32:64] = 0.0
    got = mxfp8.mxfp8_round_trip(x, along_rows=along_rows)
    assert _same_bits(got, R.mxfp8_round_trip(x, along_rows=along_rows))
    (kernel,) = kernels.values()
    assert kernel.name == ("mxfp8_round_trip_columns" if along_rows else "mxfp8_round_trip_rowwise")
    row_tiles = math.prod(shape[:-1]) // 128
    assert len(kernel.grids) == math.ceil(row_tiles / 2)
    assert sum(grid[1] for grid in kernel.grids) == row_tiles


@pytest.mark.parametrize("along_rows", [False, True])
def test_round_trip_in_place_and_into_out(kernels, along_rows):
    x = spread_bf16(2, 256, 256, seed=5)
    want = R.mxfp8_round_trip(x, along_rows=along_rows)
    out = torch.full_like(x, float("nan"))
    assert mxfp8.mxfp8_round_trip(x, along_rows=along_rows, out=out) is out
    assert _same_bits(out, want)
    assert mxfp8.mxfp8_round_trip(x, along_rows=along_rows, out=x) is x
    assert _same_bits(x, want)


def test_round_trip_of_no_rows_launches_nothing(kernels):
    x = torch.empty(0, 128, dtype=torch.bfloat16)
    assert mxfp8.mxfp8_round_trip(x, along_rows=True).shape == (0, 128)
    assert all(not kernel.grids for kernel in kernels.values())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_reference(kernels, monkeypatch, shape):
    monkeypatch.setattr(mxfp8, "MAX_ROW_TILES_PER_LAUNCH", 2)
    data, scales = R.mxfp8_quantize(spread_bf16(*shape, seed=sum(shape) + 1))
    got = mxfp8.mxfp8_dequantize(data, scales)
    assert got.dtype == torch.bfloat16
    assert _same_bits(got, R.mxfp8_dequantize(data, scales).to(torch.bfloat16))


def test_dequantize_launches_stay_below_2_to_36_elements(kernels, monkeypatch):
    # A limit of 3 row tiles of 384 columns stands for the 2^36 elements of int32 scale offsets.
    monkeypatch.setattr(mxfp8, "MAX_DEQUANTIZE_ELEMENTS_PER_LAUNCH", 3 * 128 * 384 + 1)
    data, scales = R.mxfp8_quantize(spread_bf16(8, 128, 384, seed=11))
    got = mxfp8.mxfp8_dequantize(data, scales)
    assert _same_bits(got, R.mxfp8_dequantize(data, scales).to(torch.bfloat16))
    assert [grid[1] for grid in kernels["mxfp8_dequantize_rowwise"].grids] == [3, 3, 2]


def _bf16(*shape):
    return torch.ones(*shape, dtype=torch.bfloat16)


def _unaligned(*shape, dtype=torch.bfloat16):
    return torch.ones(math.prod(shape) + 1, dtype=dtype)[1:].view(*shape)


def _fp8(*shape):
    return torch.zeros(*shape, dtype=torch.float8_e4m3fn)


def _scales(*shape):
    return torch.zeros(*shape, dtype=torch.uint8)


def _round_trip_into(out):
    return lambda: mxfp8.mxfp8_round_trip(_bf16(128, 128), along_rows=False, out=out)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: mxfp8.mxfp8_round_trip([1.0], along_rows=False), TypeError,
         r"x must be a torch.Tensor, got list"),
        (lambda: mxfp8.mxfp8_round_trip(_bf16(128, 128).float(), along_rows=False), ValueError,
         r"x must be a contiguous torch.bfloat16 tensor with >= 2 dims, got torch.float32 "
         r"\[128, 128\]"),
        (lambda: mxfp8.mxfp8_round_trip(_bf16(128), along_rows=True), ValueError,
         r"x must be a contiguous torch.bfloat16 tensor with >= 2 dims, got torch.bfloat16 "
         r"\[128\]"),
        (lambda: mxfp8.mxfp8_round_trip(_bf16(128, 256).t(), along_rows=False), ValueError,
         r"got torch.bfloat16 \[256, 128\] \(contiguous=False\)"),
        (lambda: mxfp8.mxfp8_round_trip(_bf16(2, 200, 128), along_rows=True), ValueError,
         r"the last two dims of x must be multiples of 128, got \[200, 128\]"),
        (lambda: mxfp8.mxfp8_round_trip(_unaligned(128, 128), along_rows=False), ValueError,
         r"x must be 16-byte aligned, got address 0x[0-9a-f]+"),
        (_round_trip_into(_bf16(256, 128)), ValueError,
         r"out must be a contiguous torch.bfloat16 tensor of shape \[128, 128\], got "
         r"torch.bfloat16 \[256, 128\]"),
        (_round_trip_into(_bf16(128, 128).float()), ValueError,
         r"out must be a contiguous torch.bfloat16 tensor of shape \[128, 128\], got "
         r"torch.float32 \[128, 128\]"),
        (_round_trip_into(_unaligned(128, 128)), ValueError,
         r"out must be 16-byte aligned, got address 0x[0-9a-f]+"),
        (lambda: mxfp8.mxfp8_dequantize(_bf16(128, 128), _scales(1, 1, 32, 16)), ValueError,
         r"data must be a contiguous torch.float8_e4m3fn tensor with >= 2 dims, got "
         r"torch.bfloat16 \[128, 128\]"),
        (lambda: mxfp8.mxfp8_dequantize(_fp8(128, 96), _scales(1, 1, 32, 16)), ValueError,
         r"the last two dims of data must be multiples of 128, got \[128, 96\]"),
        (lambda: mxfp8.mxfp8_dequantize(_fp8(2, 128, 256), _scales(1, 2, 32, 16)), ValueError,
         r"scales must be a contiguous torch.uint8 tensor of shape \[2, 2, 32, 16\], got "
         r"torch.uint8 \[1, 2, 32, 16\]"),
        (lambda: mxfp8.mxfp8_dequantize(_fp8(128, 128), _scales(1, 1, 32, 16).int()), ValueError,
         r"scales must be a contiguous torch.uint8 tensor of shape \[1, 1, 32, 16\], got "
         r"torch.int32"),
        (lambda: mxfp8.mxfp8_dequantize(_fp8(128, 128),
                                        _unaligned(1, 1, 32, 16, dtype=torch.uint8)),
         ValueError, r"scales must be 16-byte aligned, got address 0x[0-9a-f]+"),
    ],
)  # fmt: skip
def test_arguments_are_checked(kernels, call, error, message):
    with pytest.raises(error, match=message):
        call()
    assert all(not kernel.grids for kernel in kernels.values())  # refused before any launch


def test_out_overlapping_x_is_refused_unless_it_is_x(kernels):
    buffer = spread_bf16(3 * 128, 128, seed=3)
    x, shifted = buffer[:256], buffer[128:]  # rows 128..255 of x are rows 0..127 of shifted
    with pytest.raises(ValueError, match=r"out must be x itself \(in place\) or not overlap it"):
        mxfp8.mxfp8_round_trip(x, along_rows=True, out=shifted)
    assert all(not kernel.grids for kernel in kernels.values())
    # Another tensor viewing exactly x's bytes is in place.
    want = R.mxfp8_round_trip(x, along_rows=True)
    same_bytes = buffer[:256].view(2, 128, 128).view(256, 128)
    assert mxfp8.mxfp8_round_trip(x, along_rows=True, out=same_bytes) is same_bytes
    assert _same_bits(x, want)
