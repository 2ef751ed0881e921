"""`export()` of a vision-language forward that takes pixels (issue #17 item 4).

The image layout inputs (image_grid_thw, image_sizes...) are baked into the graph as the sample's values; the
text stays dynamic (13 and 73 tokens with the same image); a saved artifact refuses another layout at run time
with an error that names the expected one, never a silently wrong result.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import hfexport
from hfexport import DynamoConfig, DynamoExporter, OnnxConfig, OnnxExporter
from hfexport.frontends.multimodal import is_vision_tower, pixel_layouts
from hfexport.testing.corpus import CorpusEntry, load_entry
from hfexport.testing.corpus_check import check_entry, failures

CORPUS_ALL = Path(__file__).parent / "fixtures" / "corpus_all" / "vlm"

# Qwen2-VL: a two-image grid, M-RoPE positions (rule patch/mrope-index-tensor), token-type ids per token.
QWEN2_VL = "qwen2_vl"
# Another layout with the sample's patch count: eager accepts it, so only the layout check stops the artifact.
OTHER_GRID = [[1, 2, 8], [1, 8, 2]]


def _entry(name: str) -> CorpusEntry:
    return load_entry(CORPUS_ALL / f"{name}.json")


def test_layouts_are_the_small_integer_inputs_of_a_pixel_forward_only() -> None:
    ids = torch.ones(2, 14, dtype=torch.long)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(32, 96),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "mm_token_type_ids": torch.zeros_like(ids),  # per token: stays an input, the text length stays dynamic
        "token_type_ids": torch.zeros(2, 3, dtype=torch.long),
        "image_sizes": torch.tensor([[30, 24], [18, 30]]),
    }
    assert pixel_layouts(inputs) == {
        "image_grid_thw": ([[1, 4, 4], [1, 4, 4]], torch.int64),
        "image_sizes": ([[30, 24], [18, 30]], torch.int64),
    }
    text_only = {k: v for k, v in inputs.items() if k != "pixel_values"}
    assert pixel_layouts(text_only) == {}  # not a pixel-input forward: nothing is baked


def _check_text_lengths(entry: CorpusEntry, model: torch.nn.Module, run: Callable, tolerance: float) -> None:
    checks = check_entry(entry, model, run, tolerance=tolerance)
    names = [c.name for c in checks if not c.skipped]
    assert names[:4] == ["sample", "grown", "long", "longer"]  # 14, 19, 79, 144 tokens, the same images
    assert not failures(checks), " | ".join(failures(checks))


def _other_layout(entry: CorpusEntry) -> dict[str, torch.Tensor]:
    feed = entry.sample_inputs()
    feed["image_grid_thw"] = torch.tensor(OTHER_GRID)
    return feed


@pytest.mark.slow
def test_qwen2_vl_forward_exports_to_dynamo_with_its_grid_baked(tmp_path: Path) -> None:
    entry = _entry(QWEN2_VL)
    model = entry.build_model()
    exporter = DynamoExporter()
    program = exporter.export(model, entry.sample_inputs(), DynamoConfig(dynamic=True))
    # The trace left no FakeTensor behind on the model (Qwen2-VL memoises its rope deltas on the module).
    assert not isinstance(model.model.rope_deltas, torch._subclasses.fake_tensor.FakeTensor)
    hits = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    assert hits.get("patch/fake-constant-layouts", 0) > 0 and hits.get("patch/mrope-index-tensor") == 1
    module = program.module()
    _check_text_lengths(entry, model, lambda feed: module(**feed), 1e-4)

    other = _other_layout(entry)
    with torch.no_grad():
        model(**other)  # eager takes the other layout: the artifact must not answer it silently
    expected = r"image_grid_thw=\[\[1, 4, 4\], \[1, 4, 4\]\].*export again"
    with pytest.raises(RuntimeError, match=expected):
        module(**other)
    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    with pytest.raises(RuntimeError, match=expected):
        loaded.run(other)


@pytest.mark.slow  # an ONNX export of a VLM: about a minute
def test_qwen2_vl_forward_exports_to_onnx_and_the_runner_refuses_another_grid(tmp_path: Path) -> None:
    entry = _entry(QWEN2_VL)
    model = entry.build_model()
    program = OnnxExporter().export(model, entry.sample_inputs(), OnnxConfig(dynamic=True))
    hfexport.save(program, tmp_path / "out")
    loaded = hfexport.load(tmp_path / "out")
    _check_text_lengths(entry, model, loaded.run, 1e-3)
    with pytest.raises(hfexport.InputError, match=r"image_grid_thw=\[\[1, 4, 4\], \[1, 4, 4\]\]"):
        loaded.run(_other_layout(entry))


def test_the_corpus_check_skips_another_layout_the_artifact_refuses_but_not_a_wrong_answer() -> None:
    entry = _entry("llava_next")  # batch+1 cycles its image_sizes rows into a 3-image layout
    model = entry.build_model()
    sample_sizes = entry.sample_inputs()["image_sizes"]

    def refusing(feed: dict) -> object:
        if not torch.equal(feed["image_sizes"], sample_sizes):
            raise RuntimeError("exported for image_sizes=... (an image layout baked into the graph)")
        with torch.no_grad():
            return model(**feed)

    checks = {c.name: c for c in check_entry(entry, model, refusing, tolerance=1e-4)}
    assert checks["batch+1"].ok and checks["batch+1"].skipped.startswith("another image layout")
    assert checks["grown"].ok and not checks["grown"].skipped  # the same layout is compared as before

    def answering_the_sample(feed: dict) -> object:
        with torch.no_grad():
            return model(**entry.sample_inputs())  # a silently wrong answer for any other input

    bad = {c.name: c for c in check_entry(entry, model, answering_the_sample, tolerance=1e-4)}
    assert not bad["batch+1"].ok and not bad["grown"].ok


# -- a vision tower on its own (`AutoModel` of a `*_vision` config): its patches are `hidden_states`, not pixels ---

FEATURE_EXTRACTION = Path(__file__).parent / "fixtures" / "corpus_all" / "feature_extraction"


def test_a_vision_tower_alone_is_a_pixel_forward_whatever_its_patches_are_called() -> None:
    entry = load_entry(FEATURE_EXTRACTION / "qwen3_5_vision.json")
    model = entry.build_model()
    inputs = entry.sample_inputs()  # hidden_states [32, 96] and grid_thw [[1, 4, 4], [1, 4, 4]]
    assert is_vision_tower(model) and pixel_layouts(inputs) == {}
    assert pixel_layouts(inputs, vision_tower=True) == {"grid_thw": ([[1, 4, 4], [1, 4, 4]], torch.int64)}
    assert not is_vision_tower(_entry(QWEN2_VL).build_model())  # the whole VLM is not a tower


def test_a_vision_tower_alone_exports_to_dynamo_and_refuses_another_grid(tmp_path: Path) -> None:
    entry = load_entry(FEATURE_EXTRACTION / "glm4v_vision.json")
    model = entry.build_model()
    exporter = DynamoExporter()
    program = exporter.export(model, entry.sample_inputs(), DynamoConfig(dynamic=True))
    hits = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    assert hits.get("patch/fake-constant-layouts", 0) > 0
    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    checks = check_entry(entry, model, loaded.run, tolerance=1e-4)
    assert checks[0].name == "sample" and checks[0].ok and not checks[0].skipped
    assert not failures(checks), " | ".join(failures(checks))

    other = entry.sample_inputs()
    other["grid_thw"] = torch.tensor([[1, 2, 8], [1, 8, 2]])  # the same patch count, another layout
    with torch.no_grad():
        model(**other)  # eager takes it: the artifact must refuse it, not answer for the sample's grid
    with pytest.raises(RuntimeError, match=r"grid_thw=\[\[1, 4, 4\], \[1, 4, 4\]\].*export again"):
        loaded.run(other)
