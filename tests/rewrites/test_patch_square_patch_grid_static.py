"""patch/square-patch-grid-static: InternVL-style image features export with the pixel size fixed, equal to eager.

Its examples (tests/rewrites/test_examples.py) check the match (two tiles, then three: the tile count stays
dynamic) and the declined static export on every backend; here: the rule's code pattern finds exactly the
`get_image_features` methods of the installed transformers that square a patch count in Python and pixel-shuffle
it (derived from the sources), and an export refuses another pixel size instead of answering it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.rewrites.rules.patch.square_patch_grid_static import _applies, _Features, _tiles
from hfexport.rewrites.rules.patch.square_patch_grid_static import square_patch_grid_static as rule

_SQUARE_SIDE = re.compile(r"int\(\s*[\w.\[\]]+\s*\*\*\s*0\.5\s*\)")


def _sources_with_the_pattern() -> set[tuple[str, str]]:
    """(module, class) of every transformers model class whose own get_image_features has the pattern."""
    import transformers

    found = set()
    for path in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        text = path.read_text(encoding="utf-8")
        if "pixel_shuffle" not in text or "get_image_features" not in text:
            continue
        for node in ast.parse(text).body:
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "get_image_features":
                    segment = ast.get_source_segment(text, item) or ""
                    if _SQUARE_SIDE.search(segment) and "pixel_shuffle" in segment:
                        found.add((f"{path.parent.name}.{path.stem}", node.name))
    return found


def test_the_pattern_finds_the_internvl_copies_and_only_classes_that_square_their_patches() -> None:
    found = _sources_with_the_pattern()
    assert {
        ("internvl.modeling_internvl", "InternVLModel"),
        ("qianfan_ocr.modeling_qianfan_ocr", "QianfanOCRModel"),
    } <= found
    for module, name in found:
        cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
        assert _applies(cls.__new__(cls)), f"{module}.{name}"
    # Pixel-shuffling towers that do not square a patch count in get_image_features are left alone.
    from transformers.models.aya_vision.modeling_aya_vision import AyaVisionModel
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMModel

    for cls in (AyaVisionModel, SmolVLMModel):
        assert not _applies(cls.__new__(cls)), cls.__name__


def test_another_pixel_size_is_refused_not_answered() -> None:
    module, inputs = _Features(), _tiles(2)
    exporter = DynamoExporter()
    program = exporter.export(module, inputs, DynamoConfig(dynamic=True))
    hits = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    assert hits.get(rule.meta.id) == 1
    with torch.no_grad():
        assert torch.equal(program.module()(**_tiles(3, seed=1)), module(**_tiles(3, seed=1)))
    bigger = {"pixel_values": torch.rand(2, 3, 32, 32)}
    with torch.no_grad():
        module(**bigger)  # eager takes 32 x 32 tiles (its position embeddings interpolate)
    with pytest.raises(AssertionError, match=r"pixel_values.size\(\)\[[23]\] == 16"):
        program.module()(**bigger)
