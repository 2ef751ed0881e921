"""The dynamo runtime: `ExportedProgram.module()`, with a transformers `Cache` object as the cache."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.core.errors import InputError
from hfexport.generation_spec import CacheLeaf
from hfexport.naming import CACHE_ALIASES, named_outputs
from hfexport.runtime.drivers.base import Driver, Runtime, SavedComponent, Step, initial_leaf


class DynamoDriver(Driver):
    """Runs `ExportedProgram.module()`; the cache is a transformers `Cache` object (a static one is mutated in
    place by the program)."""

    runs_on_torch_threads: ClassVar[bool] = True

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        # One module per distinct program: a prefill served by the decode program runs on the decode step's.
        modules: dict[int, Any] = {}
        self.modules = {}
        for name, program in components.items():
            if id(program) not in modules:
                modules[id(program)] = program.module()
            self.modules[name] = modules[id(program)]
        self.cache: Any = None

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        from hfexport.core.cache_pytree import flatten_cache, unflatten_cache

        key = self.spec.cache_key
        self.cache = None
        # A model that makes its own cache in the first forward (MiniMax: generate hands it none) has a prefill
        # without a cache input; the cache is what that graph returns.
        if key is None or key not in self.samples[first]:
            return
        sample = self.samples[first][key]
        leaves, skeleton = flatten_cache(sample)
        fresh = [
            initial_leaf(CacheLeaf(leaf.name, leaf.shape, leaf.dtype), self.spec, batch, max_cache_len)
            for leaf in self.spec.components[first].cache_leaves
        ]
        if len(fresh) != len(leaves):
            raise InputError(f"the {first} cache has {len(leaves)} tensors, its spec {len(fresh)}")
        self.cache = unflatten_cache(fresh, skeleton)

    def run(self, name: str, step: Step) -> torch.Tensor:
        kwargs = self._kwargs(name, step)
        if self.spec.cache_key is not None and self.spec.cache_key in self.samples[name]:
            kwargs[self.spec.cache_key] = self.cache
        with torch.no_grad():
            out = self.modules[name](**kwargs)
        if self.spec.cache_key is not None and not self.spec.static_cache:
            from transformers.cache_utils import Cache

            # The output may name the cache differently from the input (`past_key_values` vs `cache`); a
            # recurrent state that is not a `Cache` (RWKV's list of tensors) comes back under its own cache name.
            returned = (v for k, v in out.items() if isinstance(v, Cache) or (k in CACHE_ALIASES and v is not None))
            self.cache = next(returned, self.cache)
        return out["logits"]

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return self.features(name, inputs)[0]

    def features(self, name: str, inputs: Mapping[str, Any]) -> Any:
        with torch.no_grad():
            return self.modules[name](**self._encoder_kwargs(name, inputs))


def open_saved(path: Path, input_names: list[str]) -> torch.export.ExportedProgram:
    from hfexport.runtime.dynamo import load_program

    return load_program(path)


def run_saved(program: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    from hfexport.runtime.devices import current_device

    device = current_device()
    if device is None or device.is_cpu:
        with torch.no_grad():
            return named_outputs(program.module()(**inputs))
    # `use_device`: weights and inputs on the device, outputs back on the CPU where eager's are compared.
    target = torch.device(device.torch_device)
    moved = {k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        outputs = named_outputs(program.module().to(target)(**moved))
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in outputs.items()}


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # The loaded program's saved example inputs carry the cache layout (its classes and tensor shapes).
    program = component.open()
    example = program.example_inputs
    return program, dict(example[1]) if example is not None else {}


def resolve_device(device: str, kind: str, index: int | None) -> Any:
    from hfexport.runtime.devices import torch_cuda_device

    return torch_cuda_device(device, "dynamo", kind, index)


RUNTIME = Runtime("dynamo", DynamoDriver, open_saved, run_saved, for_generation, resolve_device)
