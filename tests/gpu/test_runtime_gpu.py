"""GPU tests of mok.runtime on an sm_90 device (H100/H200): loading, param checks, launches.

Besides the shipped cubins (when the manifest exists), these tests use two tiny hand-written
PTX kernels, JIT-compiled by the driver, so that the runtime is tested on its own: one that
fills an int32 array (graph capture, clusters, device writes to the error record) and one
that copies its params, a TMA descriptor included, back to memory (by-value packing).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from mok.runtime import (
    ARCH_ENV_VAR,
    ErrorRecord,
    MoKParamMismatchError,
    MoKRuntimeError,
    MoKUnsupportedDeviceError,
    MoKWaitTimeoutError,
    WaitPhase,
    _driver,
    get_kernel,
    load_manifest,
)
from mok.runtime.error_record import FIELD_INDEX, FLAG_VALID
from mok.runtime.module import Kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# PTX ISA 8.0 (CUDA 12.0) so every r525+ driver can JIT it.
_COPY_DESC = "\n".join(
    f"    ld.param.u32 %r1, [desc+{4 * i}];\n    st.global.u32 [%rd1+{4 * i}], %r1;"
    for i in range(32)
)
TEST_PTX = f"""
.version 8.0
.target sm_90
.address_size 64

.visible .entry mok_test_fill(.param .u64 out_ptr, .param .u32 value, .param .u32 count)
{{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out_ptr];
    ld.param.u32 %r1, [value];
    ld.param.u32 %r2, [count];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p, %r6, %r2;
    @%p bra DONE;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r6, 4;
    add.u64 %rd3, %rd1, %rd2;
    add.u32 %r7, %r1, %r6;
    st.volatile.global.u32 [%rd3], %r7;
DONE:
    ret;
}}

.visible .entry mok_test_params(
    .param .align 64 .b8 desc[128],
    .param .u64 out_ptr,
    .param .u64 wide,
    .param .f32 real,
    .param .u32 narrow)
{{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;
    .reg .f32 %f1;
    ld.param.u64 %rd1, [out_ptr];
    cvta.to.global.u64 %rd1, %rd1;
{_COPY_DESC}
    ld.param.u64 %rd2, [wide];
    st.global.u64 [%rd1+128], %rd2;
    ld.param.f32 %f1, [real];
    st.global.f32 [%rd1+136], %f1;
    ld.param.u32 %r1, [narrow];
    st.global.u32 [%rd1+140], %r1;
    ret;
}}
"""

FILL = {
    "name": "test_fill",
    "kernel": "PtxFill",
    "arch": "sm_90a",
    "cubin": "mok_test.ptx",
    "symbol": "mok_test_fill",
    "params": [
        {"name": "out_ptr", "kind": "pointer", "size": 8, "align": 8},
        {"name": "value", "kind": "int32", "size": 4, "align": 4},
        {"name": "count", "kind": "int32", "size": 4, "align": 4},
    ],
    "block": [128, 1, 1],
    "cluster": [2, 1, 1],
    "dynamic_smem_bytes": 0,
}
PARAMS = {
    "name": "test_params",
    "kernel": "PtxParams",
    "arch": "sm_90a",
    "cubin": "mok_test.ptx",
    "symbol": "mok_test_params",
    "params": [
        {"name": "desc", "kind": "tma_desc", "size": 128, "align": 64},
        {"name": "out_ptr", "kind": "pointer", "size": 8, "align": 8},
        {"name": "wide", "kind": "int64", "size": 8, "align": 8},
        {"name": "real", "kind": "float32", "size": 4, "align": 4},
        {"name": "narrow", "kind": "int32", "size": 4, "align": 4},
    ],
    "block": [1, 1, 1],
    "cluster": [1, 1, 1],
    "dynamic_smem_bytes": 0,
    "tma": [{"param": "desc", "dtype": "bf16", "rank": 2, "box": [64, 64], "swizzle": "128B"}],
}


def make_manifest(directory, variants):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "mok_test.ptx").write_text(TEST_PTX)
    manifest = {"format": 1, "dsl_version": "test", "source_hash": "test", "variants": variants}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return load_manifest(directory)


@pytest.fixture
def sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (H100/H200)")
    return torch.cuda.current_device()


@pytest.fixture
def test_manifest(tmp_path, sm90, monkeypatch):
    monkeypatch.delenv(ARCH_ENV_VAR, raising=False)
    return make_manifest(tmp_path / "ok", [FILL, PARAMS])


def test_shipped_sm90_variants_load(sm90, monkeypatch):
    monkeypatch.delenv(ARCH_ENV_VAR, raising=False)
    try:
        manifest = load_manifest()
    except MoKRuntimeError as exc:
        pytest.skip(f"no shipped manifest: {exc}")
    variants = manifest.variants_for("sm_90a")
    if not variants:
        pytest.skip("the shipped manifest has no sm_90a variants")
    for variant in variants:
        # Loading checks cuFuncGetParamInfo against the manifest for every param.
        kernel = get_kernel(variant.name, arch="sm_90a")
        layout = kernel._param_info()
        print(variant.name, "offsets/sizes", layout)  # for the record when run with -s
        assert [size for _, size in layout] == [p.size for p in variant.params]


def test_params_pass_by_value(test_manifest, sm90):
    kernel = get_kernel("test_params", manifest=test_manifest)
    print("test_params offsets/sizes", kernel._param_info())
    source = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    descriptor = kernel.make_tma_descriptor("desc", source)
    out = torch.full((36,), -1, dtype=torch.int32, device="cuda")
    args = {"desc": descriptor, "out_ptr": out, "wide": -(1 << 40) - 3, "real": 1.25, "narrow": 7}
    kernel.launch(1, args)
    torch.cuda.synchronize()
    got = out.cpu().numpy().tobytes()
    assert got[:128] == descriptor.to_bytes()
    assert got[128:] == struct.pack("<qfI", -(1 << 40) - 3, 1.25, 7)


def test_param_mismatch_refused(tmp_path, sm90, monkeypatch):
    monkeypatch.delenv(ARCH_ENV_VAR, raising=False)
    wrong_size = json.loads(json.dumps(PARAMS))
    wrong_size["params"][2] = {"name": "wide", "kind": "int32", "size": 4, "align": 4}
    manifest = make_manifest(tmp_path / "size", [wrong_size])
    with pytest.raises(
        MoKParamMismatchError,
        match=r"test_params.*param 2 \('wide', int32\): expected size 4 bytes, cubin has 8",
    ):
        get_kernel("test_params", manifest=manifest)

    missing = json.loads(json.dumps(FILL))
    missing["params"].pop()
    manifest = make_manifest(tmp_path / "count", [missing])
    with pytest.raises(MoKParamMismatchError, match=r"takes 3 params, the manifest lists 2"):
        get_kernel("test_fill", manifest=manifest)

    extra = json.loads(json.dumps(FILL))
    extra["params"].append({"name": "spare", "kind": "int32", "size": 4, "align": 4})
    manifest = make_manifest(tmp_path / "extra", [extra])
    with pytest.raises(MoKParamMismatchError, match=r"takes 3 params, the manifest lists 4"):
        get_kernel("test_fill", manifest=manifest)


def test_graph_capture_matches_eager(test_manifest, sm90):
    kernel = get_kernel("test_fill", manifest=test_manifest)
    count = 1000
    grid = 2 * ((count + 255) // 256)  # 128-thread CTAs, a multiple of the 2x1x1 cluster
    eager = torch.zeros(count, dtype=torch.int32, device="cuda")
    kernel.launch(grid, {"out_ptr": eager, "value": 41, "count": count})

    captured = torch.zeros(count, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.launch(grid, {"out_ptr": captured, "value": 41, "count": count})
    torch.cuda.synchronize()
    assert not captured.any(), "capture must not run the kernel"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    expected = torch.arange(41, 41 + count, dtype=torch.int32, device="cuda")
    assert torch.equal(eager, expected)


def test_launch_on_side_stream_and_occupancy(test_manifest, sm90):
    kernel = get_kernel("test_fill", manifest=test_manifest)
    assert kernel.max_active_clusters() > 0
    out = torch.zeros(256, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    kernel.launch(2, {"out_ptr": out, "value": 0, "count": 256}, stream=stream)
    stream.synchronize()
    assert torch.equal(out, torch.arange(256, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"not a multiple of the cluster"):
        kernel.launch(3, {"out_ptr": out, "value": 0, "count": 256})


def test_mok_arch_sm100_refused_on_sm90(tmp_path, sm90, monkeypatch):
    blackwell = dict(FILL, arch="sm_100a")
    manifest = make_manifest(tmp_path / "sm100", [blackwell])
    monkeypatch.setenv(ARCH_ENV_VAR, "sm_100a")
    with pytest.raises(
        MoKUnsupportedDeviceError, match=r"MOK_ARCH=sm_100a selects sm_100a cubins.*runs sm_90a"
    ):
        get_kernel("test_fill", manifest=manifest)


def test_real_sm100_cubin_fails_cleanly_on_sm90(sm90):
    try:
        manifest = load_manifest()
    except MoKRuntimeError as exc:
        pytest.skip(f"no shipped manifest: {exc}")
    variants = manifest.variants_for("sm_100a")
    if not variants:
        pytest.skip("the shipped manifest has no sm_100a variants")
    # Bypass get_kernel's arch check: the driver itself must refuse with an error, not crash.
    with pytest.raises(MoKRuntimeError) as info:
        Kernel(variants[0], manifest.cubin_path(variants[0]), sm90)
    print("driver refusal:", info.value)


def test_error_record_roundtrip(sm90):
    cu = _driver.driver()
    with ErrorRecord() as record:
        record.check()  # clear after allocation
        values = {
            "rank": 3,
            "phase": int(WaitPhase.DISPATCH),
            "counter_index": 11,
            "observed": 1,
            "expected": 2,
            "peer_rank": 6,
            "cta": 40,
            "task": -1,
        }
        for name, value in values.items():
            _driver.check(
                cu.cuMemsetD32(record.device_ptr + 4 * FIELD_INDEX[name], value & 0xFFFFFFFF, 1),
                "cuMemsetD32",
            )
        _driver.check(cu.cuMemsetD32(record.device_ptr, FLAG_VALID, 1), "cuMemsetD32")
        torch.cuda.synchronize()
        with pytest.raises(
            MoKWaitTimeoutError,
            match=r"rank 3 timed out waiting in phase DISPATCH \(id 5\): counter 11 in rank 6's "
            r"memory read 1, expected 2",
        ):
            record.check()
        record.clear()
        record.check()


def test_error_record_written_by_a_kernel(test_manifest, sm90):
    kernel = get_kernel("test_fill", manifest=test_manifest)
    with ErrorRecord() as record:
        # Words 0..2 = 2, 3, 4: flag valid, rank 3, phase ROUTING_ALLGATHER.
        kernel.launch(2, {"out_ptr": record.device_ptr, "value": FLAG_VALID, "count": 3})
        torch.cuda.synchronize()
        with pytest.raises(MoKWaitTimeoutError, match=r"rank 3 .*phase ROUTING_ALLGATHER"):
            record.check()


def test_wrong_device_tensor_rejected(test_manifest, sm90):
    kernel = get_kernel("test_fill", manifest=test_manifest)
    with pytest.raises(ValueError, match=r"'out_ptr'.*CUDA tensor, got one on cpu"):
        kernel.launch(2, {"out_ptr": torch.zeros(4, dtype=torch.int32), "value": 0, "count": 4})
