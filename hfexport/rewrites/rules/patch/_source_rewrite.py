"""A class method recompiled from its own source after a LibCST rewrite: what source-rewriting patches share.

A rule that changes a few expressions of a transformers method (`patch/eos-pooling-gather`,
`patch/experts-hit-loop-every-expert`) rewrites the method's source, compiles it again in the method's own
module namespace (plus the rule's helpers under one reserved name) and applies the original decorators again,
so everything it does not rewrite is the original code.
"""

from __future__ import annotations

import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.rewrites.rules.patch._scan_site import class_method_at


def rewrite_function(source: str, find: Callable[[Any], dict[Any, Any]]) -> str | None:
    """`source` (one function definition, decorators included) with the LibCST nodes `find(function)` maps
    replaced, or None where it maps none (or where the rewritten function could not be compiled as a plain
    function: a zero-argument `super()` needs the class body)."""
    import libcst as cst
    import libcst.matchers as m

    module = cst.parse_module(textwrap.dedent(source))
    functions = [s for s in module.body if isinstance(s, cst.FunctionDef)]
    if len(functions) != 1 or m.findall(functions[0], m.Call(func=m.Name("super"))):
        return None
    replacements = find(functions[0])
    if not replacements:
        return None

    class _Replace(cst.CSTTransformer):
        def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> Any:
            return replacements.get(original, updated)

    return module.visit(_Replace()).code


def split_decorators(source: str) -> tuple[str, list[str]]:
    """The function's source without its decorators, and the decorator expressions (outermost first)."""
    import libcst as cst

    module = cst.parse_module(source)
    function = module.body[0]
    assert isinstance(function, cst.FunctionDef)
    decorators = [module.code_for_node(d.decorator) for d in function.decorators]
    return module.code_for_node(function.with_changes(decorators=[])), decorators


def recompile(
    function: types.FunctionType,
    rewrite: Callable[[str], str | None],
    rule_id: str,
    helpers: tuple[str, Any] | None = None,
    accept: Callable[[str], bool] | None = None,
) -> types.FunctionType | None:
    """`function` (a class's method, decorated or not) compiled again from `rewrite(source)`, or None where it
    has no source, `accept(source)` (a cheap text check before parsing) refuses it, `rewrite` returns None, or
    the method has a closure (a zero-argument `super()` needs the class body). `helpers` is (name, object): the
    object the rewritten source reaches under that name."""
    raw = inspect.unwrap(function)
    try:
        source = inspect.getsource(raw)
    except (OSError, TypeError):
        return None
    if accept is not None and not accept(source):
        return None
    rewritten = rewrite(source)
    if rewritten is None or raw.__code__.co_freevars:
        return None
    namespace = dict(raw.__globals__)
    if helpers is not None:
        namespace[helpers[0]] = helpers[1]
    filename = f"<hfexport {rule_id}: {raw.__code__.co_filename}>"
    body, decorators = split_decorators(rewritten)
    exec(compile(body, filename, "exec"), namespace)
    new = namespace[raw.__name__]
    # The decorators again (`can_return_tuple`, `auto_docstring`, ...), on a function that carries the class
    # method's names: transformers' decorators tell a method from a class by its qualified name.
    new.__qualname__, new.__module__ = raw.__qualname__, raw.__module__
    for decorator in reversed(decorators):
        new = eval(compile(decorator, filename, "eval"), namespace)(new)
    return new


@dataclass(frozen=True)
class ForwardRewrite:
    """A rule's rewrite of a class's own `forward`: the recompiled forward of a module (cached per function),
    whether it binds to a scanned class (`covers`, for `hfexport scan`) and the patch replacement that runs it."""

    rule_id: str
    rewrite: Callable[[str], str | None]
    accept: Callable[[str], bool] | None = None
    helpers: tuple[str, Any] | None = None
    _cache: dict[types.FunctionType, types.FunctionType | None] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    def rewritten(self, function: types.FunctionType) -> types.FunctionType | None:
        # Cached: a rule's predicate asks for every module class of every exported model, the patch for every call.
        if function not in self._cache:
            self._cache[function] = recompile(function, self.rewrite, self.rule_id, self.helpers, self.accept)
        return self._cache[function]

    def of(self, module: torch.nn.Module) -> types.FunctionType | None:
        """The module's class's own forward, rewritten; None where the class has none or nothing to rewrite."""
        function = type(module).__dict__.get("forward")
        return self.rewritten(function) if isinstance(function, types.FunctionType) else None

    def covers(self, module: str, scope: str) -> bool:
        """Whether the rule binds to the function `module.scope`: a class's `forward` it rewrites."""
        function = class_method_at(module, scope, "forward")
        return function is not None and self.rewritten(function) is not None

    def replacement(self, original: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The patch replacement: the class's forward, rewritten (the rule's predicate matched this module)."""
        forward = self.of(module)
        assert forward is not None
        return forward(module, *args, **kwargs)
