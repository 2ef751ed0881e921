"""The executorch backend: the ExecuTorch Python runtime, inputs in the program's pytree order."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import InputError
from hfexport.generation_spec import GenerationSpec
from hfexport.naming import OUTPUT_PREFIX, plain_name, spec_names
from hfexport.runtime.drivers.base import Backend, NamedDriver, SavedComponent, Step, flat


class ExecutorchDriver(NamedDriver):
    """The ExecuTorch Python runtime: inputs in the program's pytree order, outputs read back by name (the
    method has only `execute`; zero copy is a C++ path, see docs/generation.md)."""

    def __init__(self, components: Mapping[str, Any], spec: GenerationSpec, samples: Mapping[str, Any]) -> None:
        from hfexport.runtime.executorch import ExecutorchProgram, executorch_named_feed

        super().__init__(components, spec, samples)
        self.programs = {name: ExecutorchProgram(manager) for name, manager in components.items()}
        self.order = {name: executorch_named_feed(samples[name]) for name in components}
        self.output_names = {name: _executorch_output_names(m) for name, m in components.items()}

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return self.features(name, inputs)[self.output_names[name][-1]]

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        values = flat(self._encoder_kwargs(name, inputs))
        inputs_in_order = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        outputs = self.programs[name].method.execute(inputs_in_order)
        return dict(zip(self.output_names[name], outputs, strict=False))

    def run(self, name: str, step: Step) -> torch.Tensor:
        values = {**flat(self._kwargs(name, step)), **self.cache}
        inputs_in_order = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        outputs = self.programs[name].method.execute(inputs_in_order)
        return self._take_outputs(dict(zip(self.output_names[name], outputs, strict=False)))


def _executorch_output_names(manager: Any) -> list[str]:
    """Names of the method outputs: mutated inputs (`output.<input>`) first, then the user outputs."""
    from torch.export.graph_signature import OutputKind

    program = manager.exported_program()
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    input_names = spec_names(program.call_spec.in_spec, drop_first=True)
    by_placeholder = {s.arg.name: n for s, n in zip(user_inputs, input_names, strict=False) if hasattr(s.arg, "name")}
    user_names = iter(spec_names(program.call_spec.out_spec, drop_first=False))
    names = []
    for spec in program.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            names.append(OUTPUT_PREFIX + by_placeholder.get(spec.target, spec.target))
        elif spec.kind == OutputKind.USER_OUTPUT:
            names.append(next(user_names, f"output_{len(names)}"))
        else:
            names.append(f"buffer.{spec.target}")
    return names


def open_saved(path: Path, input_names: list[str]) -> Any:
    from hfexport.runtime.executorch import ExecutorchProgram

    return ExecutorchProgram(path, input_names=input_names or None)


def run_saved(program: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    tensors = [t for t in program.run(inputs) if isinstance(t, torch.Tensor)]
    names = output_names if len(output_names) == len(tensors) else [f"output_{i}" for i in range(len(tensors))]
    return {plain_name(n): t for n, t in zip(names, tensors, strict=True)}


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    raise InputError(
        "generate() over a loaded ExecuTorch artifact is not supported yet (the runtime needs the "
        "program's input order from the export); pass the export_for_generation result"
    )


BACKEND = Backend("executorch", ExecutorchDriver, open_saved, run_saved, for_generation)
