"""The runtime driver `generate` keeps for each components object, and what it is made from.

One driver is kept per live components object (an `export_for_generation` result or a loaded artifact), in
this module (`_SESSIONS`), never on the object itself, so sessions, compiled models and loaded programs are made
once and reused across calls. `open_session` finds or makes it: for a loaded artifact from the backend and
generation layout it records (read by duck typing: `SavedGeneration`), for an in-memory export from its
programs, `samples` and `spec`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hfexport.core.errors import InputError
from hfexport.formats import format_of
from hfexport.generation_spec import GenerationSpec
from hfexport.runtime.drivers import Driver, RuntimeOptions, backend
from hfexport.runtime.drivers.base import SavedComponent


@runtime_checkable
class SavedGeneration(Protocol):
    """A loaded `export_for_generation` artifact as `generate` reads it (`hfexport.load` returns one): the
    format it records, its generation layout, and its components. Duck-typed, since the artifacts layer sits
    above the runtime."""

    export_format: str
    components: Mapping[str, SavedComponent]

    @property
    def generation(self) -> GenerationSpec | None: ...


@dataclass
class _Session:
    """The driver of one components object, and the spec it was made for."""

    spec: GenerationSpec
    driver: Driver
    options: RuntimeOptions | None = None


class _PerObject:
    """Values kept per live object, by identity, without writing onto the object or keeping it alive.

    A `WeakKeyDictionary` needs hashable keys; a components dict and a `LoadedExport` are not. An object that
    cannot be referenced weakly (a plain dict) keeps nothing: each call builds its driver afresh.
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, owner: Any) -> Any:
        item = self._items.get(id(owner))
        return item[1] if item is not None and item[0]() is owner else None

    def set(self, owner: Any, value: Any) -> None:
        key = id(owner)
        try:
            ref = weakref.ref(owner, lambda _, key=key: self._items.pop(key, None))
        except TypeError:
            return
        self._items[key] = (ref, value)


_SESSIONS = _PerObject()


def generation_driver(components: Any) -> Driver | None:
    """The runtime driver `generate` keeps for `components` (its sessions, compiled models or loaded programs),
    or None before the first call: what profilers read counters from."""
    session = _SESSIONS.get(components)
    return session.driver if session is not None else None


def is_saved(components: Any) -> bool:
    return isinstance(components, SavedGeneration) and not isinstance(components, Mapping)


def _source(components: Any, spec: GenerationSpec | None) -> tuple[dict[str, Any], dict[str, Any], str, GenerationSpec]:
    """(native programs, sample kwargs, backend, spec) of what `generate` was given.

    A loaded artifact: its backend says what the driver takes from each saved component (Dynamo: the loaded
    `ExportedProgram`, whose saved example inputs carry the cache layout; ONNX / OpenVINO: the model file).
    An in-memory `export_for_generation` result: its programs, `samples` and `spec`.
    """
    if is_saved(components):
        name = components.export_format
        spec = spec or components.generation
        if spec is None:
            where = getattr(components, "directory", "the artifact")
            raise InputError(f"{where} is not an export_for_generation artifact (no generation layout)")
        natives: dict[str, Any] = {}
        samples: dict[str, Any] = {}
        for component, saved in components.components.items():
            natives[component], samples[component] = backend(name).for_generation(saved)
        return natives, samples, name, spec
    spec = spec or getattr(components, "spec", None)
    samples = getattr(components, "samples", None)
    if spec is None or samples is None:
        raise InputError("components carry no generation spec: pass the result of export_for_generation")
    # The runtime components (a multimodal model's features and prefill) are carried beside the dict.
    programs = {**components, **(getattr(components, "runtime_components", None) or {})}
    backends = set()
    for program in programs.values():
        try:
            backends.add(format_of(program))
        except TypeError:
            kind = f"{type(program).__module__}.{type(program).__name__}"
            raise InputError(f"no generation runtime for {kind}") from None
    if len(backends) != 1:
        raise InputError(f"components come from several backends: {sorted(backends)}")
    return programs, samples, backends.pop(), spec


def _check_runtime_components(natives: Mapping[str, Any], spec: GenerationSpec) -> None:
    missing = [name for name in spec.runtime_components if name not in natives]
    if missing:
        raise InputError(
            f"this export has no {missing}, which generate() runs besides the documented components: export "
            "with runtime_components=True (the default), or run the documented components in your own loop"
        )


def open_session(
    components: Any, spec: GenerationSpec | None, options: RuntimeOptions | None = None
) -> tuple[Driver, dict[str, Any], GenerationSpec]:
    """The driver of `components`, its samples and spec: one driver per live components object and spec, so
    sessions, compiled models and loaded programs are made once and reused across calls. `options` (not None)
    other than the kept driver's opens the runtimes again with them."""
    session = _SESSIONS.get(components)
    if spec is None:
        # A loaded artifact rebuilds its spec from the manifest on each read: the first one read is kept.
        spec = (
            (session.spec if session is not None else None)
            if is_saved(components)
            else getattr(components, "spec", None)
        )
    if session is not None and session.spec is spec and (options is None or options is session.options):
        return session.driver, session.driver.samples, spec
    natives, samples, name, spec = _source(components, spec)
    _check_runtime_components(natives, spec)
    driver = backend(name).driver(natives, spec, samples, options)
    _SESSIONS.set(components, _Session(spec, driver, options))
    return driver, samples, spec
