"""fx/fold-layout-constants: without the rule, the baked-layout example exports with torch.export but not to
ONNX, whose re-trace makes the layout data-dependent again; with it, ONNX Runtime matches eager (its
examples, run in tests/rewrites/test_examples.py, check the folded program against eager too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.errors import HfExportError
from hfexport.rewrites.rules.fx.fold_layout_constants import fold_layout_constants as rule


def _export(disable: list[str]):
    module, inputs = rule.meta.examples[0].build()
    config = AutoExportConfig.from_dict({"export_format": "onnx", "rules": {"disable": disable}})
    return module, inputs, AutoHfExporter.from_config(config).export(module, inputs, config)


def test_the_baked_layout_example_does_not_translate_without_its_rule() -> None:
    with pytest.raises(HfExportError, match=r"data-dependent"):
        _export([rule.meta.id])


def test_the_folded_example_matches_eager_in_onnx_runtime() -> None:
    import onnxruntime as ort

    module, inputs, program = _export([])
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"pixel_values": inputs["pixel_values"].numpy()})
    with torch.no_grad():
        expected = module(**inputs)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
    assert len(session.get_inputs()) == 1  # the layout is no input: it is folded into the graph
