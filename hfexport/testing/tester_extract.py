"""The tiny configs of transformers' own model tests, read from their files (`extract`); tools/extract_tester_configs.py
writes them into hfexport/testing/tester_configs.json.

transformers' test suite builds every model from a tiny config made by a `*ModelTester` class: the keyword
defaults of its `__init__` (and of the base testers it extends: `tests/causal_lm_tester.py`'s
`CausalLMModelTester`, ...) and what its `get_config` passes to the config class. `extract` reads those files
with `ast` and evaluates only the values: literals, the tester's attributes (`self.hidden_size`), arithmetic
on them, dict/list literals, nested config-class calls (`Gemma3TextConfig(**self.text_config)`) and
`get_config`'s locals. No test code is run or copied: the output is `{model_type: [{tester, config_class,
kwargs}]}`, and a keyword whose value is not such an expression (a tensor, a function's result) is listed
under `dropped`. The `model_type` and the config's fields come from the installed transformers (the
config class a tester names, or the `config_class` of its `base_model_class`), so the data matches the
installed version's classes; the file a value came from is named with the commit it was read at.

`hfexport.testing.corpus_gen` builds a type from its tester config first (falling back to its own shrinking)
and adds it to every type as the `@tester` variant (`hfexport.testing.corpus_variants`).
"""

from __future__ import annotations

import ast
import operator
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


class Unknown(Exception):
    """A value this evaluator does not compute (a tensor, a call into test helpers)."""


@dataclass
class ConfigCall:
    """A call of a config class with evaluated keywords: a nested config becomes a dict naming its model_type."""

    class_name: str
    kwargs: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        model_type = _model_type(self.class_name)
        head = {"model_type": model_type} if model_type else {}
        return {**head, **{k: _plain(v) for k, v in self.kwargs.items()}}


@dataclass
class ClassRef:
    """A class named in a tester (`config_class = LlamaConfig`, `base_model_class = LlamaModel`)."""

    name: str


def _plain(value: Any) -> Any:
    if isinstance(value, ConfigCall):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, ClassRef):
        raise Unknown(f"class {value.name} as a value")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise Unknown(type(value).__name__)


def _transformers_attr(name: str) -> Any:
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None


def _is_config_class(name: str) -> bool:
    from transformers import PretrainedConfig

    cls = _transformers_attr(name)
    return isinstance(cls, type) and issubclass(cls, PretrainedConfig)


def _model_type(class_name: str) -> str | None:
    cls = _transformers_attr(class_name)
    return getattr(cls, "model_type", None) or None


def _config_of(ref: Any) -> str | None:
    """The config class name of a ClassRef to a config or a model class."""
    if not isinstance(ref, ClassRef):
        return None
    if _is_config_class(ref.name):
        return ref.name
    cls = _transformers_attr(ref.name)
    config = getattr(cls, "config_class", None)
    return config.__name__ if isinstance(config, type) else None


@dataclass
class Tester:
    """One tester class evaluated: its attributes after `__init__`, and the config its `get_config` makes."""

    name: str
    attrs: dict[str, Any] = field(default_factory=dict)


class Module:
    """The classes of one test file plus those of the shared base files, by name."""

    def __init__(self, tree: ast.Module, bases: dict[str, ast.ClassDef]) -> None:
        self.classes = dict(bases)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
        self.own = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]

    def chain(self, name: str) -> list[ast.ClassDef]:
        """The class and its known bases, the class first (single inheritance is all testers use)."""
        out, seen = [], set()
        while name in self.classes and name not in seen:
            seen.add(name)
            node = self.classes[name]
            out.append(node)
            bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in self.classes]
            if not bases:
                break
            name = bases[0]
        return out

    def method(self, name: str, method: str) -> tuple[ast.FunctionDef, str] | None:
        for node in self.chain(name):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item, node.name
        return None


class Evaluator:
    """Evaluates a tester's `__init__` and `get_config` over values only."""

    def __init__(self, module: Module, name: str) -> None:
        self.module = module
        self.name = name
        self.attrs: dict[str, Any] = {}

    # -- expressions ---------------------------------------------------------------------------------------------

    def expr(self, node: ast.expr, env: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in {"True", "False", "None"}:
                return {"True": True, "False": False, "None": None}[node.id]
            if node.id[:1].isupper():
                return ClassRef(node.id)
            raise Unknown(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in self.attrs:
                    return self.attrs[node.attr]
                raise Unknown(f"self.{node.attr}")
            base = self.expr(node.value, env)
            if isinstance(base, ConfigCall):
                base = base.kwargs
            if isinstance(base, dict) and node.attr in base:  # a (nested) config's field
                return base[node.attr]
            raise Unknown(ast.unparse(node))
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.expr(e, env) for e in node.elts]
        if isinstance(node, ast.Dict):
            out: dict[str, Any] = {}
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None:
                    merged = self.expr(value, env)
                    if isinstance(merged, ConfigCall):
                        merged = merged.as_dict()
                    if not isinstance(merged, dict):
                        raise Unknown("** of a non-dict")
                    out.update(merged)
                else:
                    out[self.expr(key, env)] = self.expr(value, env)
            return out
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self.expr(node.left, env), self.expr(node.right, env)
            if (isinstance(left, list) and isinstance(right, (int, list))) or isinstance(node.op, ast.Add):
                try:
                    return _BINOPS[type(node.op)](left, right)
                except TypeError as exc:
                    raise Unknown(str(exc)) from None
            if not all(isinstance(v, (int, float)) for v in (left, right)):
                raise Unknown("arithmetic on non-numbers")
            return _BINOPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp):
            value = self.expr(node.operand, env)
            if isinstance(node.op, ast.USub):
                return -value
            if isinstance(node.op, ast.Not):
                return not value
            raise Unknown("unary")
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            return _COMPARE[type(node.ops[0])](self.expr(node.left, env), self.expr(node.comparators[0], env))
        if isinstance(node, ast.IfExp):
            return self.expr(node.body if self.expr(node.test, env) else node.orelse, env)
        if isinstance(node, ast.BoolOp):
            values = [self.expr(v, env) for v in node.values]
            if isinstance(node.op, ast.And):
                return all(values) and values[-1]
            return next((v for v in values if v), values[-1])
        if isinstance(node, ast.Subscript):
            base = self.expr(node.value, env)
            index = self.expr(node.slice, env) if not isinstance(node.slice, ast.Slice) else None
            if index is None:
                raise Unknown("slice")
            try:
                return base[index]
            except (KeyError, IndexError, TypeError) as exc:
                raise Unknown(str(exc)) from None
        if isinstance(node, ast.Call):
            return self.call(node, env)
        raise Unknown(type(node).__name__)

    def keywords(self, node: ast.Call, env: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Evaluated keywords of a call (and `**` dicts); the names that could not be evaluated."""
        kwargs: dict[str, Any] = {}
        dropped: list[str] = []
        for kw in node.keywords:
            try:
                value = self.expr(kw.value, env)
            except Unknown:
                dropped.append(kw.arg or f"**{ast.unparse(kw.value)}")
                continue
            if kw.arg is None:
                if isinstance(value, ConfigCall):
                    value = value.kwargs
                if not isinstance(value, dict):
                    dropped.append(f"**{ast.unparse(kw.value)}")
                    continue
                kwargs.update(value)
            else:
                kwargs[kw.arg] = value
        return kwargs, dropped

    def call(self, node: ast.Call, env: dict[str, Any]) -> Any:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "dict" and not node.args:
            return self.keywords(node, env)[0]
        if isinstance(func, ast.Name) and func.id in {"list", "tuple"} and len(node.args) == 1:
            return list(self.expr(node.args[0], env))
        if isinstance(func, ast.Name) and func.id in {"int", "float", "min", "max", "len"}:
            args = [self.expr(a, env) for a in node.args]
            return {"int": int, "float": float, "min": min, "max": max, "len": len}[func.id](*args)
        target = self.expr(func, env) if not isinstance(func, ast.Attribute) or func.attr != "from_dict" else None
        if isinstance(func, ast.Attribute) and func.attr == "from_dict":
            target = self.expr(func.value, env)
            config = _config_of(target)
            if config and len(node.args) == 1:
                value = self.expr(node.args[0], env)
                return ConfigCall(config, dict(value.kwargs if isinstance(value, ConfigCall) else value))
        config = _config_of(target) if isinstance(target, ClassRef) else None
        if config:
            kwargs, _ = self.keywords(node, env)
            return ConfigCall(config, kwargs)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            found = self.module.method(self.name, func.attr)
            if found and not node.args and not node.keywords:
                return self.run(found[0], {})
        raise Unknown(ast.unparse(func))

    # -- statements ----------------------------------------------------------------------------------------------

    def run(self, func: ast.FunctionDef, bound: dict[str, Any], owner: str | None = None) -> Any:
        """Run a method body over values: assignments to locals and to `self.*`, `super().__init__`, ifs whose
        test evaluates, and the first `return`. Statements it cannot evaluate are skipped."""
        env = self.defaults(func)
        env.update(bound)
        return self.block(func.body, env, owner)

    def defaults(self, func: ast.FunctionDef) -> dict[str, Any]:
        env: dict[str, Any] = {}
        args = func.args.args
        for arg, default in zip(args[len(args) - len(func.args.defaults) :], func.args.defaults, strict=True):
            try:
                env[arg.arg] = self.expr(default, {})
            except Unknown:
                continue
        for arg, default in zip(func.args.kwonlyargs, func.args.kw_defaults, strict=True):
            if default is not None:
                try:
                    env[arg.arg] = self.expr(default, {})
                except Unknown:
                    continue
        return env

    def block(self, body: list[ast.stmt], env: dict[str, Any], owner: str | None) -> Any:
        for stmt in body:
            if isinstance(stmt, ast.Return):
                return self.expr(stmt.value, env) if stmt.value is not None else None
            if isinstance(stmt, ast.If):
                try:
                    test = self.expr(stmt.test, env)
                except Unknown:
                    test = _torch_available(stmt.test)
                    if test is None:
                        continue
                result = self.block(stmt.body if test else stmt.orelse, env, owner)
                if result is not None:
                    return result
                continue
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if stmt.value is None:
                    continue
                try:
                    value = self.expr(stmt.value, env)
                except Unknown:
                    continue
                for target in targets:
                    self.assign(target, value, env)
                continue
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                self.super_init(stmt.value, env, owner)
        return None

    def assign(self, target: ast.expr, value: Any, env: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            if target.value.id == "self":
                self.attrs[target.attr] = value
            elif isinstance(env.get(target.value.id), ConfigCall):
                env[target.value.id].kwargs[target.attr] = value  # config.x = v after the config call
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            holder = env.get(target.value.id)
            try:
                key = self.expr(target.slice, env)
            except Unknown:
                return
            if isinstance(holder, dict):
                holder[key] = value
            elif isinstance(holder, ConfigCall):
                holder.kwargs[key] = value

    def super_init(self, call: ast.Call, env: dict[str, Any], owner: str | None) -> None:
        """`super().__init__(parent, k=v, **kwargs)`: run the base class's `__init__` with those values."""
        func = call.func
        is_super = (
            isinstance(func, ast.Attribute)
            and func.attr == "__init__"
            and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "super"
        )
        if not is_super or owner is None:
            return
        chain = self.module.chain(owner)
        if len(chain) < 2:
            return
        base = chain[1].name
        kwargs, _ = self.keywords(call, env)
        found = self.module.method(base, "__init__")
        if found:
            self.run(found[0], kwargs, found[1])

    # -- the tester ----------------------------------------------------------------------------------------------

    def init(self) -> None:
        """Class attributes from the root base down, then `__init__` with its defaults."""
        for node in reversed(self.module.chain(self.name)):
            names: dict[str, Any] = {}  # a class attribute is a name bound in the class body
            self.block([s for s in node.body if not isinstance(s, ast.FunctionDef)], names, None)
            self.attrs.update(names)
        found = self.module.method(self.name, "__init__")
        if found:
            self.run(found[0], {}, found[1])

    def config(self) -> tuple[str, dict[str, Any], list[str]] | None:
        """(config class, kwargs, dropped keyword names) of `get_config`, or None if it is not readable."""
        found = self.module.method(self.name, "get_config")
        if found is None:
            return None
        func = found[0]
        if "signature(" in ast.unparse(func):
            # CausalLMModelTester-style: every tester attribute the config class's __init__ names, plus forced.
            config = _config_of(self.attrs.get("config_class")) or _config_of(self.attrs.get("base_model_class"))
            if config is None:
                return None
            import inspect

            names = set(inspect.signature(_transformers_attr(config).__init__).parameters)
            names |= set(self.attrs.get("forced_config_args") or [])
            kwargs = {k: v for k, v in self.attrs.items() if k in names and k != "self"}
            return config, kwargs, []
        env: dict[str, Any] = {}
        dropped: list[str] = []
        for stmt in ast.walk(func):
            if isinstance(stmt, ast.Call):
                target = self._callee(stmt.func, env)
                if target and stmt.keywords:
                    dropped += self.keywords(stmt, env)[1]
        try:
            value = self.block(func.body, env, found[1])
        except Unknown:
            return None
        if isinstance(value, ConfigCall):
            return value.class_name, value.kwargs, sorted(set(dropped))
        return None

    def _callee(self, func: ast.expr, env: dict[str, Any]) -> str | None:
        try:
            return _config_of(self.expr(func, env))
        except Unknown:
            return None


def _torch_available(test: ast.expr) -> bool | None:
    """`if is_torch_available():` (and the like) around class attributes: true here, torch is installed."""
    text = ast.unparse(test)
    return True if text.startswith("is_") and text.endswith("_available()") else None


def _tester_names(module: Module) -> list[str]:
    names = []
    for name in module.own:
        node = module.classes[name]
        if not name.endswith("Tester") or name.endswith(("ConfigTester", "ProcessorTester")):
            continue
        if module.method(name, "get_config") is None:
            continue
        if not any(isinstance(i, ast.FunctionDef) and i.name == "__init__" for i in node.body) and not node.body:
            continue
        names.append(name)
    return names


def base_classes(tests: Path) -> dict[str, ast.ClassDef]:
    """The tester base classes of the suite (`tests/*_tester.py`, ...): every class of tests/*.py."""
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(tests.glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Tester"):
                found[node.name] = node
    return found


def extract_file(path: Path, bases: dict[str, ast.ClassDef], where: str) -> list[dict[str, Any]]:
    """Every tester of one test file whose config is readable."""
    try:
        module = Module(ast.parse(path.read_text()), bases)
    except SyntaxError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return []
    out = []
    for name in _tester_names(module):
        evaluator = Evaluator(module, name)
        try:
            evaluator.init()
            found = evaluator.config()
        except (Unknown, RecursionError):
            found = None
        if found is None:
            continue
        config, kwargs, dropped = found
        model_type = _model_type(config)
        if not model_type:
            continue
        plain: dict[str, Any] = {}
        for key, value in kwargs.items():
            try:
                plain[key] = _plain(value)
            except Unknown:
                dropped.append(key)
        out.append(
            {
                "model_type": model_type,
                "tester": f"{where}::{name}",
                "config_class": config,
                "kwargs": plain,
                "dropped": sorted(set(dropped)),
            }
        )
    return out


def extract(tests: Path, commit: str) -> dict[str, list[dict[str, Any]]]:
    """`{model_type: [tester record, ...]}` over `tests/models/*/test_modeling_*.py`."""
    bases = base_classes(tests)
    result: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(tests.glob("models/*/test_modeling_*.py")):
        where = f"tests/{path.relative_to(tests)}" + (f"@{commit}" if commit else "")
        for record in extract_file(path, bases, where):
            result.setdefault(record.pop("model_type"), []).append(record)
    return result
