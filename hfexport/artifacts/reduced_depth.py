"""The reduced-depth check of a low-memory export: the same checkpoint cut to its first N layers, exported on the
low-memory path (FakeTensor capture, weights streamed from the same shards), run in its runtime against the eager
reduced model loaded for real (`from_pretrained(num_hidden_layers=N)` reads only the tensors it needs).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfexport.artifacts.publish import save
from hfexport.artifacts.validation import Validation, validate
from hfexport.configs import OnnxConfig, OpenVINOConfig


@dataclass
class ReducedDepthCheck:
    """The low-memory path checked on the first `layers` layers of the same checkpoint."""

    layers: int
    validation: Validation

    @property
    def ok(self) -> bool:
        return self.validation.ok

    def to_dict(self) -> dict[str, Any]:
        return {**self.validation.to_dict(), "reduced_depth_layers": self.layers}


def _reduced_overrides(folder: Path, layers: int, trust_remote_code: bool) -> dict[str, Any]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    overrides: dict[str, Any] = {"num_hidden_layers": layers}
    # Per-layer lists (sliding/full attention) must match the layer count.
    if isinstance(getattr(config, "layer_types", None), list):
        overrides["layer_types"] = config.layer_types[:layers]
    return overrides


def check_reduced_depth(
    folder: str | Path,
    inputs: Mapping[str, Any],
    config: OnnxConfig | OpenVINOConfig,
    *,
    layers: int = 2,
    auto_class: str = "AutoModelForCausalLM",
    dtype: torch.dtype | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    trust_remote_code: bool = False,
    other_inputs: Mapping[str, Mapping[str, Any]] | None = None,
) -> ReducedDepthCheck:
    """Export the first `layers` layers of checkpoint `folder` on the low-memory path with `config`'s options
    (an `OnnxConfig` or an `OpenVINOConfig`) and compare it in its runtime with the same reduced model loaded
    for real."""
    import transformers

    from hfexport.auto import AutoHfExporter
    from hfexport.frontends.empty_weights import empty_model

    folder = Path(folder)
    overrides = _reduced_overrides(folder, layers, trust_remote_code)
    options: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code, **overrides}
    if dtype is not None:
        options["dtype"] = dtype
    real = getattr(transformers, auto_class).from_pretrained(folder, **options).eval()
    empty = empty_model(folder, auto_class, dtype=dtype, trust_remote_code=trust_remote_code, **overrides)
    reduced_config = dataclasses.replace(config, output_path=None, low_memory=True, checkpoint=str(folder))
    exporter = AutoHfExporter.from_config(reduced_config)
    program = exporter.export(empty, inputs, reduced_config)
    with tempfile.TemporaryDirectory(prefix="hfexport-reduced-") as tmp:
        out = Path(tmp) / "reduced"
        save(program, out, config=reduced_config, report=exporter.report)
        validation = validate(out, real, inputs, atol=atol, rtol=rtol, other_inputs=other_inputs)
    return ReducedDepthCheck(layers, validation)
