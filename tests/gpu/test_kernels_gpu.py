"""The first shipped kernels on the GPU, through mok.ops, against mok.reference (run on CPU).

MXFP8 quantiser: bit-exact (data bytes and scale bytes). MXFP8 round trips and rowwise
dequantiser (through mok.launchers.mxfp8): bitwise. Epilogues: bit-exact (same fp32
operation order and roundings). Outputs are poisoned before each run (the ops allocate them
with torch.empty: we fill the caching allocator's blocks with NaN first), inputs are random,
and every result is compared over 3 runs for determinism.
"""

from __future__ import annotations

import pytest
import torch

from mok import functional as F
from mok import ops
from mok import reference as R
from mok.testing import poison_cuda_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def random_bf16(*shape, seed=0, spread=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if spread:  # magnitudes over 12 decades, so scales cover a wide exponent range
        x = x * torch.logspace(-6, 6, shape[-1])
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(128, 128), (256, 512), (4, 256, 384), (16384, 2048)])
@pytest.mark.parametrize("transpose", [False, True])
def test_mxfp8_quantize_bit_exact(shape, transpose):
    x = random_bf16(*shape, seed=sum(shape))
    x.view(-1)[:32] = 0.0  # an all-zero block
    want_data, want_scales = R.mxfp8_quantize(x, transpose=transpose)
    runs = []
    for _ in range(3):
        poison_cuda_allocator()
        x_fp8, x_sc, x_fp8_t, x_sc_t = ops.mxfp8_quantize(x.to(CUDA), not transpose, transpose)
        data, scales = (x_fp8_t, x_sc_t) if transpose else (x_fp8, x_sc)
        runs.append((data.cpu(), scales.cpu()))
    for data, scales in runs:
        assert data.shape == want_data.shape and scales.shape == want_scales.shape
        assert torch.equal(scales, want_scales)
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))


def blockwise_spread_bf16(*shape, seed, along_rows):
    """Random nonzero values, each 32-element block (along the last dim, or down the rows) at its
    own exponent in 2^-20 .. 2^20, each value within 2^+-6 of it: the scales span ~40 binades
    and the E4M3 values cover normals, subnormals and underflow to zero."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2], shape[-1]
    blocks = (*shape[:-2], rows // 32, cols) if along_rows else (*shape[:-1], cols // 32)
    block_exp = torch.randint(-20, 21, blocks, generator=gen)
    block_exp = block_exp.repeat_interleave(32, dim=-2 if along_rows else -1)
    value_exp = torch.randint(-6, 7, shape, generator=gen)
    x = torch.randn(*shape, generator=gen) * torch.exp2((block_exp + value_exp).float())
    x = x.to(torch.bfloat16)
    flat = x.view(-1, cols)
    flat[0, 32:64] = 0.0  # an all-zero 32-block along a row
    flat[32:64, 5] = 0.0  # and one down a column
    flat[1, 64:96] = 448.0 * 4  # amax exactly 448 * 2^2: scale exactly 4
    return x


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equality (NaN bits included) of two bf16 tensors of one shape."""
    return got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))


MXFP8_SHAPES = [(128, 128), (256, 512), (4, 256, 384), (2, 3, 128, 256), (16384, 2048)]


@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=str)
@pytest.mark.parametrize("along_rows", [False, True])
def test_mxfp8_round_trip_bit_exact(shape, along_rows):
    from mok.launchers import mxfp8

    x = blockwise_spread_bf16(*shape, seed=sum(shape), along_rows=along_rows)
    want = R.mxfp8_round_trip(x, along_rows=along_rows)
    x_gpu = x.to(CUDA)
    for _ in range(3):
        poison_cuda_allocator()
        got = mxfp8.mxfp8_round_trip(x_gpu, along_rows=along_rows)
        assert same_bits(got.cpu(), want)
    assert same_bits(x_gpu.cpu(), x)  # the input is only read


@pytest.mark.parametrize("along_rows", [False, True])
def test_mxfp8_round_trip_in_place_and_into_out(along_rows):
    from mok.launchers import mxfp8

    x = blockwise_spread_bf16(2, 512, 384, seed=17, along_rows=along_rows)
    want = R.mxfp8_round_trip(x, along_rows=along_rows)
    out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16, device=CUDA)
    assert mxfp8.mxfp8_round_trip(x.to(CUDA), along_rows=along_rows, out=out) is out
    assert same_bits(out.cpu(), want)
    in_place = x.to(CUDA)
    assert mxfp8.mxfp8_round_trip(in_place, along_rows=along_rows, out=in_place) is in_place
    assert same_bits(in_place.cpu(), want)
    # A round trip is idempotent: its values are MXFP8 values already.
    mxfp8.mxfp8_round_trip(in_place, along_rows=along_rows, out=in_place)
    assert same_bits(in_place.cpu(), want)


@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=str)
def test_mxfp8_dequantize_bit_exact(shape):
    from mok.launchers import mxfp8

    data, scales = R.mxfp8_quantize(blockwise_spread_bf16(*shape, seed=sum(shape) + 1,
                                                          along_rows=False))  # fmt: skip
    want = R.mxfp8_dequantize(data, scales).to(torch.bfloat16)
    data_gpu, scales_gpu = data.to(CUDA), scales.to(CUDA)
    for _ in range(3):
        poison_cuda_allocator()
        assert same_bits(mxfp8.mxfp8_dequantize(data_gpu, scales_gpu).cpu(), want)


@pytest.mark.parametrize("shape", MXFP8_SHAPES, ids=str)
def test_mxfp8_dequantize_transposed_bit_exact(shape):
    """A transposed copy back into the original layout in one pass (the MXFP8 backward's
    weights): mok.reference's dequantisation with transpose=True, bit for bit."""
    from mok.launchers import mxfp8

    x = blockwise_spread_bf16(*shape, seed=sum(shape) + 2, along_rows=True)
    data, scales = (t.contiguous() for t in R.mxfp8_quantize(x, transpose=True))
    want = R.mxfp8_dequantize(data, scales, transpose=True).to(torch.bfloat16)
    data_gpu, scales_gpu = data.to(CUDA), scales.to(CUDA)
    for _ in range(3):
        poison_cuda_allocator()
        got = mxfp8.mxfp8_dequantize(data_gpu, scales_gpu, transposed=True)
        assert got.shape == x.shape and same_bits(got.cpu(), want)


def test_mxfp8_dequantize_any_bytes_bit_exact():
    """Beyond what the quantiser writes: every finite E4M3 byte times every scale byte but 255
    (infinity), so products are fp32 subnormals rounded to bf16, zeros (scale byte 0) and
    infinities; one RNE rounding, the reference's, each."""
    from mok.launchers import mxfp8

    gen = torch.Generator().manual_seed(23)
    data = torch.randint(0, 256, (512, 1024), generator=gen, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x41  # E4M3 NaN bytes (0x7F, 0xFF): NaN bits differ
    scales = torch.randint(0, 255, (4, 8, 32, 16), generator=gen, dtype=torch.uint8)
    data = data.view(torch.float8_e4m3fn)
    want = R.mxfp8_dequantize(data, scales).to(torch.bfloat16)
    assert same_bits(mxfp8.mxfp8_dequantize(data.to(CUDA), scales.to(CUDA)).cpu(), want)


@pytest.mark.parametrize("kind", ["rowwise", "columns", "dequantize"])
def test_mxfp8_launches_in_row_tile_chunks(monkeypatch, kind):
    """Several launches over one tensor (chunk limit 3 row tiles instead of grid.y's 65535):
    every launch's pointer offsets, scale offsets included, on the real kernels."""
    from mok.launchers import mxfp8

    monkeypatch.setattr(mxfp8, "MAX_ROW_TILES_PER_LAUNCH", 3)
    x = blockwise_spread_bf16(5, 256, 384, seed=29, along_rows=kind == "columns")
    if kind == "dequantize":
        data, scales = R.mxfp8_quantize(x)
        want = R.mxfp8_dequantize(data, scales).to(torch.bfloat16)
        poison_cuda_allocator()
        got = mxfp8.mxfp8_dequantize(data.to(CUDA), scales.to(CUDA))
    else:
        want = R.mxfp8_round_trip(x, along_rows=kind == "columns")
        poison_cuda_allocator()
        got = mxfp8.mxfp8_round_trip(x.to(CUDA), along_rows=kind == "columns")
    assert same_bits(got.cpu(), want)


@pytest.mark.parametrize("num_tokens,hidden,topk", [(1, 64, 1), (300, 2048, 8), (4096, 7168, 2),
                                                    (70000, 128, 2)])  # fmt: skip
@pytest.mark.parametrize("shared", [False, True])
def test_epilogues_bit_exact(num_tokens, hidden, topk, shared):
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    slots = torch.randn(num_tokens * topk, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(num_tokens, topk, generator=gen) + 0.01
    base = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16) if shared else None
    want_fwd = R.fwd_epilogue(base, slots, weights)
    want_bwd = R.bwd_epilogue(base, slots, topk)
    g_slots, g_w = slots.to(CUDA), weights.to(CUDA)
    g_base = base.to(CUDA) if shared else None
    for _ in range(3):
        poison_cuda_allocator()
        assert torch.equal(ops.fwd_epilogue(g_base, g_slots, g_w).cpu(), want_fwd)
        poison_cuda_allocator()
        assert torch.equal(ops.bwd_epilogue(g_base, g_slots, topk).cpu(), want_bwd)


def test_epilogue_in_cuda_graph_replays_identically():
    slots = torch.randn(512 * 4, 1024, device=CUDA).to(torch.bfloat16)
    w = torch.rand(512, 4, device=CUDA) + 0.01
    eager = ops.fwd_epilogue(None, slots, w)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.fwd_epilogue(None, slots, w)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            captured = ops.fwd_epilogue(None, slots, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


def test_functional_build_schedule_on_gpu_equals_reference():
    from mok.testing import make_routing

    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=4096, hidden_size=128,
                         topk=8, num_local_experts=64)  # fmt: skip
    ids = make_routing(4096, 64, 8, "random", torch.Generator().manual_seed(3))
    want = R.make_schedule(ids, num_local_experts=64, capacity=ws.schedule_capacity)
    for _ in range(3):
        got = F.build_schedule(ws, config, ids.to(CUDA), num_local_experts=64)
        for a, b in zip(
            (got.peer_rank, got.peer_token_idx, got.num_tokens, got.tokens_per_expert),
            (want.peer_rank, want.peer_token_idx, want.num_tokens, want.tokens_per_expert),
            strict=True,
        ):
            assert torch.equal(a.cpu(), b)
    F.check_errors(ws)  # nothing recorded


def test_functional_schedule_overflow_is_reported_without_a_sync():
    from mok.testing import make_routing

    config = F.MoKConfig()
    # No num_local_experts: capacity 2*T*k = 1024 rows, but 16 experts pad to >= 2048.
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=256, hidden_size=128, topk=2)
    ids = make_routing(256, 16, 2, "random", torch.Generator().manual_seed(4)).to(CUDA)
    F.build_schedule(ws, config, ids, num_local_experts=16)  # returns: no host sync
    with pytest.raises(ValueError, match=r"schedule capacity overflow on EP rank 0: \d+ routed"):
        F.check_errors(ws)


@pytest.mark.parametrize("t,h,e,k", [(300, 256, 8, 2), (2048, 2048, 32, 8), (64, 7168, 4, 4)])
def test_gather_rows_bitwise(t, h, e, k):
    """The recomputed context's gather: x rows bitwise against torch, padding rows zero, rows
    past num_tokens untouched, 3 runs identical."""
    from mok.launchers import dispatch
    from mok.testing import make_routing

    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    ids = make_routing(t, e, k, "random", torch.Generator().manual_seed(t)).to(CUDA)
    sched = F.build_schedule(ws, config, ids, num_local_experts=e)
    src = random_bf16(t, h, seed=t, spread=False).to(CUDA)
    peer, slot = sched.peer_rank, sched.peer_token_idx
    rows = int(sched.num_tokens)
    real = peer[:rows] >= 0
    token = torch.where(real, slot[:rows].long() // k, 0)
    want_x = torch.where(real[:, None], src[token], 0)
    for _ in range(3):
        got_x = torch.full((peer.shape[0], h), float("nan"), dtype=torch.bfloat16, device=CUDA)
        dispatch.gather_rows(src, peer, slot, sched.num_tokens, k, out=got_x)
        torch.cuda.synchronize()
        assert torch.equal(got_x[:rows], want_x)
        assert torch.isnan(got_x[rows:].float()).all()  # past num_tokens: not written
