"""mok's module import graph, read from the sources with `ast` (docs/DESIGN.md, "Layers").

Every `import` and `from ... import` anywhere in a file counts, function-local ones included.
`from package import name` is an edge to the submodule `name` when there is one, else to the
package's __init__; `import a.b.c` is an edge to a.b.c. Nothing is imported, so this is fast.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOK = ROOT / "mok"
DOOR = "mok.launchers"  # the one module above the launchers that may be imported from outside
BELOW = ("mok.runtime", "mok.dsl_kernels")  # import nothing else of mok
ARCH_FOLDERS = ("mok.dsl_kernels.sm90", "mok.dsl_kernels.sm100")


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Import name -> (file, is a package's __init__)."""
    found = {}
    for path in MOK.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


@cache
def nodes() -> dict[str, list[ast.AST]]:
    """Every node of each module's syntax tree (parsed and walked once)."""
    return {
        name: list(ast.walk(ast.parse(path.read_text(), str(path))))
        for name, (path, _) in modules().items()
    }


def _resolve(name: str) -> str | None:
    """The deepest module of mok that `name` names (a.b.attr -> a.b)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def graph() -> dict[str, frozenset[str]]:
    edges = {}
    for module, module_nodes in nodes().items():
        is_package = modules()[module][1]
        base = module if is_package else module.rpartition(".")[0]
        targets = set()
        for node in module_nodes:
            if isinstance(node, ast.Import):
                targets.update(_resolve(a.name) for a in node.names if _inside(a.name, "mok"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = base
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    source = package + (f".{node.module}" if node.module else "")
                else:
                    source = node.module or ""
                if not _inside(source, "mok"):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in modules() else _resolve(source))
        targets.discard(None)
        targets.discard(module)
        edges[module] = frozenset(targets)
    return edges


def strongly_connected(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _a_cycle(component: list[str], edges) -> list[str]:
    """One closed walk through the component, for the failure message."""
    members, path = set(component), [component[0]]
    while True:
        step = next(t for t in sorted(edges[path[-1]]) if t in members)
        if step in path:
            return path[path.index(step) :] + [step]
        path.append(step)


def test_the_graph_sees_the_modules():
    edges = graph()
    assert {"mok.functional", DOOR, "mok.runtime.module", "mok.dsl_kernels.registry"} <= set(edges)
    assert DOOR in edges["mok.ops"] | edges["mok.layer_ops"]  # function-local imports count
    assert "mok.dsl_kernels.common.retire" in edges["mok.dsl_kernels.kernels.schedule"]
    assert "mok.dsl_kernels.phases.tickets" in edges["mok.dsl_kernels.sm90.moe_forward"]
    assert "mok.dsl_kernels.phases.tiles" in edges["mok.dsl_kernels.sm90.gemm_engine"]


def test_no_import_circles():
    edges = graph()
    circles = [c for c in strongly_connected(edges) if len(c) > 1]
    assert not circles, "import circles:\n" + "\n".join(
        f"{len(c)} modules {c}; e.g. {' -> '.join(_a_cycle(c, edges))}" for c in circles
    )


def test_the_cuda_path_is_reached_through_its_door_only():
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in graph().items()
        if not any(_inside(module, p) for p in (DOOR, *BELOW))
        for target in targets
        if _inside(target, DOOR) and target != DOOR
    )
    assert not offenders, f"imports past the door ({DOOR}):\n" + "\n".join(offenders)
    # The launchers never import their own door back (its __init__ imports them).
    back = sorted(m for m, t in graph().items() if _inside(m, DOOR) and m != DOOR and DOOR in t)
    assert not back, f"launchers importing the door {DOOR}: {back}"


def test_runtime_and_kernel_sources_import_nothing_above_them():
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in graph().items()
        for below in BELOW
        if _inside(module, below)
        for target in targets
        if not _inside(target, below)
    )
    assert not offenders, "upward imports:\n" + "\n".join(offenders)


def test_kernel_helpers_sit_below_kernels_and_arch_folders():
    """common/ at the bottom; the arch-independent phases/ over it; kernels/ and the arch
    folders (sm90/, its GEMM engine and megakernels) on top, never importing each other."""
    common, phases = "mok.dsl_kernels.common", "mok.dsl_kernels.phases"
    layers = {
        common: (common,),
        phases: (common, phases),
        "mok.dsl_kernels.kernels": (common, "mok.dsl_kernels.kernels"),
        **{arch: (common, phases, arch) for arch in ARCH_FOLDERS},
    }
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in graph().items()
        for folder, allowed in layers.items()
        if _inside(module, folder)
        for target in targets
        if not any(_inside(target, a) for a in allowed)
    )
    assert not offenders, "dsl_kernels imports across its folders:\n" + "\n".join(offenders)


def test_only_the_kernel_sources_import_the_dsl():
    offenders = sorted(
        module
        for module, module_nodes in nodes().items()
        if not _inside(module, "mok.dsl_kernels")
        for node in module_nodes
        if (isinstance(node, ast.Import) and any(_inside(a.name, "cutlass") for a in node.names))
        or (isinstance(node, ast.ImportFrom) and _inside(node.module or "", "cutlass"))
    )
    assert not offenders, f"modules outside mok.dsl_kernels importing cutlass: {offenders}"


WORKSPACE_NAMES = {"ws", "workspace", "space"}


def _names_a_workspace(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in WORKSPACE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in WORKSPACE_NAMES | {"_workspace"}


def test_no_state_is_hung_on_a_workspace_with_setattr():
    """Per-workspace state is a declared field of MoKWorkspace (mok/workspace.py), never an
    attribute another module attaches; the launchers set no attributes dynamically at all."""
    declared = {  # mok/workspace.py's `_set_fields` sets the dataclass's own fields
        id(call)
        for f in nodes()["mok.workspace"]
        if isinstance(f, ast.FunctionDef) and f.name == "_set_fields"
        for call in ast.walk(f)
    }
    offenders = []
    for module, module_nodes in nodes().items():
        for node in module_nodes:
            if not isinstance(node, ast.Call) or id(node) in declared or not node.args:
                continue
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or (
                isinstance(func, ast.Attribute)
                and func.attr in ("__setattr__", "__delattr__")
                and isinstance(func.value, ast.Name)
                and func.value.id == "object"
            )
            if dynamic and (_inside(module, DOOR) or _names_a_workspace(node.args[0])):
                offenders.append(f"{modules()[module][0].relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"dynamic attributes on workspaces or in the launchers: {offenders}"
    workspace_fields = {
        n.target.id
        for n in nodes()["mok.workspace"]
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert "comm_state" in workspace_fields  # what mok.launchers.comm keeps per workspace
