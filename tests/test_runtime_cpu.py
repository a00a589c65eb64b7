"""CPU tests of mok.runtime: manifest validation, MOK_ARCH, argument packing, layout checks.

Nothing here touches a GPU or the CUDA driver; GPU behaviour is in tests/gpu/test_runtime_gpu.py.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from mok.runtime import (
    ARCH_ENV_VAR,
    MoKManifestError,
    MoKParamMismatchError,
    MoKUnsupportedDeviceError,
    MoKWaitTimeoutError,
    TmaDescriptor,
    WaitPhase,
    arch_for_capability,
    arch_override,
    check_param_layout,
    default_manifest_path,
    load_manifest,
    normalize_grid,
    pack_args,
    select_arch,
)
from mok.runtime.error_record import (
    ERROR_RECORD_FIELDS,
    FIELD_INDEX,
    FLAG_CLAIMED,
    FLAG_VALID,
    decode_error_record,
    raise_for_words,
)
from mok.runtime.manifest import TmaSpec, parse_manifest
from mok.runtime.tma import tma_encode_args

VARIANT = {
    "name": "toy_gemm",
    "kernel": "Sm90Toy",
    "arch": "sm_90a",
    "cubin": "toy_gemm.sm_90a.cubin",
    "symbol": "mok_toy_gemm",
    "config": {"tile_n": 128},
    "params": [
        {"name": "a_desc", "kind": "tma_desc", "size": 128, "align": 64},
        {"name": "out_ptr", "kind": "pointer", "size": 8, "align": 8},
        {"name": "num_rows", "kind": "int32", "size": 4, "align": 4},
        {"name": "row_stride", "kind": "int64", "size": 8, "align": 8},
        {"name": "scale", "kind": "float32", "size": 4, "align": 4},
        {"name": "atom_state", "kind": "bytes", "size": 1, "align": 1},
    ],
    "block": [384, 1, 1],
    "cluster": [2, 1, 1],
    "dynamic_smem_bytes": 200000,
    "tma": [
        {
            "param": "a_desc",
            "dtype": "bf16",
            "rank": 3,
            "box": [64, 128, 1],
            "swizzle": "128B",
            "l2_promotion": "128B",
            "oob_fill": "none",
        }
    ],
    "launch": {"grid": "num_sms"},
}
MANIFEST = {"format": 1, "dsl_version": "4.8.1", "source_hash": "abc", "variants": [VARIANT]}


def write_manifest(tmp_path, data) -> str:
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    return str(path)


def tampered(edit) -> dict:
    data = copy.deepcopy(MANIFEST)
    edit(data["variants"][0])
    return data


@pytest.fixture
def variant(tmp_path):
    return load_manifest(write_manifest(tmp_path, MANIFEST)).variant("toy_gemm", "sm_90a")


def fake_descriptor(spec=None, fill=0xAB) -> TmaDescriptor:
    return TmaDescriptor(spec, bytes([fill]) * 128)


# ---------------------------------------------------------------- import


def test_import_has_no_side_effects():
    # A fresh interpreter: a bogus MOK_ARCH must not be read, CUDA must not be initialised.
    code = (
        "import mok.runtime, mok.runtime._driver as d, torch;"
        "assert d._driver_module is None, 'driver bindings touched at import';"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'"
    )
    env = dict(os.environ, **{ARCH_ENV_VAR: "sm_bogus"})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- arch


def test_mok_arch_override(monkeypatch):
    monkeypatch.delenv(ARCH_ENV_VAR, raising=False)
    assert arch_override() is None
    monkeypatch.setenv(ARCH_ENV_VAR, "sm_100a")
    assert arch_override() == "sm_100a"
    # With the override set, no device is queried (works on a CPU-only machine).
    assert select_arch() == "sm_100a"


def test_mok_arch_invalid(monkeypatch):
    monkeypatch.setenv(ARCH_ENV_VAR, "sm_80")
    with pytest.raises(
        ValueError, match=r"MOK_ARCH must be one of sm_90a, sm_100a, sm_103a.*'sm_80'"
    ):
        arch_override()


@pytest.mark.parametrize(
    "capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a")]
)
def test_arch_for_capability(capability, arch):
    assert arch_for_capability(capability) == arch


def test_unsupported_capability():
    assert issubclass(MoKUnsupportedDeviceError, RuntimeError)
    with pytest.raises(
        MoKUnsupportedDeviceError, match=r"NVIDIA A100.*compute capability 8\.0.*sm_90a"
    ):
        arch_for_capability((8, 0), device_name="NVIDIA A100", shipped_archs=["sm_90a"])


# ---------------------------------------------------------------- manifest


def test_manifest_loads(tmp_path):
    manifest = load_manifest(
        tmp_path / "manifest.json" if False else write_manifest(tmp_path, MANIFEST)
    )
    assert manifest.archs() == ["sm_90a"]
    v = manifest.variant("toy_gemm", "sm_90a")
    assert v.cluster == (2, 1, 1) and v.block == (384, 1, 1) and v.cluster_size == 2
    assert [p.name for p in v.params][:2] == ["a_desc", "out_ptr"]
    assert v.tma_spec("a_desc") == TmaSpec("a_desc", "bf16", 3, (64, 128, 1), "128B")
    assert manifest.cubin_path(v) == tmp_path / "toy_gemm.sm_90a.cubin"
    # A folder holding manifest.json works too.
    assert load_manifest(tmp_path).variant("toy_gemm", "sm_90a") == v


def test_manifest_missing(tmp_path):
    with pytest.raises(
        MoKManifestError, match=r"manifest not found at .*nowhere.*build the cubins"
    ):
        load_manifest(tmp_path / "nowhere" / "manifest.json")


def test_manifest_bad_json(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(MoKManifestError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_manifest_unknown_format(tmp_path):
    with pytest.raises(MoKManifestError, match=r"unknown format 2.*reads format 1"):
        load_manifest(write_manifest(tmp_path, dict(MANIFEST, format=2)))


def test_manifest_missing_variant(tmp_path):
    data = copy.deepcopy(MANIFEST)
    data["variants"].append(dict(VARIANT, name="only_blackwell", arch="sm_100a"))
    manifest = load_manifest(write_manifest(tmp_path, data))
    with pytest.raises(
        MoKManifestError, match=r"no kernel variant 'nope' for arch sm_90a.*toy_gemm"
    ):
        manifest.variant("nope", "sm_90a")
    with pytest.raises(MoKManifestError, match=r"'only_blackwell' exists for sm_100a"):
        manifest.variant("only_blackwell", "sm_90a")
    with pytest.raises(MoKManifestError, match=r"no variants for sm_103a.*sm_100a, sm_90a"):
        manifest.variant("toy_gemm", "sm_103a")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda v: v["params"][1].update(size=4), r"'out_ptr'.*kind 'pointer' has size 8.*says 4"),
        (lambda v: v["params"][1].update(kind="handle"), r"unknown kind 'handle'"),
        (lambda v: v["params"][2].update(align=3), r"align must be a power of two, got 3"),
        (lambda v: v["params"][2].update(name="out_ptr"), r"param name 'out_ptr' appears twice"),
        (lambda v: v.pop("symbol"), r"missing field 'symbol'"),
        (lambda v: v.update(block=[2048, 1, 1]), r"more than 1024 threads"),
        (lambda v: v.update(cluster=[0, 1, 1]), r"'cluster' must be 3 positive ints"),
        (lambda v: v["tma"][0].update(param="b_desc"), r"names param 'b_desc', which is not"),
        (lambda v: v["tma"][0].update(param="out_ptr"), r"has kind 'pointer', not 'tma_desc'"),
        (lambda v: v["tma"][0].update(swizzle="256B"), r"'swizzle' must be one of"),
        (lambda v: v["tma"][0].update(box=[64, 128]), r"box must be 3 ints"),
        (lambda v: v["tma"][0].update(box=[512, 1, 1]), r"box must be 3 ints in 1\.\.256"),
    ],
)
def test_manifest_validation(tmp_path, edit, message):
    with pytest.raises(MoKManifestError, match=message) as info:
        load_manifest(write_manifest(tmp_path, tampered(edit)))
    assert "toy_gemm" in str(info.value) or "b_desc" in str(info.value)


def test_manifest_duplicate_variant(tmp_path):
    data = copy.deepcopy(MANIFEST)
    data["variants"].append(copy.deepcopy(VARIANT))
    with pytest.raises(MoKManifestError, match=r"'toy_gemm' for sm_90a is listed twice"):
        parse_manifest(data, tmp_path / "manifest.json")


def test_shipped_manifest_is_valid():
    path = default_manifest_path()
    if not path.exists():
        pytest.skip(f"no shipped manifest yet at {path}")
    manifest = load_manifest()
    assert manifest.variants, "the shipped manifest lists no variants"
    for v in manifest.variants:
        assert manifest.cubin_path(v).is_file(), f"{v.name} ({v.arch}): {v.cubin} missing"


# ---------------------------------------------------------------- argument packing


def good_args(variant):
    return {
        "a_desc": fake_descriptor(variant.tma_spec("a_desc")),
        "out_ptr": 0x7F00_0000_1000,
        "num_rows": -5,
        "row_stride": 1 << 40,
        "scale": 0.5,
        "atom_state": b"\x07",
    }


def test_pack_args_values_and_alignment(variant):
    packed = pack_args(variant, good_args(variant))
    pointers = (ctypes.c_void_p * len(variant.params)).from_address(packed.address)
    for index, param in enumerate(variant.params):
        assert pointers[index] == packed.param_address(index)
        assert packed.param_address(index) % param.align == 0, param.name
    assert packed.param_bytes(0) == b"\xab" * 128
    assert packed.param_bytes(1) == struct.pack("<Q", 0x7F00_0000_1000)
    assert packed.param_bytes(2) == struct.pack("<i", -5)
    assert packed.param_bytes(3) == struct.pack("<q", 1 << 40)
    assert packed.param_bytes(4) == struct.pack("<f", 0.5)
    assert packed.param_bytes(5) == b"\x07"


def test_pack_args_null_pointer_and_unsigned(variant):
    args = dict(good_args(variant), out_ptr=None, num_rows=0xFFFF_FFFF)
    packed = pack_args(variant, args)
    assert packed.param_bytes(1) == bytes(8)
    assert packed.param_bytes(2) == b"\xff" * 4


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: a.pop("num_rows"), ValueError, r"missing num_rows"),
        (lambda a: a.update(num_tokens=1), ValueError, r"unknown 'num_tokens'.*expected exactly"),
        (
            lambda a: a.update(num_rows=1.5),
            TypeError,
            r"'num_rows' \(int32\) takes an int, got float",
        ),
        (
            lambda a: a.update(num_rows=True),
            TypeError,
            r"'num_rows' \(int32\) takes an int, got bool",
        ),
        (lambda a: a.update(num_rows=1 << 32), ValueError, r"'num_rows'.*does not fit in int32"),
        (lambda a: a.update(row_stride=-(1 << 64)), ValueError, r"does not fit in int64"),
        (lambda a: a.update(scale="1"), TypeError, r"'scale' \(float32\) takes a float"),
        (lambda a: a.update(scale=1e39), ValueError, r"'scale'.*overflows float32"),
        (
            lambda a: a.update(out_ptr="0x10"),
            TypeError,
            r"'out_ptr' \(pointer\) takes a CUDA tensor",
        ),
        (lambda a: a.update(out_ptr=-1), ValueError, r"'out_ptr'.*address must be in"),
        (
            lambda a: a.update(out_ptr=torch.zeros(4)),
            ValueError,
            r"'out_ptr'.*CUDA tensor, got one on cpu",
        ),
        (
            lambda a: a.update(a_desc=b"\0" * 128),
            TypeError,
            r"'a_desc' \(tma_desc\) takes a TmaDescriptor",
        ),
        (
            lambda a: a.update(atom_state=b"\0\0"),
            ValueError,
            r"'atom_state' \(bytes\) takes 1 bytes, got 2",
        ),
        (lambda a: a.update(atom_state=3), TypeError, r"'atom_state'.*bytes-like"),
    ],
)
def test_pack_args_rejects(variant, change, error, message):
    args = good_args(variant)
    change(args)
    with pytest.raises(error, match=message):
        pack_args(variant, args)


def test_pack_args_tma_spec_mismatch(variant):
    other = TmaSpec("a_desc", "bf16", 3, (64, 64, 1), "128B")
    args = dict(good_args(variant), a_desc=fake_descriptor(other))
    with pytest.raises(ValueError, match=r"'a_desc'.*descriptor was built for"):
        pack_args(variant, args)


def test_pack_args_not_a_dict(variant):
    with pytest.raises(TypeError, match="args must be a dict"):
        pack_args(variant, [1, 2])


# ---------------------------------------------------------------- grid


def test_normalize_grid():
    assert normalize_grid(132, (2, 1, 1)) == (132, 1, 1)
    assert normalize_grid((4, 3), (1, 1, 1)) == (4, 3, 1)
    with pytest.raises(ValueError, match=r"not a multiple of the cluster \[2, 1, 1\] in x"):
        normalize_grid(133, (2, 1, 1))
    with pytest.raises(ValueError, match=r"grid dim x must be in 1\.\."):
        normalize_grid(0, (1, 1, 1))
    with pytest.raises(ValueError, match=r"grid dim y must be in 1\.\.65535"):
        normalize_grid((1, 70000, 1), (1, 1, 1))
    with pytest.raises(TypeError, match="grid must be an int or 1 to 3 ints"):
        normalize_grid("8", (1, 1, 1))


# ---------------------------------------------------------------- param layout


def driver_layout():
    # What cuFuncGetParamInfo reports on sm_90 for VARIANT: the descriptor is 64-byte aligned
    # in the constant bank, so param 0 starts at 48.
    return [(48, 128), (176, 8), (184, 4), (192, 8), (200, 4), (204, 1)]


def test_param_layout_ok(variant):
    check_param_layout(variant, driver_layout())


@pytest.mark.parametrize(
    "layout, message",
    [
        (driver_layout()[:-1], r"takes 5 params, the manifest lists 6"),
        ([*driver_layout(), (208, 8)], r"takes 7 params, the manifest lists 6"),
        (
            [(48, 128), (176, 8), (184, 8), (192, 8), (200, 4), (204, 1)],
            r"param 2 \('num_rows', int32\): expected size 4 bytes, cubin has 8",
        ),
        (
            [(48, 128), (176, 8), (184, 4), (200, 8), (208, 4), (212, 1)],
            r"param 3 \('row_stride', int64\): expected offset in 188\.\.195.*cubin has 200",
        ),
        (
            [(48, 128), (170, 8), (184, 4), (192, 8), (200, 4), (204, 1)],
            r"param 1 \('out_ptr', pointer\): expected offset in 176\.\.183.*cubin has 170",
        ),
    ],
)
def test_param_layout_mismatch(variant, layout, message):
    with pytest.raises(MoKParamMismatchError, match=message) as info:
        check_param_layout(variant, layout)
    assert "toy_gemm" in str(info.value) and "refusing to launch" in str(info.value)


def test_param_layout_exact_offset(tmp_path):
    data = tampered(lambda v: v["params"][0].update(offset=0))
    variant = load_manifest(write_manifest(tmp_path, data)).variant("toy_gemm", "sm_90a")
    with pytest.raises(MoKParamMismatchError, match=r"param 0.*expected offset 0, cubin has 48"):
        check_param_layout(variant, driver_layout())


# ---------------------------------------------------------------- TMA arguments

SPEC_B = TmaSpec("b_desc", "bf16", 3, (64, 128, 1), "128B")


def test_tma_encode_args_dims_innermost_first():
    args = tma_encode_args(SPEC_B, (8, 512, 256), (512 * 256, 256, 1), torch.bfloat16, 0x1000)
    assert args.global_dims == (256, 512, 8)
    assert args.global_strides_bytes == (512, 512 * 512)
    assert args.box == (64, 128, 1) and args.element_strides == (1, 1, 1)
    assert (args.data_type, args.swizzle, args.l2_promotion) == ("BFLOAT16", "128B", "L2_128B")


@pytest.mark.parametrize(
    "shape, strides, dtype, ptr, error, message",
    [
        (
            (8, 512, 256),
            (131072, 256, 1),
            torch.float16,
            0,
            TypeError,
            r"needs a bf16 tensor.*got float16",
        ),
        (
            (512, 256),
            (256, 1),
            torch.bfloat16,
            0,
            ValueError,
            r"rank-3 tensor, got shape \[512, 256\]",
        ),
        ((8, 512, 256), (1, 8, 4096), torch.bfloat16, 0, ValueError, r"innermost dim.*contiguous"),
        (
            (8, 512, 260),
            (133120, 260, 1),
            torch.bfloat16,
            0,
            ValueError,
            r"multiples of 16.*\[520, 266240\]",
        ),
        ((8, 512, 256), (131072, 256, 1), torch.bfloat16, 0x1008, ValueError, r"16-byte aligned"),
        ((0, 512, 256), (131072, 256, 1), torch.bfloat16, 0, ValueError, r"every dim.*1\.\.2\^32"),
    ],
)
def test_tma_encode_args_rejects(shape, strides, dtype, ptr, error, message):
    with pytest.raises(error, match=message):
        tma_encode_args(SPEC_B, shape, strides, dtype, ptr)


def test_tma_box_wider_than_swizzle():
    spec = TmaSpec("c_desc", "bf16", 2, (64, 32), "64B")  # 128 B rows, 64 B swizzle span
    with pytest.raises(ValueError, match=r"innermost box of 128 B exceeds the 64B swizzle span"):
        tma_encode_args(spec, (64, 64), (64, 1), torch.bfloat16, 0)


def test_tma_descriptor_storage_is_aligned():
    descriptor = fake_descriptor(fill=0x11)
    assert descriptor.address % 64 == 0
    assert descriptor.to_bytes() == b"\x11" * 128
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        TmaDescriptor(None, b"12345")


# ---------------------------------------------------------------- error record


def record_words(**fields) -> list[int]:
    words = [0] * ERROR_RECORD_FIELDS
    for name, value in fields.items():
        words[FIELD_INDEX[name]] = value
    return words


def test_error_record_clear():
    assert decode_error_record(record_words()) is None
    raise_for_words(record_words())  # no error


def test_error_record_raises_naming_phase():
    words = record_words(
        flag=FLAG_VALID, rank=3, phase=int(WaitPhase.COMBINE), counter_index=17,
        observed=2, expected=4, peer_rank=5, cta=99, task=12,
    )  # fmt: skip
    cause = RuntimeError("CUDA error: unspecified launch failure")
    with pytest.raises(
        MoKWaitTimeoutError,
        match=r"rank 3 timed out waiting in phase COMBINE \(id 8\): counter 17 in rank 5's "
        r"memory read 2, expected 4 \(CTA 99, task 12\)",
    ) as info:
        raise_for_words(words, cause)
    assert info.value.__cause__ is cause
    assert info.value.fields.phase_name == "COMBINE"


def test_error_record_partial_and_unknown_phase():
    words = record_words(flag=FLAG_CLAIMED, rank=0, phase=999, peer_rank=-1)
    with pytest.raises(
        MoKWaitTimeoutError, match=r"unknown phase id 999.*this rank's memory.*cut short"
    ):
        raise_for_words(words)


def test_wait_phase_ids_are_stable():
    # The ids are a wire format shared with the kernels: renumbering breaks old cubins.
    assert WaitPhase.UNKNOWN == 0 and WaitPhase.DISPATCH == 5 and WaitPhase.COMBINE == 8
    assert [p.value for p in WaitPhase] == list(range(len(WaitPhase)))
