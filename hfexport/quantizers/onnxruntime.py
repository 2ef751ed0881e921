"""`OnnxRuntimeQuantizer`: onnxruntime.quantization on the ONNX model after lowering.

`OnnxRuntimeStaticConfig` (the default) runs `quantize_static`: int8 QDQ activations and weights, activation
ranges calibrated on `calibration_dataset`. `OnnxRuntimeDynamicConfig` runs `quantize_dynamic`: int8 weights,
activations quantized at run time (MatMulInteger), no calibration data.

Both quantize `MatMul` and `Gemm` by default. The ONNX lowering's CPU fusions produce `com.microsoft.Attention`,
which `quantize_dynamic` would turn into a `QAttention` that rejects the `is_causal` attribute, and quantizing
the activations of LayerNorm/Softmax/GELU costs accuracy on transformers (docs/quantization.md has the
measurements). Pass `op_types_to_quantize=None` for ONNX Runtime's own choice.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hfexport.core.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.naming import onnx_feed
from hfexport.quantizers.base import CalibrationSet, ExportQuantizer, jsonable, traced_inputs

_QUANT_TYPES = ("qint8", "quint8")
_CALIBRATE_METHODS = ("minmax", "entropy", "percentile", "distribution")
# Beyond this, the model goes to ONNX Runtime with its weights in an external data file (protobuf's 2 GB limit).
_EXTERNAL_DATA_BYTES = 1 << 30


def _check_type(name: str, value: str) -> None:
    if value not in _QUANT_TYPES:
        raise ConfigError(f"{name} must be one of {_QUANT_TYPES}, got {value!r}")


@dataclass
class OnnxRuntimeStaticConfig:
    """Arguments of `onnxruntime.quantization.quantize_static`.

    quant_format: "qdq" (QuantizeLinear/DequantizeLinear pairs, the default) or "qoperator" (QLinear* ops).
    per_channel: one scale per output channel of each weight (more accurate; the default).
    reduce_range: 7-bit weights; avoids the saturation of u8s8 matmuls on CPUs without VNNI (AVX2 only).
    activation_type / weight_type: "quint8" / "qint8" (the defaults) or the other.
    calibrate_method: "minmax" (the default), "entropy", "percentile" or "distribution".
    op_types_to_quantize: ONNX op types to quantize; None lets ONNX Runtime choose (every op it can).
    nodes_to_exclude: node names kept in float.
    extra_options: passed through (e.g. {"ActivationSymmetric": True}).
    """

    quant_format: str = "qdq"
    per_channel: bool = True
    reduce_range: bool = False
    activation_type: str = "quint8"
    weight_type: str = "qint8"
    calibrate_method: str = "minmax"
    op_types_to_quantize: tuple[str, ...] | None = ("MatMul", "Gemm")
    nodes_to_exclude: tuple[str, ...] = ()
    extra_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.quant_format not in ("qdq", "qoperator"):
            raise ConfigError(f"quant_format must be 'qdq' or 'qoperator', got {self.quant_format!r}")
        _check_type("activation_type", self.activation_type)
        _check_type("weight_type", self.weight_type)
        if self.calibrate_method not in _CALIBRATE_METHODS:
            raise ConfigError(f"calibrate_method must be one of {_CALIBRATE_METHODS}, got {self.calibrate_method!r}")


@dataclass
class OnnxRuntimeDynamicConfig:
    """Arguments of `onnxruntime.quantization.quantize_dynamic` (no calibration).

    per_channel: one scale per output channel of each weight (the default; per-tensor loses about 0.03 of
        cosine similarity on MiniLM). reduce_range, weight_type, op_types_to_quantize, nodes_to_exclude,
        extra_options: as in `OnnxRuntimeStaticConfig`.
    """

    per_channel: bool = True
    reduce_range: bool = False
    weight_type: str = "qint8"
    op_types_to_quantize: tuple[str, ...] | None = ("MatMul", "Gemm")
    nodes_to_exclude: tuple[str, ...] = ()
    extra_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_type("weight_type", self.weight_type)


class _Reader:
    """An ONNX Runtime `CalibrationDataReader` over a `CalibrationSet` (rewinds for each pass)."""

    def __init__(self, calibration: CalibrationSet) -> None:
        self.calibration = calibration
        self._iterator: Any = None

    def get_next(self) -> dict[str, Any] | None:
        if self._iterator is None:
            self._iterator = iter(self.calibration)
        return next(self._iterator, None)

    def rewind(self) -> None:
        self._iterator = None


class OnnxRuntimeQuantizer(ExportQuantizer):
    """Quantize the lowered ONNX model with ONNX Runtime's quantization tool (static QDQ by default)."""

    supported_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.ONNX,)
    required_packages: ClassVar[tuple[str, ...]] = ("onnxruntime", "onnx", "onnx-ir")
    min_versions: ClassVar[dict[str, str]] = {"onnxruntime": "1.17.0"}
    tested_versions: ClassVar[dict[str, str]] = {"onnxruntime": "1.32.0"}
    supports_keep_float: ClassVar[bool] = True
    # The tool quantizes every MatMul: attention written as MatMul/Softmax/MatMul would have its scores quantized
    # too (MiniLM static int8 lost 0.002 cosine against the toolkit's quantization of the plain export).
    disabled_rules: ClassVar[tuple[str, ...]] = ("onnx/attention-as-matmul",)
    # The tool quantizes a MatMul only where its weight is an initializer; a tied head reads the embedding through a
    # Transpose, so it stayed float (89 of 138 ms of a 2-layer SmolLM2-shaped int8 decode): the rule gives it one.
    # Attention left as Attention-25 (ORT 1.32 inlines its function body per layer: 75 % of a 30-layer SmolLM2
    # int8 decode step) is rewritten after the tool instead, its scores float.
    enabled_rules: ClassVar[tuple[str, ...]] = (
        "onnx/fold-shared-weight-transpose",
        "onnx/quantized-attention-as-matmul",
    )

    def __init__(
        self,
        config: OnnxRuntimeStaticConfig | OnnxRuntimeDynamicConfig | None = None,
        calibration_dataset: Iterable[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(calibration_dataset)
        config = OnnxRuntimeStaticConfig() if config is None else config
        if not isinstance(config, (OnnxRuntimeStaticConfig, OnnxRuntimeDynamicConfig)):
            raise ConfigError(
                "OnnxRuntimeQuantizer takes an OnnxRuntimeStaticConfig or OnnxRuntimeDynamicConfig, "
                f"got {type(config).__name__}"
            )
        self.config = config

    @property
    def needs_calibration(self) -> bool:
        return isinstance(self.config, OnnxRuntimeStaticConfig)

    def settings(self) -> dict[str, Any]:
        return {"recipe": type(self.config).__name__, **jsonable(dataclasses.asdict(self.config))}

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat) -> Any:
        import onnx
        import onnx_ir as ir
        from onnxruntime import quantization as ortq

        from hfexport.quantizers.scopes import onnx_nodes_in

        config = self.config
        kept = onnx_nodes_in(model, self.keep_float) if self.keep_float else []
        if self.keep_float and not kept:
            raise ConfigError(f"keep_float {list(self.keep_float)} names no module of this model")
        common: dict[str, Any] = {
            "per_channel": config.per_channel,
            "reduce_range": config.reduce_range,
            "weight_type": getattr(ortq.QuantType, _type_name(config.weight_type)),
            "op_types_to_quantize": list(config.op_types_to_quantize) if config.op_types_to_quantize else None,
            "nodes_to_exclude": [*config.nodes_to_exclude, *kept],
            "extra_options": dict(config.extra_options),
        }
        with tempfile.TemporaryDirectory(prefix="hfexport-ort-") as tmp:
            source, target = Path(tmp) / "model.onnx", Path(tmp) / "quantized.onnx"
            large = _initializer_bytes(model) > _EXTERNAL_DATA_BYTES
            ir.save(model, source, external_data="model.onnx.data" if large else None)
            common["use_external_data_format"] = large
            if isinstance(config, OnnxRuntimeStaticConfig):
                names = [value.name for value in model.graph.inputs]
                calibration = self.calibration(sample_inputs, lambda sample: onnx_feed(names, traced_inputs(sample)))
                reader = _Reader(calibration)
                ortq.quantize_static(
                    str(source),
                    str(target),
                    _as_data_reader(reader, ortq),
                    quant_format=ortq.QuantFormat.QDQ if config.quant_format == "qdq" else ortq.QuantFormat.QOperator,
                    activation_type=getattr(ortq.QuantType, _type_name(config.activation_type)),
                    calibrate_method=getattr(ortq.CalibrationMethod, _method_name(config.calibrate_method)),
                    **common,
                )
            else:
                ortq.quantize_dynamic(str(source), str(target), **common)
            # Loaded fully (external data included) before the temporary folder goes away.
            return onnx.load(str(target), load_external_data=True)


def _type_name(value: str) -> str:
    return {"qint8": "QInt8", "quint8": "QUInt8"}[value]


def _method_name(value: str) -> str:
    return {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}[value]


def _as_data_reader(reader: _Reader, ortq: Any) -> Any:
    # quantize_static checks isinstance(reader, CalibrationDataReader); the base class lives in onnxruntime.
    class Reader(ortq.CalibrationDataReader):
        def get_next(self) -> dict[str, Any] | None:
            return reader.get_next()

        def rewind(self) -> None:
            reader.rewind()

    return Reader()


def _initializer_bytes(model: Any) -> int:
    total = 0
    for value in model.graph.initializers.values():
        const = value.const_value
        if const is not None:
            total += const.nbytes
    return total
