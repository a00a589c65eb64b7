"""Compile every registered kernel variant to cubins + one manifest, on a machine with no GPU.

    python -m mok.dsl_kernels.build --arch sm_90a sm_100a [--check] [--only NAME] [--out DIR]
    python -m mok.dsl_kernels.build --arch sm_90a --only NAME[,NAME] --set FIELD=VALUE --out DIR  # diagnostic

Writes `mok/dsl_kernels/cubins/<variant>.<arch>.cubin` and `mok/dsl_kernels/cubins/manifest.json`.
`--check` builds into a temporary directory and exits 1 if the committed manifest or any cubin
differs from what the sources produce (source hash, manifest entries and cubin bytes).

Where each manifest field comes from (nothing is typed in by hand twice):
- symbol, params (order, size, alignment, kind): the `.entry` of the PTX the DSL produced;
  parameter names come from the kernel's `@cute.kernel` signature, each parameter bundle
  flattened into its fields (common/params.py), and the build fails if the two disagree in
  count or kind. A PTX `.b8` aggregate with no Python
  counterpart (a parameter the DSL inserted) is kept as kind "bytes", named `_dsl_<index>`.
- block: the PTX `.reqntid` directive, cross-checked against the launch config in the lowered
  host code (`compiled.ir_module`, the struct passed to `_cudaLaunchKernelEx`).
- dynamic_smem_bytes: the shared-memory field of that same launch config (must be a constant).
- cluster: these kernels launch without a cluster attribute, i.e. (1, 1, 1).
- tma: a kernel that takes TMA descriptors (`cute.CopyAtom` arguments of its `@cute.kernel`,
  kind "tma_desc") lists their specs in `tma_specs()` (dtype, rank, box innermost first,
  swizzle, ...), the same constants its `__call__` builds the atoms from; the build checks each
  spec against the PTX (a 128-byte param; a `cp.async.bulk.tensor.<rank>d` in the body).
  Static `cute.Tensor` arguments (TMA coordinate tensors of static shape) have no PTX param
  and are skipped; a dynamic one would leave unnamed PTX params and fail the pairing.
- archs: a variant with `archs` set is compiled only for those (sm_90a-only wgmma kernels).
"""

import argparse
import ast
import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import re
import sys
import tempfile
import time
import typing
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CUBIN_DIR = PACKAGE_DIR / "cubins"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
DEFAULT_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")


class BuildError(RuntimeError):
    """A kernel does not compile, or its compiled form disagrees with its Python signature."""


# ---------------------------------------------------------------------------------------------
# Source hash
# ---------------------------------------------------------------------------------------------
def dsl_version() -> str:
    return importlib.metadata.version(DSL_DISTRIBUTION)


def source_hash(version: str) -> str:
    """sha256 over every mok/dsl_kernels/**/*.py (sorted by relative path) and the DSL version."""
    digest = hashlib.sha256()
    for path in sorted(
        PACKAGE_DIR.rglob("*.py"), key=lambda p: p.relative_to(PACKAGE_DIR).as_posix()
    ):
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    digest.update(f"{DSL_DISTRIBUTION}=={version}".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# PTX .entry parsing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PtxParam:
    kind: str  # pointer | int32 | int64 | float32 | bytes
    size: int
    align: int
    text: str  # the declaration, for error messages


_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*?)\)", re.S)
_REQNTID_RE = re.compile(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_SCALAR_KINDS = {
    "u32": "int32",
    "s32": "int32",
    "b32": "int32",
    "u64": "int64",
    "s64": "int64",
    "b64": "int64",
    "f32": "float32",
}
_KIND_SIZE = {"pointer": 8, "int32": 4, "int64": 8, "float32": 4}


def parse_ptx_param(decl: str) -> PtxParam:
    """One `.param ...` declaration of an `.entry` -> kind, size and alignment in bytes."""
    tokens = decl.split()
    if not tokens or tokens[0] != ".param":
        raise BuildError(f"unexpected PTX parameter declaration {decl!r}")
    aggregate = re.fullmatch(r"\.param\s+\.align\s+(\d+)\s+\.b8\s+\S+\[(\d+)\]", decl.strip())
    if aggregate:
        return PtxParam("bytes", int(aggregate.group(2)), int(aggregate.group(1)), decl.strip())
    ptx_type = tokens[1].lstrip(".")
    if ".ptr" in tokens:
        return PtxParam("pointer", 8, 8, decl.strip())
    if ptx_type in _SCALAR_KINDS:
        kind = _SCALAR_KINDS[ptx_type]
        return PtxParam(kind, _KIND_SIZE[kind], _KIND_SIZE[kind], decl.strip())
    raise BuildError(f"unsupported PTX parameter type in {decl!r}")


def parse_ptx_entry(ptx: str) -> tuple[str, list[PtxParam], tuple[int, int, int]]:
    """(symbol, params, reqntid) of the single `.entry` of a PTX module."""
    entries = _ENTRY_RE.findall(ptx)
    if len(entries) != 1:
        raise BuildError(f"expected exactly one .entry in the PTX, found {len(entries)}")
    symbol, body = entries[0]
    decls = [d.strip() for d in body.split(",") if d.strip()]
    params = [parse_ptx_param(d) for d in decls]
    tail = ptx[ptx.index(body) + len(body) :]
    reqntid = _REQNTID_RE.search(tail[: tail.find("{")])
    if reqntid is None:
        raise BuildError(f"{symbol}: no .reqntid in the PTX (block size unknown)")
    block = tuple(int(g) if g else 1 for g in reqntid.groups())
    return symbol, params, block


# ---------------------------------------------------------------------------------------------
# Python signature -> named params
# ---------------------------------------------------------------------------------------------
def python_params(kernel_obj) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of the kernel's `@cute.kernel` method, in order."""
    import cutlass
    import cutlass.cute as cute

    annotation_kinds = {
        cute.Pointer: "pointer",
        cutlass.Int32: "int32",
        cutlass.Int64: "int64",
        cutlass.Float32: "float32",
    }
    from .common.params import flat_params

    signature = inspect.signature(type(kernel_obj).kernel)
    hints = typing.get_type_hints(type(kernel_obj).kernel, include_extras=True)
    leaves = [
        leaf
        for name in list(signature.parameters)[1:]  # skip self
        for leaf in flat_params(hints.get(name, signature.parameters[name].annotation), name)
    ]
    params = []
    for name, annotation in leaves:  # a bundle's fields are its PTX params, in order
        if annotation is cute.Tensor:
            continue  # static TMA coordinate tensor: no PTX param (checked by the pairing)
        if annotation is cute.CopyAtom:
            params.append((name, "tma_desc"))
            continue
        kind = annotation_kinds.get(annotation)
        if kind is None:
            raise BuildError(
                f"{type(kernel_obj).__name__}.kernel argument {name!r}: annotation "
                f"{annotation!r} is not one of Pointer, Int32, Int64, Float32, CopyAtom "
                "(TMA descriptor) or a static Tensor"
            )
        params.append((name, kind))
    return params


def name_params(
    owner: str, ptx_params: list[PtxParam], py_params: list[tuple[str, str]]
) -> list[dict]:
    """Pair PTX params with Python names in order; fail on any count or kind mismatch."""
    named = []
    remaining = list(py_params)
    for index, ptx_param in enumerate(ptx_params):
        if ptx_param.kind == "bytes" and (
            not remaining or remaining[0][1] not in ("bytes", "tma_desc")
        ):
            name = f"_dsl_{index}"  # inserted by the DSL, not in the Python signature
            print(f"  warning: {owner}: DSL-inserted parameter {index}: {ptx_param.text}")
        else:
            if not remaining:
                raise BuildError(
                    f"{owner}: PTX param {index} ({ptx_param.text}) has no Python argument"
                )
            name, py_kind = remaining.pop(0)
            if py_kind == "tma_desc" and (ptx_param.kind, ptx_param.size) == ("bytes", 128):
                named.append(
                    {"name": name, "kind": "tma_desc", "size": 128, "align": ptx_param.align}
                )
                continue
            if py_kind != ptx_param.kind:
                raise BuildError(
                    f"{owner}: argument {name!r} is {py_kind} in Python but PTX param {index} "
                    f"is {ptx_param.kind} ({ptx_param.text})"
                )
        named.append(
            {"name": name, "kind": ptx_param.kind, "size": ptx_param.size, "align": ptx_param.align}
        )
    if remaining:
        raise BuildError(
            f"{owner}: Python arguments {[n for n, _ in remaining]} have no PTX parameter "
            "(static or Constexpr arguments are not allowed in a kernel signature)"
        )
    return named


# ---------------------------------------------------------------------------------------------
# Launch config from the lowered host code
# ---------------------------------------------------------------------------------------------
_LAUNCH_STRUCT = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def launch_config_from_host_ir(ir_text: str) -> dict[str, int]:
    """Constant block dims and dynamic smem that the DSL's host code stores into the
    cudaLaunchConfig struct it passes to `_cudaLaunchKernelEx` (fields 1 and 2)."""
    funcs = [f for f in ir_text.split("llvm.func @") if "llvm.call @_cudaLaunchKernelEx" in f]
    if len(funcs) != 1:
        raise BuildError(f"expected one host function launching a kernel, found {len(funcs)}")
    body = funcs[0]
    constants = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)", body))
    fields = {}
    for ssa, index in re.findall(
        r"(%\d+) = llvm\.getelementptr %\d+\[0, ([\d, ]+)\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
        + re.escape(_LAUNCH_STRUCT),
        body,
    ):
        fields[ssa] = tuple(int(i) for i in index.split(","))
    values = {}
    for value, target in re.findall(r"llvm\.store (%\d+), (%\d+) : i\d+, !llvm\.ptr", body):
        if target in fields:
            values[fields[target]] = constants.get(value)
    block = [values.get((1, i)) for i in range(3)]
    smem = values.get((2,))
    if any(v is None for v in block) or smem is None:
        raise BuildError(f"launch config is not constant (block {block}, dynamic smem {smem})")
    return {"block": [int(v) for v in block], "dynamic_smem_bytes": int(smem)}


# ---------------------------------------------------------------------------------------------
# Compile one variant for one arch
# ---------------------------------------------------------------------------------------------
def compile_variant(variant, arch: str) -> tuple[dict, bytes, str]:
    """(manifest entry, cubin bytes, PTX text) of one registry variant for one arch."""
    import cutlass.cute as cute

    from .common.params import compile_arguments

    kernel_obj = variant.kernel(**variant.config)
    if hasattr(kernel_obj, "validate"):
        kernel_obj.validate()
    # The name options live on the shared @cute.kernel function: set them right before compiling.
    type(kernel_obj).kernel.set_name_prefix(
        variant.symbol_prefix, remove_cutlass_symbol=True, keep_mangled_name=False
    )
    with tempfile.TemporaryDirectory(prefix="mok_dsl_") as dump_dir:
        compiled = cute.compile(
            kernel_obj,
            *compile_arguments(kernel_obj),
            options=f"--gpu-arch {arch} --keep-ptx --keep-cubin --dump-dir {dump_dir}",
        )
        ptx, cubin = compiled.__ptx__, compiled.__cubin__
        host_ir = str(compiled.ir_module)
    owner = f"{variant.name} ({arch})"
    if not isinstance(ptx, str) or ".entry" not in ptx:
        raise BuildError(f"{owner}: the DSL returned no PTX")
    if not isinstance(cubin, bytes) or not cubin.startswith(b"\x7fELF"):
        raise BuildError(f"{owner}: the DSL returned no cubin")
    if f".target {arch}" not in ptx:
        raise BuildError(f"{owner}: PTX does not target {arch}")

    symbol, ptx_params, block = parse_ptx_entry(ptx)
    if not symbol.startswith(variant.symbol_prefix):
        raise BuildError(f"{owner}: entry symbol {symbol!r} lacks prefix {variant.symbol_prefix!r}")
    if symbol.encode() not in cubin:
        raise BuildError(f"{owner}: entry symbol {symbol!r} not found in the cubin")
    launch = launch_config_from_host_ir(host_ir)
    if tuple(launch["block"]) != block:
        raise BuildError(f"{owner}: .reqntid {block} != host launch block {launch['block']}")
    params = name_params(owner, ptx_params, python_params(kernel_obj))
    tma = tma_specs(owner, kernel_obj, params, ptx)

    entry = {
        "name": variant.name,
        "kernel": variant.kernel.__name__,
        "arch": arch,
        "cubin": f"{variant.name}.{arch}.cubin",
        "symbol": symbol,
        "config": dict(variant.config),
        "params": params,
        "block": list(block),
        "cluster": [1, 1, 1],
        "dynamic_smem_bytes": launch["dynamic_smem_bytes"],
        "tma": tma,
        "launch": {"grid": variant.launch_grid},
    }
    return entry, cubin, ptx


def ptxas_report(ptx: str, arch: str) -> str:
    """What `ptxas -v` prints for the PTX: registers, spills and every "Potential Performance
    Loss" (e.g. C7514 / C7520, wgmmas serialised). Needs ptxas (the CUDA toolkit) on PATH."""
    import subprocess  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="mok_ptxas_") as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run(
            ["ptxas", f"-arch={arch}", "-v", str(source), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return result.stderr


_TMA_SPEC_KEYS = ("param", "dtype", "rank", "box", "swizzle", "l2_promotion", "oob_fill")


def tma_specs(owner: str, kernel_obj, params: list[dict], ptx: str) -> list[dict]:
    """The kernel's `tma_specs()` (none without it), checked against its params and PTX."""
    specs = [dict(s) for s in kernel_obj.tma_specs()] if hasattr(kernel_obj, "tma_specs") else []
    descriptor_params = [p["name"] for p in params if p["kind"] == "tma_desc"]
    if sorted(s.get("param") for s in specs) != sorted(descriptor_params):
        raise BuildError(
            f"{owner}: tma_specs() name params {[s.get('param') for s in specs]}, the kernel "
            f"takes TMA descriptors {descriptor_params}"
        )
    for spec in specs:
        if tuple(spec) != _TMA_SPEC_KEYS:
            raise BuildError(f"{owner}: TMA spec {spec} must have keys {_TMA_SPEC_KEYS} in order")
        if len(spec["box"]) != spec["rank"]:
            raise BuildError(f"{owner}: TMA spec {spec}: box rank != rank")
        if f"cp.async.bulk.tensor.{spec['rank']}d" not in ptx:
            raise BuildError(
                f"{owner}: TMA spec {spec['param']!r} is rank {spec['rank']}, the PTX has no "
                f"cp.async.bulk.tensor.{spec['rank']}d"
            )
    return specs


# ---------------------------------------------------------------------------------------------
# Build / check
# ---------------------------------------------------------------------------------------------
def build(
    archs, only=None, verbose=True, settings=None
) -> tuple[dict, dict[str, bytes], dict[str, str]]:
    """Compile the registry: (manifest, {cubin file name: bytes}, {cubin file name: PTX}).
    `only`: a variant name, or several (comma-separated or a collection). `settings` (with
    `only`): config fields of those variants set for this build, e.g. a diagnostic build's
    {"timeline": True}; each must be a field of every one's kernel class."""
    from .registry import variants

    registry = variants()
    names = [v.name for v in registry]
    if len(set(names)) != len(names):
        raise BuildError(f"duplicate variant names in the registry: {names}")
    selected = None
    if only is not None:
        selected = set(only.split(",") if isinstance(only, str) else only)
        unknown = sorted(selected - set(names))
        if unknown or not selected:
            raise BuildError(
                f"--only {unknown or only!r}: not registered variants (known: {names})"
            )
    version = dsl_version()
    manifest = {
        "format": MANIFEST_FORMAT,
        "dsl_version": version,
        "source_hash": source_hash(version),
        "variants": [],
    }
    cubins, ptxs = {}, {}
    start = time.perf_counter()
    for variant in registry:
        if selected is not None and variant.name not in selected:
            continue
        if settings:
            fields = {f.name for f in dataclasses.fields(variant.kernel)}
            unknown = sorted(set(settings) - fields)
            if unknown:
                raise BuildError(f"--set {unknown}: not config fields of {variant.name} "
                                 f"(its kernel {variant.kernel.__name__} has {sorted(fields)})")  # fmt: skip
            variant = dataclasses.replace(variant, config={**variant.config, **settings})
        for arch in archs:
            if getattr(variant, "archs", None) and arch not in variant.archs:
                continue  # e.g. wgmma kernels: sm_90a only
            t0 = time.perf_counter()
            entry, cubin, ptx = compile_variant(variant, arch)
            manifest["variants"].append(entry)
            cubins[entry["cubin"]] = cubin
            ptxs[entry["cubin"]] = ptx
            if verbose:
                print(
                    f"  {variant.name:<28} {arch:<8} {time.perf_counter() - t0:6.2f} s "
                    f"{len(cubin):>8} B  {entry['symbol']}",
                    flush=True,
                )
    if verbose:
        # Variants with `archs` set skip the other archs, so kernels != variants x archs.
        built = manifest["variants"]
        per_arch = ", ".join(
            f"{sum(e['arch'] == arch for e in built)} for {arch}" for arch in archs
        )
        total = sum(len(c) for c in cubins.values())
        print(
            f"built {len(built)} kernels from {len({e['name'] for e in built})} variants ({per_arch}) "
            f"in {time.perf_counter() - start:.1f} s, {total} cubin bytes"
        )
    return manifest, cubins, ptxs


def manifest_text(manifest: dict) -> str:
    return json.dumps(manifest, indent=2) + "\n"


def write(out_dir: Path, manifest: dict, cubins: dict[str, bytes], only=None) -> None:
    """Write cubins and the manifest; with `only`, merge into the existing manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST_NAME
    if only is not None and manifest_path.exists():
        previous = json.loads(manifest_path.read_text())
        rebuilt = {(e["name"], e["arch"]) for e in manifest["variants"]}
        kept = [e for e in previous["variants"] if (e["name"], e["arch"]) not in rebuilt]
        manifest = dict(manifest, variants=kept + manifest["variants"])
    for file_name, data in cubins.items():
        _write_atomic(out_dir / file_name, data)
    _write_atomic(manifest_path, manifest_text(manifest).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def check(committed_dir: Path, manifest: dict, cubins: dict[str, bytes], only=None) -> list[str]:
    """Differences between the committed artefacts and a fresh build (empty list: identical)."""
    problems = []
    manifest_path = committed_dir / MANIFEST_NAME
    if not manifest_path.exists():
        return [f"{manifest_path} is missing"]
    committed = json.loads(manifest_path.read_text())
    if committed.get("source_hash") != manifest["source_hash"]:
        problems.append("source_hash differs: sources or DSL version changed since the last build")
    if committed.get("dsl_version") != manifest["dsl_version"]:
        problems.append(
            f"dsl_version {committed.get('dsl_version')} != installed {manifest['dsl_version']}"
        )
    committed_entries = {(e["name"], e["arch"]): e for e in committed.get("variants", [])}
    fresh_entries = {(e["name"], e["arch"]): e for e in manifest["variants"]}
    if only is None and set(committed_entries) != set(fresh_entries):
        problems.append(
            f"variant set differs: committed {sorted(committed_entries)} vs built {sorted(fresh_entries)}"
        )
    for key, entry in fresh_entries.items():
        if committed_entries.get(key) != entry:
            problems.append(f"manifest entry {key} differs")
        path = committed_dir / entry["cubin"]
        if not path.exists():
            problems.append(f"{path} is missing")
        elif path.read_bytes() != cubins[entry["cubin"]]:
            problems.append(f"{path} differs from the freshly built cubin")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mok.dsl_kernels.build", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), choices=SUPPORTED_ARCHS)
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="build only these variants")
    parser.add_argument("--out", type=Path, default=CUBIN_DIR, help="output directory")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a diagnostic build: set a config field of the --only variants "
                        "(e.g. timeline=True); never into the shipped cubins")  # fmt: skip
    args = parser.parse_args(argv)
    archs = list(dict.fromkeys(args.arch))
    settings = {}
    for item in args.set:
        field_name, _, value = item.partition("=")
        try:
            settings[field_name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[field_name] = value
    if settings and (args.only is None or args.check or args.out.resolve() == CUBIN_DIR.resolve()):
        print("--set needs --only, no --check, and an --out other than the shipped cubins",
              file=sys.stderr)  # fmt: skip
        return 2

    try:
        manifest, cubins, _ = build(archs, only=args.only, settings=settings)
    except BuildError as error:
        print(f"build failed: {error}", file=sys.stderr)
        return 2
    if args.check:
        problems = check(args.out, manifest, cubins, only=args.only)
        for problem in problems:
            print(f"  MISMATCH: {problem}", file=sys.stderr)
        if problems:
            print(
                f"check failed: rebuild with `python -m mok.dsl_kernels.build --arch {' '.join(archs)}`",
                file=sys.stderr,
            )
            return 1
        print("check passed: committed manifest and cubins match the sources")
        return 0
    write(args.out, manifest, cubins, only=args.only)
    print(f"wrote {args.out / MANIFEST_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
