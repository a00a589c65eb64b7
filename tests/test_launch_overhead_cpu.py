"""CPU tests of the launch fast path: same bytes as the per-param packer, bounded host cost.

`ArgPacker` (mok/runtime/launch.py) replaced a packer that allocated a buffer and wrote each param
through ctypes on every launch. `reference_pack` below is that packer, kept here as the
reference: every kind must pack to the same bytes and be refused with the same error. The
launch path itself runs against a fake driver that records each cuLaunchKernelEx call.
Timings are printed (`pytest -s`); the asserted bounds are generous, for slow CI machines.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import struct
import threading
import time
import types

import pytest
import torch

from mok.runtime import TmaDescriptor, _driver, normalize_grid, pack_args
from mok.runtime import module as runtime_module
from mok.runtime.errors import MoKCudaError
from mok.runtime.launch import (
    PackedArgs,
    _check_tma_spec,
    _normalize_grid_checked,
    arg_packer,
)
from mok.runtime.manifest import ParamSpec, TmaSpec, VariantSpec

DESC_SPEC = TmaSpec("a_desc", "bf16", 3, (64, 128, 1), "128B")
# One param of every kind, in an order that needs padding before the 8- and 64-byte ones.
EVERY_KIND = VariantSpec(
    name="every_kind",
    kernel="Sm90Toy",
    arch="sm_90a",
    cubin="every_kind.sm_90a.cubin",
    symbol="mok_every_kind",
    params=(
        ParamSpec("flag", "int32", 4, 4),
        ParamSpec("a_desc", "tma_desc", 128, 64),
        ParamSpec("out_ptr", "pointer", 8, 8),
        ParamSpec("shared_ptr", "pointer", 8, 8),
        ParamSpec("count", "int32", 4, 4),
        ParamSpec("stride", "int64", 8, 8),
        ParamSpec("scale", "float32", 4, 4),
        ParamSpec("state", "bytes", 3, 1),
        ParamSpec("offset", "int64", 8, 8),
    ),
    block=(128, 1, 1),
    cluster=(1, 1, 1),
    dynamic_smem_bytes=0,
    tma=(DESC_SPEC,),
)
# The shape of the epilogue kernels' params: the common launch (4 pointers, 4 int32).
EPILOGUE = VariantSpec(
    name="moe_combine_forward",
    kernel="Sm90Combine",
    arch="sm_90a",
    cubin="moe_combine_forward.sm_90a.cubin",
    symbol="mok_moe_combine_forward",
    params=tuple(ParamSpec(n, "pointer", 8, 8) for n in ("out", "shared", "weight", "slots"))
    + tuple(ParamSpec(n, "int32", 4, 4) for n in ("num_tokens", "hidden", "topk", "has_shared")),
    block=(128, 1, 1),
    cluster=(1, 1, 1),
    dynamic_smem_bytes=0,
)
EPILOGUE_ARGS = {
    "out": 0x7F00_0000_1000,
    "shared": None,
    "weight": 0x7F00_0000_2000,
    "slots": 0x7F00_0000_3000,
    "num_tokens": 4096,
    "hidden": 7168,
    "topk": 8,
    "has_shared": 0,
}

_RANGES = {"int32": (-(1 << 31), 1 << 32), "int64": (-(1 << 63), 1 << 64)}
_CTYPES = {"int32": ctypes.c_uint32, "int64": ctypes.c_uint64}


def reference_pack(variant: VariantSpec, args, *, device_index=None) -> PackedArgs:
    """The packer before the packing plan: a new buffer, each param written through ctypes."""
    if not isinstance(args, dict):
        raise TypeError(f"kernel {variant.name!r}: args must be a dict, got {type(args).__name__}")
    expected = [p.name for p in variant.params]
    missing = [name for name in expected if name not in args]
    unknown = [name for name in args if name not in expected]
    if missing or unknown:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"unknown {', '.join(map(repr, unknown))}"] if unknown else []
        raise ValueError(
            f"kernel {variant.name!r} ({variant.arch}): bad argument names: {'; '.join(parts)} "
            f"(expected exactly: {', '.join(expected)})"
        )
    packed = PackedArgs(variant.params)
    for index, param in enumerate(variant.params):
        value, address = args[param.name], packed.param_address(index)
        where = f"kernel {variant.name!r} argument {param.name!r} ({param.kind})"
        if param.kind == "pointer":
            if value is None:
                value = 0
            elif isinstance(value, torch.Tensor):
                if not value.is_cuda:
                    raise ValueError(f"{where} must be a CUDA tensor, got one on {value.device}")
                value = value.data_ptr()
            elif not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"{where} takes a CUDA tensor, an int address or None, got "
                    f"{type(value).__name__}"
                )
            elif not 0 <= value < 1 << 64:
                raise ValueError(f"{where}: address must be in 0..2^64-1, got {value}")
            ctypes.c_uint64.from_address(address).value = value
        elif param.kind in _RANGES:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where} takes an int, got {type(value).__name__}")
            low, high = _RANGES[param.kind]
            if not low <= value < high:
                raise ValueError(
                    f"{where}: {value} does not fit in {param.kind} (range {low}..{high - 1})"
                )
            _CTYPES[param.kind].from_address(address).value = value
        elif param.kind == "float32":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where} takes a float, got {type(value).__name__}")
            try:
                struct.pack_into("<f", (ctypes.c_ubyte * 4).from_address(address), 0, value)
            except OverflowError:
                raise ValueError(f"{where}: {value} overflows float32") from None
        elif param.kind == "tma_desc":
            if not isinstance(value, TmaDescriptor):
                raise TypeError(
                    f"{where} takes a TmaDescriptor (mok.runtime.make_tma_descriptor), "
                    f"got {type(value).__name__}"
                )
            _check_tma_spec(variant, param, value, where)
            ctypes.memmove(address, value.address, 128)
        else:
            try:
                raw = memoryview(value).cast("B")
            except TypeError:
                raise TypeError(
                    f"{where} takes a bytes-like object of {param.size} bytes, got "
                    f"{type(value).__name__}"
                ) from None
            if raw.nbytes != param.size:
                raise ValueError(f"{where} takes {param.size} bytes, got {raw.nbytes}")
            ctypes.memmove(address, bytes(raw), param.size)
    return packed


def all_bytes(packed: PackedArgs, count: int) -> list[bytes]:
    return [packed.param_bytes(index) for index in range(count)]


def every_kind_args(**changes):
    args = {
        "flag": -1,
        "a_desc": TmaDescriptor(DESC_SPEC, bytes(range(128))),
        "out_ptr": 0x7F00_0000_1000,
        "shared_ptr": None,
        "count": 0xFFFF_FFFF,
        "stride": -(1 << 63),
        "scale": 0.1,
        "state": b"\x01\x02\x03",
        "offset": (1 << 64) - 1,
    }
    args.update(changes)
    return args


# ---------------------------------------------------------------- same bytes as before


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"flag": -(1 << 31), "count": 1 << 31, "stride": 1 << 40, "offset": -1},
        {"flag": (1 << 31) - 1, "count": 0, "stride": (1 << 63), "offset": 0},
        {"out_ptr": 0, "shared_ptr": (1 << 64) - 1},
        {"scale": -0.0},
        {"scale": math.inf},
        {"scale": -math.inf},
        {"scale": 3.4028234e38},
        {"scale": 1e-45},  # rounds to the smallest subnormal
        {"scale": 3},  # an int is a valid float32 value
        {"scale": 1 << 100},
        {"state": bytearray(b"xyz")},
        {"state": memoryview(b"\xff\x00\xff")},
        {"a_desc": TmaDescriptor(None, b"\x5a" * 128)},  # no spec: not checked, as before
    ],
)
def test_packed_bytes_identical(changes):
    args = every_kind_args(**changes)
    count = len(EVERY_KIND.params)
    assert all_bytes(pack_args(EVERY_KIND, args), count) == all_bytes(
        reference_pack(EVERY_KIND, args), count
    )


def test_packed_bytes_values():
    # Independent of both packers: the bytes each kind must produce.
    packed = pack_args(EVERY_KIND, every_kind_args())
    assert packed.param_bytes(0) == struct.pack("<i", -1)
    assert packed.param_bytes(1) == bytes(range(128))
    assert packed.param_bytes(2) == struct.pack("<Q", 0x7F00_0000_1000)
    assert packed.param_bytes(3) == bytes(8)
    assert packed.param_bytes(4) == b"\xff" * 4
    assert packed.param_bytes(5) == struct.pack("<q", -(1 << 63))
    assert packed.param_bytes(6) == struct.pack("<f", 0.1)
    assert packed.param_bytes(7) == b"\x01\x02\x03"
    assert packed.param_bytes(8) == b"\xff" * 8
    nan = pack_args(EVERY_KIND, every_kind_args(scale=math.nan)).param_bytes(6)
    assert math.isnan(struct.unpack("<f", nan)[0])


def test_subclass_values_take_the_checked_path():
    class Count(int):
        pass

    class Scale(float):
        pass

    args = every_kind_args(flag=Count(-3), stride=Count(5), scale=Scale(2.5), out_ptr=Count(64))
    count = len(EVERY_KIND.params)
    assert all_bytes(pack_args(EVERY_KIND, args), count) == all_bytes(
        reference_pack(EVERY_KIND, args), count
    )


def test_reused_buffer_is_rewritten_whole():
    packer = arg_packer(EVERY_KIND)
    reused = packer.new_args()
    count = len(EVERY_KIND.params)
    packer.pack_into(reused, every_kind_args(), None)
    other = every_kind_args(
        flag=5, a_desc=TmaDescriptor(DESC_SPEC, b"\x11" * 128), out_ptr=None, shared_ptr=8,
        count=-7, stride=0, scale=-2.0, state=b"abc", offset=12,
    )  # fmt: skip
    packer.pack_into(reused, other, None)
    assert all_bytes(reused, count) == all_bytes(reference_pack(EVERY_KIND, other), count)
    # The void*[] still points at the (aligned) params.
    pointers = (ctypes.c_void_p * count).from_address(reused.address)
    for index, param in enumerate(EVERY_KIND.params):
        assert pointers[index] == reused.param_address(index)
        assert reused.param_address(index) % param.align == 0, param.name


def test_packer_cache_is_per_variant_object():
    assert arg_packer(EVERY_KIND) is arg_packer(EVERY_KIND)
    twin = VariantSpec(**{**EVERY_KIND.__dict__, "name": "twin"})
    assert arg_packer(twin).variant is twin


@pytest.mark.parametrize(
    "changes",
    [
        {"flag": 1 << 32},
        {"flag": -(1 << 31) - 1},
        {"flag": True},
        {"flag": 1.0},
        {"stride": 1 << 64},
        {"stride": "1"},
        {"out_ptr": -1},
        {"out_ptr": 1 << 64},
        {"out_ptr": False},
        {"out_ptr": "0x10"},
        {"out_ptr": torch.zeros(2)},
        {"scale": 1e39},
        {"scale": -1e39},
        {"scale": "0.5"},
        {"scale": None},
        {"a_desc": b"\0" * 128},
        {"a_desc": TmaDescriptor(TmaSpec("a_desc", "bf16", 3, (64, 64, 1), "128B"), bytes(128))},
        {"state": b"\0\0"},
        {"state": 3},
    ],
)
def test_refusals_identical(changes):
    args = every_kind_args(**changes)
    with pytest.raises((TypeError, ValueError)) as before:
        reference_pack(EVERY_KIND, args)
    with pytest.raises(before.type) as after:
        pack_args(EVERY_KIND, args)
    assert str(after.value) == str(before.value)


def test_huge_int_scale_is_a_value_error():
    # The per-param packer let struct.error escape here; now it is refused like 1e39.
    with pytest.raises(ValueError, match=r"'scale' \(float32\): 1000\d+ overflows float32"):
        pack_args(EVERY_KIND, every_kind_args(scale=10**400))


@pytest.mark.parametrize(
    "edit",
    [
        lambda a: a.pop("count"),
        lambda a: a.update(extra=1),
        lambda a: (a.pop("count"), a.update(cnt=1)),  # same count of names, one wrong
    ],
)
def test_name_refusals_identical(edit):
    args = every_kind_args()
    edit(args)
    with pytest.raises(ValueError) as before:
        reference_pack(EVERY_KIND, args)
    with pytest.raises(ValueError) as after:
        pack_args(EVERY_KIND, args)
    assert str(after.value) == str(before.value)


@pytest.mark.parametrize(
    "grid, cluster",
    [
        (132, (2, 1, 1)), (133, (2, 1, 1)), (0, (1, 1, 1)), (1 << 31, (1, 1, 1)),
        ((4, 3, 1), (1, 1, 1)), ((4, 3), (1, 1, 1)), ([4, 3, 2], (1, 1, 1)),
        ((4, 70000, 1), (1, 1, 1)), ((4, 3, 0), (1, 1, 1)), ((4, 4, 1), (2, 2, 1)),
        ((4, 3, 1), (2, 2, 1)), (8, (2, 2, 1)), ((4, True, 1), (1, 1, 1)), (True, (1, 1, 1)),
        ("8", (1, 1, 1)),
    ],
)  # fmt: skip
def test_grid_fast_path_agrees(grid, cluster):
    try:
        expected = _normalize_grid_checked(grid, cluster)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)) as info:
            normalize_grid(grid, cluster)
        assert str(info.value) == str(exc)
    else:
        assert normalize_grid(grid, cluster) == expected


# ---------------------------------------------------------------- host cost


def per_call_us(function, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(200):
        function()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


def test_pack_args_cost():
    packer = arg_packer(EPILOGUE)
    reused = packer.new_args()
    before = per_call_us(lambda: reference_pack(EPILOGUE, EPILOGUE_ARGS))
    fresh = per_call_us(lambda: pack_args(EPILOGUE, EPILOGUE_ARGS))
    into = per_call_us(lambda: packer.pack_into(reused, EPILOGUE_ARGS, 0))
    print(
        f"\nepilogue params (4 pointers, 4 int32), us per call: per-param packer {before:.2f}, "
        f"pack_args {fresh:.2f}, pack_into a reused buffer (launch path) {into:.2f}"
    )
    # Generous: ~1.7 us on a 2-core CI box for pack_into; the bound only catches a regression
    # to per-launch planning or allocation.
    assert into < 50 and fresh < 50


# ---------------------------------------------------------------- launch path, fake driver


class FakeDriver:
    """The real cuda-python types; launches and context calls recorded, not executed."""

    def __init__(self, real, current=0x1000):
        self._real = real
        self.current = current
        self.launches = []
        self.context_sets = []
        self.launch_result = real.CUresult.CUDA_SUCCESS

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cuCtxGetCurrent(self):  # noqa: N802 - driver spelling
        return self._real.CUresult.CUDA_SUCCESS, self._real.CUcontext(self.current)

    def cuCtxSetCurrent(self, context):  # noqa: N802
        self.context_sets.append(int(context))
        self.current = int(context)
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, config, function, params, extra):  # noqa: N802
        assert extra == 0
        grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        self.launches.append((grid, int(config.hStream), int(function), params, self.current))
        return (self.launch_result,)


def read_params(address: int, variant: VariantSpec) -> list[bytes]:
    pointers = (ctypes.c_void_p * len(variant.params)).from_address(address)
    return [ctypes.string_at(pointers[i], p.size) for i, p in enumerate(variant.params)]


@pytest.fixture
def fake_kernel(monkeypatch):
    try:
        from cuda.bindings import driver as real
    except ImportError:
        real = pytest.importorskip("cuda.cuda")
    fake = FakeDriver(real)
    monkeypatch.setattr(_driver, "_driver_module", fake)
    monkeypatch.setitem(runtime_module._primary_contexts, 0, real.CUcontext(0x1000))
    return fake_kernel_of(EPILOGUE, real), fake


def fake_kernel_of(variant: VariantSpec, real):
    kernel = object.__new__(runtime_module.Kernel)  # skips loading: no GPU here
    kernel.variant, kernel.device_index, kernel.cubin_path = variant, 0, None
    kernel.function = real.CUfunction(0x2000)
    kernel._cluster_attribute = kernel._make_cluster_attribute()
    kernel._prepare_launches()
    return kernel


def test_cluster_attribute_only_for_clusters_of_more_than_one_cta(fake_kernel):
    """A 1x1x1 kernel launches without a launch attribute (the driver's cheaper call); a larger
    cluster carries its shape."""
    kernel, fake = fake_kernel
    plain = kernel._launch_config((4, 1, 1), 0)
    assert plain.numAttrs == 0
    wide = fake_kernel_of(dataclasses.replace(EPILOGUE, cluster=(2, 1, 1)), fake._real)
    config = wide._launch_config((4, 1, 1), 0)
    assert config.numAttrs == 1
    dims = config.attrs[0].value.clusterDim
    assert (dims.x, dims.y, dims.z) == (2, 1, 1)


def test_launch_passes_grid_stream_and_param_bytes(fake_kernel):
    kernel, fake = fake_kernel
    kernel.launch((3, 5, 1), EPILOGUE_ARGS, stream=0xABC)
    args = dict(EPILOGUE_ARGS, num_tokens=-2, shared=0x10)
    kernel.launch(7, args, stream=0xDEF)
    count = len(EPILOGUE.params)
    (grid0, stream0, function0, params0, ctx0), (grid1, stream1, _, params1, _) = fake.launches
    assert (grid0, stream0, function0, ctx0) == ((3, 5, 1), 0xABC, 0x2000, 0x1000)
    assert (grid1, stream1) == ((7, 1, 1), 0xDEF)
    # One buffer per thread, reused: the second launch rewrote it whole.
    assert params0 == params1
    assert read_params(params1, EPILOGUE) == all_bytes(reference_pack(EPILOGUE, args), count)
    assert fake.context_sets == []  # the primary context was current: no switch


def test_launch_switches_context_and_restores(fake_kernel):
    kernel, fake = fake_kernel
    fake.current = 0x9000  # another context is current on this thread
    kernel.launch(1, EPILOGUE_ARGS, stream=1)
    assert fake.launches[0][4] == 0x1000  # launched in the kernel's primary context
    assert fake.context_sets == [0x1000, 0x9000] and fake.current == 0x9000


def test_launch_error_names_the_launch(fake_kernel):
    kernel, fake = fake_kernel
    fake.launch_result = fake.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(MoKCudaError, match=r"cuLaunchKernelEx\('moe_combine_forward', grid \[2"):
        kernel.launch((2, 1, 1), EPILOGUE_ARGS, stream=1)


def test_launch_refuses_bad_args_before_the_driver(fake_kernel):
    kernel, fake = fake_kernel
    with pytest.raises(ValueError, match=r"'num_tokens'.*does not fit in int32"):
        kernel.launch(1, dict(EPILOGUE_ARGS, num_tokens=1 << 32), stream=1)
    with pytest.raises(ValueError, match=r"not a multiple|must be in"):
        kernel.launch(0, EPILOGUE_ARGS, stream=1)
    assert fake.launches == []


def test_launch_buffers_are_per_thread(fake_kernel):
    kernel, fake = fake_kernel
    kernel.launch(1, EPILOGUE_ARGS, stream=1)
    thread = threading.Thread(target=kernel.launch, args=(1, EPILOGUE_ARGS), kwargs={"stream": 2})
    thread.start()
    thread.join()
    assert len(fake.launches) == 2 and fake.launches[0][3] != fake.launches[1][3]


def test_launch_cost(fake_kernel):
    kernel, fake = fake_kernel
    fake.launches = types.SimpleNamespace(append=lambda item: None)  # record nothing
    cost = per_call_us(lambda: kernel.launch((4, 100, 1), EPILOGUE_ARGS, stream=0x1234))
    print(f"\nKernel.launch with a no-op fake driver: {cost:.2f} us per call")
    assert cost < 100  # generous; ~3 us here. The GPU figure adds the real driver calls.


# ---------------------------------------------------------------- cached lookups


def test_arch_env_token_follows_the_environment(monkeypatch):
    monkeypatch.delenv("MOK_ARCH", raising=False)
    assert runtime_module.arch_env_token() is None
    monkeypatch.setenv("MOK_ARCH", "sm_100a")
    token = runtime_module.arch_env_token()
    monkeypatch.setenv("MOK_ARCH", "sm_90a")
    assert runtime_module.arch_env_token() not in (None, token)


def test_get_kernel_resolves_an_indexless_device_every_call(monkeypatch):
    current = {"index": 0}
    loaded = []

    def resolve(device):
        return current["index"] if device in (None, "cuda", torch.device("cuda")) else device

    def load(name, *, device, arch, manifest):
        loaded.append(device)
        return f"{name}@{device}"

    monkeypatch.setattr(runtime_module, "_fast_kernels", {})
    monkeypatch.setattr(runtime_module, "device_index", resolve)
    monkeypatch.setattr(runtime_module, "_get_kernel_slow", load)
    assert runtime_module.get_kernel("k", device=torch.device("cuda")) == "k@0"
    current["index"] = 1  # torch.cuda.set_device(1)
    assert runtime_module.get_kernel("k", device=torch.device("cuda")) == "k@1"
    assert runtime_module.get_kernel("k", device=torch.device("cuda", 0)) == "k@0"
    assert runtime_module.get_kernel("k") == "k@1"
    assert loaded == [0, 1]  # later calls hit the cache


# ---------------------------------------------------------------- bound launches (Kernel.bind)


def test_bound_launch_writes_only_its_dynamic_params(fake_kernel):
    kernel, fake = fake_kernel
    bound = kernel.bind((3, 5, 1), EPILOGUE_ARGS, dynamic=("out", "slots", "num_tokens"))
    bound.launch(0x7F00_0000_9000, 0x7F00_0000_A000, -2, stream=0xABC)
    bound.launch(0x7F00_0000_B000, 0x7F00_0000_C000, 64, stream=0xDEF)
    count = len(EPILOGUE.params)
    (grid0, stream0, _, params0, _), (grid1, stream1, _, params1, _) = fake.launches
    assert (grid0, stream0, grid1, stream1) == ((3, 5, 1), 0xABC, (3, 5, 1), 0xDEF)
    expected = dict(EPILOGUE_ARGS, out=0x7F00_0000_B000, slots=0x7F00_0000_C000, num_tokens=64)
    assert params0 == params1  # one buffer, rewritten in place
    assert read_params(params1, EPILOGUE) == all_bytes(reference_pack(EPILOGUE, expected), count)


def test_bound_launch_of_every_kind_writes_the_packers_bytes(fake_kernel):
    """Dynamic descriptors, ints (negative ones modulo 2^bits) and floats beside constant raw
    bytes and padding: every launch's buffer holds what the full packer writes."""
    _, fake = fake_kernel
    kernel = fake_kernel_of(EVERY_KIND, fake._real)
    dynamic = ("a_desc", "flag", "scale", "stride", "out_ptr")
    bound = kernel.bind(1, every_kind_args(), dynamic=dynamic)
    count = len(EVERY_KIND.params)
    for changes in (
        dict(a_desc=TmaDescriptor(DESC_SPEC, b"\x11" * 128), flag=-2, scale=-0.5,
             stride=-(1 << 63), out_ptr=0x7F00_0000_4000),
        dict(a_desc=TmaDescriptor(DESC_SPEC, bytes(range(128, 256))), flag=(1 << 32) - 1,
             scale=3.0e38, stride=(1 << 64) - 1, out_ptr=0),
    ):  # fmt: skip
        bound.launch(*(changes[name] for name in dynamic), stream=0x5)
        want = all_bytes(reference_pack(EVERY_KIND, every_kind_args(**changes)), count)
        assert read_params(fake.launches[-1][3], EVERY_KIND) == want


def test_bound_launch_checks_its_args_once_when_bound(fake_kernel):
    kernel, fake = fake_kernel
    with pytest.raises(ValueError, match=r"'num_tokens'.*does not fit in int32"):
        kernel.bind(1, dict(EPILOGUE_ARGS, num_tokens=1 << 32))
    with pytest.raises(ValueError, match=r"dynamic param 'nope' is not one of its params"):
        kernel.bind(1, EPILOGUE_ARGS, dynamic=("nope",))
    with pytest.raises(ValueError, match=r"not a multiple|must be in"):
        kernel.bind(0, EPILOGUE_ARGS)
    assert fake.launches == []


def test_bound_launch_cost(fake_kernel):
    kernel, fake = fake_kernel
    fake.launches = types.SimpleNamespace(append=lambda item: None)  # record nothing
    bound = kernel.bind((4, 100, 1), EPILOGUE_ARGS, dynamic=("out", "weight", "slots"))
    cost = per_call_us(lambda: bound.launch(0x1000, 0x2000, 0x3000, stream=0x1234))
    print(f"\nBoundLaunch.launch with a no-op fake driver: {cost:.2f} us per call")
    assert cost < 100  # generous; ~1 us here (GPU: 5.4 us with the driver, tools/host_floors.py)
