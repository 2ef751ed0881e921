"""The executorch runtime: the ExecuTorch Python runtime, inputs in the program's pytree order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.generation_spec import GenerationSpec
from hfexport.naming import OUTPUT_PREFIX, plain_name, spec_names
from hfexport.runtime.drivers.base import NamedDriver, Runtime, SavedComponent, Step, flat
from hfexport.runtime.executorch import contiguous


class ExecutorchDriver(NamedDriver):
    """The ExecuTorch Python runtime: inputs in the program's pytree order, outputs read back by name (the
    method has only `execute`; zero copy is a C++ path, see docs/generation.md)."""

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        from hfexport.runtime.executorch import ExecutorchProgram, executorch_named_feed

        self.programs: dict[str, Any] = {}
        self.order: dict[str, list[tuple[str, Any]]] = {}
        self.output_names: dict[str, list[str]] = {}
        # Saved components: the names of their tensor outputs, as the manifest lists them (see `_named`).
        self.saved_outputs: dict[str, list[str]] = {}
        for name, native in components.items():
            if isinstance(native, SavedExecutorch):  # a loaded artifact: no manager, the layout says the order
                self.programs[name] = native.program
                self.order[name] = _saved_order(self.spec, name, native.program.method)
                self.saved_outputs[name] = _saved_output_names(name, native)
            else:
                # A prefill served by the decode program (the same manager) runs on the decode step's.
                same = next((other for other, seen in components.items() if seen is native), name)
                self.programs[name] = self.programs[same] if same != name else ExecutorchProgram(native)
                self.order[name] = executorch_named_feed(self.samples[name])
                self.output_names[name] = _executorch_output_names(native)

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return list(self.features(name, inputs).values())[-1]

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        values = flat(self._encoder_kwargs(name, inputs))
        inputs_in_order = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        return self._named(name, self._execute(name, inputs_in_order))

    def run(self, name: str, step: Step) -> torch.Tensor:
        values = {**flat(self._kwargs(name, step)), **self.cache}
        inputs_in_order = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        return self._take_outputs(self._named(name, self._execute(name, inputs_in_order)))

    def _named(self, name: str, outputs: list[Any]) -> dict[str, Any]:
        """The method's outputs by name. A saved component's manifest names its tensor outputs only: a `None` leaf
        of the model's output (LLaVA's image features return `hidden_states` with `None` in place of the layers
        they do not keep) is a method output too, so tensors are named, after the input mutations before them."""
        saved = self.saved_outputs.get(name)
        if saved is None:
            return dict(zip(self.output_names[name], outputs, strict=False))
        tensors = [value for value in outputs if isinstance(value, torch.Tensor)]
        names = [f"buffer.{i}" for i in range(len(tensors) - len(saved))] + saved
        return dict(zip(names, tensors, strict=False))

    def _execute(self, name: str, inputs_in_order: list[Any]) -> Any:
        """`method.execute` unchecked (a check per decode step costs Python time on every input); when the
        runtime refuses the feed, its error ("set_inputs() ... failed with error 0x10") is explained by the input
        that does not fit the program's planned shapes (e.g. a batch of 2 for a program traced at batch 1)."""
        program = self.programs[name]  # an ExecutorchProgram: its planned shapes were read when it was loaded
        try:
            return program.method.execute(contiguous(inputs_in_order))
        except RuntimeError:
            from hfexport.runtime.executorch import check_feed  # the failure path only: nothing added per step

            names = [leaf for leaf, _ in self.order[name]]
            check_feed(program.slots, list(zip(names, inputs_in_order, strict=True)))
            raise


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


def open_method(source: Any, method: str, input_names: list[str]) -> Any:
    """One method of a `.pte` that holds a method per component: from the file, or from the `ExecutorchProgram` of
    another of its methods, whose loaded program it shares (the file, its weights included, is loaded once)."""
    from hfexport.runtime.executorch import ExecutorchProgram

    program = source.program if isinstance(source, ExecutorchProgram) else source
    return ExecutorchProgram(program, method=method, input_names=input_names or None)


def run_saved(program: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    tensors = [t for t in program.run(inputs) if isinstance(t, torch.Tensor)]
    names = output_names if len(output_names) == len(tensors) else [f"output_{i}" for i in range(len(tensors))]
    return {plain_name(n): t for n, t in zip(names, tensors, strict=True)}


@dataclass(frozen=True)
class SavedExecutorch:
    """A saved `.pte` component as `generate` drives it: the program (opened once by the loaded component) and
    the names of its user outputs as the manifest records them. A `.pte` keeps neither the forward's argument
    names nor the cache's pytree, so the flat input order is rebuilt from the generation layout instead
    (`_saved_order`)."""

    program: Any
    outputs: list[str] = field(default_factory=list)


def _saved_order(spec: GenerationSpec, name: str, method: Any) -> list[tuple[str, Any]]:
    """The method's inputs of a saved component, by flat name: its forward kwargs in the recorded order, the
    cache (`spec.cache_key`) expanded to its recorded leaves, in pytree order, as the capture flattened it.

    A nested kwarg (an encoder-decoder's `encoder_outputs`, a VLM's `mm_encoder_outputs`) is expanded to the flat
    names of its tensors the layout records (`ComponentSpec.leaves`), as `generate` names what it feeds; a layout
    without them places `encoder_outputs` by its recorded fields (`encoder_outputs.last_hidden_state`, or
    `encoder_outputs.0` for a tuple). Checked against the program's own input count: what the layout cannot place
    is refused rather than fed in a guessed order."""
    component = spec.components[name]
    order: list[tuple[str, Any]] = []
    for kwarg in component.inputs:
        if kwarg == spec.cache_key:
            order += [(leaf.name, None) for leaf in component.cache_leaves]
        elif kwarg in component.leaves:
            order += [(leaf, None) for leaf in component.leaves[kwarg]]
        elif kwarg == "encoder_outputs" and spec.is_encoder_decoder:  # a layout that records no `leaves`
            order += [(f"{kwarg}.{field}", None) for field in spec.encoder_output_fields or ["0"]]
        else:
            order.append((kwarg, None))
    count = method.metadata.num_inputs()
    if len(order) != count:
        raise InputError(
            f"the saved ExecuTorch component {name!r} takes {count} inputs; its generation layout names {len(order)} "
            f"({[n for n, _ in order]}): generate() places a loaded ExecuTorch artifact's inputs by "
            "its generation layout; pass the export_for_generation result for this one, or export it again"
        )
    return order


def _saved_output_names(name: str, saved: SavedExecutorch) -> list[str]:
    """The names of the method's tensor user outputs, as the manifest lists them. The method returns the input
    mutations first (a static cache written in place; unnamed, since the cache the model returns follows as user
    outputs), then the user outputs, `None` leaves included (`ExecutorchDriver._named`)."""
    count = saved.program.method.metadata.num_outputs()
    if count < len(saved.outputs):
        raise InputError(f"the saved ExecuTorch component {name!r} returns {count} outputs, its manifest names more")
    return list(saved.outputs)


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # No sample kwargs: a .pte has no example inputs. Decoder-only loops need none (the layout has the cache).
    return SavedExecutorch(component.open(), list(getattr(component, "outputs", None) or [])), {}


def resolve_device(device: str, kind: str, index: int | None) -> Any:
    """A CUDA device: the ExecuTorch CUDA backend (chosen when lowering: the `.pte` holds the delegate)."""
    from hfexport.runtime.devices import RuntimeDevice, check_cuda, refuse

    if kind == "gpu":
        raise refuse(device, "executorch", "`gpu` names OpenVINO's GPU; a CUDA device is --device cuda")
    check_cuda(device, "executorch", index)
    if index not in (None, 0):
        raise refuse(device, "executorch", "the ExecuTorch CUDA backend runs on the current device only")
    return RuntimeDevice("executorch", device, "cuda", index, torch_device="cuda", executorch_backend="cuda")


def device_config(device: Any) -> dict[str, Any]:
    """An ExecuTorch program's device is its delegate, chosen when lowering: the CUDA backend or XNNPACK."""
    return {"backend": device.executorch_backend}


RUNTIME = Runtime(
    "executorch",
    ExecutorchDriver,
    open_saved,
    run_saved,
    for_generation,
    resolve_device,
    device_config,
    open_method=open_method,
)
