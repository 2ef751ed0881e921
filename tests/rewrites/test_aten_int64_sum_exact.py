"""aten/int64-sum-exact: an int64 sum past 2**53 and past 2**63 (wrapping) runs in ONNX Runtime as torch computes it
with the rule and differs without it; a float sum and an int64 sum to another dtype keep torchlib's single ReduceSum.
The rule's examples (tests/rewrites/test_examples.py) run BLT's n-gram hash and these sums against eager."""

from __future__ import annotations

import numpy as np
import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.rewrites.rules.aten.int64_sum_exact import int64_sum_exact as rule

ROWS = [[2**62, 2**62, 2**62], [-(2**62), -(2**62), -(2**62)], [2**60 + 1, 1, -5], [3, -7, 11], [2**53, 1, 1]]


class _Sum(torch.nn.Module):
    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, dtype=self.dtype)


def _run(module: torch.nn.Module, x: torch.Tensor, disable: list[str]) -> tuple[np.ndarray, list[str]]:
    import onnxruntime as ort

    config = AutoExportConfig.from_dict({"export_format": "onnx", "rules": {"disable": disable}})
    program = AutoHfExporter.from_config(config).export(module, {"x": x}, config)
    proto = program.model_proto
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return got, [node.op_type for node in proto.graph.node]


def test_int64_sums_wrap_as_torch_with_the_rule_and_not_without() -> None:
    x = torch.tensor(ROWS, dtype=torch.int64)
    expected = _Sum()(x).numpy()
    got, _ = _run(_Sum(), x, [])
    np.testing.assert_array_equal(got, expected)
    without, _ = _run(_Sum(), x, [rule.meta.id])
    assert not np.array_equal(without, expected)  # ONNX Runtime's ReduceSum rounds and saturates


def test_other_sums_keep_one_reduce_sum() -> None:
    _, float_ops = _run(_Sum(), torch.randn(2, 5), [])
    x = torch.tensor(ROWS, dtype=torch.int64)
    got, cast_ops = _run(_Sum(torch.float64), x, [])
    np.testing.assert_allclose(got, _Sum(torch.float64)(x).numpy())
    for ops in (float_ops, cast_ops):
        assert ops.count("ReduceSum") == 1 and "BitwiseAnd" not in ops
