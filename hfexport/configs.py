"""Export configs: dataclasses that round-trip through dicts and JSON, keyed by `export_format`.

Later lowerings (ONNX, ExecuTorch, OpenVINO) subclass `DynamoConfig`, since every backend starts from
the same torch.export capture.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from hfexport.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.quantizers.base import ExportQuantizer
from hfexport.rewrites.rule import RuleSelection


def _dim_to_json(dim: Any) -> Any:
    import torch

    if dim is None or isinstance(dim, int):
        return dim
    if dim is torch.export.Dim.AUTO:
        return "AUTO"
    if dim is torch.export.Dim.STATIC:
        return "STATIC"
    if dim is torch.export.Dim.DYNAMIC:
        return "DYNAMIC"
    name = getattr(dim, "__name__", None)
    # A derived dim (`2 * batch`) has a name like "2*batch" that `Dim()` rejects on load: refuse it here.
    if name is None or not name.isidentifier():
        raise ConfigError(f"cannot serialise dynamic shape entry {dim!r}")
    low, high = getattr(dim, "min", None), getattr(dim, "max", None)
    return {"dim": name, "min": low, "max": high if isinstance(high, int) else None}


def _dim_from_json(data: Any) -> Any:
    import torch

    if isinstance(data, str):
        return getattr(torch.export.Dim, data)
    if isinstance(data, dict):
        kwargs = {k: data[k] for k in ("min", "max") if data.get(k) is not None}
        low, high = kwargs.get("min"), kwargs.get("max")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            # torch.export.Dim refuses this with a bare AssertionError.
            raise ConfigError(f"dynamic shape {data.get('dim')!r}: min {low} is greater than max {high}")
        return torch.export.Dim(data["dim"], **kwargs)
    return data


def _map_dims(shapes: Any, fn: Any) -> Any:
    if isinstance(shapes, dict):
        return {k: _map_dims(v, fn) for k, v in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        return [_map_dims(v, fn) for v in shapes]
    return fn(shapes)


def dynamic_shapes_to_json(shapes: dict[str, Any] | None) -> Any:
    # JSON object keys are strings; axes are restored to ints on load.
    if shapes is None:
        return None
    return {name: _map_dims(spec, _dim_to_json) for name, spec in shapes.items()}


def dynamic_shapes_from_json(data: dict[str, Any] | None) -> dict[str, Any] | None:
    if data is None:
        return None

    def restore(spec: Any) -> Any:
        if isinstance(spec, dict) and "dim" not in spec:
            # Axis keys come back from JSON as "0", "1"; keys of a nested dict input stay strings.
            return {int(a) if isinstance(a, str) and a.isdigit() else a: restore(v) for a, v in spec.items()}
        if isinstance(spec, list):
            return [restore(v) for v in spec]
        return _dim_from_json(spec)

    return {name: restore(spec) for name, spec in data.items()}


@dataclass
class ExportConfigMixin:
    """Base of every export config: `to_dict`/`from_dict`/JSON carrying `export_format`.

    quantizer: an `ExportQuantizer` run during the export (keyword only; see docs/quantization.md). `to_dict`
        records its class and settings as plain data; `from_dict` does not rebuild it (calibration data and
        toolkit objects are not JSON): a loaded config has `quantizer=None`, set it again to re-export.
    """

    export_format: ClassVar[str] = ""

    quantizer: Any = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.quantizer is not None and not isinstance(self.quantizer, ExportQuantizer):
            raise ConfigError(
                f"quantizer must be an ExportQuantizer (PT2EQuantizer, OnnxRuntimeQuantizer, ...), "
                f"got {type(self.quantizer).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"export_format": str(self.export_format)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "quantizer":
                value = None if value is None else value.to_dict()
            elif f.name == "dynamic_shapes":
                value = dynamic_shapes_to_json(value)
            elif isinstance(value, RuleSelection):
                value = value.to_dict()
            elif isinstance(value, Enum):
                value = value.value
            data[f.name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExportConfigMixin:
        data = dict(data)
        fmt = data.pop("export_format", cls.export_format)
        if str(fmt) != str(cls.export_format):
            raise ConfigError(f"{cls.__name__} is for export_format {cls.export_format!r}, got {fmt!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(names)}")
        if data.get("dynamic_shapes") is not None:
            if not isinstance(data["dynamic_shapes"], dict):
                raise ConfigError("dynamic_shapes must be a dict keyed by input name, as to_dict writes it")
            try:
                data["dynamic_shapes"] = dynamic_shapes_from_json(data["dynamic_shapes"])
            except (AttributeError, TypeError, ValueError, KeyError, AssertionError) as exc:
                # AssertionError: torch.export.Dim's own checks (e.g. a negative min).
                raise ConfigError(f"dynamic_shapes cannot be read back: {type(exc).__name__}: {exc}") from exc
        if isinstance(data.get("rules"), dict):
            try:
                data["rules"] = RuleSelection(**data["rules"])
            except TypeError as exc:
                raise ConfigError(f"rules takes the keys 'enable' and 'disable': {exc}") from exc
        _check_field_types(cls, data)
        # A recorded quantizer is a description, not the object: it is not rebuilt (see the class docstring).
        data.pop("quantizer", None)
        return cls(**data)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ExportConfigMixin:
        return cls.from_dict(json.loads(text))


_SIMPLE_TYPES = {"bool": (bool,), "int": (int,), "str": (str,), "float": (int, float)}


def _check_field_types(cls: type, data: dict[str, Any]) -> None:
    """Refuse a value of the wrong type for the plain fields (bool, int, str, float, optionally None)."""
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        annotation = str(f.type).replace(" ", "")
        optional = annotation.endswith("|None")
        allowed = _SIMPLE_TYPES.get(annotation.removesuffix("|None"))
        if allowed is None or (value is None and optional):
            continue
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
            raise ConfigError(f"{cls.__name__}.{f.name} takes {annotation.replace('|', ' | ')}, got {value!r}")


@dataclass
class DynamoConfig(ExportConfigMixin):
    """Capture options shared by every backend.

    dynamic: mark every axis of every input (and cache) `Dim.AUTO` when `dynamic_shapes` is not given.
    dynamic_shapes: passed to `torch.export.export` untouched (keys must be sample input names).
    strict: trace with TorchDynamo (`strict=True`) instead of the default Python-level tracer.
    prefer_deferred_runtime_asserts_over_guards: emit runtime asserts instead of failing on guards that
        do not hold over a whole explicit `Dim(min, max)` range.
    rules: which rewrite rules run (`RuleSelection(enable=..., disable=...)` by id or prefix).
    """

    export_format: ClassVar[str] = ExportFormat.DYNAMO.value

    dynamic: bool = False
    dynamic_shapes: dict[str, Any] | None = None
    strict: bool = False
    prefer_deferred_runtime_asserts_over_guards: bool = False
    rules: RuleSelection = field(default_factory=RuleSelection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rules, dict):
            self.rules = RuleSelection(**self.rules)
        if not isinstance(self.rules, RuleSelection):
            raise ConfigError(f"rules must be a RuleSelection, got {type(self.rules).__name__}")


def check_streaming_quantizer(config: Any) -> None:
    """Refuse a quantizer that cannot quantize a low-memory export (`ExportQuantizer.streaming_refusal`)."""
    quantizer = config.quantizer
    refusal = None if quantizer is None else quantizer.streaming_refusal(config.export_format)
    if refusal:
        raise ConfigError(f"low_memory=True cannot quantize with {quantizer!r}: {refusal}")


def _check_low_memory(config: Any) -> None:
    """The checks of `low_memory`/`checkpoint` that ONNX and OpenVINO configs share."""
    if config.checkpoint is not None:
        config.checkpoint = str(config.checkpoint)
    if config.low_memory:
        check_streaming_quantizer(config)
    if config.checkpoint is not None and not config.low_memory:
        raise ConfigError("checkpoint= is the low-memory export's weight source: set low_memory=True with it")


@dataclass
class OnnxConfig(DynamoConfig):
    """Options of the ONNX lowering, on top of the capture options of `DynamoConfig`.

    output_path: where to save the `.onnx` file (None keeps the `ONNXProgram` in memory only).
    opset_version: the ONNX opset of the model; None takes the newest the installed onnxscript converts to.
    external_data: save the weights in a `.onnx.data` side file, so models over protobuf's 2 GB limit work.
    optimize: run the onnxscript optimizer (constant folding, dead code); turn it off to work around an
        optimizer bug or to inspect the translated graph.
    export_params: False gives a graph without weights (no initializers).
    keep_initializers_as_inputs: also list the weights as graph inputs (runtimes of opset < 9 need it).
    fusions: the ONNX Runtime fusions to apply (the `onnx` rules of kind "optimization", run after the
        optimizer): "cpu" (RMSNorm -> SimplifiedLayerNormalization, ...) or None for a plain ONNX graph.
    low_memory: export a model whose weights hold no memory (`hfexport.empty_model(folder)`: FakeTensor
        weights) and stream its weights from the safetensors checkpoint into the `.onnx.data` file, one tensor
        at a time, when the program is saved (docs/low-memory.md).
    checkpoint: the checkpoint folder the low-memory export reads weights from; None takes the model's
        `name_or_path` (which `empty_model` sets).
    """

    export_format: ClassVar[str] = ExportFormat.ONNX.value

    output_path: str | None = None
    opset_version: int | None = None
    external_data: bool = True
    optimize: bool = True
    export_params: bool = True
    keep_initializers_as_inputs: bool = False
    fusions: str | None = "cpu"
    low_memory: bool = False
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_path is not None:
            # A Path from the caller is fine, but the config must round-trip through JSON.
            self.output_path = str(self.output_path)
        if self.low_memory and not self.external_data:
            # A model too large for memory is also over protobuf's 2 GB: its weights can only go to a .data file.
            raise ConfigError("low_memory=True writes the weights as external data: external_data must be True")
        _check_low_memory(self)
        if self.opset_version is not None and (not isinstance(self.opset_version, int) or self.opset_version < 18):
            # torchlib implements opset 18 and up; older opsets go through a lossy version conversion.
            raise ConfigError(f"opset_version must be an int >= 18 (None: the newest), got {self.opset_version!r}")
        if self.fusions not in (None, "cpu"):
            raise ConfigError(f"fusions must be 'cpu' or None, got {self.fusions!r}")


EXECUTORCH_BACKENDS = ("xnnpack", "cuda")


@dataclass
class ExecutorchConfig(DynamoConfig):
    """Options of the ExecuTorch lowering, on top of the capture options of `DynamoConfig`.

    backend: "xnnpack" (CPU, the default) or "cuda" (needs a CUDA device; asking for it without one
        raises `RuntimeError` before tracing).
    alloc_graph_input / alloc_graph_output / alloc_mutable_buffers: whether memory planning gives graph
        inputs, outputs and mutable buffers room in the program's own arena. Turn all three off so that
        in-place writes (a static cache) land in caller-owned tensors (bound with
        `Method::set_output_data_ptr` from C++).
    """

    export_format: ClassVar[str] = ExportFormat.EXECUTORCH.value

    backend: str = "xnnpack"
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    alloc_mutable_buffers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in EXECUTORCH_BACKENDS:
            raise ConfigError(f"backend must be one of {EXECUTORCH_BACKENDS}, got {self.backend!r}")


@dataclass
class OpenVINOConfig(DynamoConfig):
    """Options of the OpenVINO lowering, on top of the capture options of `DynamoConfig`.

    output_path: where to save the model as OpenVINO IR (`model.xml` + `model.bin`); None keeps the
        `openvino.Model` in memory only.
    compress_to_fp16: when saving, store float weights as fp16 (OpenVINO's own default); compute
        precision is chosen at compile time by the device's inference-precision hint.
    stateful: keep the cache inside the infer request: every cache input `input.<name>` and the output
        `output.<name>` it pairs with become one OpenVINO variable (ReadValue/Assign), so a decode step feeds
        only its tokens, mask and positions. `hfexport.runtime.generate` resets the state per generation.
        A model without such pairs is left stateless (with a note in the report).
    low_memory: export a model whose weights hold no memory (`hfexport.empty_model(folder)`) and write its
        weights into the IR's `.bin` from the safetensors checkpoint, one tensor at a time, when it is saved; the
        `openvino.Model` returned holds placeholder (zero) weights until then (docs/low-memory.md).
    checkpoint: the checkpoint folder the low-memory export reads weights from; None takes the model's
        `name_or_path` (which `empty_model` sets).
    """

    export_format: ClassVar[str] = ExportFormat.OPENVINO.value

    output_path: str | None = None
    compress_to_fp16: bool = True
    stateful: bool = False
    low_memory: bool = False
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_path is not None:
            self.output_path = str(self.output_path)
            # OpenVINO IR is a pair: the .xml graph names its .bin weights beside it.
            if not self.output_path.endswith(".xml"):
                raise ConfigError(
                    f"output_path must name the IR's .xml file (weights go to .bin beside it), got {self.output_path!r}"
                )
        _check_low_memory(self)
