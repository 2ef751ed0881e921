"""The config attributes that select a model's code paths, and which of those paths a config takes.

A modeling file branches on its config: `if config.q_lora_rank is None`, `if self.sliding_window`,
`range(config.n_shared_experts)`, `layer_type == "sliding_attention"`, `config.hidden_size //
config.num_attention_heads`. The export rules were written for the configs the corpus drew; another config of
the same type takes other branches. This module finds those sites with LibCST (`branch_sites`) and, for a
built model, measures which side of each `if` a forward pass took (`taken_sides`, line counts under
`sys.settrace`, restricted to the model's modeling file), so the corpus variants
(`hfexport.testing.corpus_variants`) can be judged by the branches they cover.

A site is an `if` (or `while`, conditional expression, `range(...)` bound, `//` or `%` operand) whose
expression reads a config attribute: `config.x`, `self.config.x`, `getattr(config, "x", ...)`, or `self.x`
where the class's `__init__` assigned `self.x` from one of those. The attribute names, the comparison
literals (`layer_type == "sliding_attention"` gives `sliding_attention`) and the site's line are recorded.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider

__all__ = [
    "BranchSite",
    "LineCounts",
    "attributes",
    "branch_sites",
    "count_lines",
    "model_sources",
    "sides_taken",
    "taken_sides",
]


@dataclass(frozen=True)
class BranchSite:
    """One place where a config attribute decides a branch, a loop bound or a shape."""

    kind: str  # if | while | ifexp | range | div
    line: int
    attrs: tuple[str, ...]
    code: str
    scope: str  # Class.method
    body: int | None = None  # first line of the `if` body (kind "if")
    orelse: int | None = None  # first line of the `else`/`elif` (kind "if"), None without one
    literals: tuple[str, ...] = ()  # strings the attributes are compared with (`== "sliding_attention"`)
    none_test: bool = False  # the test is `attr is None` / `is not None`

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "line": self.line,
            "attrs": list(self.attrs),
            "code": self.code,
            "scope": self.scope,
            "body": self.body,
            "orelse": self.orelse,
            "literals": list(self.literals),
            "none_test": self.none_test,
        }


_CONFIG_NAMES = ("config", "text_config", "cfg")
# Flags a caller sets per call (what to return, which kernel), not a property of the architecture.
RUNTIME_FLAGS = frozenset(
    {
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_return_dict",
        "output_router_logits",
        "_attn_implementation",
        "_experts_implementation",
        "torchscript",
        "gradient_checkpointing",
        "initializer_range",
        "problem_type",
        "num_labels",
        "pad_token_id",
    }
)


def _config_attr(node: cst.CSTNode) -> str | None:
    """`config.x` / `self.config.x` / `getattr(config, "x", d)`: x; else None."""
    if isinstance(node, cst.Attribute):
        owner = node.value
        if m.matches(owner, m.Name()) and owner.value in _CONFIG_NAMES:
            return node.attr.value
        if m.matches(owner, m.Attribute(value=m.Name("self"), attr=m.OneOf(*(m.Name(n) for n in _CONFIG_NAMES)))):
            return node.attr.value
    if m.matches(node, m.Call(func=m.Name("getattr"), args=[m.AtLeastN(n=2)])):
        owner, name = node.args[0].value, node.args[1].value
        config_owner = (m.matches(owner, m.Name()) and owner.value in _CONFIG_NAMES) or m.matches(
            owner, m.Attribute(value=m.Name("self"), attr=m.Name("config"))
        )
        if config_owner and isinstance(name, cst.SimpleString):
            return name.evaluated_value if isinstance(name.evaluated_value, str) else None
    return None


class _Collector(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.sites: list[BranchSite] = []
        self.classes: list[str] = []
        self.functions: list[str] = []
        self.self_attrs: list[dict[str, set[str]]] = []  # per class: self.x -> the config attributes it holds
        self.locals: list[dict[str, set[str]]] = []  # per function: local name -> config attributes
        # per class: self.x -> the strings its assignment compared with (`config.layer_types[i] == "sliding..."`)
        self.self_literals: list[dict[str, list[str]]] = []

    # -- scopes --------------------------------------------------------------------------------------------------

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node.name.value)
        mapping: dict[str, set[str]] = {}
        self.self_attrs.append(mapping)
        self.self_literals.append({})
        # `self.x = config.y` anywhere in the class (usually __init__): self.x stands for config.y
        # (`self.is_sliding = config.layer_types[i] == "sliding_attention"` for layer_types).
        for assign in m.findall(node, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])):
            target = assign.targets[0].target
            found = self._reads(assign.value, {})
            if found and isinstance(target, cst.Attribute):
                mapping.setdefault(target.attr.value, set()).update(found)
                literals = self.self_literals[-1].setdefault(target.attr.value, [])
                literals += [lit for lit in self._literals(assign.value) if lit not in literals]

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.classes.pop()
        self.self_attrs.pop()
        self.self_literals.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node.name.value)
        self.locals.append({})

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()
        self.locals.pop()

    def scope(self) -> str:
        return ".".join([*self.classes[-1:], *self.functions[-1:]])

    def _skipped(self) -> bool:
        # Weight initialisation runs once on random weights; `__init__` stays: it decides which modules exist.
        return bool(self.functions) and self.functions[-1] in {"_init_weights", "post_init", "init_weights"}

    # -- reads of config attributes ------------------------------------------------------------------------------

    def _reads(self, node: cst.CSTNode, local: dict[str, set[str]]) -> set[str]:
        found: set[str] = set()
        mapping = self.self_attrs[-1] if self.self_attrs else {}

        class Reads(cst.CSTVisitor):
            def visit_Attribute(self, n: cst.Attribute) -> bool:
                attr = _config_attr(n)
                if attr:
                    found.add(attr)
                    return False
                if m.matches(n.value, m.Name("self")) and n.attr.value in mapping:
                    found.update(mapping[n.attr.value])
                return True

            def visit_Call(self, n: cst.Call) -> bool:
                attr = _config_attr(n)
                if attr:
                    found.add(attr)
                    return False
                return True

            def visit_Name(self, n: cst.Name) -> None:
                if n.value in local:
                    found.update(local[n.value])

        node.visit(Reads())
        return found - RUNTIME_FLAGS

    def _local(self) -> dict[str, set[str]]:
        return self.locals[-1] if self.locals else {}

    def visit_Assign(self, node: cst.Assign) -> None:
        # `layer_type = config.layer_types[i]`, `window = self.sliding_window`: the local stands for the attribute.
        if not self.locals:
            return
        found = self._reads(node.value, self._local())
        for target in node.targets:
            if m.matches(target.target, m.Name()):
                if found:
                    self._local()[target.target.value] = found
                else:
                    self._local().pop(target.target.value, None)

    def _literals(self, test: cst.CSTNode) -> tuple[str, ...]:
        out = []
        for string in m.findall(test, m.SimpleString()):
            value = string.evaluated_value
            if isinstance(value, str) and len(value) < 64:
                out.append(value)
        return tuple(dict.fromkeys(out))

    def _add(self, kind: str, node: cst.CSTNode, test: cst.CSTNode, **extra: Any) -> None:
        if self._skipped():
            return
        attrs = self._reads(test, self._local())
        if not attrs:
            return
        line = self.get_metadata(PositionProvider, node).start.line
        literals = list(self._literals(test))
        held = self.self_literals[-1] if self.self_literals else {}
        for attribute in m.findall(test, m.Attribute(value=m.Name("self"))):
            literals += [lit for lit in held.get(attribute.attr.value, []) if lit not in literals]
        code = " ".join(cst.Module([]).code_for_node(test).split())[:120]
        none_test = bool(m.findall(test, m.Comparison(comparisons=[m.ComparisonTarget(comparator=m.Name("None"))])))
        self.sites.append(
            BranchSite(
                kind,
                line,
                tuple(sorted(attrs)),
                code,
                self.scope(),
                literals=tuple(literals),
                none_test=none_test,
                **extra,
            )
        )

    def visit_If(self, node: cst.If) -> None:
        body = self.get_metadata(PositionProvider, node.body.body[0]).start.line if node.body.body else None
        orelse = None
        if node.orelse is not None:
            first = node.orelse if isinstance(node.orelse, cst.If) else node.orelse.body.body[0]
            orelse = self.get_metadata(PositionProvider, first).start.line
        self._add("if", node, node.test, body=body, orelse=orelse)

    def visit_While(self, node: cst.While) -> None:
        self._add("while", node, node.test)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self._add("ifexp", node, node.test)

    def visit_Call(self, node: cst.Call) -> None:
        if m.matches(node.func, m.Name("range")) and node.args:
            self._add("range", node, node.args[-1].value if len(node.args) < 3 else node.args[1].value)

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if isinstance(node.operator, (cst.FloorDivide, cst.Modulo)):
            self._add("div", node, node)


def branch_sites_of_source(source: str) -> list[BranchSite]:
    """Every config-dependent site of one file, in source order (one per kind and line)."""
    wrapper = cst.MetadataWrapper(cst.parse_module(source))
    collector = _Collector()
    wrapper.visit(collector)
    seen: set[tuple[str, int]] = set()
    out = []
    for site in sorted(collector.sites, key=lambda s: (s.line, s.kind)):
        if (site.kind, site.line) not in seen:
            seen.add((site.kind, site.line))
            out.append(site)
    return out


def model_sources(model_type: str) -> list[Path]:
    """The installed transformers' modeling files of a model type (its module folder's `modeling_*.py`)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from hfexport.apps.scan import transformers_root

    folder = transformers_root() / "models" / model_type_to_module_name(model_type)
    return sorted(folder.glob("modeling_*.py")) if folder.is_dir() else []


# transformers' shared code that reads a model's config to pick masks and cache layers (windows, chunks).
SHARED_SOURCES = ("masking_utils.py", "cache_utils.py")


@functools.cache
def _shared_sites() -> dict[str, list[BranchSite]]:
    from hfexport.apps.scan import transformers_root

    paths = [transformers_root() / name for name in SHARED_SOURCES]
    return {str(path): branch_sites_of_source(path.read_text()) for path in paths if path.exists()}


@functools.cache
def branch_sites(model_type: str) -> dict[str, list[BranchSite]]:
    """``{file path: sites}`` over the model type's modeling files and the shared mask and cache code (cached;
    treat as read-only)."""
    own = {str(path): branch_sites_of_source(path.read_text()) for path in model_sources(model_type)}
    return {**own, **_shared_sites()}


def attributes(model_type: str) -> Counter[str]:
    """The config attributes a model type's modeling code branches on, with their site counts."""
    counts: Counter[str] = Counter()
    for sites in branch_sites(model_type).values():
        for site in sites:
            counts.update(site.attrs)
    return counts


# -- which side a run took -----------------------------------------------------------------------------------


@dataclass
class LineCounts:
    """Executed line counts per watched file, from one or more runs."""

    counts: dict[str, Counter[int]] = field(default_factory=dict)

    def merge(self, other: LineCounts) -> None:
        for path, lines in other.counts.items():
            self.counts.setdefault(path, Counter()).update(lines)


def count_lines(files: list[str], run: Callable[[], Any]) -> LineCounts:
    """Run `run()` with a line tracer on the frames of `files` only; the executed lines' counts."""
    watched = {str(Path(f).resolve()) for f in files}
    counts: dict[str, Counter[int]] = {f: Counter() for f in watched}

    def local(frame: Any, event: str, _arg: Any) -> Any:
        if event == "line":
            counts[frame.f_code.co_filename][frame.f_lineno] += 1
        return local

    def global_(frame: Any, event: str, _arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename in watched:
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        run()
    finally:
        sys.settrace(previous)
    return LineCounts(counts)


def sides_taken(site: BranchSite, lines: Counter[int]) -> tuple[bool, bool] | None:
    """(true side taken, false side taken) of an `if` site from line counts; None if the site never ran.

    The true side ran when the body's first line did; the false side when the `else` did, or, without an
    `else`, when the test ran more often than the body (a test spanning several lines counts once per line, so
    the test's first line is what is compared)."""
    if site.kind != "if" or site.body is None:
        return None
    tested = lines.get(site.line, 0)
    if not tested:
        return None
    body = lines.get(site.body, 0)
    false = lines.get(site.orelse, 0) > 0 if site.orelse is not None else tested > body
    return body > 0, false


def taken_sides(model_type: str, counts: LineCounts) -> Iterator[tuple[str, BranchSite, tuple[bool, bool] | None]]:
    """Each `if` site of the model type's files with the sides `counts` show taken (None: not reached)."""
    for path, sites in branch_sites(model_type).items():
        lines = counts.counts.get(str(Path(path).resolve()), Counter())
        for site in sites:
            if site.kind == "if":
                yield path, site, sides_taken(site, lines)
