"""The cubin manifest: what the ahead-of-time build produced, read and validated.

`mok/dsl_kernels/cubins/manifest.json` (format 1) lists every compiled kernel variant:

    {"format": 1, "dsl_version": "4.8.1", "source_hash": "...",
     "variants": [{"name", "kernel", "arch", "cubin", "symbol", "config",
                   "params": [{"name", "kind", "size", "align"[, "offset"]}, ...],
                   "block": [x, y, z], "cluster": [x, y, z], "dynamic_smem_bytes",
                   "tma": [{"param", "dtype", "rank", "box", "swizzle", "l2_promotion",
                            "oob_fill"}, ...],
                   "launch": {"grid": "..."}}, ...]}

Param kinds and their sizes: pointer 8, int32 4, int64 8, float32 4, tma_desc 128 (a
CUtensorMap passed by value), bytes (any size, passed as raw bytes). `offset` is optional;
when present it must equal the driver's cuFuncGetParamInfo offset exactly. A `.ptx` file in
place of a cubin is accepted (JIT-compiled by the driver), for tests only.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import MoKManifestError

MANIFEST_FORMAT = 1
MANIFEST_FILENAME = "manifest.json"

PARAM_KIND_SIZES = {"pointer": 8, "int32": 4, "int64": 8, "float32": 4, "tma_desc": 128}
PARAM_KINDS = (*PARAM_KIND_SIZES, "bytes")
TMA_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "fp8_e8m0", "uint8", "int32")
TMA_SWIZZLES = ("none", "32B", "64B", "128B")
TMA_L2_PROMOTIONS = ("none", "64B", "128B", "256B")
TMA_OOB_FILLS = ("none", "nan")
# Hardware limit of a TMA box in every dimension.
TMA_MAX_BOX = 256


@dataclass(frozen=True)
class ParamSpec:
    """One PTX `.entry` parameter, in order."""

    name: str
    kind: str
    size: int
    align: int
    offset: int | None = None


@dataclass(frozen=True)
class TmaSpec:
    """How the runtime must encode the TMA descriptor passed in param `param`."""

    param: str
    dtype: str
    rank: int
    box: tuple[int, ...]  # innermost dimension first
    swizzle: str
    l2_promotion: str = "128B"
    oob_fill: str = "none"

    def layout_key(self) -> tuple:
        """Everything but the param name: two specs with equal keys build the same descriptor."""
        return (self.dtype, self.rank, self.box, self.swizzle, self.l2_promotion, self.oob_fill)


@dataclass(frozen=True)
class VariantSpec:
    """One compiled kernel variant of one arch."""

    name: str
    kernel: str
    arch: str
    cubin: str
    symbol: str
    params: tuple[ParamSpec, ...]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]
    dynamic_smem_bytes: int
    tma: tuple[TmaSpec, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    launch: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def cluster_size(self) -> int:
        return self.cluster[0] * self.cluster[1] * self.cluster[2]

    def param(self, name: str) -> ParamSpec:
        for param in self.params:
            if param.name == name:
                return param
        raise KeyError(f"kernel variant {self.name!r} has no param {name!r}")

    def tma_spec(self, param_name: str) -> TmaSpec | None:
        for spec in self.tma:
            if spec.param == param_name:
                return spec
        return None


@dataclass(frozen=True)
class Manifest:
    """A validated manifest and the folder its cubins live in."""

    path: Path
    dsl_version: str
    source_hash: str
    variants: tuple[VariantSpec, ...]

    @property
    def directory(self) -> Path:
        return self.path.parent

    def archs(self) -> list[str]:
        return sorted({v.arch for v in self.variants})

    def variants_for(self, arch: str) -> list[VariantSpec]:
        return [v for v in self.variants if v.arch == arch]

    def variant(self, name: str, arch: str) -> VariantSpec:
        """The variant `name` compiled for `arch`; MoKManifestError naming what exists."""
        for v in self.variants:
            if v.name == name and v.arch == arch:
                return v
        for_arch = sorted(v.name for v in self.variants if v.arch == arch)
        other_archs = sorted(v.arch for v in self.variants if v.name == name)
        message = f"no kernel variant {name!r} for arch {arch} in {self.path}; "
        message += (
            f"variants for {arch}: {', '.join(for_arch)}"
            if for_arch
            else f"the manifest has no variants for {arch} (archs present: "
            f"{', '.join(self.archs()) or 'none'})"
        )
        if other_archs:
            message += f"; {name!r} exists for {', '.join(other_archs)}"
        raise MoKManifestError(message)

    def cubin_path(self, variant: VariantSpec) -> Path:
        return self.directory / variant.cubin


# A folder of cubins and manifest to load instead of the installed ones: a diagnostic build
# (`python -m mok.dsl_kernels.build ... --set FIELD=VALUE --out DIR`, tools/phase_timeline.py).
KERNEL_DIR_ENV_VAR = "MOK_KERNEL_DIR"


def installed_cubin_dir() -> Path:
    """The installed `mok.dsl_kernels/cubins` folder, whatever MOK_KERNEL_DIR says."""
    return Path(str(resources.files("mok.dsl_kernels") / "cubins"))


def default_manifest_path() -> Path:
    """`manifest.json` in the installed `mok.dsl_kernels/cubins` folder, or in MOK_KERNEL_DIR
    when that is set (read when a kernel is first loaded: set it before any mok call)."""
    folder = os.environ.get(KERNEL_DIR_ENV_VAR)
    if folder:
        return Path(folder) / MANIFEST_FILENAME
    return installed_cubin_dir() / MANIFEST_FILENAME


def load_manifest(path: str | os.PathLike | None = None) -> Manifest:
    """Read and validate a manifest (a file, or a folder holding manifest.json).

    None means the installed one. Results are cached per file version (path, mtime, size).
    """
    resolved = default_manifest_path() if path is None else Path(path)
    if resolved.is_dir():
        resolved = resolved / MANIFEST_FILENAME
    resolved = resolved.resolve()
    try:
        stat = resolved.stat()
    except FileNotFoundError:
        raise MoKManifestError(
            f"cubin manifest not found at {resolved}: build the cubins "
            f"(`python -m mok.dsl_kernels.build --arch sm_90a`, needs the [dev] extra) or "
            f"install a mok wheel that ships them"
        ) from None
    return _load_manifest_cached(str(resolved), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _load_manifest_cached(path: str, mtime_ns: int, size: int) -> Manifest:
    del mtime_ns, size  # cache key only
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise MoKManifestError(f"cannot read cubin manifest {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MoKManifestError(f"cubin manifest {path} is not valid JSON: {exc}") from exc
    return parse_manifest(data, Path(path))


def parse_manifest(data: Any, path: Path) -> Manifest:
    """Validate decoded manifest JSON; every error names the file, variant and field."""
    if not isinstance(data, dict):
        raise MoKManifestError(f"cubin manifest {path} must hold a JSON object at top level")
    fmt = data.get("format")
    if fmt != MANIFEST_FORMAT:
        raise MoKManifestError(
            f"cubin manifest {path} has unknown format {fmt!r}; this mok runtime reads format "
            f"{MANIFEST_FORMAT} (rebuild the cubins or update mok)"
        )
    variants_data = data.get("variants")
    if not isinstance(variants_data, list):
        raise MoKManifestError(f"cubin manifest {path}: 'variants' must be a list")
    variants = []
    seen = set()
    for position, entry in enumerate(variants_data):
        variant = _parse_variant(entry, f"cubin manifest {path}, variants[{position}]")
        key = (variant.name, variant.arch)
        if key in seen:
            raise MoKManifestError(
                f"cubin manifest {path}: variant {variant.name!r} for {variant.arch} is listed twice"
            )
        seen.add(key)
        variants.append(variant)
    return Manifest(
        path=path,
        dsl_version=str(data.get("dsl_version", "")),
        source_hash=str(data.get("source_hash", "")),
        variants=tuple(variants),
    )


def _require(entry: Mapping, key: str, types: type | tuple[type, ...], where: str) -> Any:
    if key not in entry:
        raise MoKManifestError(f"{where}: missing field {key!r}")
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, types):
        raise MoKManifestError(f"{where}: field {key!r} has the wrong type, got {value!r}")
    return value


def _dims3(entry: Mapping, key: str, where: str) -> tuple[int, int, int]:
    value = _require(entry, key, list, where)
    if len(value) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
    ):
        raise MoKManifestError(f"{where}: {key!r} must be 3 positive ints, got {value!r}")
    return (value[0], value[1], value[2])


def _parse_variant(entry: Any, where: str) -> VariantSpec:
    if not isinstance(entry, dict):
        raise MoKManifestError(f"{where}: must be an object")
    name = _require(entry, "name", str, where)
    where = f"{where} ({name!r})"
    arch = _require(entry, "arch", str, where)
    where = f"{where[:-1]}, {arch})"
    params_data = _require(entry, "params", list, where)
    params = []
    names = set()
    for index, param_data in enumerate(params_data):
        param = _parse_param(param_data, f"{where}, params[{index}]")
        if param.name in names:
            raise MoKManifestError(f"{where}: param name {param.name!r} appears twice")
        names.add(param.name)
        params.append(param)
    block = _dims3(entry, "block", where)
    if block[0] * block[1] * block[2] > 1024:
        raise MoKManifestError(f"{where}: block {list(block)} has more than 1024 threads")
    cluster = _dims3(entry, "cluster", where) if "cluster" in entry else (1, 1, 1)
    smem = entry.get("dynamic_smem_bytes", 0)
    if isinstance(smem, bool) or not isinstance(smem, int) or smem < 0:
        raise MoKManifestError(f"{where}: 'dynamic_smem_bytes' must be an int >= 0, got {smem!r}")
    tma = []
    for index, tma_data in enumerate(entry.get("tma", [])):
        spec = _parse_tma(tma_data, f"{where}, tma[{index}]")
        if spec.param not in names:
            raise MoKManifestError(
                f"{where}, tma[{index}]: names param {spec.param!r}, which is not in params"
            )
        kind = next(p.kind for p in params if p.name == spec.param)
        if kind != "tma_desc":
            raise MoKManifestError(
                f"{where}, tma[{index}]: param {spec.param!r} has kind {kind!r}, not 'tma_desc'"
            )
        tma.append(spec)
    config = entry.get("config", {})
    launch = entry.get("launch", {})
    return VariantSpec(
        name=name,
        kernel=str(entry.get("kernel", "")),
        arch=arch,
        cubin=_require(entry, "cubin", str, where),
        symbol=_require(entry, "symbol", str, where),
        params=tuple(params),
        block=block,
        cluster=cluster,
        dynamic_smem_bytes=smem,
        tma=tuple(tma),
        config=config if isinstance(config, dict) else {},
        launch=launch if isinstance(launch, dict) else {},
    )


def _parse_param(entry: Any, where: str) -> ParamSpec:
    if not isinstance(entry, dict):
        raise MoKManifestError(f"{where}: must be an object")
    name = _require(entry, "name", str, where)
    where = f"{where} ({name!r})"
    kind = _require(entry, "kind", str, where)
    if kind not in PARAM_KINDS:
        raise MoKManifestError(
            f"{where}: unknown kind {kind!r}; known kinds: {', '.join(PARAM_KINDS)}"
        )
    size = _require(entry, "size", int, where)
    expected_size = PARAM_KIND_SIZES.get(kind)
    if (expected_size is not None and size != expected_size) or size < 1:
        raise MoKManifestError(
            f"{where}: kind {kind!r} has size {expected_size or '>= 1'}, manifest says {size}"
        )
    align = _require(entry, "align", int, where)
    if align < 1 or align & (align - 1):
        raise MoKManifestError(f"{where}: align must be a power of two, got {align}")
    offset = entry.get("offset")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
        raise MoKManifestError(f"{where}: offset must be an int, got {offset!r}")
    return ParamSpec(name=name, kind=kind, size=size, align=align, offset=offset)


def _parse_tma(entry: Any, where: str) -> TmaSpec:
    if not isinstance(entry, dict):
        raise MoKManifestError(f"{where}: must be an object")

    def choice(key: str, allowed: tuple[str, ...], default: str | None = None) -> str:
        value = entry.get(key, default) if default is not None else _require(entry, key, str, where)
        if value not in allowed:
            raise MoKManifestError(
                f"{where}: {key!r} must be one of {', '.join(allowed)}, got {value!r}"
            )
        return value

    param = _require(entry, "param", str, where)
    rank = _require(entry, "rank", int, where)
    if not 1 <= rank <= 5:
        raise MoKManifestError(f"{where}: rank must be 1..5, got {rank}")
    box = _require(entry, "box", list, where)
    if len(box) != rank or not all(
        isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= TMA_MAX_BOX for b in box
    ):
        raise MoKManifestError(
            f"{where}: box must be {rank} ints in 1..{TMA_MAX_BOX} (innermost first), got {box!r}"
        )
    return TmaSpec(
        param=param,
        dtype=choice("dtype", TMA_DTYPES),
        rank=rank,
        box=tuple(box),
        swizzle=choice("swizzle", TMA_SWIZZLES),
        l2_promotion=choice("l2_promotion", TMA_L2_PROMOTIONS, "128B"),
        oob_fill=choice("oob_fill", TMA_OOB_FILLS, "none"),
    )
