"""NNCF quantizers: one per representation NNCF quantizes (the FX graph, the ONNX model, the OpenVINO model).

Each takes either recipe:

- `NNCFQuantizationConfig` (the default): `nncf.quantize`, int8 activations and weights, calibrated on
  `calibration_dataset`, `model_type=TRANSFORMER` unless told otherwise.
- `NNCFWeightCompressionConfig`: `nncf.compress_weights`, weight-only int8 or int4 (group size, mixed
  precision ratio, AWQ / scale estimation / GPTQ / LoRA correction where the backend has them). Matmuls stay in
  floating point. Int8 weight compression never reads calibration data; int4 reads it when it is given or
  when a data-aware algorithm is switched on.

Settings that name an NNCF enum accept the enum or its value (`"int4_sym"`, `"transformer"`), so a config
can be written before NNCF is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from hfexport.core.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.naming import onnx_feed, openvino_feed
from hfexport.quantizers.base import ExportQuantizer, jsonable, traced_inputs

logger = logging.getLogger("hfexport")

_NNCF_TESTED = {"nncf": "3.4.0"}
_NNCF_MIN = {"nncf": "2.16.0"}
# The newest ONNX opset at which ONNX Runtime loads the QDQ graph `nncf.quantize` writes (see NNCFOnnxQuantizer).
MAX_ONNX_INT8_OPSET = 20


def _enum(kind: str, value: Any) -> Any:
    """`value` as the NNCF enum `kind` (e.g. "ModelType"), matched by value or name, case-insensitive."""
    if value is None or isinstance(value, Enum):
        return value
    import nncf

    enum = getattr(nncf, kind)
    for member in enum:
        if str(value).lower() in (str(member.value).lower(), member.name.lower()):
            return member
    raise ConfigError(f"{value!r} is not an nncf.{kind}; choose from {[m.value for m in enum]}")


def _value(value: Any) -> str:
    return str(value.value if isinstance(value, Enum) else value).lower()


@dataclass
class NNCFQuantizationConfig:
    """Arguments of `nncf.quantize` (int8 activations and weights, calibrated).

    model_type: "transformer" (the default: keeps sensitive ops such as softmax and layer norm in float);
        None for NNCF's generic placement.
    preset: "performance" (symmetric) or "mixed" (asymmetric activations); None lets NNCF choose.
    target_device, subset_size, fast_bias_correction, ignored_scope, advanced_parameters: as in `nncf.quantize`.
    """

    model_type: Any = "transformer"
    preset: Any = None
    target_device: Any = "ANY"
    subset_size: int = 300
    fast_bias_correction: bool = True
    ignored_scope: Any = None
    advanced_parameters: Any = None

    def nncf_kwargs(self) -> dict[str, Any]:
        return {
            "model_type": _enum("ModelType", self.model_type),
            "preset": _enum("QuantizationPreset", self.preset),
            "target_device": _enum("TargetDevice", self.target_device),
            "subset_size": self.subset_size,
            "fast_bias_correction": self.fast_bias_correction,
            "ignored_scope": self.ignored_scope,
            "advanced_parameters": self.advanced_parameters,
        }


@dataclass
class NNCFWeightCompressionConfig:
    """Arguments of `nncf.compress_weights` (weight-only int8/int4).

    mode: an `nncf.CompressWeightsMode` or its value: "int8_asym" (the default), "int8_sym", "int4_sym",
        "int4_asym", ...
    group_size: int4 block size (None: NNCF's default, 128; -1: per channel).
    ratio: share of the weights in `mode`, the rest in int8 (int4 only; None: all of them).
    awq, scale_estimation, gptq, lora_correction: data-aware int4 algorithms (they read calibration data).
    all_layers, sensitivity_metric, subset_size, ignored_scope, backup_mode, advanced_parameters: as in
        `nncf.compress_weights`.
    """

    mode: Any = "int8_asym"
    group_size: int | None = None
    ratio: float | None = None
    awq: bool | None = None
    scale_estimation: bool | None = None
    gptq: bool | None = None
    lora_correction: bool | None = None
    all_layers: bool | None = None
    sensitivity_metric: Any = None
    subset_size: int = 128
    ignored_scope: Any = None
    backup_mode: Any = None
    advanced_parameters: Any = None

    def __post_init__(self) -> None:
        if self.is_int8 and any((self.awq, self.scale_estimation, self.gptq, self.lora_correction)):
            raise ConfigError("awq, scale_estimation, gptq and lora_correction apply to int4 modes, not int8")

    @property
    def is_int8(self) -> bool:
        return _value(self.mode).startswith("int8")

    @property
    def data_aware(self) -> bool:
        """Whether an algorithm that needs calibration data is on (int8 compression never needs it)."""
        return not self.is_int8 and bool(
            self.awq or self.scale_estimation or self.gptq or self.lora_correction or self.sensitivity_metric
        )

    def nncf_kwargs(self) -> dict[str, Any]:
        kwargs = {
            "mode": _enum("CompressWeightsMode", self.mode),
            "group_size": self.group_size,
            "ratio": self.ratio,
            "awq": self.awq,
            "scale_estimation": self.scale_estimation,
            "gptq": self.gptq,
            "lora_correction": self.lora_correction,
            "all_layers": self.all_layers,
            "sensitivity_metric": _enum("SensitivityMetric", self.sensitivity_metric),
            "subset_size": self.subset_size,
            "ignored_scope": self.ignored_scope,
            "backup_mode": _enum("BackupMode", self.backup_mode),
            "advanced_parameters": self.advanced_parameters,
        }
        # Unset options are left to NNCF's own defaults (some backends reject an explicit None).
        return {k: v for k, v in kwargs.items() if v is not None}


NNCFConfig = NNCFQuantizationConfig | NNCFWeightCompressionConfig

# Weight compression modes whose every output (compressed weight, scale, zero point) NNCF computes from one weight
# alone, with integer arithmetic the low-memory export repeats per weight (`compress_weight`).
STREAMING_MODES = ("int8_asym", "int8_sym", "int4_sym", "int4_asym")


def _weight_compression_refusal(config: NNCFConfig, calibration_dataset: Any) -> str | None:
    """Why `config` cannot compress a low-memory export's weights one at a time as they stream (None: it can)."""
    if not isinstance(config, NNCFWeightCompressionConfig):
        return (
            "NNCFQuantizationConfig quantizes activations, calibrated by running the model on data; the low-memory "
            f"export compresses weights only, data-free: NNCFWeightCompressionConfig(mode={'|'.join(STREAMING_MODES)})"
        )
    if _value(config.mode) not in STREAMING_MODES:
        return f"mode {_value(config.mode)!r}: the low-memory export compresses in {', '.join(STREAMING_MODES)}"
    data_aware = [name for name in ("awq", "scale_estimation", "gptq", "lora_correction") if getattr(config, name)]
    if data_aware:
        return (
            f"{', '.join(data_aware)} read(s) activations of the whole model on calibration data, and the result of "
            "each weight depends on them; only data-free compression works weight by weight"
        )
    if calibration_dataset is not None:
        return "a calibration_dataset makes NNCF's int4 compression data-aware; drop it to compress weight by weight"
    if (config.ratio is not None and config.ratio != 1) or config.sensitivity_metric is not None:
        return (
            "a ratio below 1 (or a sensitivity_metric) ranks the weights by their sensitivity, computed from every "
            "weight of the model, to choose which stay int8: set ratio=None or 1"
        )
    if config.advanced_parameters is not None:
        return "advanced_parameters can change NNCF's arithmetic, which the low-memory export does not repeat"
    return None


@contextmanager
def compiled_compression_released() -> Iterator[None]:
    """Where OpenVINO is installed, NNCF compresses each weight of 10,000 elements and up with a model OpenVINO
    compiles (`weight_lowering._can_run_optimized`, nncf 3.4) and keeps every compiled model, with buffers sized for
    its weight, in `OV_MODEL_CACHE` for the life of the process. Inside this block none is kept: each compiled
    model goes with its weight (one compilation per weight instead of per shape), and the cache is emptied when the
    block ends. On a 30-layer SmolLM2-135M shape this lowers the int4 export's peak by about 270 MB (1999 -> 1732 MB)
    and the RSS after NNCF by as much; the values NNCF computes are the same."""
    try:
        from nncf.common.utils.caching import disable_results_caching
        from nncf.openvino.optimized_functions.models import OV_MODEL_CACHE, clear_ov_model_cache
    except ImportError:  # no OpenVINO: NNCF computes with numpy and compiles nothing
        yield
        return
    try:
        with disable_results_caching(OV_MODEL_CACHE):
            yield
    finally:
        clear_ov_model_cache()


class _NNCFQuantizer(ExportQuantizer):
    """Shared by the three NNCF quantizers: the recipe, the calibration and the call into NNCF."""

    required_packages: ClassVar[tuple[str, ...]] = ("nncf",)
    min_versions: ClassVar[dict[str, str]] = _NNCF_MIN
    tested_versions: ClassVar[dict[str, str]] = _NNCF_TESTED
    supports_keep_float: ClassVar[bool] = True

    def __init__(
        self, config: NNCFConfig | None = None, calibration_dataset: Iterable[Mapping[str, Any]] | None = None
    ) -> None:
        super().__init__(calibration_dataset)
        config = NNCFQuantizationConfig() if config is None else config
        if not isinstance(config, (NNCFQuantizationConfig, NNCFWeightCompressionConfig)):
            raise ConfigError(
                f"{type(self).__name__} takes an NNCFQuantizationConfig or NNCFWeightCompressionConfig, "
                f"got {type(config).__name__}"
            )
        self.config = config

    @property
    def weight_only(self) -> bool:
        return isinstance(self.config, NNCFWeightCompressionConfig)

    @property
    def needs_calibration(self) -> bool:
        if isinstance(self.config, NNCFWeightCompressionConfig):
            return self.config.data_aware or (not self.config.is_int8 and self.calibration_dataset is not None)
        return True

    def settings(self) -> dict[str, Any]:
        return {"recipe": type(self.config).__name__, **jsonable(dataclasses.asdict(self.config))}

    def _ignored_scope(self, kept: list[str]) -> Any:
        """The config's `ignored_scope`, plus `kept`: the nodes of the `keep_float` modules, by NNCF's names."""
        scope = self.config.ignored_scope
        if not self.keep_float:
            return scope
        import nncf

        if not kept:
            raise ConfigError(f"keep_float {list(self.keep_float)} names no module of this model")
        if scope is None:
            return nncf.IgnoredScope(names=kept, validate=False)
        return nncf.IgnoredScope(
            names=[*scope.names, *kept],
            patterns=scope.patterns,
            types=scope.types,
            subgraphs=scope.subgraphs,
            validate=False,
        )

    def _run(
        self,
        model: Any,
        sample_inputs: Mapping[str, Any],
        feed: Callable[[Mapping[str, Any]], Any],
        kept: list[str] | None = None,
    ) -> Any:
        """NNCF on `model`; `kept`: the node names `keep_float` excludes (`hfexport.quantizers.scopes`)."""
        import nncf

        kwargs = self.config.nncf_kwargs()
        if self.keep_float:
            kwargs["ignored_scope"] = self._ignored_scope(kept or [])
        if isinstance(self.config, NNCFQuantizationConfig):
            dataset = nncf.Dataset(self.calibration(sample_inputs, feed))
            return nncf.quantize(model, dataset, **kwargs)
        if self.needs_calibration:
            kwargs["dataset"] = nncf.Dataset(self.calibration(sample_inputs, feed))
        return nncf.compress_weights(model, **kwargs)


class NNCFTorchFXQuantizer(_NNCFQuantizer):
    """NNCF on the captured FX graph, before lowering: every backend receives the result.

    ExecuTorch takes only weight compression (`NNCFWeightCompressionConfig`): int8 activation quantization
    leaves quantize/dequantize pairs that no ExecuTorch delegate lowers. The compressed weights are decompressed
    in the graph before each linear; the rules `executorch/quant-*`, `openvino/quant-*` and
    `aten/unsigned-right-shift` carry that graph through XNNPACK, `openvino.convert_model` and torch.onnx (see
    docs/quantization.md). `nncf.quantize` (nncf 3.4) cannot read graphs with symbolic shapes, so int8
    quantization needs a static export (`dynamic=False`, no `dynamic_shapes`); weight compression works on dynamic
    graphs. With `NNCFQuantizationConfig` the export runs `fx/untie-shared-weights`: nncf.quantize changes a weight
    for every reader of it, so a tied embedding would read the head's int8 weight.
    """

    quantizes_fx_graph: ClassVar[bool] = True
    # Every format: each starts from the captured FX graph.
    supported_formats: ClassVar[tuple[ExportFormat, ...]] = tuple(ExportFormat)
    # Where int8 activations leave quantize/dequantize pairs that no delegate lowers.
    weight_only_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.EXECUTORCH,)

    @property
    def enabled_rules(self) -> tuple[str, ...]:  # type: ignore[override]
        # nncf.quantize replaces a weight for every reader of its get_attr node: a tied embedding would take the
        # head's int8 weight. Weight compression handles a shared weight itself (one decompression, both readers).
        return () if self.weight_only else ("fx/untie-shared-weights",)

    def check_format(self, export_format: str | ExportFormat) -> None:
        super().check_format(export_format)
        if str(export_format) in map(str, self.weight_only_formats) and not self.weight_only:
            raise ConfigError(
                "NNCFTorchFXQuantizer on ExecuTorch takes weight compression only: pass "
                "NNCFWeightCompressionConfig(...), or use PT2EQuantizer(XNNPACKQuantizer(...)) for int8 activations"
            )

    def newest_onnx_opset(self, config: Any = None) -> int | None:
        return None if self.weight_only else MAX_ONNX_INT8_OPSET

    def check_config(self, config: Any) -> None:
        # A config with an ONNX opset (`OnnxConfig.opset_version`; None: the newest).
        onnx = hasattr(config, "opset_version")
        opset = getattr(config, "opset_version", None)
        if onnx and not self.weight_only and (opset or 99) > MAX_ONNX_INT8_OPSET:
            raise ConfigError(
                f"NNCFTorchFXQuantizer int8 on ONNX needs OnnxConfig(opset_version={MAX_ONNX_INT8_OPSET}) or lower: "
                "ONNX Runtime cannot load NNCF's int8 QDQ graph at newer opsets (see NNCFOnnxQuantizer)"
            )
        if not self.weight_only and (getattr(config, "dynamic", False) or getattr(config, "dynamic_shapes", None)):
            raise ConfigError(
                "NNCFTorchFXQuantizer with NNCFQuantizationConfig needs a static export: nncf.quantize cannot read "
                "FX graphs with symbolic shapes. Export with dynamic=False, or use PT2EQuantizer or "
                "NNCFWeightCompressionConfig for a dynamic export"
            )

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat) -> Any:
        from hfexport.quantizers.scopes import fx_nodes_in

        kept = fx_nodes_in(model, self.keep_float) if self.keep_float else None
        return self._run(model, sample_inputs, lambda sample: traced_inputs(sample, sample_inputs), kept)


class NNCFOnnxQuantizer(_NNCFQuantizer):
    """NNCF on the ONNX model after lowering. Int4 weight compression becomes ONNX Runtime's `MatMulNBits` at
    opset <= 20 and blocked `DequantizeLinear` at opset 21 and up, which the rule `onnx/blocked-dequantize-matmul-
    nbits` turns into the same `MatMulNBits` (so weight compression exports at the newest opset, with its fusions;
    a low-memory export at 20).

    accuracy_level: the `MatMulNBits` `accuracy_level` of the int4 weights (weight compression only): 4 (the
        default, as onnxruntime-genai's builder) quantizes the activations to int8 per block and runs integer
        products; 0 computes in float (each block dequantized, float products); 1 to 3 ask for fp32 / fp16 / bf16
        compute, which ONNX Runtime's CPU kernels run as 0. On a trained model both give the same accuracy, and 4 is
        faster on the CPU (docs/quantization.md, "MatMulNBits accuracy level").
    """

    ACCURACY_LEVELS: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)

    supported_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.ONNX,)
    required_packages: ClassVar[tuple[str, ...]] = ("nncf", "onnx", "onnx-ir")
    # NNCF reads a tied head's weight under its Transpose's output name and fails ("There is no tensor with the
    # name val_..."): the rule gives that MatMul a transposed initializer of its own.
    enabled_rules: ClassVar[tuple[str, ...]] = ("onnx/fold-shared-weight-transpose",)

    def __init__(
        self,
        config: NNCFConfig | None = None,
        calibration_dataset: Iterable[Mapping[str, Any]] | None = None,
        accuracy_level: int = 4,
    ) -> None:
        super().__init__(config, calibration_dataset)
        if accuracy_level not in self.ACCURACY_LEVELS:
            raise ConfigError(f"accuracy_level={accuracy_level!r}: MatMulNBits takes one of {self.ACCURACY_LEVELS}")
        self.accuracy_level = accuracy_level

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        if self.weight_only:
            settings["accuracy_level"] = self.accuracy_level
        return settings

    def newest_onnx_opset(self, config: Any = None) -> int | None:
        # int8 activations: the newest opset ONNX Runtime loads NNCF's QDQ graph at. Weight compression: any (the
        # newest, where the opset-23 fusions apply); NNCF writes int4 groups there as blocked DequantizeLinear,
        # which `onnx/blocked-dequantize-matmul-nbits` turns into the MatMulNBits it writes below opset 21. A
        # low-memory export stays at 20: its weights are computed when saved, in the layout NNCF chose
        # (quantize_streaming), which the rule does not repack.
        if self.weight_only and not getattr(config, "low_memory", False):
            return None
        return MAX_ONNX_INT8_OPSET

    def check_config(self, config: Any) -> None:
        opset = getattr(config, "opset_version", None)
        if not self.weight_only and (opset is None or opset > MAX_ONNX_INT8_OPSET):
            # nncf 3.4's QDQ graph at opset 25 fails ONNX Runtime 1.32's session optimizer ("QuantizeLinear
            # output_dtype INT8 does not match y_zero_point type UINT8"); at opset 20 it loads and runs.
            raise ConfigError(
                f"NNCFOnnxQuantizer with NNCFQuantizationConfig needs OnnxConfig(opset_version={MAX_ONNX_INT8_OPSET}) "
                f"or lower (got {opset or 'the newest opset'}): ONNX Runtime cannot load NNCF's int8 graph at newer "
                "opsets. Weight compression (NNCFWeightCompressionConfig) works at any opset"
            )

    def streaming_refusal(self, export_format: str | ExportFormat) -> str | None:
        # Runs on the model with placeholder weights (external data of zeros): the graph is NNCF's, the values are
        # computed per weight from the checkpoint when saved (hfexport/lowerings/quantize_streaming.py).
        return _weight_compression_refusal(self.config, self.calibration_dataset)

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat) -> Any:
        import onnx_ir as ir

        from hfexport.lowerings.onnx import STREAMED_KEY
        from hfexport.quantizers.scopes import onnx_nodes_in

        kept = onnx_nodes_in(model, self.keep_float) if self.keep_float else None
        if STREAMED_KEY in model.metadata_props:  # a low-memory export: its weights are lazy, never all read
            from hfexport.lowerings.quantize_streaming import compress_streamed_onnx

            with compiled_compression_released():
                quantized = compress_streamed_onnx(model, functools.partial(self._compress_external, kept=kept))
        else:
            names = [value.name for value in model.graph.inputs]
            quantized = self._compress_weightwise(model, kept)
            if quantized is None:
                proto = ir.to_proto(model)
                quantized = ir.from_proto(
                    self._run(proto, sample_inputs, lambda s: onnx_feed(names, traced_inputs(s)), kept)
                )
        if self.weight_only:
            self._set_accuracy_level(quantized)
        return quantized

    def _set_accuracy_level(self, model: Any) -> None:
        """The accuracy level on the `MatMulNBits` NNCF wrote (opset <= 20: it writes 0) and, for the rules that write
        the others after the quantizer (`onnx/blocked-dequantize-matmul-nbits`), on the model."""
        import onnx_ir as ir

        from hfexport.rewrites.rules.onnx._quantized import ACCURACY_LEVEL_KEY

        model.metadata_props[ACCURACY_LEVEL_KEY] = str(self.accuracy_level)
        for node in model.graph.all_nodes():
            if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
                node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", self.accuracy_level)

    def _compress_weightwise(self, model: Any, kept: list[str] | None) -> Any:
        """`model` compressed by NNCF reading its weights one at a time from a file (`compress_onnx_from_file`),
        or None where the recipe reads more than each weight alone (`streaming_refusal`: calibration data,
        advanced parameters): then NNCF runs on the whole model in memory."""
        from hfexport.lowerings.quantize_streaming import compress_onnx_from_file

        if self.streaming_refusal(ExportFormat.ONNX) is not None:
            return None
        with compiled_compression_released():
            return compress_onnx_from_file(model, functools.partial(self._compress_external, kept=kept))

    def _compress_external(self, proto: Any, external_data_dir: str, kept: list[str] | None = None) -> Any:
        """Data-free weight compression of `proto`, whose weights are external data in `external_data_dir`."""
        import nncf
        from nncf.onnx.quantization.backend_parameters import BackendParameters

        kwargs = self.config.nncf_kwargs()  # streaming_refusal: weight compression, no advanced_parameters
        if self.keep_float:
            kwargs["ignored_scope"] = self._ignored_scope(kept or [])
        params = {BackendParameters.EXTERNAL_DATA_DIR: external_data_dir}
        kwargs["advanced_parameters"] = nncf.AdvancedCompressionParameters(backend_params=params)
        return nncf.compress_weights(proto, **kwargs)


class NNCFOpenVINOQuantizer(_NNCFQuantizer):
    """NNCF on the `openvino.Model` after conversion (int8 FakeQuantize, or int8/int4 compressed weights)."""

    supported_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.OPENVINO,)
    required_packages: ClassVar[tuple[str, ...]] = ("nncf", "openvino")

    def streaming_refusal(self, export_format: str | ExportFormat) -> str | None:
        # Runs on the model built on placeholders: the graph is NNCF's, the values are recomputed per weight from
        # the checkpoint when saved (hfexport/lowerings/quantize_streaming.py).
        return _weight_compression_refusal(self.config, self.calibration_dataset)

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat) -> Any:
        from hfexport.quantizers.scopes import openvino_nodes_in

        kept = openvino_nodes_in(model, self.keep_float) if self.keep_float else None
        return self._run(model, sample_inputs, lambda sample: openvino_feed(traced_inputs(sample), model), kept)
