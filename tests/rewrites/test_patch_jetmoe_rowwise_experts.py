"""patch/jetmoe-rowwise-experts where it matters: without it JetMoe's experts fail `to_edge`; with it
the program runs in the ExecuTorch runtime and matches eager on a second shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")

from hfexport import ExecutorchConfig, ExecutorchExporter, HfExportError, RuleSelection
from hfexport.rewrites.rules.patch.jetmoe_rowwise_experts import _jetmoe
from hfexport.runtime.executorch import ExecutorchProgram

RULE = "patch/jetmoe-rowwise-experts"


@pytest.mark.slow  # two lowerings of a JetMoe layer: minutes on 2 shared cores
def test_jetmoe_lowers_to_executorch_only_with_the_rowwise_experts_patch() -> None:
    model, inputs = _jetmoe(6)
    shapes = {"input_ids": {0: torch.export.Dim.AUTO(max=4), 1: torch.export.Dim.AUTO(max=32)}, "use_cache": None}

    without = ExecutorchConfig(dynamic_shapes=shapes, rules=RuleSelection(disable=(RULE,)))
    # The split by expert counts: to_edge's argument validator takes len() of its unbacked first piece.
    with pytest.raises(HfExportError, match=r"(?s)stage 'edge'.*data-dependent"):
        ExecutorchExporter().export(model, inputs, without)

    exporter = ExecutorchExporter()
    program = ExecutorchProgram(exporter.export(model, inputs, ExecutorchConfig(dynamic_shapes=shapes)))
    # Two experts modules (attention and MLP) of two projections each, in the one layer.
    assert exporter.report.hits["patch"][RULE] == 4
    for feed in (inputs, _jetmoe(11)[1]):
        with torch.no_grad():
            expected = model(**feed).last_hidden_state
        actual = program.run(feed)[0]
        assert actual.shape == expected.shape
        assert (actual - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
