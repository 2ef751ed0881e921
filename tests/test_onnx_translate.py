"""torch.onnx's translation without its re-trace gives the model the re-trace gives, and is taken for decoders."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.lowerings.onnx import newest_opset
from hfexport.lowerings.onnx_optimizer import optimize
from hfexport.lowerings.onnx_translate import translate
from hfexport.naming import onnx_feed
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext
from hfexport.tiny import TINY_MODELS

# (model, whether every node of its captured forward translates without the re-trace). The models whose capture
# needs the ONNX pipeline's own rules (T5's layout fix, the MoE's grouped-mm translation) are checked through the
# pipeline: the CLI matrix and the rule examples export them on ONNX Runtime and compare with eager.
CASES = [("tiny-llama", True), ("tiny-gpt2", True)]


def _capture(name: str) -> tuple[torch.export.ExportedProgram, Any]:
    spec = TINY_MODELS[name]
    model, inputs = spec.build(), spec.sample_inputs()
    return DynamoExporter().export(model, inputs, DynamoConfig(dynamic=True)), spec


def _translations(opset: int) -> dict[Any, Any]:
    """The `aten` rules' translations, as the ONNX lowering hands them to torch.onnx."""
    return dict(engine.apply("aten", opset, RewriteContext(backend="onnx")).outputs)


def _run(program: Any, path: str, inputs: dict[str, torch.Tensor]) -> tuple[list[np.ndarray], Counter]:
    model = optimize(program.model)
    ir.save(model, path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, onnx_feed(names, inputs)), Counter(node.op_type for node in model.graph)


@pytest.mark.parametrize(("name", "skips"), CASES)
def test_the_translation_without_re_trace_is_the_re_traced_one(name: str, skips: bool | None, tmp_path) -> None:
    opset = newest_opset()
    table = _translations(opset)
    fast, fast_skipped = translate(_capture(name)[0], table, opset)
    program, spec = _capture(name)
    slow, slow_skipped = translate(program, table, opset, retrace=True)
    assert not slow_skipped
    if skips is not None:
        assert fast_skipped is skips
    inputs = spec.sample_inputs(seed=3, batch=3, length=11)  # another batch and length than the capture's
    fast_outputs, fast_ops = _run(fast, str(tmp_path / "fast.onnx"), inputs)
    slow_outputs, slow_ops = _run(slow, str(tmp_path / "slow.onnx"), inputs)
    assert fast_ops == slow_ops
    assert len(fast_outputs) == len(slow_outputs)
    for got, expected in zip(fast_outputs, slow_outputs, strict=True):
        np.testing.assert_array_equal(got, expected)
