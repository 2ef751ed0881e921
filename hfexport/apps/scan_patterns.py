"""The patterns of a static scan: Python code that breaks `torch.export`, found in a source with LibCST matchers
(`scan_source`); `hfexport.apps.scan` runs it over the installed transformers.

Patterns (`Site.kind`):

- `tensor-control-flow`: `if`/`while`/conditional expression whose test calls into a tensor's values
  (`torch.any(x)`, `(x == 0).all()`, `x.sum() > 0`, `torch.equal(a, b)`): data-dependent branching, which
  export either specialises to the sample or rejects.
- `raise-on-tensor`: the same test guarding a `raise`, or an `assert` on tensor values.
- `item-tolist`: `.item()` / `.tolist()`: a tensor value pulled into Python (a guard or a baked-in constant).
- `inplace-input`: an in-place method (`x.add_()`, `x.masked_fill_()`) or an item assignment (`x[...] = v`)
  on a `forward` argument that has not been rebound: export functionalises it, runtimes see a mutated input.
- `loop-over-shape`: `for ... in range(<a tensor size>)`: the loop is unrolled for the sample's length.
- `list-from-shape`: `list(range(<a tensor size>))` or `torch.tensor(<list/comprehension>)` over a size: the
  length is baked into the graph.

- `window-slice`: a slice whose start is the negation of an attribute (`full[:, :, -self.sliding_window + 1 :]`):
  torch decides the start's sign on the sample's length, so a sample shorter than the window guards the length
  below it (Dynamo) or bakes "keep everything" into the graph (ONNX).
- `size-modulo`: a tensor size modulo a block or chunk size (`pad = (chunk - L % chunk) % chunk`,
  `if L % block != 0`): the padding branch and the chunk count are decided on the sample.
- `size-min-max`: Python's `min`/`max` over a tensor size: a guard on which side won at the sample
  (`torch.sym_min` keeps both).
- `masked-size-branch`: a branch on the size of a boolean-mask selection (`if x[mask].numel() != n:`): the
  selection's size is data-dependent and export cannot guard on it.
- `module-to-in-forward`: `self.m = self.m.to(dtype)` while running: `Module.to` cannot swap a trace's fake
  parameters (moves to a device, a cache's offloading, are left out).
- `mask-row-pooling`: rows selected by a boolean mask and pooled to the last one per example
  (`hidden[eos_mask, :].view(B, -1, H)[:, -1, :]`, inline or through one local): the selection's row count is
  data-dependent (an unbacked size the saved program cannot be loaded with).
- `size-ceil`: `math.ceil` of an expression over a tensor size (`math.ceil(fraction * nb_tokens)`,
  `math.ceil(L / block)`): the graph keeps a `math.ceil` node on a symbolic float, which torch.export.save
  cannot write (fixed in the graph by `fx/sym-ceil-to-int`; OpenVINO by `openvino/sym-ceil-to-int`).
- `size-split`: a split whose piece size is a tensor size (`x.split(x.shape[0] // 2, dim=1)`,
  `torch.split(h, batch_size)`), or a chunk along a non-negative axis (`x.chunk(1 + ngram, dim=1)`; no `dim`
  is axis 0): on a dynamic axis the piece size is symbolic, which torch.onnx writes as SplitToSequence with a
  0-d split that onnxscript 0.7.2's optimizer crashes on (fixed in the graph by `fx/split-symbolic-size-as-sizes`,
  ONNX only). Syntax cannot tell a dynamic axis from a hidden one (`qkv.chunk(3, dim=2)`): read the site.
- `vmap-mask-function`: a `create_*_mask(...)` call given its own `and_mask_function=` / `or_mask_function=`
  (not one forwarded under the same name): masking_utils then vmaps the mask function, and a tensor it or the
  padding mask indexes becomes a `flat_apply` of torch's ModIndex that torch.export.save cannot write (fixed in
  the graph by `fx/mod-index-as-aten-index`).
- `state-on-module`: a `forward` that stores a state on its module (`self.conv1d_state = ...`,
  `self.rg_lru.recurrent_states = ...`: an attribute named `*state` / `*states`, set to something other than
  None): a generation state kept outside the cache, which an exported step can neither take nor return.

- `loop-over-nonzero`: a Python loop over the rows of a `nonzero()` result (`for e in hit` with `hit =
  mask.nonzero()`): its length is data-dependent, so the trace cannot iterate it ("Could not guard on
  data-dependent expression Eq(u0, 0)"). Experts classes decorated with transformers' `use_experts_implementation`
  are left out: under export their forward dispatches to a batched function, not to this loop.

"A tensor size" is `x.shape[i]`, `x.size(i)` or a local name assigned from one of them.
`hfexport.apps.scan_rules.causes()` maps the patterns that registered rules fix (each rule declares them:
`RuleMeta.scan`) to those rules, so a scan of a newer transformers shows the copies of a cause that no rule targets
yet (tests/test_scan.py asserts each is targeted or a known gap).
These are heuristics over syntax (no types): they point at code to read, and each site says whether a
registered rule targets its module, class or function.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ByteSpanPositionProvider

KINDS = (
    "tensor-control-flow",
    "raise-on-tensor",
    "item-tolist",
    "inplace-input",
    "loop-over-shape",
    "list-from-shape",
    "window-slice",
    "size-modulo",
    "size-min-max",
    "masked-size-branch",
    "module-to-in-forward",
    "mask-row-pooling",
    "size-ceil",
    "vmap-mask-function",
    "state-on-module",
    "size-split",
    "loop-over-nonzero",
)

# torch.<name>(...) calls that read tensor values. Everything else under torch (dtype checks, finfo,
# compiler/jit state, tensor constructors) is fine in a branch condition.
_VALUE_READERS = (
    "any",
    "all",
    "equal",
    "allclose",
    "isclose",
    "isnan",
    "isinf",
    "isfinite",
    "count_nonzero",
    "nonzero",
    "sum",
    "max",
    "min",
    "amax",
    "amin",
    "mean",
    "eq",
    "ne",
    "gt",
    "lt",
    "ge",
    "le",
    "unique",
    "where",
)
# x.<name>() methods that read tensor values.
_VALUE_METHODS = (*_VALUE_READERS, "item", "tolist", "numpy")
_INPLACE_EXCLUDED = ("requires_grad_", "share_memory_")
# Functions that only build or initialise a model, never run under export.
_SKIPPED_FUNCTIONS = ("__init__", "_init_weights", "init_weights", "post_init", "tie_weights", "extra_repr")

_TORCH_VALUE_CALL = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.OneOf(*(m.Name(n) for n in _VALUE_READERS))))
_VALUE_METHOD_CALL = m.Call(
    func=m.Attribute(value=~m.Name("torch"), attr=m.OneOf(*(m.Name(n) for n in _VALUE_METHODS)))
)
_READS_VALUES = m.OneOf(_TORCH_VALUE_CALL, _VALUE_METHOD_CALL)
_ITEM_OR_TOLIST = m.Call(func=m.Attribute(attr=m.Name("item") | m.Name("tolist")), args=[])
_SIZE = m.OneOf(
    m.Subscript(value=m.Attribute(attr=m.Name("shape"))),
    m.Call(func=m.Attribute(attr=m.Name("size")), args=[m.AtLeastN(n=1)]),
)
# `batch, length, _ = x.shape` / `x.size()`: every name bound is a size.
_WHOLE_SHAPE = m.OneOf(m.Attribute(attr=m.Name("shape")), m.Call(func=m.Attribute(attr=m.Name("size")), args=[]))
_RANGE = m.Call(func=m.Name("range"))
_NONZERO = m.Call(func=m.Attribute(attr=m.Name("nonzero")))
_LIST_OF_RANGE = m.Call(func=m.Name("list"), args=[m.Arg(value=_RANGE)])
_TORCH_TENSOR_OF_SEQUENCE = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("tensor")),
    args=[m.Arg(value=m.OneOf(m.ListComp(), m.List(), m.Call(func=m.Name("list")), m.Subscript())), m.ZeroOrMore()],
)


# `-self.sliding_window`, `-config.window`: a negated attribute, the start of a window slice.
_NEGATED_ATTRIBUTE = m.UnaryOperation(operator=m.Minus(), expression=m.Attribute())
_MODULO = m.BinaryOperation(operator=m.Modulo())
_BUILTIN_MIN_MAX = m.Call(func=m.Name("min") | m.Name("max"))
# `x[mask].numel()` / `x[mask].shape`: the size of an index selection (not of a slice).
_SELECTION = m.Subscript(slice=[m.SubscriptElement(slice=m.Index(value=m.Name() | m.Attribute()))])
_SELECTION_SIZE = m.OneOf(
    m.Call(func=m.Attribute(value=_SELECTION, attr=m.Name("numel") | m.Name("size"))),
    m.Attribute(value=_SELECTION, attr=m.Name("shape")),
)
_SELF_ATTRIBUTE = m.Attribute(value=m.Name("self"))
# `X[mask, :]`: the selection `mask-row-pooling` starts from (the rule's matcher then checks its uses).
_ROW_SELECTION = m.Subscript(
    slice=[
        m.SubscriptElement(slice=m.Index(value=m.Name())),
        m.SubscriptElement(slice=m.Slice(lower=None, upper=None, step=None)),
    ]
)


_MATH_CEIL = m.Call(func=m.Attribute(value=m.Name("math"), attr=m.Name("ceil")))
_MASK_FUNCTION_KEYWORDS = ("and_mask_function", "or_mask_function")
_SPLIT_OR_CHUNK = m.Call(func=m.Attribute(attr=m.Name("split") | m.Name("chunk")))
_SIZE_LIST = m.List() | m.Tuple() | m.ListComp()


def _is_vmap_mask_call(node: cst.Call) -> bool:
    """`create_*_mask(..., and_mask_function=f)` with `f` built here (not None, not the caller's same-named one)."""
    func = node.func
    name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else ""
    if not (name.startswith("create_") and name.endswith("mask")):
        return False
    for arg in node.args:
        keyword = arg.keyword.value if arg.keyword is not None else None
        if keyword not in _MASK_FUNCTION_KEYWORDS:
            continue
        value = arg.value
        if isinstance(value, cst.Name) and value.value in ("None", keyword):
            continue
        return True
    return False


def _is_inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_") and name not in _INPLACE_EXCLUDED


_INPLACE_METHOD = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name(value=m.MatchIfTrue(_is_inplace_name))))


@dataclass(frozen=True)
class Site:
    """One place in a source file that matches a pattern."""

    kind: str
    path: str
    module: str
    line: int
    scope: str  # Class.function, or function for a module-level function
    code: str
    rules: tuple[str, ...] = ()

    @property
    def owner(self) -> str:
        """The class the site is in, or `<module>` for a module-level function."""
        return self.scope.split(".")[0] if "." in self.scope else "<module>"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "owner": self.owner, "rules": list(self.rules)}


@dataclass
class _Scope:
    name: str
    is_class: bool
    params: set[str] = field(default_factory=set)
    sizes: set[str] = field(default_factory=set)
    # Whether the function has an `X[mask, :]` selection: only then is it matched for `mask-row-pooling`.
    selects_rows: bool = False
    nonzero: set[str] = field(default_factory=set)  # locals bound to a `.nonzero()` result
    # A class decorated with transformers' `use_experts_implementation`: under export its forward dispatches to a
    # batched experts function, so the eager loop in its body is not what runs.
    dispatches: bool = False


class _Finder(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (ByteSpanPositionProvider,)

    def __init__(self, report: Callable[[str, cst.CSTNode, str], None]) -> None:
        super().__init__()
        self.report = report
        self.scopes: list[_Scope] = []

    # -- scopes ------------------------------------------------------------------------------------------
    def _function(self) -> _Scope | None:
        for scope in reversed(self.scopes):
            if not scope.is_class:
                return scope
        return None

    def qualname(self) -> str:
        return ".".join(s.name for s in self.scopes)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        dispatches = any(m.findall(d.decorator, m.Name("use_experts_implementation")) for d in node.decorators)
        self.scopes.append(_Scope(node.name.value, True, dispatches=dispatches))
        return True

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        params: set[str] = set()
        if node.name.value == "forward":
            every = (*node.params.posonly_params, *node.params.params, *node.params.kwonly_params)
            params = {p.name.value for p in every if p.name.value not in ("self", "cls")}
        self.scopes.append(_Scope(node.name.value, False, params))
        # libcst calls leave_FunctionDef even when the body is skipped, so the scope is pushed either way.
        return node.name.value not in _SKIPPED_FUNCTIONS

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        if self.scopes[-1].selects_rows and original_node.name.value not in _SKIPPED_FUNCTIONS:
            # The rule's own matcher (patch/eos-pooling-gather), so the scan and the rule agree on the pattern.
            from hfexport.rewrites.rules.patch.eos_pooling_gather import pooled_selections

            for selection in pooled_selections(original_node):
                self.report("mask-row-pooling", selection, "")
        self.scopes.pop()

    def _in_function(self) -> bool:
        return self._function() is not None

    # -- helpers -----------------------------------------------------------------------------------------
    def _is_size(self, node: cst.BaseExpression) -> bool:
        """Whether `node` mentions a tensor size: x.shape[i], x.size(i), len(x), or a local derived from one."""
        if m.findall(node, _SIZE):
            return True
        scope = self._function()
        return bool(scope and scope.sizes and m.findall(node, m.Name(m.MatchIfTrue(lambda n: n in scope.sizes))))

    def _reads_values(self, test: cst.BaseExpression) -> bool:
        return bool(m.findall(test, _READS_VALUES))

    def _is_size_split(self, node: cst.Call) -> bool:
        """`x.split(size)` / `torch.split(x, size)` with `size` a tensor size, or `x.chunk(n, dim)` /
        `torch.chunk(x, n, dim)` along a non-negative literal axis (or axis 0, the default)."""
        method = node.func.attr.value  # type: ignore[attr-defined]
        positional = [a for a in node.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        if m.matches(node.func.value, m.Name("torch")):  # type: ignore[attr-defined]
            positional = positional[1:]  # the tensor
        if method == "split":
            size = positional[0].value if positional else keywords.get("split_size_or_sections")
            return size is not None and not m.matches(size, _SIZE_LIST) and self._is_size(size)
        if not positional and "chunks" not in keywords:
            return False
        dim = positional[1].value if len(positional) > 1 else keywords.get("dim")
        return dim is None or isinstance(dim, cst.Integer)

    def _is_list_from_shape(self, node: cst.Call) -> bool:
        if m.matches(node, _LIST_OF_RANGE):
            return self._is_size(node)
        return m.matches(node, _TORCH_TENSOR_OF_SEQUENCE) and self._is_size(node.args[0].value)

    # -- patterns ----------------------------------------------------------------------------------------
    def visit_If(self, node: cst.If) -> None:
        if not self._in_function():
            return
        if m.findall(node.test, _SELECTION_SIZE):
            self.report("masked-size-branch", node.test, "if")
        elif self._reads_values(node.test):
            raises = m.findall(node.body, m.Raise())
            self.report("raise-on-tensor" if raises else "tensor-control-flow", node.test, "if")

    def visit_While(self, node: cst.While) -> None:
        if self._in_function() and self._reads_values(node.test):
            self.report("tensor-control-flow", node.test, "while")

    def visit_IfExp(self, node: cst.IfExp) -> None:
        if self._in_function() and self._reads_values(node.test):
            self.report("tensor-control-flow", node.test, "if-expression")

    def visit_Assert(self, node: cst.Assert) -> None:
        if self._in_function() and self._reads_values(node.test):
            self.report("raise-on-tensor", node.test, "assert")

    def visit_Call(self, node: cst.Call) -> None:
        if not self._in_function():
            return
        if m.matches(node, _ITEM_OR_TOLIST):
            self.report("item-tolist", node, "")
        elif m.matches(node, _BUILTIN_MIN_MAX) and any(self._is_size(arg.value) for arg in node.args):
            self.report("size-min-max", node, "")
        elif self._is_list_from_shape(node):
            self.report("list-from-shape", node, "")
        elif m.matches(node, _MATH_CEIL) and any(self._is_size(arg.value) for arg in node.args):
            self.report("size-ceil", node, "")
        elif _is_vmap_mask_call(node):
            self.report("vmap-mask-function", node, "")
        elif m.matches(node, _SPLIT_OR_CHUNK) and self._is_size_split(node):
            self.report("size-split", node, "")
        elif m.matches(node, _INPLACE_METHOD):
            scope = self._function()
            target = node.func.value.value  # type: ignore[attr-defined]
            if scope is not None and target in scope.params:
                self.report("inplace-input", node, "")

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if not self._in_function():
            return
        scope = self._function()
        if scope is not None and m.matches(node, _ROW_SELECTION):
            scope.selects_rows = True
        for element in node.slice:
            if isinstance(element.slice, cst.Slice) and element.slice.lower is not None:
                lower = element.slice.lower
                # The start itself, or its left operand (`-self.window + 1`), is a negated attribute.
                head = lower.left if isinstance(lower, cst.BinaryOperation) else lower
                if m.matches(head, _NEGATED_ATTRIBUTE):
                    self.report("window-slice", node, "")
                    return

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        # A size modulo a literal (`L % 2`) is parity, not a block boundary: only a named block size counts.
        modulo = m.matches(node, _MODULO) and not isinstance(node.right, cst.Integer)
        if modulo and self._in_function() and self._is_size(node.left):
            self.report("size-modulo", node, "")

    def visit_For(self, node: cst.For) -> None:
        if self._in_function() and m.matches(node.iter, _RANGE) and self._is_size(node.iter):
            self.report("loop-over-shape", node.iter, "for")
        scope = self._function()
        dispatched = any(s.is_class and s.dispatches for s in self.scopes)
        over_nonzero = m.findall(node.iter, _NONZERO) or (
            m.matches(node.iter, m.Name()) and scope is not None and node.iter.value in scope.nonzero
        )
        if scope is not None and over_nonzero and not dispatched:
            self.report("loop-over-nonzero", node.iter, "for")

    def visit_CompFor(self, node: cst.CompFor) -> None:
        # A comprehension unrolls the same way (`cat([... for i in range(batch_size)])`, Reformer's axial positions).
        if self._in_function() and m.matches(node.iter, _RANGE) and self._is_size(node.iter):
            self.report("loop-over-shape", node.iter, "comprehension")

    def visit_Assign(self, node: cst.Assign) -> None:
        scope = self._function()
        if scope is None:
            return
        if scope.name == "forward" and not m.matches(node.value, m.Name("None")):
            for target in node.targets:
                if _is_state_attribute(target.target):
                    self.report("state-on-module", node, "")
                    break
        for target in node.targets:
            if (
                m.matches(target.target, _SELF_ATTRIBUTE)
                and m.matches(node.value, m.Call(func=m.Attribute(value=_SELF_ATTRIBUTE, attr=m.Name("to"))))
                and node.value.func.value.attr.value == target.target.attr.value  # type: ignore[attr-defined]
                # A move (`.to(self.device)`, `.to("cpu")`) is a cache tensor's offloading, not a cast.
                and not m.findall(node.value, m.Name("device") | m.Attribute(attr=m.Name("device")) | m.SimpleString())
            ):
                self.report("module-to-in-forward", node, "")
            subscript = target.target
            if not isinstance(subscript, cst.Subscript) or not isinstance(subscript.value, cst.Name):
                continue
            # A string key (`outputs["pair"] = ...`) writes into a dict argument, not a tensor.
            keyed = m.findall(subscript, m.SimpleString() | m.FormattedString())
            if subscript.value.value in scope.params and not keyed:
                self.report("inplace-input", subscript, "item assignment")

    def leave_Assign(self, original_node: cst.Assign) -> None:
        scope = self._function()
        if scope is None:
            return
        names = [n.value for t in original_node.targets for n in m.findall(t.target, m.Name())]
        bound = {t.target.value for t in original_node.targets if m.matches(t.target, m.Name())}
        bound |= {n for t in original_node.targets if m.matches(t.target, m.Tuple()) for n in names}
        # A rebound argument is no longer the caller's tensor; a name assigned from a size carries it on.
        scope.params -= bound
        if self._is_size(original_node.value) or m.matches(original_node.value, _WHOLE_SHAPE):
            scope.sizes |= bound
        else:
            scope.sizes -= bound
        if m.findall(original_node.value, _NONZERO):
            scope.nonzero |= bound
        else:
            scope.nonzero -= bound


def _is_state_attribute(node: cst.BaseExpression) -> bool:
    """`self.x_state` / `self.sub.x_states`: an attribute of the module (or of a submodule) named as a state."""
    if not isinstance(node, cst.Attribute) or re.search(r"(^|_)states?$", node.attr.value) is None:
        return False
    owner = node.value
    while isinstance(owner, cst.Attribute):
        owner = owner.value
    return m.matches(owner, m.Name("self"))


class RulesFor(Protocol):
    """What a scan asks of its rule index (`hfexport.apps.scan_rules.RuleIndex`): the rules that target a site."""

    def rules_for(self, module: str, scope: str, kind: str | None = None) -> tuple[str, ...]: ...


def scan_source(
    source: str, path: str = "<source>", module: str = "", rule_index: RulesFor | None = None
) -> list[Site]:
    """Every site in one file's `source`, in source order; each names the rules `rule_index` says target it."""
    tree = cst.parse_module(source)
    found: list[tuple[str, cst.CSTNode, str, str]] = []
    finder: _Finder

    def report(kind: str, node: cst.CSTNode, _what: str) -> None:
        found.append((kind, node, finder.qualname(), tree.code_for_node(node)))

    finder = _Finder(report)
    wrapper = cst.MetadataWrapper(tree, unsafe_skip_copy=True)
    wrapper.visit(finder)
    if not found:
        return []
    spans = wrapper.resolve(ByteSpanPositionProvider)
    encoded = source.encode("utf-8")
    line_starts = [0] + [i + 1 for i, b in enumerate(encoded) if b == 0x0A]
    sites = []
    seen: set[tuple[str, int]] = set()
    for kind, node, scope, code in found:
        start = spans[node].start
        line = bisect.bisect_right(line_starts, start)
        snippet = " ".join(code.split())
        # One site per pattern and line: `torch.tensor(list(range(n)))` matches at two nested calls.
        key = (kind, line)
        if key in seen:
            continue
        seen.add(key)
        rules = rule_index.rules_for(module, scope, kind) if rule_index else ()
        sites.append(Site(kind, path, module, line, scope, snippet[:120], rules))
    return sites
