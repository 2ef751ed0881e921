"""`OpenVINOConfig`: the options of the OpenVINO lowering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hfexport.backends.dynamo.config import DynamoConfig
from hfexport.configs import check_low_memory
from hfexport.core.errors import ConfigError


@dataclass
class OpenVINOConfig(DynamoConfig):
    """Options of the OpenVINO lowering, on top of the capture options of `DynamoConfig`.

    output_path: where to save the model as OpenVINO IR (`model.xml` + `model.bin`); None keeps the
        `openvino.Model` in memory only.
    compress_to_fp16: when saving, store float weights as fp16 (OpenVINO's own default); compute
        precision is chosen at compile time by the device's inference-precision hint.
    stateful: keep the cache inside the infer request: every cache input `input.<name>` and the output
        `output.<name>` it pairs with become one OpenVINO variable (ReadValue/Assign), so a decode step feeds
        only its tokens, mask and positions. `hfexport.runtime.generate` resets the state per generation.
        A model without such pairs is left stateless (with a note in the report).
    low_memory: export a model whose weights hold no memory (`hfexport.empty_model(folder)`) and write its
        weights into the IR's `.bin` from the safetensors checkpoint, one tensor at a time, when it is saved; the
        `openvino.Model` returned holds placeholder (zero) weights until then (docs/low-memory.md).
    checkpoint: the checkpoint folder the low-memory export reads weights from; None takes the model's
        `name_or_path` (which `empty_model` sets).
    """

    export_format: ClassVar[str] = "openvino"

    output_path: str | None = None
    compress_to_fp16: bool = True
    stateful: bool = False
    low_memory: bool = False
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_path is not None:
            self.output_path = str(self.output_path)
            # OpenVINO IR is a pair: the .xml graph names its .bin weights beside it.
            if not self.output_path.endswith(".xml"):
                raise ConfigError(
                    f"output_path must name the IR's .xml file (weights go to .bin beside it), got {self.output_path!r}"
                )
        check_low_memory(self)
