"""Run an `openvino.Model` exported by `OpenVINOExporter` with the source model's forward kwargs.

`openvino_feed` (from `hfexport.naming`, re-exported here) flattens forward kwargs (tensors and transformers
caches) to the model's inputs, named as the lowering names them (`input_ids`, `cache.layers_0_keys`,
`input.<name>` for a cache the model also returns). `OpenVINORunner` compiles once and maps outputs back to their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hfexport.naming import openvino_feed

__all__ = ["F32_HINT", "OpenVINORunner", "openvino_feed"]

# Validation compiles in f32: the CPU plugin's default is bf16/f16 compute on CPUs that have it.
F32_HINT: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32"}


class OpenVINORunner:
    """Compile an `openvino.Model` (or an IR path) once; call it with forward kwargs.

    `runner(**inputs)` returns `{output name: torch.Tensor}` in the model's output order.
    """

    def __init__(self, model: Any, device: str = "CPU", properties: Mapping[str, Any] | None = None) -> None:
        import openvino as ov

        core = ov.Core()
        if not isinstance(model, ov.Model):
            model = core.read_model(str(model))
        self.model = model
        self.compiled = core.compile_model(model, device, dict(F32_HINT if properties is None else properties))
        # An output the lowering could not name keeps no name: call it by its index.
        self.output_names = [
            next(iter(sorted(port.get_names())), f"output_{i}") for i, port in enumerate(self.compiled.outputs)
        ]

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        result = self.compiled(openvino_feed(inputs, self.compiled))
        return {
            name: torch.from_numpy(np.array(result[port]))
            for name, port in zip(self.output_names, self.compiled.outputs, strict=True)
        }
