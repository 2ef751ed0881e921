"""Run an `openvino.Model` exported by `OpenVINOExporter` with the source model's forward kwargs.

`hfexport.naming.openvino_feed` flattens forward kwargs (tensors and transformers
caches) to the model's inputs, named as the lowering names them (`input_ids`, `cache.layers_0_keys`,
`input.<name>` for a cache the model also returns). `OpenVINORunner` compiles once and maps outputs back to their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.naming import openvino_feed

__all__ = ["F32_HINT", "SHARED_IR_WEIGHTS", "OpenVINORunner", "ir_weights", "output_tensor"]

# Validation compiles in f32: the CPU plugin's default is bf16/f16 compute on CPUs that have it.
F32_HINT: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32"}
# The weights file the IRs of a generation artifact share (`<component>.xml` beside it; hfexport.save).
SHARED_IR_WEIGHTS = "weights.bin"


def ir_weights(xml: str | Path) -> Path:
    """The weights of the IR `xml`: its own `<stem>.bin`, or where it has none the `weights.bin` beside it that the
    IRs of a generation artifact share. (`load` checks that the one used is listed by the component.)"""
    xml = Path(xml)
    own = xml.with_suffix(".bin")
    return own if own.exists() or own.is_symlink() else xml.parent / SHARED_IR_WEIGHTS


def output_tensor(value: Any, element_type: Any) -> torch.Tensor:
    """A compiled model's output as a torch tensor. numpy has no bfloat16: OpenVINO's Python API returns a bf16
    output as a float16 array of the bf16 bits (`Type.bf16.to_dtype()` is float16), which read as float16 are
    numbers off by up to their own size; they are viewed as the bfloat16 they are."""
    import openvino as ov

    array = np.array(value)
    if element_type == ov.Type.bf16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class OpenVINORunner:
    """Compile an `openvino.Model` (or an IR path) once; call it with forward kwargs.

    `runner(**inputs)` returns `{output name: torch.Tensor}` in the model's output order.
    """

    def __init__(self, model: Any, device: str = "CPU", properties: Mapping[str, Any] | None = None) -> None:
        import openvino as ov

        core = ov.Core()
        if not isinstance(model, ov.Model):
            model = core.read_model(str(model), str(ir_weights(model)))
        self.model = model
        self.device = device
        self.compiled = core.compile_model(model, device, dict(F32_HINT if properties is None else properties))
        # An output the lowering could not name keeps no name: call it by its index.
        self.output_names = [
            next(iter(sorted(port.get_names())), f"output_{i}") for i, port in enumerate(self.compiled.outputs)
        ]

    def __call__(self, **inputs: Any) -> dict[str, torch.Tensor]:
        result = self.compiled(openvino_feed(inputs, self.compiled))
        return {
            name: output_tensor(result[port], port.get_element_type())
            for name, port in zip(self.output_names, self.compiled.outputs, strict=True)
        }
