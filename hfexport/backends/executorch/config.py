"""`ExecutorchConfig`: the options of the ExecuTorch lowering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hfexport.backends.dynamo.config import DynamoConfig
from hfexport.core.errors import ConfigError

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

    export_format: ClassVar[str] = "executorch"

    backend: str = "xnnpack"
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    alloc_mutable_buffers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in EXECUTORCH_BACKENDS:
            raise ConfigError(f"backend must be one of {EXECUTORCH_BACKENDS}, got {self.backend!r}")
