"""Which cubin arch a torch CUDA device runs, with the MOK_ARCH override.

`sm_90a`, `sm_100a` and `sm_103a` cubins run only on that exact chip family, so the arch is
picked from the compute capability, never by "closest match".
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from .errors import MoKUnsupportedDeviceError

ARCH_ENV_VAR = "MOK_ARCH"
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}


def arch_override() -> str | None:
    """The arch forced by the MOK_ARCH environment variable (read now), or None when unset.

    Raises ValueError naming the variable, the allowed values and the value given.
    """
    value = os.environ.get(ARCH_ENV_VAR, "").strip()
    if not value:
        return None
    if value not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{ARCH_ENV_VAR} must be one of {', '.join(SUPPORTED_ARCHS)} (or unset), got {value!r}"
        )
    return value


def device_index(device: int | str | torch.device | None = None) -> int:
    """The CUDA device index of `device` (None: torch's current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise TypeError(f"device must be a CUDA device index or torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {str(device)!r}")
    return torch.cuda.current_device() if device.index is None else device.index


def arch_for_capability(
    capability: tuple[int, int],
    *,
    device_name: str = "this GPU",
    shipped_archs: Iterable[str] | None = None,
) -> str:
    """The cubin arch of a compute capability; MoKUnsupportedDeviceError for any other GPU."""
    major, minor = capability
    arch = ARCH_BY_CAPABILITY.get((major, minor))
    if arch is None:
        supported = sorted(set(shipped_archs)) if shipped_archs is not None else SUPPORTED_ARCHS
        raise MoKUnsupportedDeviceError(
            f"{device_name} (compute capability {major}.{minor}) is not supported by mok: the "
            f"shipped cubins are built for {', '.join(supported) or 'no arch'} "
            f"(capabilities {', '.join(f'{a}.{b}' for a, b in ARCH_BY_CAPABILITY)}); "
            f"{ARCH_ENV_VAR} cannot make other GPUs run them"
        )
    return arch


_NATIVE_ARCH: dict[int, str] = {}


def native_arch(device: int | str | torch.device | None = None) -> str:
    """The arch of the physical device, ignoring MOK_ARCH (MoKUnsupportedDeviceError if none).

    Cached per device index: a device's capability never changes, and querying it (device
    properties, the manifest for the error message) costs tens of microseconds per launch.
    """
    index = device_index(device)
    cached = _NATIVE_ARCH.get(index)
    if cached is not None:
        return cached
    _NATIVE_ARCH[index] = arch = _query_native_arch(index)
    return arch


def _query_native_arch(index: int) -> str:
    return arch_for_capability(
        torch.cuda.get_device_capability(index),
        device_name=f"cuda:{index} ({torch.cuda.get_device_name(index)})",
        shipped_archs=_shipped_archs(),
    )


def select_arch(device: int | str | torch.device | None = None) -> str:
    """The arch whose cubins the runtime loads for `device`: MOK_ARCH if set, else native_arch.

    With MOK_ARCH set the device is not queried at all (so a build or CPU-only process can
    name an arch); a mismatch with the real device is reported when a kernel is loaded.
    """
    override = arch_override()
    if override is not None:
        return override
    return native_arch(device)


def _shipped_archs() -> list[str] | None:
    # Best effort: the error message lists what the installed manifest holds, if readable.
    from .manifest import MoKManifestError, load_manifest

    try:
        return load_manifest().archs()
    except MoKManifestError:
        return None
