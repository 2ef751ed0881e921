"""`generate()` over the components of `export_for_generation`, on any backend, with one call contract.

The loop is the same for every backend; a *driver* runs one component on one step and keeps the cache:

| backend | driver | cache between steps |
|---|---|---|
| dynamo | `DynamoDriver` | the transformers `Cache` object; a static cache is mutated in place by the program |
| onnx | `OnnxDriver` | ONNX Runtime IO binding: each `input.<name>`/`output.<name>` pair double-buffered (no copies) |
| openvino | `OpenVINODriver` | numpy arrays by name, fed back from the outputs |
| executorch | `ExecutorchDriver` | tensors by name, read back from the method outputs (C++ zero-copy: docs) |

Two shapes of export are driven: a `prefill` + `decode` pair, or (static cache with multi-token decode)
the `decode` graph alone, which takes the whole prompt on an empty cache and then one token a step.
Masks follow what `generate` gives the model: 2-D over past + current tokens for a growing cache; for a
static cache, 4-D `[batch, 1, query, max_cache_len]` rows (causal over cache slots, padding masked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hfexport.errors import InputError
from hfexport.generation_spec import CacheLeaf, GenerationSpec
from hfexport.naming import INPUT_PREFIX, OUTPUT_PREFIX, leaf_names, spec_names
from hfexport.positions import apply as rebuild_positions
from hfexport.positions import text_positions


@dataclass
class Step:
    """One call: the new tokens, the mask the component takes, their positions."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    # Inputs that stay the same every step (an encoder-decoder's encoder output and encoder mask).
    extra: dict[str, Any] = field(default_factory=dict)


def _initial_leaf(leaf: CacheLeaf, spec: GenerationSpec, batch: int, max_cache_len: int | None) -> torch.Tensor:
    shape = list(leaf.shape)
    if shape and shape[0] == spec.sample_batch:
        shape[0] = batch
    if spec.static_cache and max_cache_len and spec.max_cache_len and len(shape) >= 3:
        shape = [max_cache_len if (i >= 2 and s == spec.max_cache_len) else s for i, s in enumerate(shape)]
    return torch.zeros(shape, dtype=getattr(torch, leaf.dtype))  # recorded as torch names


class Driver:
    """Runs components of one backend and owns the cache between steps."""

    def __init__(self, components: Mapping[str, Any], spec: GenerationSpec, samples: Mapping[str, Any]) -> None:
        self.components = components
        self.spec = spec
        self.samples = samples

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
                raise InputError(
                    f"{name} was exported for {key}={baked} (a layout baked into the graph); got "
                    f"{torch.as_tensor(given).tolist()}: export again with inputs of this layout"
                )
        return {**{k: v for k, v in inputs.items() if k in spec.inputs}, **spec.constants}


class DynamoDriver(Driver):
    """Runs `ExportedProgram.module()`; the cache is a transformers `Cache` object."""

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        from hfexport.cache_pytree import flatten_cache, unflatten_cache

        key = self.spec.cache_key
        if not hasattr(self, "modules"):
            self.modules = {name: program.module() for name, program in self.components.items()}
        self.cache = None
        if key is None:
            return
        sample = self.samples[first][key]
        leaves, skeleton = flatten_cache(sample)
        fresh = [
            _initial_leaf(CacheLeaf(leaf.name, leaf.shape, leaf.dtype), self.spec, batch, max_cache_len)
            for leaf in self.spec.components[first].cache_leaves
        ]
        if len(fresh) != len(leaves):
            raise InputError(f"the {first} cache has {len(leaves)} tensors, its spec {len(fresh)}")
        self.cache = unflatten_cache(fresh, skeleton)

    def run(self, name: str, step: Step) -> torch.Tensor:
        kwargs = self._kwargs(name, step)
        if self.spec.cache_key is not None:
            kwargs[self.spec.cache_key] = self.cache
        kwargs.update(self.spec.components[name].constants)
        with torch.no_grad():
            out = self.modules[name](**kwargs)
        if self.spec.cache_key is not None and not self.spec.static_cache:
            from transformers.cache_utils import Cache

            # The output may name the cache differently from the input (`past_key_values` vs `cache`).
            self.cache = next((v for v in out.values() if isinstance(v, Cache)), self.cache)
        return out["logits"]

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return self.features(name, inputs)[0]

    def features(self, name: str, inputs: Mapping[str, Any]) -> Any:
        if not hasattr(self, "modules"):
            self.modules = {n: program.module() for n, program in self.components.items()}
        with torch.no_grad():
            return self.modules[name](**self._encoder_kwargs(name, inputs))


class _NamedDriver(Driver):
    """A driver whose runtime takes and returns flat, named tensors; the cache is a dict by leaf name."""

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        self.cache: dict[str, torch.Tensor] = {
            leaf.name: _initial_leaf(leaf, self.spec, batch, max_cache_len)
            for leaf in self.spec.components[first].cache_leaves
        }

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return next(iter(self.features(name, inputs).values()))

    def _flat_feed(self, name: str, step: Step, input_names: list[str]) -> dict[str, Any]:
        values = {**_flat(self._kwargs(name, step)), **self.cache}
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
            plain = _cache_name(out_name.removeprefix(OUTPUT_PREFIX), key)
            if key is not None and plain.startswith(key + "."):
                self.cache[plain] = torch.as_tensor(np.asarray(value)) if not torch.is_tensor(value) else value
        logits = outputs["logits"]
        return logits if torch.is_tensor(logits) else torch.from_numpy(np.asarray(logits))


# Names a model output gives the cache it returns, when the forward's cache kwarg is named otherwise.
_CACHE_OUTPUT_NAMES = ("cache", "past_key_values", "cache_params")


def _cache_name(name: str, key: str | None) -> str:
    """An output leaf name with its cache prefix renamed to the input's (`past_key_values.x` -> `cache.x`)."""
    if key is None:
        return name
    for alias in _CACHE_OUTPUT_NAMES:
        if name.startswith(alias + "."):
            return key + name[len(alias) :]
    return name


def _flat(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of forward kwargs by flat name (`encoder_outputs.0`), as the lowerings name graph inputs."""
    return {name: value for name, value in leaf_names(dict(kwargs)) if isinstance(value, torch.Tensor)}


class OpenVINODriver(_NamedDriver):
    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        from hfexport.runtime.openvino import OpenVINORunner

        super().start(first, batch, max_cache_len)
        if not hasattr(self, "runners"):  # compiled once per components object
            self.runners = {name: OpenVINORunner(model) for name, model in self.components.items()}

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
        if not hasattr(self, "runners"):
            from hfexport.runtime.openvino import OpenVINORunner

            self.runners = {n: OpenVINORunner(model) for n, model in self.components.items()}
        return dict(self.runners[name](**self._encoder_kwargs(name, inputs)))


class ExecutorchDriver(_NamedDriver):
    """The ExecuTorch Python runtime: inputs in the program's pytree order, outputs read back by name."""

    def start(self, first: str, batch: int, max_cache_len: int | None) -> None:
        super().start(first, batch, max_cache_len)
        self._load()

    def _load(self) -> None:
        from hfexport.runtime.executorch import ExecutorchProgram, executorch_named_feed

        if not hasattr(self, "programs"):  # loaded once per components object
            self.programs = {name: ExecutorchProgram(manager) for name, manager in self.components.items()}
            self.order = {name: executorch_named_feed(self.samples[name]) for name in self.components}
            self.output_names = {name: _executorch_output_names(m) for name, m in self.components.items()}

    def encode(self, name: str, inputs: Mapping[str, Any]) -> torch.Tensor:
        return self.features(name, inputs)[self.output_names[name][-1]]

    def features(self, name: str, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        self._load()
        values = _flat(self._encoder_kwargs(name, inputs))
        flat = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        outputs = self.programs[name].method.execute(flat)
        return dict(zip(self.output_names[name], outputs, strict=False))

    def run(self, name: str, step: Step) -> torch.Tensor:
        values = {**_flat(self._kwargs(name, step)), **self.cache}
        flat = [values.get(leaf, constant) for leaf, constant in self.order[name]]
        program = self.programs[name]
        outputs = program.method.execute(flat)
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


class OnnxDriver(_NamedDriver):
    """ONNX Runtime with IO binding. A static cache pair the graph writes in place (`output.<name>` made by
    a `ScatterElements` into `input.<name>`, which nothing else reads but `Shape`: rule
    `onnx/index-copy-scatter-elements`) is bound to one buffer, so ONNX Runtime writes the new rows into it
    and copies nothing. Other pairs are double-buffered: each step binds the input to one preallocated buffer
    and the output to the other, then swaps them (binding both to one buffer is not safe in general: an op
    may read the input after another wrote the output). A grown cache (no pair) is handed from one step's
    output OrtValue to the next step's input without a copy.
    """

    def __init__(self, components: Mapping[str, Any], spec: GenerationSpec, samples: Mapping[str, Any]) -> None:
        super().__init__(components, spec, samples)
        import onnxruntime as ort

        self.sessions = {}
        self.in_place: dict[str, set[str]] = {}
        for name, program in components.items():
            proto = None if isinstance(program, (str, bytes)) else program.model_proto
            model = program if proto is None else proto.SerializeToString()
            options = ort.SessionOptions()
            self.sessions[name] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
            self.in_place[name] = written_in_place(proto if proto is not None else program)
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

        inputs = _flat(self._kwargs(name, step))
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
            plain = _cache_name(out.removeprefix(OUTPUT_PREFIX), self.spec.cache_key)
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
        values = _flat(self._encoder_kwargs(name, inputs))
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


_DRIVERS: dict[str, type[Driver]] = {
    "dynamo": DynamoDriver,
    "onnx": OnnxDriver,
    "openvino": OpenVINODriver,
    "executorch": ExecutorchDriver,
}


def backend_of(program: Any) -> str:
    """The backend a native program belongs to."""
    kind = type(program).__module__ + "." + type(program).__name__
    if isinstance(program, torch.export.ExportedProgram):
        return "dynamo"
    if "onnx" in kind:
        return "onnx"
    if "openvino" in kind:
        return "openvino"
    if "executorch" in kind:
        return "executorch"
    raise InputError(f"no generation runtime for {kind}")


@dataclass
class _Sampler:
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None = field(default=None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if not self.do_sample:
            return logits.argmax(-1)
        if self.temperature and self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, index = logits.sort(-1, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) > self.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
        return torch.multinomial(logits.softmax(-1), 1, generator=self.generator).squeeze(-1)


def _static_mask(valid: torch.Tensor, first_slot: int, query: int) -> torch.Tensor:
    """4-D mask rows for `query` tokens written at cache slots `first_slot...`: causal over slots, padding off."""
    slots = torch.arange(valid.shape[1])
    rows = torch.arange(first_slot, first_slot + query)
    causal = slots[None, :] <= rows[:, None]
    return (causal[None] & valid[:, None, :].bool())[:, None]


def _processed(scores: torch.Tensor, spec: GenerationSpec, index: int, max_new_tokens: int, width: int) -> torch.Tensor:
    """The logits processors of the model's generation config that the spec records, in transformers' order:
    suppressed ids, ids suppressed at the first new token, then a forced first token and a forced last one.
    `width` is the length of the ids generation started from (transformers forces a first token only when
    that is the single decoder start token)."""
    vocab = scores.shape[-1]
    forces_first = spec.forced_bos_token_id is not None and width == 1

    def only(ids: list[int]) -> torch.Tensor:
        return torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.long)

    if spec.suppress_tokens:
        scores = scores.float().index_fill(-1, only(spec.suppress_tokens), float("-inf"))
    if index == (1 if forces_first else 0) and spec.begin_suppress_tokens:
        scores = scores.float().index_fill(-1, only(spec.begin_suppress_tokens), float("-inf"))
    forced: list[int] = []
    if index == 0 and forces_first:
        forced = [spec.forced_bos_token_id]
    elif index == max_new_tokens - 1 and spec.forced_eos_token_id:
        forced = spec.forced_eos_token_id
    if forced:
        kept = torch.full_like(scores.float(), float("-inf"))
        scores = kept.index_fill(-1, only(forced), 0.0)
    return scores


def _encoder_outputs(outputs: Any, samples: Mapping[str, Any], spec: GenerationSpec) -> Any:
    """The encoder output in the container the decoder steps were exported with (a `ModelOutput` or a tuple),
    with every field the samples had (Moonshine's encoder returns its downsampled `attention_mask` too).

    `outputs` is what the driver's `features` returns: a ModelOutput (Dynamo) or a dict by flat output name.
    Without samples (a loaded ONNX / OpenVINO artifact), a dict with the recorded field names gives the same
    flat input names (`encoder_outputs.last_hidden_state`)."""
    if isinstance(outputs, Mapping):
        named = {k.removeprefix(OUTPUT_PREFIX): v for k, v in outputs.items()}
        hidden = next(iter(outputs.values()))
    else:
        named, hidden = {}, outputs[0]
    sample = next((s["encoder_outputs"] for s in samples.values() if "encoder_outputs" in s), None)
    if sample is not None and not isinstance(sample, (tuple, list)):
        fields = {k: named[k] for k in sample if k != "last_hidden_state" and named.get(k) is not None}
        return type(sample)(last_hidden_state=hidden, **fields)
    if sample is None and spec.encoder_output_fields:
        first, *rest = spec.encoder_output_fields
        return {first: hidden, **{k: named[k] for k in rest if k in named}}
    return (hidden,)


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))


def _like(value: Any, sample: Any) -> Any:
    """`value` (a ModelOutput or dict of features) with only the fields of `sample`, in `sample`'s order."""
    if not isinstance(sample, Mapping) or not isinstance(value, Mapping):
        return value
    fields = {k: value[k] for k in sample if k in value}
    return fields if type(sample) is dict else type(sample)(**fields)


def _loaded(components: Any) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """Native programs, samples and backend of a loaded artifact (`hfexport.load`), or None for an in-memory export.

    Dynamo: the loaded `ExportedProgram`s, whose saved example inputs carry the cache layout; ONNX / OpenVINO:
    the model files, opened by the drivers (they need no samples: inputs go by flat name).
    """
    from hfexport.saving import LoadedExport

    if not isinstance(components, LoadedExport):
        return None
    backend = components.export_format
    if backend == "executorch":
        raise InputError(
            "generate() over a loaded ExecuTorch artifact is not supported yet (the runtime needs the "
            "program's input order from the export); pass the export_for_generation result"
        )
    natives: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for name, component in components.components.items():
        if backend == "dynamo":
            natives[name] = component.open()
            example = natives[name].example_inputs
            samples[name] = dict(example[1]) if example is not None else {}
        else:
            natives[name] = str(component.path)
            samples[name] = {}
    return natives, samples, backend


def generate(
    components: Mapping[str, Any],
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer: Any = None,
    *,
    min_new_tokens: int = 0,
    encoder_inputs: Mapping[str, Any] | None = None,
    spec: GenerationSpec | None = None,
    max_cache_len: int | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[Driver], None] | None = None,
) -> torch.Tensor:
    """Generate with exported components; returns `[batch, prompt + new]` token ids like `model.generate`.

    `components` is an `export_for_generation` result (any backend). Greedy (`do_sample=False`) tokens
    equal `model.generate(do_sample=False)` with the same cache kind. `max_cache_len` sizes a static cache
    (default: the exported one). `streamer` gets `put(tokens)` per step and `end()`, like transformers'.
    `min_new_tokens` keeps `eos_token_id` (default: the model's) from ending a sequence earlier. For an
    encoder-decoder export, `input_ids`/`attention_mask` (or `encoder_inputs`, e.g. Whisper's `input_features`)
    feed the encoder, and the returned ids are the decoder's, from its start token.
    """
    owner = components
    loaded = _loaded(components)
    if loaded is not None:
        natives, samples, backend = loaded
        spec = spec or getattr(components, "_spec", None) or components.generation
        if spec is None:
            raise InputError(f"{components.directory} is not an export_for_generation artifact (no generation layout)")
        with contextlib.suppress(AttributeError):
            components._spec = spec  # one spec object per loaded artifact, so its driver is reused
        components = natives
        backends = {backend}
    else:
        spec = spec or getattr(components, "spec", None)
        samples = getattr(components, "samples", None)
        if spec is None or samples is None:
            raise InputError("components carry no generation spec: pass the result of export_for_generation")
        backends = {backend_of(p) for p in components.values()}
    if len(backends) != 1:
        raise InputError(f"components come from several backends: {sorted(backends)}")
    # One driver per components object: sessions, compiled models and loaded programs are reused across calls.
    driver = getattr(owner, "_driver", None)
    if driver is None or driver.spec is not spec:
        driver = _DRIVERS[backends.pop()](components, spec, samples)
        with contextlib.suppress(AttributeError):  # a plain dict cannot keep it: no reuse
            owner._driver = driver  # type: ignore[attr-defined]

    extra: dict[str, Any] = {}
    if spec.is_encoder_decoder:
        # The encoder runs once; its output and mask are inputs of every decoder step. Decoding starts
        # from the decoder start token, as transformers' generate does.
        encoder = {**dict(encoder_inputs or {})}
        if input_ids is not None:
            encoder["input_ids"] = torch.as_tensor(input_ids)
        if attention_mask is not None:  # the mask of input_ids, or of input_values / input_features
            encoder["attention_mask"] = torch.as_tensor(attention_mask)
        extra["encoder_outputs"] = _encoder_outputs(driver.features("encoder", encoder), samples, spec)
        hidden = _first_tensor(extra["encoder_outputs"])
        if "attention_mask" in encoder:
            extra["attention_mask"] = encoder["attention_mask"]
        if spec.decoder_start_token_id is None:
            raise InputError("the export records no decoder_start_token_id; set it on the model's config")
        input_ids = torch.full((hidden.shape[0], 1), spec.decoder_start_token_id, dtype=torch.long)
        attention_mask = None
    elif input_ids is None:
        raise InputError("generate() needs input_ids")
    input_ids = torch.as_tensor(input_ids)
    batch, prompt = input_ids.shape
    mask2d = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
    # A static cache with multi-token decode needs one graph: the prompt goes through `decode` too.
    single = "prefill" not in components or (spec.static_cache and spec.multi_token_decode)
    length = max_cache_len or spec.max_cache_len
    if spec.static_cache and length is not None and prompt + max_new_tokens > length:
        raise InputError(
            f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) exceed the static cache ({length} slots); "
            "pass a larger max_cache_len (the exported graphs take any length when exported with dynamic=True)"
        )
    eos = eos_token_id if eos_token_id is not None else spec.eos_token_id
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
    pad = pad_token_id if pad_token_id is not None else (spec.pad_token_id if spec.pad_token_id is not None else 0)
    sampler = _Sampler(do_sample, temperature, top_k, top_p, generator)

    first = "decode" if single else "prefill"
    driver.start(first, batch, length)
    positions = text_positions(mask2d)
    first_positions, rope_delta = positions, None
    if spec.positions is not None and not single:
        # Multimodal rotary positions (Qwen2-VL style), which generate computes with model code: rebuilt from
        # the export's template; decode steps add each row's delta to the plain position.
        template = spec.positions
        types = (encoder_inputs or {}).get(template.type_key) if template.type_key else None
        if template.type_key and types is None:
            raise InputError(f"this export builds multimodal positions from {template.type_key}: pass it too")
        first_positions, rope_delta = rebuild_positions(template, input_ids, mask2d, types)
    valid = torch.zeros((batch, length), dtype=torch.long) if spec.static_cache else None

    def mask_for(name: str, query: int, written: int) -> torch.Tensor:
        if spec.components[name].mask_rank == 4 and valid is not None:
            return _static_mask(valid, written, query)
        return mask2d[:, -query:] if spec.mask_current_only else mask2d

    if valid is not None:
        valid[:, :prompt] = mask2d
    first_extra = extra
    if encoder_inputs and not spec.is_encoder_decoder:
        # Modality inputs the first forward takes itself (Fuyu's image_patches, token_type_ids...).
        taken = spec.components[first].inputs
        first_extra = {**extra, **{k: v for k, v in encoder_inputs.items() if k in taken}}
    modalities = [n for n in spec.components if n.endswith("_features")]
    if modalities and not spec.is_encoder_decoder:
        # As transformers' generate: the modality features first, handed to the first forward, which merges
        # them at the image tokens; later steps read them from the cache.
        from hfexport.frontends.generation import tensor_fields

        if not encoder_inputs:
            raise InputError(f"this export takes {modalities}: pass their inputs (pixel_values...) as encoder_inputs")
        features = {n.removesuffix("_features"): driver.features(n, encoder_inputs) for n in modalities}
        given = tensor_fields(features)
        sample = samples.get(first, {}).get("mm_encoder_outputs")
        if isinstance(sample, Mapping) and isinstance(driver, DynamoDriver):
            # The fields the first forward was exported with, in its order (the features graph may return more,
            # e.g. hidden_states, which generate does not hand over). Named drivers feed by flat input name.
            given = {m: _like(features[m], sample[m]) if m in sample else v for m, v in given.items()}
        first_extra = {**first_extra, "mm_encoder_outputs": given}
    logits = driver.run(first, Step(input_ids, mask_for(first, prompt, 0), first_positions, first_extra))
    # Per-token inputs besides the ids (PaliGemma's token_type_ids) that decode steps take too: generate
    # extends them by repeating their last column, so each new token gets the prompt's last value.
    decode_inputs = spec.components["decode"].inputs if "decode" in spec.components else []
    per_token = {
        k: torch.as_tensor(v)[:, -1:]
        for k, v in (encoder_inputs or {}).items()
        if k in decode_inputs and torch.is_tensor(v) and v.ndim == 2 and tuple(v.shape) == (batch, prompt)
    }
    # A model without a cache (use_cache=False) merges the image features again at every step.
    features_every_step = "mm_encoder_outputs" in decode_inputs and "mm_encoder_outputs" in first_extra
    every_step = {"mm_encoder_outputs": first_extra["mm_encoder_outputs"]} if features_every_step else {}
    # Inputs generate keeps passing to every step unchanged (Qwen2-Audio's feature_attention_mask).
    constant = {k: v for k, v in (encoder_inputs or {}).items() if k in decode_inputs and k not in per_token}
    sequences = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool)
    if streamer is not None:
        streamer.put(input_ids)
    written = prompt
    last_position = positions[:, -1:]
    for index in range(max_new_tokens):
        scores = logits[:, -1, :]
        if index < min_new_tokens and len(eos_ids):
            # As transformers' MinNewTokensLengthLogitsProcessor: no end of sequence before min_new_tokens
            # (ids beyond the vocabulary, which some configs carry, cannot be produced anyway).
            in_vocab = eos_ids[eos_ids < scores.shape[-1]]
            scores = scores.float().index_fill(-1, in_vocab, float("-inf"))
        scores = _processed(scores, spec, index, max_new_tokens, input_ids.shape[1])
        token = sampler(scores)
        token = torch.where(unfinished, token, torch.full_like(token, pad))
        sequences = torch.cat([sequences, token[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(token[:, None])
        if len(eos_ids):
            unfinished &= ~torch.isin(token, eos_ids)
        if index == max_new_tokens - 1 or not bool(unfinished.any()):
            break
        mask2d = torch.cat([mask2d, torch.ones((batch, 1), dtype=mask2d.dtype)], dim=-1)
        if valid is not None:
            valid[:, written] = 1
        last_position = last_position + 1
        if spec.cache_key is None or spec.decode_full_sequence:
            # No cache (a model that returns none, e.g. a BERT decoder without is_decoder), or a decode step
            # that takes every token and slices off the cached ones itself: as transformers' generate does,
            # every step runs the whole sequence so far.
            full = (mask2d.cumsum(-1) - 1).masked_fill(mask2d == 0, 1)
            step = Step(sequences, mask2d, full, {**extra, **every_step})
        else:
            step_positions = last_position
            if rope_delta is not None:
                step_positions = last_position + rope_delta
                if spec.positions.decode_rows is not None:
                    step_positions = step_positions[None].expand(spec.positions.decode_rows, -1, -1).contiguous()
            step = Step(
                token[:, None], mask_for("decode", 1, written), step_positions, {**constant, **extra, **per_token}
            )
        logits = driver.run("decode", step)
        written += 1
        if on_step is not None:
            on_step(driver)
    if streamer is not None:
        streamer.end()
    return sequences
