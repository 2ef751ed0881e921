"""Which nodes of a quantizer's model compute which module of the source model: `keep_float` by module name.

`ExportQuantizer.keep_float` names modules (`"model.layers.3.mlp"`, `"lm_head"`, or a glob such as
`"model.layers.*.mlp.down_proj"`) whose linears stay in floating point. Each toolkit excludes nodes by its own
names, so this module turns module names into them:

- the captured FX graph: a node's `nn_module_stack` (the deepest module it was traced in);
- ONNX: a node's `namespace` metadata, which torch.onnx writes from the same stack, else the FX node it came
  from (torch.onnx names it `node_<fx name>`);
- OpenVINO: the FX node it came from (the converter names an op `<fx name>/<aten op>/<kind>`), mapped through
  the FX graph the export captured, which the pipeline hands over (`node_modules`).

The toolkits' own exclusion does the rest: NNCF's `IgnoredScope(names=...)`, ONNX Runtime's
`nodes_to_exclude`, and for PT2E the annotation of those nodes removed after the PT2E quantizer annotated them.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

# {FX node name: module path} of the program the export captured, while a backend quantizer runs on its lowering.
_NODE_MODULES: ContextVar[Mapping[str, str] | None] = ContextVar("hfexport_node_modules", default=None)


def module_matches(module: str, patterns: Iterable[str]) -> bool:
    """Whether `module` is one of `patterns` or inside one (a dotted prefix), or matches one as a glob."""
    for pattern in patterns:
        if module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern):
            return True
    return False


def fx_node_modules(graph_module: Any) -> dict[str, str]:
    """{node name: the deepest module it was traced in} of an FX graph (nodes without a module left out)."""
    modules = {}
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            # torch.export records paths of the traced wrapper's attributes as written ("L['self'].model...").
            modules[node.name] = path.removeprefix("L['self'].")
    return modules


@contextlib.contextmanager
def node_modules(mapping: Mapping[str, str] | None) -> Iterator[None]:
    """Hand the captured program's `fx_node_modules` to a backend quantizer that runs inside this block."""
    token = _NODE_MODULES.set(mapping)
    try:
        yield
    finally:
        _NODE_MODULES.reset(token)


def fx_nodes_in(graph_module: Any, patterns: Iterable[str]) -> list[str]:
    """The call nodes of an FX graph traced inside a module of `patterns`."""
    patterns = tuple(patterns)
    kinds = {node.name: node.op for node in graph_module.graph.nodes}
    return [
        name
        for name, module in fx_node_modules(graph_module).items()
        if kinds.get(name) == "call_function" and module_matches(module, patterns)
    ]


def _onnx_module(node: Any, captured: Mapping[str, str]) -> str | None:
    namespace = node.metadata_props.get("namespace") if hasattr(node, "metadata_props") else None
    if namespace:
        # "module: class/.../module: class/fx node: aten op": the scope before the node's own is its module.
        scopes = namespace.split("/")
        return scopes[-2].split(": ")[0].strip() or None if len(scopes) >= 2 else None
    return captured.get((node.name or "").removeprefix("node_"))


def onnx_nodes_in(model: Any, patterns: Iterable[str]) -> list[str]:
    """The nodes of an ONNX model (`onnx_ir.Model`) computed inside a module of `patterns`."""
    import onnx_ir as ir

    patterns = tuple(patterns)
    captured = _NODE_MODULES.get() or {}
    names = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        module = _onnx_module(node, captured)
        if node.name and module is not None and module_matches(module, patterns):
            names.append(node.name)
    return names


def openvino_nodes_in(model: Any, patterns: Iterable[str]) -> list[str]:
    """The ops of an `openvino.Model` converted from FX nodes traced inside a module of `patterns`."""
    captured = _NODE_MODULES.get()
    if captured is None:
        raise RuntimeError("keep_float on an OpenVINO model needs the captured program's node modules")
    kept = {name for name, module in captured.items() if module_matches(module, tuple(patterns))}
    return [op.get_friendly_name() for op in model.get_ops() if op.get_friendly_name().split("/")[0] in kept]
