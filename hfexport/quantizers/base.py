"""The quantizer contract: `ExportQuantizer`, calibration data (`CalibrationSet`) and the feeds.

A quantizer runs at one fixed point of an export:

- `quantizes_fx_graph = True`: on the `torch.fx.GraphModule` of the captured program (`program.module()`),
  between capture and lowering, so every backend receives the quantized graph. It returns a GraphModule
  (re-exported by hfexport with the capture's own dynamic shapes) or an `ExportedProgram`.
- `quantizes_eager_model = True`: on the eager `torch.nn.Module`, before capture (a toolkit that swaps modules or
  weights, such as torchao's `quantize_`). It returns a quantized copy and never changes the caller's model; the
  copy is captured and lowered as a float model would be. `export_for_generation` quantizes the model once and
  every component is traced from that one copy.
- otherwise: on the model the backend produced (an `onnx_ir.Model` for ONNX, an
  `openvino.Model` for OpenVINO), after lowering and before saving. It returns the quantized model (for
  ONNX an `onnx.ModelProto` is accepted too).

The export checks `supported_formats` and the packages (`required_packages`, `min_versions`,
`tested_versions`) before tracing. Heavy packages are imported inside `quantize`, never at import time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum
from typing import Any, ClassVar

import torch

from hfexport.core.errors import ConfigError, InputError
from hfexport.core.versions import check_packages
from hfexport.formats import ExportFormat

logger = logging.getLogger("hfexport")

__all__ = [
    "CalibrationSet",
    "ExportQuantizer",
    "jsonable",
    "traced_inputs",
]


def _as_tensor(value: Any) -> Any:
    # A tokenizer called without return_tensors gives lists; numpy arrays come from datasets' numpy format.
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return torch.tensor([value])
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return torch.tensor(value)
    if type(value).__module__ == "numpy":
        return torch.as_tensor(value)
    return value


def traced_inputs(sample: Mapping[str, Any], sample_inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The forward kwargs of a traced graph (`program.module()`) for one calibration `sample`.

    With the export's `sample_inputs`, the result holds exactly their names, in their order: a name the
    sample lacks (a constant such as `use_cache=True`, a cache) is taken from `sample_inputs`, and a key the
    export did not take (e.g. `token_type_ids`) is dropped. A missing tensor input raises `KeyError`.
    """
    if not isinstance(sample, Mapping):
        raise InputError(
            f"a calibration sample must be a mapping of forward argument names to tensors (a tokenizer's output "
            f"or a collated DataLoader batch), got {type(sample).__name__}"
        )
    values = {name: _as_tensor(value) for name, value in sample.items()}
    if sample_inputs is None:
        return values
    result: dict[str, Any] = {}
    for name, reference in sample_inputs.items():
        if name in values:
            result[name] = values[name]
        elif isinstance(reference, torch.Tensor):
            raise KeyError(
                f"calibration sample has no {name!r}, an input of the exported graph; sample keys: {sorted(values)}"
            )
        else:
            result[name] = reference
    return result


class CalibrationSet:
    """Calibration samples mapped to a model's own inputs, iterable any number of times.

    calibration_dataset: an iterable of forward-kwargs mappings (a list of tokenizer outputs, a DataLoader
        whose batches collate to model inputs). A one-shot iterator is read once and kept.
    sample_inputs: the export's own sample inputs; used, with one warning, when there is no dataset.
    feed: maps one sample to what the model takes (`traced_inputs` for the FX graph,
        `hfexport.naming.onnx_feed`, `hfexport.naming.openvino_feed`); by default `traced_inputs` against
        `sample_inputs`.
    """

    def __init__(
        self,
        calibration_dataset: Iterable[Mapping[str, Any]] | None,
        sample_inputs: Mapping[str, Any],
        feed: Callable[[Mapping[str, Any]], Any] | None = None,
    ) -> None:
        if calibration_dataset is not None and (
            isinstance(calibration_dataset, (Mapping, torch.Tensor, str))
            or not isinstance(calibration_dataset, Iterable)
        ):
            raise InputError(
                "calibration_dataset must be an iterable of samples (a list of tokenizer outputs or a DataLoader), "
                f"got {type(calibration_dataset).__name__}; wrap a single sample in a list"
            )
        if calibration_dataset is not None and iter(calibration_dataset) is calibration_dataset:
            calibration_dataset = list(calibration_dataset)
        self.calibration_dataset = calibration_dataset
        self.sample_inputs = sample_inputs
        self.feed = feed if feed is not None else (lambda sample: traced_inputs(sample, sample_inputs))
        self.used_sample_inputs = calibration_dataset is None
        self._warned = False

    def _samples(self) -> Iterable[Mapping[str, Any]]:
        if self.calibration_dataset is not None:
            return self.calibration_dataset
        if not self._warned:
            self._warned = True
            logger.warning(
                "no calibration_dataset: calibrating on the export's single sample input, which can skew the "
                "observed ranges; set quantizer.calibration_dataset to representative inputs"
            )
        return [self.sample_inputs]

    def __iter__(self) -> Iterator[Any]:
        for sample in self._samples():
            yield self.feed(sample)

    def __len__(self) -> int:
        samples = self._samples()
        try:
            return len(samples)  # type: ignore[arg-type]
        except TypeError:
            return sum(1 for _ in samples)


def jsonable(value: Any) -> Any:
    """`value` as JSON data: enums by value, dataclasses as dicts, other objects by class name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return type(value).__name__


class ExportQuantizer:
    """Base of every quantizer. Subclasses declare where they run and what they need, and implement `quantize`.

    calibration_dataset: calibration samples (forward kwargs); a plain attribute, so it can be set after
        construction. Quantizers that need data and have none calibrate on the export's sample inputs.
    keep_float: modules whose linears stay in floating point (mixed precision), by module name, dotted prefix or
        glob (`("model.layers.3.mlp", "lm_head")`); a plain attribute too. hfexport turns the names into the
        toolkit's own exclusion (`hfexport.quantizers.scopes`); quantizers that do so set `supports_keep_float`.
    """

    # Where the quantizer runs (at most one of the two set; neither: on the backend's model).
    quantizes_fx_graph: ClassVar[bool] = False
    quantizes_eager_model: ClassVar[bool] = False
    # Rewrite rules the export runs without when this quantizer is set (ids), each for a stated reason.
    disabled_rules: ClassVar[tuple[str, ...]] = ()
    # Opt-in rewrite rules the export runs when this quantizer is set (ids), unless the config disables them.
    enabled_rules: ClassVar[tuple[str, ...]] = ()
    supported_formats: ClassVar[tuple[ExportFormat, ...]] = ()
    required_packages: ClassVar[tuple[str, ...]] = ()
    min_versions: ClassVar[dict[str, str]] = {}
    tested_versions: ClassVar[dict[str, str]] = {}
    supports_keep_float: ClassVar[bool] = False
    keep_float: tuple[str, ...] = ()

    def __init__(self, calibration_dataset: Iterable[Mapping[str, Any]] | None = None) -> None:
        self.calibration_dataset = calibration_dataset

    @property
    def needs_calibration(self) -> bool:
        """Whether `quantize` reads calibration data (data-free quantizers override this to False)."""
        return True

    def streaming_refusal(self, export_format: str | ExportFormat) -> str | None:
        """Why this quantizer cannot quantize a low-memory export, whose weights stream from the checkpoint one at
        a time when saved (None: it can, docs/low-memory.md). By default it cannot: calibration runs the model on
        its real weights, and a rewrite of the model reads all of them at once."""
        return "it calibrates or rewrites the model on its real weights, which a low-memory export never holds"

    def check_format(self, export_format: str | ExportFormat) -> None:
        """Raise `ConfigError` when this quantizer cannot quantize for `export_format` (before tracing)."""
        formats = [str(f) for f in self.supported_formats]
        if str(export_format) not in formats:
            raise ConfigError(
                f"{type(self).__name__} quantizes {', '.join(formats) or 'no format'} exports, not "
                f"{str(export_format)!r}; see docs/quantization.md for the quantizer that fits each backend"
            )

    def check_keep_float(self) -> None:
        """Raise `ConfigError` when `keep_float` is set on a quantizer that cannot honour it."""
        if isinstance(self.keep_float, str):
            raise ConfigError(f"keep_float takes a sequence of module names, got the string {self.keep_float!r}")
        if self.keep_float and not self.supports_keep_float:
            raise ConfigError(f"{type(self).__name__} does not support keep_float (mixed precision by module name)")

    def validate_environment(self) -> dict[str, str]:
        """Raise `MissingPackageError` for missing or too-old packages; warn once on drift from tested."""
        return check_packages(self.required_packages, self.min_versions, self.tested_versions, who=type(self).__name__)

    def check(self, export_format: str | ExportFormat) -> dict[str, str]:
        """Everything an export checks before tracing: the format, then the packages."""
        self.check_format(export_format)
        return self.validate_environment()

    def newest_onnx_opset(self, config: Any = None) -> int | None:
        """The newest ONNX opset this quantizer gives the documented result at for the export `config` (None:
        any). An ONNX export that sets no `opset_version` is made at this one; an explicit newer one is refused
        by `check_config` where it cannot work."""
        return None

    def calibration(self, sample_inputs: Mapping[str, Any], feed: Callable[[Mapping[str, Any]], Any]) -> CalibrationSet:
        return CalibrationSet(self.calibration_dataset, sample_inputs, feed)

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat) -> Any:
        """Quantize `model` (the eager model, the FX graph, or the backend's model) and return the quantized model."""
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize()")

    def settings(self) -> dict[str, Any]:
        """The quantizer's settings as JSON data (never the calibration samples)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """What a config's `to_dict` records: the class and its settings. Not enough to rebuild it."""
        record = {
            "class": type(self).__name__,
            "module": type(self).__module__,
            "settings": jsonable(self.settings()),
            "calibration_samples": _length(self.calibration_dataset),
        }
        if self.keep_float:
            record["keep_float"] = list(self.keep_float)
        return record

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings()})"


def _length(dataset: Any) -> int | None:
    if dataset is None:
        return None
    try:
        return len(dataset)
    except TypeError:
        return None
