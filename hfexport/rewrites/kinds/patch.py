"""Model patches and the reversible context that installs them for one trace.

Two forms, each scoped so that nothing outside the export ever sees a patch (DESIGN.md):

- `MethodPatch`: a replacement bound on the model's own module instances (an instance attribute that
  shadows the class method), never on the class, so other models of the same class are untouched; the
  bound replacement runs only in the thread that installed it, so another thread that calls the very
  instance being exported runs the original method.
- `ModuleFunctionPatch`: replaces a module-level function by a gate that calls the replacement only in
  the context that installed it (a `ContextVar`); every other thread keeps the original behaviour.

Every replacement receives the original callable first and may return `NOT_APPLICABLE` to decline a
call; only calls it accepts are counted as hits. Counting is done here, never in rule bodies. A rule may give one
replacement per backend (`PerBackend`); the export installs the one of its backend.
"""

from __future__ import annotations

import builtins
import contextvars
import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hfexport.rewrites.rule import PerBackend, Rule, for_backend


class _NotApplicable:
    _instance: _NotApplicable | None = None

    def __new__(cls) -> _NotApplicable:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_APPLICABLE"


NOT_APPLICABLE = _NotApplicable()
"""Returned by a replacement to decline one call: the original runs and no hit is counted."""

HitCallback = Callable[[str], None]
_DECLINED = "its replacement returned NOT_APPLICABLE"


def _declined(rule_id: str) -> None:
    # A replacement gives no reason with NOT_APPLICABLE; that it was called and declined is still worth
    # telling from "never called". Not under TorchDynamo (strict=True), which would trace the bookkeeping.
    if not torch.compiler.is_dynamo_compiling():
        from hfexport.rewrites.declines import note_declined

        note_declined(rule_id, _DECLINED)


@dataclass
class MethodPatch(Rule):
    """Replace `Class.method` on the matching module instances of the model being exported.

    `target` is a dotted path `"package.module.Class.method"`, or a predicate over modules together
    with `method`. `replacement(original, self, *args, **kwargs)`.
    """

    target: str | Callable[[torch.nn.Module], bool] = ""
    # One callable, or one per backend (`PerBackend`): the export installs its backend's.
    replacement: Callable[..., Any] | PerBackend | None = None
    method: str | None = None
    # Also installed while `decompose_for_generation` records generate's calls (`engine.recording`): for a patch
    # that moves state eager keeps on modules into the cache generate carries, so the recorded samples hold it.
    records: bool = False
    stages: ClassVar[tuple[str, ...]] = ("patch",)
    phase: str = field(init=False, default="trace")


@dataclass
class ModuleFunctionPatch(Rule):
    """Gate a module-level function `"package.module.function"`: `replacement(original, *args, **kwargs)`.

    `target` may name several copies of one function (transformers copies code across model families);
    each is gated only when the model being exported has a submodule defined in that module. Patch the
    module where the caller looks the name up (a `from x import f` copy is a separate name).
    """

    target: str | tuple[str, ...] = ""
    # One callable, or one per backend (`PerBackend`): the export installs its backend's.
    replacement: Callable[..., Any] | PerBackend | None = None
    # The target names a builtin (`len`) as the module's callers see it: the gate is set as a module global that
    # shadows the builtin while installed, and is deleted again on release.
    shadows_builtin: bool = False
    # For shared helpers (e.g. transformers.integrations) that no model class is defined next to: says
    # whether the model uses the function, instead of the module-of-a-submodule check.
    applies: Callable[[torch.nn.Module], bool] | None = None
    # Also installed while `decompose_for_generation` records generate's calls (`engine.recording`): for a patch
    # that changes the cache generate builds, so the recorded samples hold the cache the program takes.
    records: bool = False
    stages: ClassVar[tuple[str, ...]] = ("patch",)
    phase: str = field(init=False, default="trace")


# A TorchFunctionMode-based kind was removed: no rule used it (issue #18, unused kinds go).
PatchRule = MethodPatch | ModuleFunctionPatch


def resolve(path: str, builtin: bool = False) -> tuple[Any, str] | str:
    """Resolve a dotted path to (owner object, attribute name), or return why it cannot be resolved.

    With `builtin`, `package.module.len` resolves to (the module, "len") when `len` is a builtin the module does not
    define itself: a name its functions look up in the builtins."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name, None)
            if owner is None:
                return f"{'.'.join(parts[: split + 1])} does not exist in the installed packages"
        if builtin and isinstance(owner, types.ModuleType) and hasattr(builtins, parts[-1]):
            return owner, parts[-1]
        if not hasattr(owner, parts[-1]):
            return f"{path} does not exist in the installed packages"
        return owner, parts[-1]
    return f"no module of {path} is importable"


def _is_unimported_module(name: str) -> bool:
    """`name` is a module not imported yet (found by its spec, which imports its parent packages only)."""
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --- module-level gates: one gate per (module, name) for the whole process, refcounted -------------
_GATES_LOCK = threading.Lock()
_GATES: dict[tuple[int, str], _Gate] = {}
_ACTIVE: contextvars.ContextVar[dict[tuple[int, str], tuple[tuple[str, Callable[..., Any], HitCallback], ...]]] = (
    contextvars.ContextVar("hfexport_active_module_patches", default={})  # noqa: B039 - never mutated
)


@torch.compiler.assume_constant_result
def _in_thread(ident: int) -> bool:
    # assume_constant_result: TorchDynamo (strict=True) calls this at trace time and bakes in the answer
    # instead of tracing into `threading`; eagerly it is a plain call, evaluated in the calling thread.
    return threading.get_ident() == ident


@dataclass
class _Gate:
    owner: Any
    name: str
    original: Callable[..., Any]
    users: int = 0
    # The gate shadows a builtin the owner module does not define: released by deleting the global.
    shadowed_builtin: bool = False


def _make_gate(key: tuple[int, str], original: Callable[..., Any]) -> Callable[..., Any]:
    def gate(*args: Any, **kwargs: Any) -> Any:
        for rule_id, replacement, on_hit in _ACTIVE.get().get(key, ()):
            result = replacement(original, *args, **kwargs)
            if result is not NOT_APPLICABLE:
                on_hit(rule_id)
                return result
            _declined(rule_id)
        return original(*args, **kwargs)

    gate.__wrapped__ = original  # type: ignore[attr-defined]
    gate.__name__ = getattr(original, "__name__", "gate")
    return gate


class PatchSession:
    """Installs patches and attribute overrides, and undoes all of them, in reverse order, on exit.

    Restoration runs even when the body raises, and every undo step runs even if an earlier one fails.
    """

    def __init__(self, on_hit: HitCallback, on_rule: Callable[[str | None], None] | None = None) -> None:
        self._on_hit = on_hit
        # Told which rule's replacement is running (None when it returned), so a failure inside one names it.
        self._on_rule = on_rule
        self._undo: list[Callable[[], None]] = []
        self._module_handlers: dict[tuple[int, str], list[tuple[str, Callable[..., Any], HitCallback]]] = {}

    # -- generic reversible attribute override, also used by the frontend for model state ---------
    def setattr(self, obj: Any, name: str, value: Any) -> None:
        store = obj.__dict__ if hasattr(obj, "__dict__") else {}
        had_own, previous = name in store, store.get(name)

        def undo() -> None:
            if had_own:
                setattr(obj, name, previous)
            elif name in obj.__dict__:
                delattr(obj, name)

        setattr(obj, name, value)
        self._undo.append(undo)

    def call_on_exit(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # -- installing rules: each returns None when installed, or why the rule does not apply -------
    def install(self, rule: PatchRule, model: torch.nn.Module, backend: str | None = None) -> str | None:
        """Install `rule` on `model` for an export to `backend` (whose replacement a `PerBackend` one gives; None:
        the rule's first backend)."""
        replacement = for_backend(rule.replacement, backend or rule.meta.backends[0])
        if isinstance(rule, MethodPatch):
            return self._install_method(rule, model, replacement)
        if isinstance(rule, ModuleFunctionPatch):
            return self._install_module_function(rule, model, replacement)
        raise TypeError(f"not a patch rule: {rule!r}")

    def _install_method(self, rule: MethodPatch, model: torch.nn.Module, replacement: Callable[..., Any]) -> str | None:
        if callable(rule.target):
            predicate, method = rule.target, rule.method
            # Said in words, not by the predicate's (private) name: the report is read by users.
            models = ", ".join(rule.meta.models)
            described = "module this rule is for" + (f" ({models})" if models else "")
        else:
            resolved = resolve(rule.target)
            if isinstance(resolved, str):
                return resolved
            cls, method = resolved
            if not isinstance(cls, type):
                return f"{rule.target}: owner is not a class"
            class_function = cls.__dict__.get(method)
            if not isinstance(class_function, types.FunctionType):
                return f"{rule.target} is not a plain method"

            # Subclasses that override the method keep their own code; patch only inheritors.
            def predicate(module: torch.nn.Module, _cls=cls, _fn=class_function) -> bool:
                return isinstance(module, _cls) and getattr(type(module), method, None) is _fn

            described = f"instances of {cls.__qualname__}"
        assert method is not None, f"rule {rule.id}: a predicate target needs `method`"
        matched = [m for m in model.modules() if predicate(m)]
        if not matched:
            return f"the model has no {described}"
        for module in matched:
            original = getattr(module, method)
            wrapper = self._method_wrapper(rule.id, replacement, original)
            self.setattr(module, method, types.MethodType(wrapper, module))
        return None

    def _running(self, rule_id: str, replacement: Callable[..., Any] | None) -> Callable[..., Any]:
        """`replacement`, reporting to `on_rule` while it runs; after an exception the rule stays reported."""
        on_rule = self._on_rule
        if on_rule is None or replacement is None:
            return replacement  # type: ignore[return-value]

        def running(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_dynamo_compiling():
                # strict=True: TorchDynamo would trace the bookkeeping into the graph's side effects.
                return replacement(*args, **kwargs)
            on_rule(rule_id)
            result = replacement(*args, **kwargs)
            on_rule(None)
            return result

        return running

    def _method_wrapper(
        self, rule_id: str, replacement: Callable[..., Any], original: Callable[..., Any]
    ) -> Callable[..., Any]:
        replacement, on_hit = self._running(rule_id, replacement), self._on_hit
        owner = threading.get_ident()

        def patched(module_self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not _in_thread(owner):
                # Another thread calling the instance being exported: the original method.
                return original(*args, **kwargs)
            result = replacement(original, module_self, *args, **kwargs)
            if result is NOT_APPLICABLE:
                _declined(rule_id)
                return original(*args, **kwargs)
            on_hit(rule_id)
            return result

        return patched

    def _install_module_function(
        self, rule: ModuleFunctionPatch, model: torch.nn.Module, replacement: Callable[..., Any]
    ) -> str | None:
        targets = (rule.target,) if isinstance(rule.target, str) else rule.target
        used_modules = {type(m).__module__ for m in model.modules()}
        reasons = []
        for target in targets:
            module_name = target.rpartition(".")[0]
            if rule.applies is None and module_name not in used_modules and _is_unimported_module(module_name):
                # What resolving would conclude below, without importing the module (a modeling file the model
                # does not use: importing the dozens a rule may list took seconds of every export).
                reasons.append(f"the model uses no module of {module_name}")
                continue
            resolved = resolve(target, builtin=rule.shadows_builtin)
            if isinstance(resolved, str):
                reasons.append(resolved)
                continue
            owner, name = resolved
            if rule.applies is not None:
                if not rule.applies(model):
                    reasons.append(f"the model does not use {target}")
                    continue
            else:
                # A function of a module, or a method of a class (a cache class's): gated only for a model that
                # uses that module, or every strict export after the module's import would refuse the gate.
                home = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(owner, "__module__", None)
                if home not in used_modules:
                    reasons.append(f"the model uses no module of {home}")
                    continue
            self._gate(owner, name, rule.id, replacement)
        return None if len(reasons) < len(targets) else _joined(reasons)

    def _gate(self, owner: Any, name: str, rule_id: str, replacement: Callable[..., Any]) -> None:
        key = (id(owner), name)
        with _GATES_LOCK:
            gate = _GATES.get(key)
            if gate is None:
                shadowed = isinstance(owner, types.ModuleType) and name not in vars(owner) and hasattr(builtins, name)
                original = getattr(builtins, name) if shadowed else getattr(owner, name)
                gate = _Gate(owner, name, original, shadowed_builtin=shadowed)
                setattr(owner, name, _make_gate(key, gate.original))
                _GATES[key] = gate
            gate.users += 1
        running = self._running(rule_id, replacement)
        self._module_handlers.setdefault(key, []).append((rule_id, running, self._on_hit))
        self._undo.append(lambda: _release_gate(key))

    @property
    def gated_rule_ids(self) -> list[str]:
        """Ids of the installed module-function patches (their gates read a ContextVar)."""
        return sorted({rule_id for handlers in self._module_handlers.values() for rule_id, _, _ in handlers})

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make the module-function patches visible, in this context only."""
        token = _ACTIVE.set({**_ACTIVE.get(), **{k: tuple(v) for k, v in self._module_handlers.items()}})
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def restore(self) -> None:
        errors: list[BaseException] = []
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as exc:
                errors.append(exc)
        self._module_handlers.clear()
        if errors:
            raise RuntimeError(f"hfexport failed to restore {len(errors)} patch(es)") from errors[0]

    def __enter__(self) -> PatchSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.restore()


def _release_gate(key: tuple[int, str]) -> None:
    with _GATES_LOCK:
        gate = _GATES[key]
        gate.users -= 1
        if gate.users == 0:
            if gate.shadowed_builtin:
                delattr(gate.owner, gate.name)
            else:
                setattr(gate.owner, gate.name, gate.original)
            del _GATES[key]


def installed_gates() -> list[str]:
    """Module functions currently gated (for leak checks in tests and the audit)."""
    with _GATES_LOCK:
        return [f"{getattr(g.owner, '__name__', g.owner)}.{g.name}" for g in _GATES.values()]


def _joined(reasons: list[str]) -> str:
    """One reason for every target a module-function rule skipped: the modules the model does not use in one
    list ("the model uses no module of a, b"), not one sentence each."""
    prefix = "the model uses no module of "
    modules = [r.removeprefix(prefix) for r in reasons if r.startswith(prefix)]
    others = [r for r in dict.fromkeys(reasons) if not r.startswith(prefix)]
    return "; ".join([*([prefix + ", ".join(dict.fromkeys(modules))] if modules else []), *others])
