"""The openvino runtime: compiled OpenVINO models (f32 inference hint), with numpy arrays by name as the cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.core.errors import InputError
from hfexport.naming import plain_name, variable_leaf
from hfexport.runtime.drivers.base import NamedDriver, Runtime, SavedComponent, Step


class OpenVINODriver(NamedDriver):
    """Feeds numpy arrays by input name; the cache is fed back from the outputs of the previous step.

    A stateful component (`OpenVINOConfig(stateful=True)`) keeps the cache in its infer request instead: each
    generation starts with `reset_state()`, the cache moves into the request once, when that component first
    runs (from the zero cache, or the cache the prefill returned), and a step feeds only its tokens, mask and
    positions. `holder` is the component whose request holds the cache (None: `self.cache` holds it).
    """

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        from hfexport.runtime.openvino import F32_HINT, OpenVINORunner

        properties = {**F32_HINT, **(self.options.openvino_properties or {})}
        # One compiled model per distinct program: a prefill served by the decode graph (the same model, or the
        # same saved file) runs on the decode step's, so its weights are in memory once.
        compiled: dict[Any, Any] = {}
        self.runners: dict[str, Any] = {}
        for name, model in components.items():
            saved = model if isinstance(model, SavedOpenVINO) else None
            if saved is not None:
                model = saved.path
            key = model if isinstance(model, str) else id(model)
            if key not in compiled:
                if saved is not None and self.options.openvino_properties is None and saved.on_cpu():
                    # The model `load` compiled, with the properties this driver would use: not a second copy.
                    compiled[key] = saved.component.open()
                else:
                    compiled[key] = OpenVINORunner(model, properties=properties)
            self.runners[name] = compiled[key]
        self.requests = {name: runner.compiled.create_infer_request() for name, runner in self.runners.items()}
        # component -> {cache leaf name: its variable state}, for the stateful components.
        self.states: dict[str, dict[str, Any]] = {}
        for name, request in self.requests.items():
            states = {variable_leaf(state.name): state for state in request.query_state()}
            if states:
                unknown = [state.name for leaf, state in states.items() if leaf is None]
                if unknown:
                    raise InputError(f"{name} has OpenVINO variables that are no cache pair: {unknown}")
                self.states[name] = states
        self.holder: str | None = None

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        super().start(first, batch, max_cache_len)
        for name in self.states:
            self.requests[name].reset_state()
        self.holder = None

    def run(self, name: str, step: Step) -> torch.Tensor:
        runner = self.runners[name]
        if self.holder is not None and self.holder != name:
            self._take_state(self.holder)
        if name in self.states and self.holder != name:
            self._put_state(name)
        names = [port.get_any_name() for port in runner.compiled.inputs]
        feed = {k: v.numpy() for k, v in self.flat_feed(name, step, names).items()}
        # The request reads the arrays in place (the fed cache is not copied into it) and hands back fresh arrays
        # of its outputs, one copy each, which the next step may feed back (no output aliases an input).
        result = self.requests[name].infer(feed, share_inputs=True, share_outputs=False)
        outputs = {
            out: np.asarray(result[port])
            for out, port in zip(runner.output_names, runner.compiled.outputs, strict=True)
        }
        return self._take_outputs(outputs)

    def _put_state(self, name: str) -> None:
        """Move the cache from `self.cache` into the variables of `name`'s request."""
        import openvino as ov

        for leaf, state in self.states[name].items():
            state.state = ov.Tensor(np.ascontiguousarray(self.cache.pop(leaf).numpy()))
        self.holder = name

    def _take_state(self, name: str) -> None:
        """Move the cache from the variables of `name`'s request back into `self.cache`."""
        for leaf, state in self.states[name].items():
            self.cache[leaf] = torch.from_numpy(np.array(state.state.data))
        self.holder = None

    def cache_tensors(self) -> dict[str, torch.Tensor]:
        """The current cache by leaf name, wherever it is held (tests read it; a copy of the variables)."""
        if self.holder is None:
            return dict(self.cache)
        return {leaf: torch.from_numpy(np.array(s.state.data)) for leaf, s in self.states[self.holder].items()}

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return dict(self.runners[name](**self._encoder_kwargs(name, inputs)))


def open_saved(path: Path, input_names: list[str]) -> Any:
    from hfexport.runtime.devices import current_device
    from hfexport.runtime.openvino import OpenVINORunner

    device = current_device()
    return OpenVINORunner(path, device.openvino_device if device is not None else "CPU")


def run_saved(runner: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    return {plain_name(n): t for n, t in runner(**inputs).items()}


@dataclass(frozen=True)
class SavedOpenVINO:
    """A saved component as the driver takes it: its IR file, and the component, whose compiled model (`load`
    compiles it, or the first use) the driver runs when it would compile the same (CPU, hfexport's f32 hint only),
    so a loaded artifact that generates holds each model once."""

    path: str
    component: SavedComponent

    def on_cpu(self) -> bool:
        return bool(self.component.open().device == "CPU")


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # Inputs go by flat name: no samples needed.
    return SavedOpenVINO(str(component.path), component), {}


def resolve_device(device: str, kind: str, index: int | None) -> Any:
    """OpenVINO's (Intel) GPU: `gpu`, `gpu.N`, as the OpenVINO core lists it here."""
    import openvino as ov

    from hfexport.runtime.devices import RuntimeDevice, refuse

    if kind == "cuda":
        raise refuse(device, "openvino", "OpenVINO has no CUDA device; its (Intel) GPU is --device gpu")
    available = ov.Core().available_devices
    want = "GPU" if index is None else f"GPU.{index}"
    if not any(d == want or (index is None and d.startswith("GPU")) for d in available):
        raise refuse(device, "openvino", f"OpenVINO sees no {want} here (devices: {', '.join(available)})")
    return RuntimeDevice("openvino", device, "gpu", index, openvino_device=want)


RUNTIME = Runtime(
    "openvino",
    OpenVINODriver,
    open_saved,
    run_saved,
    for_generation,
    resolve_device,
    graph_inputs=lambda runner: [set(port.get_names()) for port in runner.compiled.inputs],
)
