"""The `optimize` stage writes the graph onnxscript's optimizer writes, without its quadratic pair matching."""

from __future__ import annotations

import onnx_ir as ir
import onnxscript
import pytest
import torch

from hfexport import OnnxConfig, OnnxExporter
from hfexport.lowerings.onnx_optimizer import optimize, rewrite_rules
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]


def _graph_bytes(model: ir.Model) -> bytes:
    proto = ir.serde.serialize_model(model)
    return proto.SerializeToString(deterministic=True)


@pytest.fixture(scope="module")
def translated(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama as torch.onnx translates it, before any optimizer (saved, so each test loads a fresh copy)."""
    model, inputs = TINY.build(), TINY.sample_inputs()
    path = tmp_path_factory.mktemp("optimizer") / "translated.onnx"
    OnnxExporter().export(
        model, inputs, config=OnnxConfig(output_path=str(path), optimize=False, fusions=None, external_data=False)
    )
    return str(path)


def test_the_rule_list_is_onnxscript_s_defaults_but_the_pair_patterns() -> None:
    from onnxscript.rewriter import _DEFAULT_REWRITE_RULES
    from onnxscript.rewriter.rules.common import slice_split_rule

    kept = rewrite_rules()
    assert slice_split_rule not in kept
    left_out = [rule for rule in _DEFAULT_REWRITE_RULES if rule not in kept]
    assert left_out == [slice_split_rule], "only the multi-output pattern is left out"
    assert all(rule._target_pattern.has_single_output_node for rule in kept)


def test_the_optimized_graph_is_onnxscript_s(translated: str) -> None:
    theirs = onnxscript.optimizer.optimize(ir.load(translated))
    ours = optimize(ir.load(translated))
    assert len(ours.graph) < len(ir.load(translated).graph), "the optimizer folded and removed nodes"
    assert _graph_bytes(ours) == _graph_bytes(theirs)


def test_a_split_in_halves_keeps_its_values_in_onnx_runtime(tmp_path) -> None:
    """The pattern the left-out rule rewrites (x[..., :d/2], x[..., d/2:d]): two Slices, the same numbers."""
    import onnxruntime as ort

    class Halves(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first, second = x[..., :4], x[..., 4:8]
            return torch.cat([second * 2, first], dim=-1)

    x = torch.randn(2, 3, 8)
    path = tmp_path / "halves.onnx"
    OnnxExporter().export(Halves(), {"x": x}, config=OnnxConfig(output_path=str(path), external_data=False))
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), Halves()(x), rtol=0, atol=0)
