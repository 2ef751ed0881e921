"""What every backend driver shares: the step record, the driver interface, and the runtime record.

A *driver* runs the components of one backend for `generate` and owns the cache between steps. A backend's
*runtime* (`Runtime`, one per format, in `hfexport/backends/<name>/driver.py`, named by the descriptor) bundles the
driver with how a saved component of that format is opened and run (`hfexport.load(...).run`), what `generate` takes
from one, and the devices it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from hfexport.core.errors import InputError
from hfexport.generation_spec import CacheLeaf, GenerationSpec, layout_mismatch
from hfexport.naming import CACHE_ALIASES, INPUT_PREFIX, OUTPUT_PREFIX, leaf_names


@dataclass(frozen=True)
class RuntimeOptions:
    """Options for the runtimes a driver opens, for profiling or tuning; None keeps hfexport's defaults.

    `onnx_session_options`: an `onnxruntime.SessionOptions` each ONNX Runtime session of the components is created
    with (e.g. `enable_profiling` with `profile_file_prefix`; one object serves every component, so give a run
    of several components distinct prefixes yourself if their files must not share a name).
    `onnx_prepacking`: whether ONNX Runtime's MatMul/Gemm kernels pack their weights (the default). Packed
    weights are a copy per session, so the prefill and decode sessions of an artifact each hold their own; False
    (`session.disable_prepacking`) makes the sessions share one copy of every weight of the artifact's weights
    file, for slower steps (docs/cli.md, after the table of artifact layouts). Applies to the sessions hfexport opens
    (not with `onnx_session_options`, which are used as given).
    `openvino_properties`: compile properties for each OpenVINO component, over hfexport's f32 inference hint
    (e.g. `{"PERF_COUNT": "YES"}`, then `request.get_profiling_info()` per call). A backend ignores the other's.
    """

    onnx_session_options: Any = None
    onnx_prepacking: bool = True
    openvino_properties: Mapping[str, Any] | None = None


@dataclass
class Step:
    """One call: the new tokens, the mask the component takes, their positions."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    # Inputs that stay the same every step (an encoder-decoder's encoder output and encoder mask).
    extra: dict[str, Any] = field(default_factory=dict)


def initial_leaf(leaf: CacheLeaf, spec: GenerationSpec, batch: int, max_cache_len: int | None) -> torch.Tensor:
    """A zero cache tensor of `leaf`'s recorded shape, resized to `batch` and (static cache) `max_cache_len`."""
    shape = list(leaf.shape)
    if shape and shape[0] == spec.sample_batch:
        shape[0] = batch
    if spec.static_cache and max_cache_len and spec.max_cache_len and len(shape) >= 3:
        shape = [max_cache_len if (i >= 2 and s == spec.max_cache_len) else s for i, s in enumerate(shape)]
    return torch.zeros(shape, dtype=getattr(torch, leaf.dtype))  # recorded as torch names


class Driver:
    """Runs components of one backend and owns the cache between steps.

    A driver opens its runtimes (modules, sessions, compiled models) in `__init__` and keeps no reference to
    the components object it was made from, so `generate` can keep one driver per live components object
    without keeping that object alive.
    """

    # Whether the runtime takes flat tensors by input name (else the forward's own pytrees: ModelOutputs, caches).
    feeds_by_name: ClassVar[bool] = False
    # Whether the components run on torch's own intra-op threads (an ExportedProgram), not a runtime's.
    runs_on_torch_threads: ClassVar[bool] = False

    def __init__(
        self,
        components: Mapping[str, Any],
        spec: GenerationSpec,
        samples: Mapping[str, Any],
        options: RuntimeOptions | None = None,
    ) -> None:
        fed = sorted(name for name, c in spec.components.items() if c.constants)
        if fed:
            # Exports before the graphs took tensors only kept generate's Python arguments as program inputs.
            raise InputError(
                f"components {fed} take Python-valued inputs ({spec.components[fed[0]].constants}): they come from "
                "an older hfexport; export again, and every graph takes tensors and the cache only"
            )
        self.names = tuple(components)
        self.spec = spec
        self.samples = samples
        self.options = options or RuntimeOptions()
        self.open_runtimes(components)

    @contextmanager
    def running(self, torch_threads: int | None = 1) -> Iterator[None]:
        """The context `generate` runs its loop in: torch's intra-op threads set to `torch_threads` (None: left as
        they are) while a runtime with its own threads runs the components, then restored.

        Why: between two calls the loop does small torch work (the copies of the cache tensors the runtime returns,
        masks, the next token's argmax). At torch's default thread count each such op wakes torch's OpenMP
        workers, which then spin-wait for the next parallel region on the cores the runtime's own threads
        (XNNPACK's pthreadpool, ONNX Runtime's and OpenVINO's pools) need: in the 30-layer ExecuTorch decode
        (`perf`, docs/benchmarks/history/) libgomp had 13-19 % of the samples. With 1 thread, decode at 8
        layers ran 1.07x (ONNX Runtime), 1.17x (OpenVINO stateful) and 1.28x (ExecuTorch) as fast, tokens equal
        (`tools/ab_torch_threads.py`).
        """
        before = torch.get_num_threads()
        if self.runs_on_torch_threads or torch_threads is None or torch_threads == before:
            yield
            return
        torch.set_num_threads(torch_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        """Open each component's runtime once (sessions, compiled models, loaded programs), with `self.options`."""

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        raise NotImplementedError

    def run(self, name: str, step: Step) -> torch.Tensor:
        """Run component `name` on `step`; return its logits `[batch, query or 1, vocab]`; update the cache."""
        raise NotImplementedError

    def _kwargs(self, name: str, step: Step) -> dict[str, Any]:
        spec = self.spec.components[name]
        ids_key = "decoder_input_ids" if "decoder_input_ids" in spec.inputs else "input_ids"
        kwargs: dict[str, Any] = {ids_key: step.input_ids, "position_ids": step.position_ids}
        if spec.mask_rank is not None:
            kwargs["attention_mask"] = step.attention_mask
        kwargs.update(step.extra)
        return {k: v for k, v in kwargs.items() if k in spec.inputs}

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Run a cache-free component (an encoder) on forward kwargs; return its first output."""
        raise NotImplementedError

    def features(self, name: str, inputs: Mapping[str, Any]) -> Any:
        """Run a `<modality>_features` component; return its whole output (a ModelOutput pytree)."""
        raise InputError(
            f"generate() over multimodal components runs on the dynamo backend for now, not {type(self).__name__}"
        )

    def _encoder_kwargs(self, name: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        spec = self.spec.components[name]
        for key, baked in spec.layout.items():
            given = inputs.get(key)
            if given is not None and torch.as_tensor(given).tolist() != baked:
                raise InputError(layout_mismatch(name, key, baked, torch.as_tensor(given).tolist()))
        return {k: v for k, v in inputs.items() if k in spec.inputs}


class NamedDriver(Driver):
    """A driver whose runtime takes and returns flat, named tensors; the cache is a dict by leaf name."""

    feeds_by_name: ClassVar[bool] = True

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        self.cache: dict[str, torch.Tensor] = {
            leaf.name: initial_leaf(leaf, self.spec, batch, max_cache_len)
            for leaf in self.spec.components[first].cache_leaves
        }

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return next(iter(self.features(name, inputs).values()))

    def flat_feed(self, name: str, step: Step, input_names: list[str]) -> dict[str, Any]:
        values = {**flat(self._kwargs(name, step)), **self.cache}
        feed = {}
        for graph_name in input_names:
            plain = graph_name.removeprefix(INPUT_PREFIX)
            if plain not in values:
                raise InputError(f"{name} takes {graph_name!r}, which the generation loop does not have")
            feed[graph_name] = values[plain]
        return feed

    def _take_outputs(self, outputs: Mapping[str, Any]) -> torch.Tensor:
        key = self.spec.cache_key
        for out_name, value in outputs.items():
            plain = cache_name(out_name.removeprefix(OUTPUT_PREFIX), key)
            if key is not None and plain.startswith(key + "."):
                self.cache[plain] = torch.as_tensor(np.asarray(value)) if not torch.is_tensor(value) else value
        logits = outputs["logits"]
        return logits if torch.is_tensor(logits) else torch.from_numpy(np.asarray(logits))


def cache_name(name: str, key: str | None) -> str:
    """An output leaf name with its cache prefix renamed to the input's (`past_key_values.x` -> `cache.x`)."""
    if key is None:
        return name
    for alias in CACHE_ALIASES:
        if name.startswith(alias + "."):
            return key + name[len(alias) :]
    return name


def flat(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of forward kwargs by flat name (`encoder_outputs.0`), as the lowerings name graph inputs."""
    return {name: value for name, value in leaf_names(dict(kwargs)) if isinstance(value, torch.Tensor)}


class SavedComponent(Protocol):
    """What a backend reads from one component of a loaded artifact (`hfexport.load`): its main file, and its
    runtime object, opened once. The artifacts layer, above the runtime, provides objects of this shape."""

    @property
    def path(self) -> Path: ...

    def open(self) -> Any: ...


@dataclass(frozen=True)
class Runtime:
    """Everything the runtime does differently for one format."""

    name: str
    # The generation driver.
    driver: type[Driver]
    # open(main file, input names from the manifest) -> the runtime object of a saved component.
    open: Callable[[Path, list[str]], Any]
    # run(runtime object, forward kwargs, output names from the manifest) -> {output name: tensor}.
    run: Callable[[Any, Mapping[str, Any], list[str]], dict[str, torch.Tensor]]
    # for_generation(saved component) -> (what the driver takes for it, its sample forward kwargs).
    for_generation: Callable[[SavedComponent], tuple[Any, dict[str, Any]]]
    # resolve_device(name as given, kind "cuda"/"gpu", index or None) -> the `RuntimeDevice` (the CPU is every
    # format's: `hfexport.runtime.devices.resolve_device` answers it); refuses one this format or machine lacks.
    resolve_device: Callable[[str, str, int | None], Any]
    # The config fields a device sets where the device is chosen when exporting (`Backend.device_at_export`).
    device_config: Callable[[Any], dict[str, Any]] = lambda device: {}
    # graph_inputs(opened runtime object) -> the names of each input it takes by name (a port may have several): a
    # feed is built from the manifest's inputs, so `load` checks each is one of them; [] where inputs are by position.
    graph_inputs: Callable[[Any], list[set[str]]] = lambda runtime: []
    # open_method(main file, or the runtime object of another method of it, method name, input names from the
    # manifest) -> the runtime object of that method, where one file holds a program per component (ExecuTorch's
    # methods): from another method's runtime object, the file's program, loaded once, serves both. None: a file
    # holds one program.
    open_method: Callable[[Any, str, list[str]], Any] | None = None
