"""The package's layering: every import runs downward, and no two modules import each other in a circle.

The layers are listed bottom to top (docs/design-notes.md, "Layers"). A module may import from its own layer
or any layer below; within a layer, imports must not form a circle. Every import counts, also those inside
functions and under `TYPE_CHECKING`: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hfexport"

# Bottom to top. A module belongs to the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    # hfexport/core/ (and `_version`, where the build reads it): the bottom of the stack, below every other folder.
    (
        "hfexport.core",
        "hfexport.core.errors",
        "hfexport.core.versions",
        "hfexport.core._lazy",
        "hfexport.core.timing",
        "hfexport._version",
    ),
    ("hfexport.core.files", "hfexport.core.model_files"),
    ("hfexport.core.checkpoints",),
    ("hfexport.core.cache_classes",),
    ("hfexport.core.cache_context",),
    ("hfexport.core.cache_pytree",),
    ("hfexport.core.positions",),
    ("hfexport.backends",),
    ("hfexport.formats",),
    ("hfexport.naming",),
    ("hfexport.generation_spec",),
    ("hfexport.rewrites.examples", "hfexport.rewrites.declines", "hfexport.rewrites.upstream"),
    ("hfexport.rewrites.rule",),
    ("hfexport.rewrites.kinds",),
    ("hfexport.rewrites.example_models", "hfexport.rewrites.experts", "hfexport.rewrites.rules"),
    ("hfexport.rewrites.external",),
    ("hfexport.rewrites.registry",),
    ("hfexport.rewrites.engine", "hfexport.rewrites"),
    ("hfexport.quantizers.base",),
    ("hfexport.configs",),
    ("hfexport.report",),
    ("hfexport.frontends",),
    ("hfexport.lowerings",),
    ("hfexport.quantizers",),
    ("hfexport.exporters", "hfexport.auto"),
    ("hfexport.runtime",),
    ("hfexport.artifacts",),
    ("hfexport.modeling",),
    (
        "hfexport.tiny",
        "hfexport.testing",
        "hfexport.apps",
    ),
    ("hfexport.cli", "hfexport.__main__", "hfexport"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The hfexport modules `module` imports (statically, anywhere in its file)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from a import b` imports a.b when b is a module, else a.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        for name in names:
            if name == "hfexport" or name.startswith("hfexport."):
                resolved = _resolve(name)
                if resolved is not None and resolved != module:
                    targets.add(resolved)
    return targets


# A backend's folder (`hfexport/backends/<name>/`) holds its descriptor (`__init__`, at the registry's layer) and one
# module per layer it has code in, named by that layer (docs/design-notes.md, "Backends").
BACKEND_ROLES: dict[str, str] = {
    "config": "hfexport.configs",
    "ops": "hfexport.lowerings",
    "lowering": "hfexport.lowerings",
    "exporter": "hfexport.exporters",
    "driver": "hfexport.runtime",
    "artifact": "hfexport.artifacts",
    "tools": "hfexport.testing",
}


def backend_role(module: str) -> str | None:
    """The role of a module of a backend's folder (`hfexport.backends.onnx.driver` -> "driver"), or None."""
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["hfexport", "backends"] and (ROOT / "backends" / parts[2]).is_dir():
        return parts[3]
    return None


def layer_of(module: str) -> int:
    role = backend_role(module)
    if role is not None:
        if role not in BACKEND_ROLES:
            raise AssertionError(f"{module}: a backend's module is named by its layer, one of {sorted(BACKEND_ROLES)}")
        return layer_of(BACKEND_ROLES[role])
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (tests/test_layers.py) and the design notes")
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    # The package root only re-exports lazily (hfexport/core/_lazy.py); importing a submodule runs it, so it is no edge.
    return {m: imports_of(m) - {"hfexport"} for m in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_upward() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    graph = import_graph()
    # The package root is the public face: it may name anything (lazily), and nothing inside imports it.
    inside = [
        m for m, targets in graph.items() if "hfexport" in imports_of(m) and m not in ("hfexport", "hfexport.__main__")
    ]
    assert not inside, f"modules that import the package root (import from the defining module instead): {inside}"
    assert not _cycles(graph), f"import circles: {_cycles(graph)}"


def test_core_is_the_bottom_of_the_stack() -> None:
    # The folder mirrors the layer list: every module of hfexport/core/ sits below every module outside it.
    core = [m for m in MODULES if m == "hfexport.core" or m.startswith("hfexport.core.")]
    others = [m for m in MODULES if m not in core and m != "hfexport._version"]
    highest = max(core, key=layer_of)
    lowest = min(others, key=layer_of)
    assert layer_of(highest) < layer_of(lowest), f"{lowest} (outside core/) is not above {highest} (in core/)"


@pytest.mark.parametrize(
    ("module", "target"),
    [
        ("hfexport.rewrites.rule", "hfexport.lowerings.onnx"),
        ("hfexport.naming", "hfexport.rewrites.engine"),
        # A backend's descriptor sits below its driver, and its config below its exporter.
        ("hfexport.backends.onnx", "hfexport.backends.onnx.driver"),
        ("hfexport.backends.onnx.config", "hfexport.backends.onnx.exporter"),
    ],
)
def test_the_checker_sees_an_upward_import(module: str, target: str) -> None:
    # The rule the test enforces, on two edges it would report.
    assert layer_of(target) > layer_of(module)
