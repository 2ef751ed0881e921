"""The openvino backend: compiled OpenVINO models (f32 inference hint), with numpy arrays by name as the cache."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.generation_spec import GenerationSpec
from hfexport.naming import plain_name
from hfexport.runtime.drivers.base import Backend, NamedDriver, SavedComponent, Step


class OpenVINODriver(NamedDriver):
    """Feeds numpy arrays by input name; the cache is fed back from the outputs of the previous step."""

    def __init__(self, components: Mapping[str, Any], spec: GenerationSpec, samples: Mapping[str, Any]) -> None:
        from hfexport.runtime.openvino import OpenVINORunner

        super().__init__(components, spec, samples)
        self.runners = {name: OpenVINORunner(model) for name, model in components.items()}  # compiled once

    def run(self, name: str, step: Step) -> torch.Tensor:
        runner = self.runners[name]
        names = [port.get_any_name() for port in runner.compiled.inputs]
        feed = {k: v.numpy() for k, v in self._flat_feed(name, step, names).items()}
        result = runner.compiled(feed)
        outputs = {
            out: np.array(result[port]) for out, port in zip(runner.output_names, runner.compiled.outputs, strict=True)
        }
        return self._take_outputs(outputs)

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return dict(self.runners[name](**self._encoder_kwargs(name, inputs)))


def open_saved(path: Path, input_names: list[str]) -> Any:
    from hfexport.runtime.devices import current_device
    from hfexport.runtime.openvino import OpenVINORunner

    device = current_device()
    return OpenVINORunner(path, device.openvino_device if device is not None else "CPU")


def run_saved(runner: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    return {plain_name(n): t for n, t in runner(**inputs).items()}


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # The driver compiles the IR itself (inputs go by flat name: no samples needed).
    return str(component.path), {}


BACKEND = Backend("openvino", OpenVINODriver, open_saved, run_saved, for_generation)
