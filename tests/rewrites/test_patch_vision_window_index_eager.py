"""patch/vision-window-index-eager: Qwen2.5-VL-style window attention exports on a baked grid, equal to eager.

Its examples (tests/rewrites/test_examples.py) check the match and the declined call on every backend; here: the
list of gated modules is every importer of the helper in the installed transformers, and a tower exports through
`export()` for grids whose windows are padded or exact, saved and loaded, equal to eager. That the rule is needed
(the trace fails without it) is the examples' slow tier.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hfexport
from hfexport import DynamoConfig, DynamoExporter
from hfexport.rewrites.rules.patch.vision_window_index_eager import IMPORTERS, _tower
from hfexport.rewrites.rules.patch.vision_window_index_eager import vision_window_index_eager as rule

# `from ...vision_utils import (..., get_vision_window_index, ...)`, on one line or several.
_IMPORT = re.compile(r"from \.\.\.vision_utils import (\([^)]*|[^\n]*)\bget_vision_window_index\b")


def test_every_importer_of_the_helper_is_gated() -> None:
    import transformers

    models = Path(transformers.__file__).parent / "models"
    found = {
        f"{path.parent.name}.{path.stem}"
        for path in models.glob("*/modeling_*.py")
        if _IMPORT.search(path.read_text(encoding="utf-8"))
    }
    assert found == set(IMPORTERS)


# Slow: each export of the tower takes 10-15 s on an idle core (the examples' default tier exports it once).
@pytest.mark.slow
@pytest.mark.parametrize(
    "grid",
    [
        pytest.param([[1, 12, 8], [1, 6, 10]], id="padded-last-windows"),
        pytest.param([[2, 16, 16]], id="video-exact-windows"),
    ],
)
@pytest.mark.parametrize("window", [16, 8])
def test_a_tower_exports_saves_and_equals_eager(grid: list[list[int]], window: int, tmp_path: Path) -> None:
    layout_specialised, inputs = _tower(grid, window_size=window)
    tower = layout_specialised.inner  # the tower itself: export() bakes its grid (a vision sub-config)
    inputs = {**inputs, "grid_thw": torch.tensor(grid)}
    exporter = DynamoExporter()
    program = exporter.export(tower, inputs, DynamoConfig(dynamic=True))
    hits = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    assert hits.get(rule.meta.id) == 1
    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    with torch.no_grad():
        expected = tower(**inputs)
    got = loaded.run(inputs)
    torch.testing.assert_close(got["pooler_output"], expected.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["last_hidden_state"], expected.last_hidden_state, atol=1e-5, rtol=1e-5)
