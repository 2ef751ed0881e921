"""The aoti runtime: AOTInductor packages run on flat tensors by name; a static cache is written in place."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.naming import plain_name
from hfexport.runtime.drivers.base import NamedDriver, Runtime, SavedComponent, Step, flat


class AOTInductorDriver(NamedDriver):
    """Feeds each package its flat tensors by name (the cache from `self.cache`). A static cache is an input the
    package writes into (a USER_INPUT_MUTATION compiled as a write into the caller's tensor), so the cache tensors
    fed at the first step are the ones every later step reads and writes: nothing is copied or rebound."""

    # The kernels run on torch's own (OpenMP) threads: the loop leaves their count as it is.
    runs_on_torch_threads: ClassVar[bool] = True

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        self.packages = dict(components)
        for package in self.packages.values():
            package.load()

    def run(self, name: str, step: Step) -> torch.Tensor:
        package = self.packages[name]
        feed = self.flat_feed(name, step, package.input_names)
        with torch.no_grad():
            outputs = dict(zip(package.output_names, package.run(list(feed.values())), strict=True))
        if self.spec.static_cache:
            # The cache the model returns is the cache it wrote in place: keep the tensors the loop feeds.
            return outputs["logits"]
        return self._take_outputs(outputs)

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        package = self.packages[name]
        values = flat(self._encoder_kwargs(name, inputs))
        with torch.no_grad():
            return dict(zip(package.output_names, package.run([values[n] for n in package.input_names]), strict=True))


def open_saved(path: Path, input_names: list[str]) -> Any:
    from hfexport.backends.aoti.lowering import AOTInductorPackage

    return AOTInductorPackage(path)  # its names are in the package's metadata


def run_saved(package: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {plain_name(name): value for name, value in package(**inputs).items()}


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # The package takes flat tensors by name: the driver needs no samples.
    return component.open(), {}


def resolve_device(device: str, kind: str, index: int | None) -> Any:
    from hfexport.runtime.devices import refuse

    raise refuse(device, "aoti", "a package runs on the device it was compiled for, and hfexport compiles for the CPU")


RUNTIME = Runtime(
    "aoti",
    AOTInductorDriver,
    open_saved,
    run_saved,
    for_generation,
    resolve_device,
    # The names the package records in its metadata: the manifest must list each.
    graph_inputs=lambda package: [{name} for name in package.input_names],
)
