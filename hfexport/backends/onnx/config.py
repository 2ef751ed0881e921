"""`OnnxConfig`: the options of the ONNX lowering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hfexport.backends.dynamo.config import DynamoConfig
from hfexport.configs import check_low_memory
from hfexport.core.errors import ConfigError


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

    export_format: ClassVar[str] = "onnx"

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
        check_low_memory(self)
        if self.opset_version is not None and (not isinstance(self.opset_version, int) or self.opset_version < 18):
            # torchlib implements opset 18 and up; older opsets go through a lossy version conversion.
            raise ConfigError(f"opset_version must be an int >= 18 (None: the newest), got {self.opset_version!r}")
        if self.fusions not in (None, "cpu"):
            raise ConfigError(f"fusions must be 'cpu' or None, got {self.fusions!r}")
