"""fx/fold-layout-constants: without the rule, the baked-layout example exports with torch.export but not to
ONNX, whose re-trace makes the layout data-dependent again; with it, ONNX Runtime matches eager (its
examples, run in tests/rewrites/test_examples.py, check the folded program against eager too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.core.errors import HfExportError
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


class _ReturnsItsLayout(torch.nn.Module):
    """Returns a value computed from the baked layout alone, beside one that reads an input."""

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = grid_thw[:, 1] * grid_thw[:, 2]
        return x * frames.sum(), frames


def test_a_folded_value_the_program_returns_saves_and_loads(tmp_path) -> None:
    # Found on gemma2/exaone4 sequence classifiers: the output spec still named the replaced node, and
    # torch.export.save refused the program ("User output _folded_layout_0 is not in the correct order").
    from hfexport import load, save
    from hfexport.generation_spec import LayoutSpecialised

    module = LayoutSpecialised(_ReturnsItsLayout().eval(), {"grid_thw": ([[1, 2, 3], [2, 3, 1]], torch.int64)})
    inputs = {"x": torch.randn(2, 3)}
    config = AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    program = exporter.export(module, inputs, config)
    assert rule.meta.id in exporter.report.fired
    save(program, tmp_path, config=config)
    got = list(load(tmp_path, trust=True).run(inputs).values())
    with torch.no_grad():
        expected = module(**inputs)
    assert len(got) == 2
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.as_tensor(g), e)


class _AdvancesAnOffset(torch.nn.Module):
    """A cache's position offset, an integer literal the forward advances in place by the length (xLSTM's cache
    `seqlen_offset`): state, not a layout."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offset = torch.tensor(0)
        offset += x.shape[1]
        return x * 2, offset


def test_an_integer_literal_written_in_place_is_not_folded() -> None:
    # Folded, the offset would be a constant the program mutates, which the lowering refuses ('Constant
    # _folded_layout_0 is mutated in the forward method').
    module = _AdvancesAnOffset()
    config = AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    program = exporter.export(module, {"x": torch.randn(2, 5)}, config)
    for length in (5, 9):
        _, offset = program.module()(x=torch.randn(2, length))
        assert int(offset) == length
