"""The backends: what the package knows of a format is its descriptor's, and no code outside `hfexport/backends/`
switches on a format's name.

A format switch is a comparison with a format name (`fmt == "onnx"`, `fmt in ("onnx", "openvino")`, with a string
or an `ExportFormat` member), a dict literal keyed by format names only (`{"onnx": ..., "openvino": ...}`), or a
`match` case on one. Outside the backends' folders, code asks the descriptor instead (`backend(fmt).streams_weights`,
`backend(fmt).runtime.load()`, ...). Names that are also a format's (the rewrite stages "onnx", "executorch" and
"openvino", the packages `onnx` and `openvino`) are not formats: a table keyed by them has other keys too. A rule
example's `known_failure={backend: reason}` is a fact of the rule, not a switch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hfexport.backends import Backend, backends, names

ROOT = Path(__file__).resolve().parents[1] / "hfexport"
FORMAT_NAMES = frozenset(names())
MEMBERS = frozenset(name.upper() for name in FORMAT_NAMES)

# Keywords of a rule's example whose dict is keyed by backend: what the rule knows of that example on each backend
# (`Match(..., known_failure={backend: reason})`, docs/authoring-rules.md), a fact of the rule, not a switch.
PER_BACKEND_FACTS = frozenset({"known_failure"})


def _is_format(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in FORMAT_NAMES
    if isinstance(node, ast.Attribute):
        if node.attr == "value":  # ExportFormat.ONNX.value
            return _is_format(node.value)
        return node.attr in MEMBERS and isinstance(node.value, ast.Name) and node.value.id == "ExportFormat"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_format(element) for element in node.elts)
    return False


def _facts_of_rules(tree: ast.AST) -> set[int]:
    """The ids of the dicts passed as a `PER_BACKEND_FACTS` keyword, or bound to a name passed there."""
    facts, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in PER_BACKEND_FACTS:
            if isinstance(node.value, ast.Dict):
                facts.add(id(node.value))
            elif isinstance(node.value, ast.Name):
                names.add(node.value.id)
    for node in ast.walk(tree):
        bound = isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        if bound and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            facts.add(id(node.value))
    return facts


def format_switches(source: str, path: str = "<source>") -> list[str]:
    """Each format switch in `source`, as `path:line: what`."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_is_format(side) for side in (node.left, *node.comparators)):
            found.append((node.lineno, "comparison with a format name", node))
        elif isinstance(node, ast.Dict):
            keys = [key for key in node.keys if key is not None]  # None: a `**mapping` entry
            if keys and all(_is_format(key) for key in keys):
                found.append((node.lineno, "dict keyed by format names", node))
        elif isinstance(node, ast.match_case) and _is_format(getattr(node.pattern, "value", None)):
            found.append((node.pattern.lineno, "match case on a format name", node))
    facts = _facts_of_rules(tree)
    return [
        f"{path}:{line}: {what}"
        for line, what, node in sorted(found, key=lambda item: item[0])
        if id(node) not in facts
    ]


def test_no_format_switch_outside_the_backends() -> None:
    found = [
        switch
        for path in sorted(ROOT.rglob("*.py"))
        if "backends" not in path.relative_to(ROOT).parts[:1]
        for switch in format_switches(path.read_text(), str(path.relative_to(ROOT.parent)))
    ]
    assert not found, "format switches outside hfexport/backends/ (ask the descriptor instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        'if fmt == "onnx": pass',
        'ok = "openvino" != export_format',
        'if fmt in ("onnx", "openvino"): pass',
        "fold = str(fmt) != ExportFormat.OPENVINO.value",
        "if fmt is ExportFormat.EXECUTORCH: pass",
        'TOLERANCE = {"dynamo": 1e-4, "onnx": 1e-3}',
        'DEFAULTS = {"openvino": {"compress_to_fp16": False}, **OTHERS}',
        'match fmt:\n    case "onnx":\n        pass',
    ],
)
def test_the_scan_sees_a_format_switch(snippet: str) -> None:
    assert format_switches(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        # A rewrite stage named like a backend, among other stages; packages named like backends, among others.
        'APPLIERS = {"fx": apply_fx, "onnx": apply_onnx}',
        'EXTRA = {"onnx": "onnx", "onnxscript": "onnx", "nncf": "quantization"}',
        "if backend(fmt).streams_weights: pass",
        'engine.apply("onnx", model, context)',
        # A rule example's facts per backend, given in place or through a name.
        'Match(build, "why", known_failure={"executorch": "XNNPACK refuses it"})',
        'fails = {"onnx": "guards"}\nexamples = (Match(build, "a", known_failure=fails),)',
    ],
)
def test_the_scan_leaves_other_names_alone(snippet: str) -> None:
    assert not format_switches(snippet), snippet


@pytest.mark.parametrize("each", backends(), ids=lambda b: b.name)
def test_a_descriptor_names_code_in_its_own_folder_only(each: Backend) -> None:
    # What a backend is lives in its folder: every reference resolves there, to a module named by its layer.
    from tests.test_layers import BACKEND_ROLES

    for field in ("config", "exporter", "runtime", "artifact", "ops", "tools"):
        ref = getattr(each, field)
        module = ref.module
        assert module.startswith(each.package + "."), f"{each.name}.{field} = {ref.target} is outside {each.package}"
        assert module.rsplit(".", 1)[1] in BACKEND_ROLES, f"{each.name}.{field}: {module} is not named by a layer"
        assert ref.load() is not None
    assert each.exporter.load().export_format == each.config.load().export_format == each.name
    assert each.runtime.load().name == each.artifact.load().name == each.name
    assert each.rules in names() and set(each.devices) and each.main_file.startswith("model.")


def test_every_format_is_a_member_of_export_format_and_a_public_name() -> None:
    import hfexport
    from hfexport.formats import ExportFormat

    assert [str(member) for member in ExportFormat] == list(names())
    for each in backends():
        assert getattr(ExportFormat, each.name.upper()) == each.name
        assert getattr(hfexport, each.exporter.attribute) is each.exporter.load()
        assert getattr(hfexport, each.config.attribute) is each.config.load()


def test_a_backend_that_runs_another_backends_rules_checks_their_match_examples() -> None:
    # AOTInductor compiles the Dynamo program: the Dynamo rules run for it, and their Match examples run on it.
    from hfexport.backends import backend
    from hfexport.rewrites.engine import default_registry
    from hfexport.rewrites.examples import Match, NoMatch
    from hfexport.testing import harness

    runs_dynamos = tuple(b.name for b in backends() if b.rules == "dynamo" and b.name != "dynamo")
    assert backend("aoti").rules == "dynamo" and runs_dynamos == ("aoti",)
    rule = next(r for r in default_registry().rules() if r.meta.backends == ("dynamo",))
    match = next(e for e in rule.meta.examples if isinstance(e, Match))
    no_match = next(e for e in rule.meta.examples if isinstance(e, NoMatch))
    assert harness.example_backends(rule, match) == ("dynamo", "aoti")
    assert harness.example_backends(rule, no_match) == ("dynamo",)
