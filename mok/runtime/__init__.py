"""mok's runtime: load the ahead-of-time cubins and launch them with cuda-python only.

Importing this package has no side effects: the CUDA driver bindings are imported, the
manifest read and MOK_ARCH consulted only when a function that needs them is called.
"""

from .arch import (
    ARCH_ENV_VAR,
    SUPPORTED_ARCHS,
    arch_for_capability,
    arch_override,
    native_arch,
    select_arch,
)
from .error_record import (
    ERROR_RECORD_BYTES,
    ERROR_RECORD_FIELDS,
    ErrorRecord,
    ErrorRecordFields,
)
from .errors import (
    MoKCudaError,
    MoKManifestError,
    MoKParamMismatchError,
    MoKRuntimeError,
    MoKUnsupportedDeviceError,
    MoKWaitTimeoutError,
    WaitPhase,
)
from .launch import PackedArgs, check_param_layout, normalize_grid, pack_args
from .manifest import (
    Manifest,
    ParamSpec,
    TmaSpec,
    VariantSpec,
    default_manifest_path,
    load_manifest,
)
from .module import Kernel, get_kernel
from .tma import TmaDescriptor, make_tma_descriptor

__all__ = [
    "ARCH_ENV_VAR",
    "ERROR_RECORD_BYTES",
    "ERROR_RECORD_FIELDS",
    "SUPPORTED_ARCHS",
    "ErrorRecord",
    "ErrorRecordFields",
    "Kernel",
    "Manifest",
    "MoKCudaError",
    "MoKManifestError",
    "MoKParamMismatchError",
    "MoKRuntimeError",
    "MoKUnsupportedDeviceError",
    "MoKWaitTimeoutError",
    "PackedArgs",
    "ParamSpec",
    "TmaDescriptor",
    "TmaSpec",
    "VariantSpec",
    "WaitPhase",
    "arch_for_capability",
    "arch_override",
    "check_param_layout",
    "default_manifest_path",
    "get_kernel",
    "load_manifest",
    "make_tma_descriptor",
    "native_arch",
    "normalize_grid",
    "pack_args",
    "select_arch",
]
