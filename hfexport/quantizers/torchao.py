"""`TorchAOQuantizer`: torchao's `quantize_` on the eager model's linears (8da4w: dynamic int8 activations, int4
weights in groups), before capture.

torchao's quantized tensor workflows replace each `nn.Linear` weight with a quantized tensor subclass, which
torch.export traces into `choose_qparams_affine` / `quantize_affine` / `dequantize_affine` around a float linear;
ExecuTorch's XNNPACK partitioner takes that pattern whole (its qd8-f32-qb4w GEMM: int8 activations quantized per
token at run time, 4-bit weights with one scale per group). The quantizer works on a copy of the model (the
copy's modules are new, its tensors the caller's until `quantize_` replaces a linear's weight), so the caller's
model is never changed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from hfexport.core.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.quantizers.base import ExportQuantizer

# torchao's choices of how weight scales are found: plain min/max ("affine"), or HQQ's scale search without zero
# points ("hqq_scale_only", what optimum-executorch uses by default).
QPARAMS_ALGORITHMS = ("affine", "hqq_scale_only")


class TorchAOQuantizer(ExportQuantizer):
    """Dynamic int8 activations and `weight_bits`-bit symmetric weights in groups of `group_size` input channels
    (torchao's `Int8DynamicActivationIntxWeightConfig`), on every `nn.Linear` of a copy of the eager model.

    weight_bits: 4 (8da4w, the default) or 8 (8da8w).
    group_size: input channels per weight scale; 0 is one scale per output channel. A linear whose input width
        `group_size` does not divide is quantized per output channel instead (recorded in `settings()`).
    qparams_algorithm: how the weight scales are chosen, one of `QPARAMS_ALGORITHMS`.
    keep_float: modules (names, dotted prefixes or globs) whose linears stay in float.
    """

    quantizes_eager_model: ClassVar[bool] = True
    # ExecuTorch lowers the pattern to XNNPACK; a Dynamo program runs the same ops in PyTorch.
    supported_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.EXECUTORCH, ExportFormat.DYNAMO)
    required_packages: ClassVar[tuple[str, ...]] = ("torchao",)
    min_versions: ClassVar[dict[str, str]] = {"torchao": "0.14.0"}
    tested_versions: ClassVar[dict[str, str]] = {"torchao": "0.18.0"}
    supports_keep_float: ClassVar[bool] = True

    def __init__(self, weight_bits: int = 4, group_size: int = 32, qparams_algorithm: str = "hqq_scale_only") -> None:
        super().__init__(None)
        if weight_bits not in (4, 8):
            raise ConfigError(f"TorchAOQuantizer weight_bits is 4 or 8, got {weight_bits!r}")
        if group_size < 0 or group_size % 2:
            raise ConfigError(f"TorchAOQuantizer group_size is 0 (per output channel) or even, got {group_size!r}")
        if qparams_algorithm not in QPARAMS_ALGORITHMS:
            raise ConfigError(
                f"TorchAOQuantizer qparams_algorithm is one of {', '.join(QPARAMS_ALGORITHMS)}, "
                f"got {qparams_algorithm!r}"
            )
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.qparams_algorithm = qparams_algorithm
        self._per_channel: list[str] = []

    @property
    def needs_calibration(self) -> bool:
        return False  # activation ranges are measured at run time; weights need no data

    def settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "recipe": "Int8DynamicActivationIntxWeightConfig",
            "weight_bits": self.weight_bits,
            "group_size": self.group_size,
            "dynamic_activations": True,
            "qparams_algorithm": self.qparams_algorithm,
        }
        if self._per_channel:
            settings["per_channel_linears"] = list(self._per_channel)
        return settings

    def _config(self, granularity: Any) -> Any:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig

        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4 if self.weight_bits == 4 else torch.int8,
            weight_granularity=granularity,
            intx_choose_qparams_algorithm=self.qparams_algorithm,
        )

    def quantize(
        self, model: torch.nn.Module, sample_inputs: Any, export_format: str | ExportFormat
    ) -> torch.nn.Module:
        """A quantized copy of the eager `model`; `model` itself is left as it was."""
        from torchao.quantization import PerAxis, PerGroup, quantize_

        from hfexport.quantizers.scopes import module_matches

        linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        if self.keep_float and not any(module_matches(name, self.keep_float) for name in linears):
            raise ConfigError(f"keep_float {list(self.keep_float)} names no linear of this model")
        quantized = shared_tensor_copy(model)
        grouped = self.group_size > 0

        def chosen(module: torch.nn.Module, name: str, groups: bool) -> bool:
            if not isinstance(module, torch.nn.Linear) or module_matches(name, self.keep_float):
                return False
            fits = grouped and module.in_features % self.group_size == 0
            return fits == groups

        if grouped:
            quantize_(quantized, self._config(PerGroup(self.group_size)), filter_fn=lambda m, n: chosen(m, n, True))
        self._per_channel = [n for n, m in quantized.named_modules() if chosen(m, n, False)] if grouped else []
        quantize_(quantized, self._config(PerAxis(0)), filter_fn=lambda m, n: chosen(m, n, False))
        return quantized


def shared_tensor_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with new module objects that hold the same parameter and buffer tensors: replacing a
    weight on the copy (`quantize_` sets a new `Parameter`) leaves `model` as it was, and no tensor is copied."""
    tensors: Iterable[torch.Tensor] = [*model.parameters(), *model.buffers()]
    with warnings.catch_warnings():
        # Copying a transformers model copies pytree specs torch registered, which warn of a deprecated name.
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(model, memo={id(t): t for t in tensors})
