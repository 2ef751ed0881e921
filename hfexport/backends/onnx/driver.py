"""The onnx runtime: ONNX Runtime sessions, driven with IO binding so that cache tensors are never copied."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.core.errors import InputError
from hfexport.generation_spec import LAYOUT_METADATA_KEY, layout_mismatch
from hfexport.naming import INPUT_PREFIX, OUTPUT_PREFIX, onnx_feed, plain_name
from hfexport.runtime.drivers.base import NamedDriver, Runtime, SavedComponent, Step, cache_name, flat


class OnnxDriver(NamedDriver):
    """ONNX Runtime with IO binding. A static cache pair the graph writes in place (`output.<name>` made by
    a `ScatterElements` into `input.<name>`, which nothing else reads but `Shape`: rule
    `onnx/index-copy-scatter-elements`) is bound to one buffer, so ONNX Runtime writes the new rows into it
    and copies nothing. Other pairs are double-buffered: each step binds the input to one preallocated buffer
    and the output to the other, then swaps them (binding both to one buffer is not safe in general: an op
    may read the input after another wrote the output). A grown cache (no pair) is handed from one step's
    output OrtValue to the next step's input without a copy.
    """

    def open_runtimes(self, components: Mapping[str, Any]) -> None:
        import onnxruntime as ort

        self.sessions = {}
        self.in_place: dict[str, set[str]] = {}
        # One session per distinct graph: a prefill served by the decode graph (the same program, or the same
        # saved file) runs in the decode step's session, so its weights are in memory once.
        opened: dict[Any, tuple[Any, set[str]]] = {}
        for name, program in components.items():
            saved = program if isinstance(program, SavedOnnx) else None
            if saved is not None:
                program = saved.path
            key = program if isinstance(program, (str, bytes)) else id(program)
            if key not in opened:
                proto = None if isinstance(program, (str, bytes)) else program.model_proto
                model = program if proto is None else proto.SerializeToString()
                if saved is not None and self.options.onnx_session_options is None and saved.on_cpu():
                    # The session `load` opened, with the options this driver would use: not a second copy.
                    session = saved.component.open()
                else:
                    session_options = self.options.onnx_session_options or ort.SessionOptions()
                    session = ort.InferenceSession(model, session_options, providers=["CPUExecutionProvider"])
                opened[key] = (session, written_in_place(proto if proto is not None else program))
            self.sessions[name], self.in_place[name] = opened[key]
        # Graph input/output names per session, read once (each get_inputs() call builds new objects).
        self.io = {
            name: ([a.name for a in s.get_inputs()], [o.name for o in s.get_outputs()])
            for name, s in self.sessions.items()
        }
        self.bound_pointers: list[dict[str, int]] = []

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        super().start(first, batch, max_cache_len)
        # Second buffer of each double-buffered pair; the two are swapped after every step.
        shared = set.intersection(*self.in_place.values()) if self.in_place else set()
        self.spare = (
            {k: torch.empty_like(v) for k, v in self.cache.items() if k not in shared} if self.spec.static_cache else {}
        )
        self.values: dict[str, Any] = {}
        # One IO binding per session for the whole generation; each step rebinds only the names whose buffer
        # changed (the in-place cache keeps its buffer, so most of a decode step's bindings are set once).
        self.bindings: dict[str, tuple[Any, dict[str, Any]]] = {}

    def run(self, name: str, step: Step) -> torch.Tensor:
        import onnxruntime as ort

        session = self.sessions[name]
        input_names, output_names = self.io[name]
        in_place = self.in_place[name] if self.spec.static_cache else set()
        if name not in self.bindings:
            self.bindings[name] = (session.io_binding(), {})
        binding, bound = self.bindings[name]

        def bind_input(graph_name: str, tensor: torch.Tensor) -> None:
            # A buffer is bound by address: the same address, shape and dtype is the same binding.
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if bound.get(graph_name) != key:
                _bind_tensor_input(binding, graph_name, tensor)
                bound[graph_name] = key

        inputs = flat(self._kwargs(name, step))
        pointers: dict[str, int] = {}
        for graph_name in input_names:
            plain = graph_name.removeprefix(INPUT_PREFIX)
            if plain in inputs:
                tensor = inputs[plain].contiguous()
                inputs[plain] = tensor  # keep alive until run
                bind_input(graph_name, tensor)
            elif plain in self.values:  # an OrtValue returned by the previous step
                binding.bind_ortvalue_input(graph_name, self.values[plain])
                bound[graph_name] = None
            elif plain in self.cache:
                bind_input(graph_name, self.cache[plain])
                pointers[plain] = self.cache[plain].data_ptr()
            else:
                raise InputError(f"{name} takes {graph_name!r}, which the generation loop does not have")
        for out in output_names:
            plain = out.removeprefix(OUTPUT_PREFIX)
            target = None
            if out.startswith(OUTPUT_PREFIX):
                target = self.cache.get(plain) if plain in in_place else self.spare.get(plain)
            if target is None:
                binding.bind_output(out, "cpu")  # ORT allocates it (its shape may change from step to step)
                bound[out] = None
                continue
            key = (target.data_ptr(), tuple(target.shape), target.dtype)
            if bound.get(out) != key:
                binding.bind_output(out, "cpu", 0, _NP[target.dtype], list(target.shape), target.data_ptr())
                bound[out] = key
        session.run_with_iobinding(binding)
        results = dict(zip(output_names, binding.get_outputs(), strict=True))
        for out, value in results.items():
            plain = cache_name(out.removeprefix(OUTPUT_PREFIX), self.spec.cache_key)
            if out.startswith(OUTPUT_PREFIX) and plain in in_place and plain in self.cache:
                continue  # written into the input's own buffer
            if out.startswith(OUTPUT_PREFIX) and plain in self.spare:
                self.cache[plain], self.spare[plain] = self.spare[plain], self.cache[plain]
            elif self.spec.cache_key is not None and plain.startswith(self.spec.cache_key + "."):
                self.values[plain] = value
                self.cache.pop(plain, None)
        self.bound_pointers.append(pointers)
        logits: ort.OrtValue = results["logits"]
        return torch.from_numpy(logits.numpy())

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        session = self.sessions[name]
        values = flat(self._encoder_kwargs(name, inputs))
        # An input that shares its name with an output is `input.<name>` (Moonshine's encoder: attention_mask).
        feed = {
            arg.name: values[arg.name if arg.name in values else arg.name.removeprefix(INPUT_PREFIX)].numpy()
            for arg in session.get_inputs()
        }
        names = [o.name for o in session.get_outputs()]
        return {n: torch.from_numpy(v) for n, v in zip(names, session.run(None, feed), strict=True)}


_NP = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def _bind_tensor_input(binding: Any, name: str, tensor: torch.Tensor) -> None:
    binding.bind_input(name, "cpu", 0, _NP[tensor.dtype], list(tensor.shape), tensor.data_ptr())


# Ops that read only their input's shape: they may see an input after another node wrote it in place.
_SHAPE_READERS = {"Shape", "Size"}


def written_in_place(model: Any) -> set[str]:
    """Plain names of the `input.<name>`/`output.<name>` pairs that `model` (a ModelProto or a path) may run on
    one buffer: the output is a `ScatterElements` into the input, and nothing else reads the input's data."""
    import onnx

    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    elif isinstance(model, str):
        model = onnx.load(model, load_external_data=False)
    graph = model.graph
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    pairs = set()
    for value in graph.input:
        if not value.name.startswith(INPUT_PREFIX):
            continue
        plain = value.name.removeprefix(INPUT_PREFIX)
        writer = producers.get(OUTPUT_PREFIX + plain)
        if writer is None or writer.op_type != "ScatterElements" or writer.domain not in ("", "ai.onnx"):
            continue
        others = [n for n in readers.get(value.name, []) if n is not writer]
        if (
            writer.input[0] == value.name
            and value.name not in outputs
            and all(n.op_type in _SHAPE_READERS for n in others)
        ):
            pairs.add(plain)
    return pairs


def open_saved(path: Path, input_names: list[str]) -> Any:
    import onnxruntime

    from hfexport.runtime.devices import current_device

    device = current_device()
    providers = list(device.providers) if device is not None else ["CPUExecutionProvider"]
    return onnxruntime.InferenceSession(str(path), providers=providers)


def check_layout(session: Any, inputs: Mapping[str, Any]) -> None:
    """Refuse inputs of another image layout than the one an export baked in (recorded in the model's metadata,
    since ONNX has no assertion op): a mismatched grid would otherwise run into silently wrong outputs."""
    recorded = session.get_modelmeta().custom_metadata_map.get(LAYOUT_METADATA_KEY)
    if not recorded:
        return
    for name, expected in json.loads(recorded).items():
        given = inputs.get(name)
        if given is not None and torch.as_tensor(given).tolist() != expected:
            raise InputError(layout_mismatch("this ONNX model", name, expected, torch.as_tensor(given).tolist()))


def run_saved(session: Any, inputs: Mapping[str, Any], output_names: list[str]) -> dict[str, torch.Tensor]:
    check_layout(session, inputs)
    feed = onnx_feed([i.name for i in session.get_inputs()], inputs)
    names = [plain_name(o.name) for o in session.get_outputs()]
    return {n: torch.from_numpy(v) for n, v in zip(names, session.run(None, feed), strict=True)}


@dataclass(frozen=True)
class SavedOnnx:
    """A saved component as the driver takes it: its graph file, and the component, whose session (`load` opens
    it, or the first use) the driver runs when it would open the same (the CPU provider, default options), so a
    loaded artifact that generates holds each graph once."""

    path: str
    component: SavedComponent

    def on_cpu(self) -> bool:
        return list(self.component.open().get_providers()) == ["CPUExecutionProvider"]


def for_generation(component: SavedComponent) -> tuple[Any, dict[str, Any]]:
    # Sessions take inputs by flat name: no samples needed.
    return SavedOnnx(str(component.path), component), {}


def resolve_device(device: str, kind: str, index: int | None) -> Any:
    """A CUDA device: ONNX Runtime's CUDA execution provider (onnxruntime-gpu), then the CPU's."""
    import onnxruntime

    from hfexport.runtime.devices import RuntimeDevice, refuse

    if kind == "gpu":
        raise refuse(device, "onnx", "`gpu` names OpenVINO's GPU; a CUDA device is --device cuda")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise refuse(
            device, "onnx", "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu); use --device cpu"
        )
    provider = ("CUDAExecutionProvider", {"device_id": index or 0})
    return RuntimeDevice("onnx", device, "cuda", index, providers=(provider, "CPUExecutionProvider"))


RUNTIME = Runtime(
    "onnx",
    OnnxDriver,
    open_saved,
    run_saved,
    for_generation,
    resolve_device,
    graph_inputs=lambda session: [{i.name} for i in session.get_inputs()],
)
