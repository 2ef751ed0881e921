"""What the quantization accuracy tests share: the code model fixture (optionally cut to fewer layers) and a recipe
broken on purpose (a wrong scale in the quantized weights of one module)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from hfexport.quantizers.onnxruntime import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer

FIXTURE = Path(__file__).parent / "fixtures" / "code_lm"
HELDOUT = (FIXTURE / "heldout.txt").read_text()
# Fewer windows than the figures of docs/quantization.md (16, tools/quant_accuracy.py): a faster default tier.
MEASURE = {"windows": 8, "window": 128, "greedy_prompt": 32, "greedy_tokens": 16}


def code_lm(layers: int | None = None) -> tuple[torch.nn.Module, Any]:
    """The fixture and its tokenizer; `layers` keeps only the first decoder layers (a smaller, faster export)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model, AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)


def sample(tokenizer: Any) -> dict[str, torch.Tensor]:
    """Two 12-token rows of Python, the sample the tests export with."""
    ids = tokenizer(
        ["import os\nimport sys\n\n\ndef main(argv=None):\n", "class Point:\n    def __init__(self, x, y):\n"]
    )
    rows = torch.tensor([row[:12] for row in ids["input_ids"]])
    return {"input_ids": rows, "attention_mask": torch.ones_like(rows)}


@functools.cache
def trained() -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor]]:
    """The whole fixture, its tokenizer and the sample, loaded once per test process (the tests only read it)."""
    model, tokenizer = code_lm()
    return model, tokenizer, sample(tokenizer)


class WrongScale(OnnxRuntimeQuantizer):
    """ONNX Runtime's dynamic int8 with the weight scales of `module`'s linears multiplied by `factor`: a recipe
    broken on purpose. Only linears the export quantized are touched (none when `keep_float` keeps `module`)."""

    def __init__(self, module: str, factor: float = 1.5) -> None:
        super().__init__(OnnxRuntimeDynamicConfig())
        self.module, self.factor = module, factor

    def quantize(self, model: Any, sample_inputs: Any, export_format: Any) -> Any:
        import onnx.numpy_helper as nh

        from hfexport.quantizers.scopes import onnx_nodes_in

        targets = {f"{name}_quant" for name in onnx_nodes_in(model, [self.module])}
        proto = super().quantize(model, sample_inputs, export_format)
        scales = {
            node.input[1].removesuffix("_quantized") + "_scale"
            for node in proto.graph.node
            if node.op_type == "MatMulInteger" and node.name in targets
        }
        for index, tensor in enumerate(proto.graph.initializer):
            if tensor.name in scales:
                value = nh.to_array(tensor) * self.factor
                proto.graph.initializer[index].CopyFrom(nh.from_array(value.astype(value.dtype), tensor.name))
        return proto
