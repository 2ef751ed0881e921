"""The onnx runtime: ONNX Runtime sessions, driven with IO binding so that cache tensors are never copied."""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
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
                given, prepacking = self.options.onnx_session_options, self.options.onnx_prepacking
                if saved is not None and given is None and prepacking and saved.on_cpu():
                    # The session `load` opened, with the options this driver would use: not a second copy.
                    session = saved.component.open()
                else:
                    session = open_session(model, given, ["CPUExecutionProvider"], prepacking=prepacking)
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
    from hfexport.runtime.devices import current_device

    device = current_device()
    providers = list(device.providers) if device is not None else ["CPUExecutionProvider"]
    return open_session(path, None, providers)


def open_session(model: str | Path | bytes, options: Any, providers: list[Any], *, prepacking: bool = True) -> Any:
    """An ONNX Runtime session of `model` (a saved graph's path, or a serialized one), with the caller's `options`
    as given, else hfexport's. Without `prepacking`, on the CPU, the weights a saved graph reads from
    external-data files are the ones every other such session opened on those files reads (`SharedWeights`):
    the prefill and decode sessions of an artifact hold one copy. With prepacking (ONNX Runtime's default) each
    MatMul/Gemm kernel packs its weight into memory of its own whatever the session was given, so there is
    nothing to share: ONNX Runtime maps the file itself."""
    import onnxruntime

    shared = []
    if options is None:
        options = onnxruntime.SessionOptions()
        if not prepacking:
            options.add_session_config_entry(DISABLE_PREPACKING, "1")
            if not isinstance(model, bytes) and all(p == "CPUExecutionProvider" for p in providers):
                shared = add_shared_initializers(Path(model), options)
    session = onnxruntime.InferenceSession(
        model if isinstance(model, bytes) else str(model), options, providers=providers
    )
    session.shared_weights = shared  # the OrtValues must outlive the session
    return session


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


# -- one copy of the weights for the sessions of one weights file ----------------------------------------

# Session config key: whether MatMul/Gemm kernels pack their constant B into a copy of their own.
DISABLE_PREPACKING = "session.disable_prepacking"


@dataclass(eq=False)
class SharedWeights:
    """One memory map of an external-data file and an `OrtValue` over each distinct tensor in it (by offset,
    length, dtype and shape), handed to every session that reads the file with `SessionOptions.add_initializer`:
    ONNX Runtime then reads the caller's buffer in place instead of loading the tensor itself, so the sessions
    of one artifact read one copy. The map is copy-on-write (`mode="c"`): the file is never written, and what
    is not written stays file pages shared with the page cache, as in ONNX Runtime's own maps."""

    file: Path
    mapped: np.memmap
    values: dict[tuple[int, int, str, tuple[int, ...]], Any] = field(default_factory=dict)
    # The arrays (views of `mapped`) the values wrap, by the same key.
    arrays: dict[tuple[int, int, str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)

    def value(self, offset: int, length: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
        import onnxruntime as ort

        key = (offset, length, dtype.str, shape)
        if key not in self.values:
            count = int(np.prod(shape, dtype=np.int64))
            if count * dtype.itemsize != length or offset + length > self.mapped.size or offset % dtype.alignment:
                raise ValueError(f"{self.file.name}: {length} bytes at {offset} are not a {dtype} tensor of {shape}")
            array = self.mapped[offset : offset + length].view(dtype).reshape(shape)
            self.arrays[key] = array
            self.values[key] = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array: no copy
        return self.values[key]

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct tensors handed to sessions."""
        return sum(key[1] for key in self.values)


# ONNX tensor types numpy holds as themselves (bfloat16, float8 and int4 have no numpy type of their own).
_NUMPY_TYPES = {
    "FLOAT", "FLOAT16", "DOUBLE", "BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"
}  # fmt: skip

# Open files by identity (path, size, modification time): sessions opened on the same weights file share them.
_OPEN: weakref.WeakValueDictionary[tuple[str, int, int], SharedWeights] = weakref.WeakValueDictionary()


def _shared(file: Path) -> SharedWeights:
    stat = file.stat()
    key = (os.path.realpath(file), stat.st_size, stat.st_mtime_ns)
    weights = _OPEN.get(key)
    if weights is None:
        weights = SharedWeights(Path(key[0]), np.memmap(key[0], dtype=np.uint8, mode="c"))
        _OPEN[key] = weights
    return weights


def add_shared_initializers(model_path: Path, options: Any) -> list[SharedWeights]:
    """Add to `options` every initializer `model_path` reads from an external-data file whose type numpy holds,
    as the `OrtValue` shared by all sessions opened on that file. Returns the `SharedWeights` the session must
    keep alive. Tensors of other types (bfloat16, int4, float8) are left to ONNX Runtime's own loading."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    proto = onnx.load(str(model_path), load_external_data=False)
    used: dict[Path, SharedWeights] = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if onnx.TensorProto.DataType.Name(tensor.data_type) not in _NUMPY_TYPES:
            continue
        dtype = np.dtype(tensor_dtype_to_np_dtype(tensor.data_type))
        info = {e.key: e.value for e in tensor.external_data}
        file = model_path.parent / info["location"]
        if file not in used:
            used[file] = _shared(file)
        shape = tuple(int(d) for d in tensor.dims)
        length = int(info.get("length") or dtype.itemsize * int(np.prod(shape, dtype=np.int64)))
        value = used[file].value(int(info.get("offset") or 0), length, dtype, shape)
        options.add_initializer(tensor.name, value)
    return list(used.values())


RUNTIME = Runtime(
    "onnx",
    OnnxDriver,
    open_saved,
    run_saved,
    for_generation,
    resolve_device,
    graph_inputs=lambda session: [{i.name} for i in session.get_inputs()],
)
