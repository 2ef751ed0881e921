"""Export configs: the base every config shares (`ExportConfigMixin`: dicts and JSON keyed by `export_format`).

Each backend's config class lives in its folder (`hfexport/backends/<name>/config.py`, named by its descriptor);
the backends' configs subclass `DynamoConfig`, since every backend starts from the same torch.export capture. The
config classes are also names of this module (`hfexport.configs.OnnxConfig`), looked up in the descriptors.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from hfexport.backends.registry import lazy_classes
from hfexport.core.errors import ConfigError
from hfexport.formats import ExportFormat as ExportFormat
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


def check_streaming_quantizer(config: Any) -> None:
    """Refuse a quantizer that cannot quantize a low-memory export (`ExportQuantizer.streaming_refusal`)."""
    quantizer = config.quantizer
    refusal = None if quantizer is None else quantizer.streaming_refusal(config.export_format)
    if refusal:
        raise ConfigError(f"low_memory=True cannot quantize with {quantizer!r}: {refusal}")


def check_low_memory(config: Any) -> None:
    """The checks of `low_memory`/`checkpoint` that ONNX and OpenVINO configs share."""
    if config.checkpoint is not None:
        config.checkpoint = str(config.checkpoint)
    if config.low_memory:
        check_streaming_quantizer(config)
    if config.checkpoint is not None and not config.low_memory:
        raise ConfigError("checkpoint= is the low-memory export's weight source: set low_memory=True with it")


# The backends' config classes by name, imported from their folders on first use.
__getattr__ = lazy_classes(__name__, "config")
