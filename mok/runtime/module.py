"""Loading cubins into a device's primary context and launching their kernels.

Each cubin is loaded once per (device, cubin file) with cuModuleLoadData into the device's
primary context, the one torch uses, so launches run on torch's streams. Loading checks the
function's parameter layout against the manifest (cuFuncGetParamInfo) and sets the function
attributes the kernel needs; a mismatch refuses the kernel before any launch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import _driver
from .arch import ARCH_ENV_VAR, device_index, native_arch, select_arch
from .bound_launch import BoundLaunch
from .errors import MoKCudaError, MoKManifestError, MoKUnsupportedDeviceError
from .launch import ArgPacker, PackedArgs, check_param_layout, normalize_grid
from .manifest import Manifest, TmaSpec, VariantSpec, load_manifest
from .tma import TmaDescriptor, make_tma_descriptor

# Dynamic shared memory above this needs the MAX_DYNAMIC_SHARED_SIZE_BYTES opt-in.
_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
# Clusters larger than this are "non-portable" and need an opt-in attribute.
_PORTABLE_CLUSTER_SIZE = 8
# Safety bound when probing cuFuncGetParamInfo past the manifest's param count.
_MAX_PARAMS_PROBED = 4096

_lock = threading.RLock()
_primary_contexts: dict[int, Any] = {}
_modules: dict[tuple[int, str], Any] = {}
_kernels: dict[tuple[int, str, str, str], Kernel] = {}
_fast_kernels: dict[tuple, Kernel] = {}
_current_raw_stream: Any = None  # resolved on first use, see current_stream_handle()


def current_stream_handle(index: int) -> int:
    """torch's current CUstream of device `index`, as an int.

    `torch._C._cuda_getCurrentRawStream` (what torch inductor's generated code calls) answers
    without building a torch.cuda.Stream object; the public spelling is the fallback where a
    torch build lacks it. Both read the same current stream, the capture stream included.
    """
    global _current_raw_stream
    if _current_raw_stream is None:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _current_raw_stream = raw if raw is not None else _public_current_stream_handle
    return _current_raw_stream(index)


def _public_current_stream_handle(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


_environ_key: Any = None  # MOK_ARCH as os.environ stores keys, resolved on first use


def arch_env_token() -> Any:
    """MOK_ARCH's raw value now (None when unset), for cache keys only: never validated.

    `os.environ.get` encodes the key on every call; the mapping's own dict answers the same
    question without that, and os.environ's setters keep it current. Falls back to
    `os.environ.get` where os.environ has no such dict.
    """
    global _environ_key
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data is None:
        return environ.get(ARCH_ENV_VAR)
    if _environ_key is None:
        _environ_key = environ.encodekey(ARCH_ENV_VAR)
    return data.get(_environ_key)


# ---------------------------------------------------------------- contexts


def primary_context(index: int) -> Any:
    """The primary context of device `index` (retained once, for the process lifetime)."""
    with _lock:
        context = _primary_contexts.get(index)
        if context is None:
            cu = _driver.driver()
            # Idempotent; torch has already initialised the driver when it touched the GPU.
            _driver.check(cu.cuInit(0), "cuInit")
            device = _driver.check(cu.cuDeviceGet(index), f"cuDeviceGet({index})")
            context = _driver.check(
                cu.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain(cuda:{index})"
            )
            _primary_contexts[index] = context
        return context


def _make_current(context: Any) -> Any:
    """Make `context` current on this thread; return the context to restore, or None.

    torch keeps its device's primary context current, so this is usually one
    cuCtxGetCurrent call; it switches only when the caller's current device differs.
    """
    cu = _driver.driver()
    current = _driver.check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) == int(context):
        return None
    _driver.check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    # A thread with no current context keeps the primary one: that is what cudart would do.
    return current if int(current) != 0 else None


def _restore(previous: Any) -> None:
    if previous is not None:
        cu = _driver.driver()
        _driver.check(cu.cuCtxSetCurrent(previous), "cuCtxSetCurrent (restore)")


# ---------------------------------------------------------------- modules


def load_module(index: int, cubin_path: Path) -> Any:
    """Load a cubin (or, for tests, a .ptx file) into device `index`'s primary context, once."""
    key = (index, str(cubin_path))
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        try:
            image = cubin_path.read_bytes()
        except OSError as exc:
            raise MoKManifestError(f"cannot read cubin {cubin_path}: {exc}") from exc
        if cubin_path.suffix == ".ptx":
            image += b"\0"  # the driver reads PTX as a C string
        cu = _driver.driver()
        previous = _make_current(primary_context(index))
        try:
            module = _driver.check(
                cu.cuModuleLoadData(image), f"cuModuleLoadData({cubin_path.name}) on cuda:{index}"
            )
        finally:
            _restore(previous)
        _modules[key] = module
        return module


class _LaunchState:
    """One thread's reusable launch buffers for one Kernel (see `Kernel.launch`)."""

    __slots__ = ("packed", "config", "stream_handle")

    def __init__(self, packed: PackedArgs, config: Any):
        self.packed = packed
        self.config = config
        self.stream_handle = 0  # what config.hStream holds


class Kernel:
    """One kernel variant loaded on one device, ready to launch.

    Attributes: `variant` (the manifest entry), `device_index`, `function` (CUfunction).
    Build with `get_kernel`; launching is thread-safe and CUDA-graph capturable.
    """

    def __init__(self, variant: VariantSpec, cubin_path: Path, index: int):
        self.variant = variant
        self.device_index = index
        self.cubin_path = cubin_path
        cu = _driver.driver()
        module = load_module(index, cubin_path)
        previous = _make_current(primary_context(index))
        try:
            self.function = _driver.check(
                cu.cuModuleGetFunction(module, variant.symbol.encode()),
                f"cuModuleGetFunction({variant.symbol!r}) in {cubin_path.name} "
                f"(variant {variant.name!r})",
            )
            # Under CUDA's lazy module loading a function's code is loaded at its first launch,
            # which may wait for the kernels already running in the context. A mok kernel
            # that is the producer of another kernel's bounded wait must never be held back
            # that way, so load it now (cuFuncLoad, CUDA >= 12.4 drivers).
            if hasattr(cu, "cuFuncLoad"):
                _driver.check(cu.cuFuncLoad(self.function), f"cuFuncLoad({variant.symbol!r})")
            check_param_layout(variant, self._param_info())
            self._set_attributes()
        finally:
            _restore(previous)
        self._cluster_attribute = self._make_cluster_attribute()
        self._prepare_launches()

    # ------------------------------------------------------------ load-time checks

    def _param_info(self) -> list[tuple[int, int]]:
        """(offset, size) of every param of the function: probe until the driver refuses.

        cuFuncGetParamInfo answers CUDA_ERROR_INVALID_VALUE for an index past the last
        param; that ends the list. Any other error is raised.
        """
        cu = _driver.driver()
        info = []
        for index in range(_MAX_PARAMS_PROBED):
            result = cu.cuFuncGetParamInfo(self.function, index)
            if result[0] == cu.CUresult.CUDA_ERROR_INVALID_VALUE:
                break
            _driver.check(
                result,
                f"cuFuncGetParamInfo({self.variant.symbol!r}, {index}) for variant "
                f"{self.variant.name!r}",
            )
            info.append((int(result[1]), int(result[2])))
        return info

    def _function_attribute(self, attribute: str) -> int:
        cu = _driver.driver()
        return _driver.check(
            cu.cuFuncGetAttribute(getattr(cu.CUfunction_attribute, attribute), self.function),
            f"cuFuncGetAttribute({attribute}) for {self.variant.name!r}",
        )

    def _set_attribute(self, attribute: str, value: int) -> None:
        cu = _driver.driver()
        _driver.check(
            cu.cuFuncSetAttribute(
                self.function, getattr(cu.CUfunction_attribute, attribute), value
            ),
            f"cuFuncSetAttribute({attribute}={value}) for {self.variant.name!r}",
        )

    def _set_attributes(self) -> None:
        variant = self.variant
        threads = variant.block[0] * variant.block[1] * variant.block[2]
        max_threads = self._function_attribute("CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK")
        if threads > max_threads:
            raise MoKManifestError(
                f"kernel {variant.name!r}: manifest block {list(variant.block)} has {threads} "
                f"threads, the cubin allows at most {max_threads}"
            )
        if variant.dynamic_smem_bytes > _DEFAULT_DYNAMIC_SMEM_LIMIT:
            cu = _driver.driver()
            device = _driver.check(cu.cuDeviceGet(self.device_index), "cuDeviceGet")
            optin = _driver.check(
                cu.cuDeviceGetAttribute(
                    cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                    device,
                ),
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)",
            )
            static = self._function_attribute("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES")
            if variant.dynamic_smem_bytes + static > optin:
                raise MoKManifestError(
                    f"kernel {variant.name!r} needs {variant.dynamic_smem_bytes} B dynamic + "
                    f"{static} B static shared memory; cuda:{self.device_index} allows {optin} B"
                )
            self._set_attribute(
                "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", variant.dynamic_smem_bytes
            )
        if variant.cluster_size > _PORTABLE_CLUSTER_SIZE:
            self._set_attribute("CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED", 1)

    def _make_cluster_attribute(self) -> Any:
        # The cluster shape is not recorded in the cubin: a kernel of clusters larger than one
        # CTA is launched with this attribute (`_launch_config`); a 1x1x1 one without it.
        cu = _driver.driver()
        attribute = cu.CUlaunchAttribute()
        attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attribute.value.clusterDim.x = self.variant.cluster[0]
        attribute.value.clusterDim.y = self.variant.cluster[1]
        attribute.value.clusterDim.z = self.variant.cluster[2]
        return attribute

    # ------------------------------------------------------------ launching

    def _prepare_launches(self) -> None:
        """Everything a launch needs that does not change between launches (see `launch`)."""
        cu = _driver.driver()
        self._cu = cu
        self._success = cu.CUresult.CUDA_SUCCESS
        self._packer = ArgPacker(self.variant)
        self._context = primary_context(self.device_index)
        self._context_handle = int(self._context)
        self._thread_state = threading.local()

    def _launch_config(self, grid: tuple[int, int, int], stream_handle: int) -> Any:
        cu = _driver.driver()
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.variant.block
        config.sharedMemBytes = self.variant.dynamic_smem_bytes
        config.hStream = cu.CUstream(stream_handle)
        # A launch with a cluster attribute costs the driver more than one without, and a
        # kernel without one runs as clusters of one CTA (`tools/host_floors.py` times both).
        if tuple(self.variant.cluster) != (1, 1, 1):
            config.attrs = [self._cluster_attribute]  # the setter copies the attribute
            config.numAttrs = 1
        return config

    def _new_thread_state(self) -> _LaunchState:
        state = _LaunchState(self._packer.new_args(), self._launch_config(self.variant.cluster, 0))
        self._thread_state.state = state
        return state

    def _stream_handle(self, stream: Any) -> int:
        if stream is None:
            return current_stream_handle(self.device_index)
        if isinstance(stream, torch.cuda.Stream):
            if stream.device_index != self.device_index:
                raise ValueError(
                    f"kernel {self.variant.name!r} is loaded on cuda:{self.device_index}, "
                    f"stream is on cuda:{stream.device_index}"
                )
            return stream.cuda_stream
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        raise TypeError(
            f"stream must be None, a torch.cuda.Stream or a raw CUstream handle (int), "
            f"got {type(stream).__name__}"
        )

    def launch(
        self,
        grid: int | Sequence[int],
        args: Mapping[str, Any],
        *,
        stream: torch.cuda.Stream | int | None = None,
    ) -> None:
        """Launch on `stream` (default: torch's current stream of this kernel's device).

        `args` maps every manifest param name to its value (see `pack_args`); every launch
        checks names, kinds and ranges. Asynchronous: no host sync, no device allocation, so
        it can be captured in a CUDA graph.

        Thread-safe: each thread packs into its own param buffer and CUlaunchConfig (held in
        a threading.local), which are rewritten, never shared, on every launch. Reusing them
        is safe because cuLaunchKernelEx copies the param values and the config during the
        call (also under graph capture, where the node keeps its own copy).
        """
        grid3 = normalize_grid(grid, self.variant.cluster)
        try:
            state = self._thread_state.state
        except AttributeError:
            state = self._new_thread_state()
        packed = self._packer.pack_into(state.packed, args, self.device_index)
        handle = (
            current_stream_handle(self.device_index)
            if stream is None
            else self._stream_handle(stream)
        )
        config = state.config
        config.gridDimX, config.gridDimY, config.gridDimZ = grid3
        if handle != state.stream_handle:
            config.hStream = self._cu.CUstream(handle)
            state.stream_handle = handle
        self.launch_packed(config, packed, grid3)

    def bind(
        self, grid: int | Sequence[int], args: Mapping[str, Any], dynamic: Sequence[str] = ()
    ) -> BoundLaunch:
        """This launch with `args` checked and packed once; `BoundLaunch.launch` rewrites only
        the `dynamic` params (mok/runtime/bound_launch.py)."""
        return BoundLaunch(self, grid, args, dynamic)

    def current_stream_handle(self) -> int:
        """torch's current CUstream of this kernel's device, as an int."""
        return current_stream_handle(self.device_index)

    def launch_packed(self, config: Any, packed: PackedArgs, grid3: tuple) -> None:
        """cuLaunchKernelEx of packed args with a ready CUlaunchConfig (grid and stream set)."""
        # torch keeps its device's primary context current, so this is one cuCtxGetCurrent
        # (a thread-local read in the driver); a switch happens only when it is another one.
        status, current = self._cu.cuCtxGetCurrent()
        if status != self._success or int(current) != self._context_handle:
            self._launch_switching_context(config, packed, grid3)
            return
        result = self._cu.cuLaunchKernelEx(config, self.function, packed.address, 0)
        if result[0] != self._success:
            self._raise_launch_error(result, grid3)

    def _launch_switching_context(self, config: Any, packed: PackedArgs, grid3: tuple) -> None:
        previous = _make_current(self._context)
        try:
            result = self._cu.cuLaunchKernelEx(config, self.function, packed.address, 0)
            if result[0] != self._success:
                self._raise_launch_error(result, grid3)
        finally:
            _restore(previous)

    def _raise_launch_error(self, result: Any, grid3: tuple) -> None:
        # The message is built only on failure: formatting it costs more than a launch.
        _driver.check(
            result,
            f"cuLaunchKernelEx({self.variant.name!r}, grid {list(grid3)}, block "
            f"{list(self.variant.block)}, cluster {list(self.variant.cluster)})",
        )

    def max_active_clusters(self) -> int:
        """Clusters of this kernel that can be co-resident on the device (persistent grids)."""
        cu = _driver.driver()
        # The grid of the query config is ignored beyond being a multiple of the cluster.
        config = self._launch_config(self.variant.cluster, 0)
        previous = _make_current(self._context)
        try:
            return _driver.check(
                cu.cuOccupancyMaxActiveClusters(self.function, config),
                f"cuOccupancyMaxActiveClusters({self.variant.name!r})",
            )
        finally:
            _restore(previous)

    def make_tma_descriptor(self, param: str, tensor: torch.Tensor) -> TmaDescriptor:
        """A TMA descriptor for `tensor` as this kernel's manifest spec for `param` says."""
        spec: TmaSpec | None = self.variant.tma_spec(param)
        if spec is None:
            names = [s.param for s in self.variant.tma]
            raise ValueError(
                f"kernel {self.variant.name!r} has no TMA spec for param {param!r}; "
                f"TMA params: {', '.join(names) or 'none'}"
            )
        return make_tma_descriptor(spec, tensor)

    def __repr__(self) -> str:
        return (
            f"Kernel({self.variant.name!r}, arch={self.variant.arch}, "
            f"device=cuda:{self.device_index})"
        )


def get_kernel(
    name: str,
    *,
    device: int | str | torch.device | None = None,
    arch: str | None = None,
    manifest: Manifest | str | Path | None = None,
) -> Kernel:
    """The variant `name` loaded on `device` (default: torch's current device), cached.

    `arch` defaults to `select_arch` (MOK_ARCH, else the device's compute capability).
    `manifest` defaults to the installed one. Raises MoKManifestError (no such variant),
    MoKUnsupportedDeviceError (arch cannot run on the device), MoKParamMismatchError (cubin
    and manifest disagree) or MoKCudaError (a driver call failed).
    """
    # Fast path for the launchers' per-call lookups: same name, device index, arch request,
    # manifest request and MOK_ARCH value as an earlier call returns the same Kernel. The
    # device is resolved to its index first (an index-less "cuda" means torch's current
    # device, which may change between calls).
    if not (manifest is None or isinstance(manifest, str)):
        return _get_kernel_slow(name, device=device, arch=arch, manifest=manifest)
    if device.__class__ is torch.device and device.type == "cuda" and device.index is not None:
        index = device.index
    elif device.__class__ is int and device >= 0:
        index = device
    else:
        index = device_index(device)
    fast_key = (name, index, arch, manifest, arch_env_token())
    kernel = _fast_kernels.get(fast_key)
    if kernel is not None:
        return kernel
    kernel = _get_kernel_slow(name, device=index, arch=arch, manifest=manifest)
    _fast_kernels[fast_key] = kernel
    return kernel


def _get_kernel_slow(name, *, device, arch, manifest) -> Kernel:
    index = device_index(device)
    chosen_arch = select_arch(index) if arch is None else arch
    if not isinstance(manifest, Manifest):
        manifest = load_manifest(manifest)
    key = (index, chosen_arch, name, str(manifest.path))
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(key)
        if kernel is not None:
            return kernel
        variant = manifest.variant(name, chosen_arch)
        device_arch = native_arch(index)
        if device_arch != variant.arch:
            source = f"{ARCH_ENV_VAR}={chosen_arch}" if arch is None else f"arch={chosen_arch!r}"
            raise MoKUnsupportedDeviceError(
                f"kernel {name!r}: {source} selects {variant.arch} cubins, but cuda:{index} "
                f"({torch.cuda.get_device_name(index)}, compute capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(index)))}) runs "
                f"{device_arch} cubins only"
            )
        cubin_path = manifest.cubin_path(variant)
        if not cubin_path.is_file():
            raise MoKManifestError(
                f"cubin {cubin_path} of variant {name!r} ({variant.arch}) listed in "
                f"{manifest.path} does not exist"
            )
        try:
            kernel = Kernel(variant, cubin_path, index)
        except MoKCudaError as exc:
            if exc.error_name in ("CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_IMAGE"):
                raise MoKUnsupportedDeviceError(
                    f"cubin {cubin_path.name} ({variant.arch}) cannot be loaded on "
                    f"cuda:{index}: {exc}"
                ) from exc
            raise
        _kernels[key] = kernel
        return kernel
