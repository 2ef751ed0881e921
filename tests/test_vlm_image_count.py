"""`export()` of a pixel-input forward whose model makes one Python value per image (issue #17).

LLaVA's `get_image_features` returns `list(image_features)`, Idefics2/3 and SmolVLM split the features per batch
row by `num_real_images_per_batch.tolist()`, DeepSeek-OCR 2 loops `for idx in range(batch_size)`: the forward's
output holds one tensor per image (or row), so torch.export keeps the image axis at the sample's size. The export
records that count (`report.used["image_count"]`, a warning), the loaded artifact refuses another count with an
error naming it (every format), and the corpus check counts that refusal as a skipped check, never a wrong answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hfexport
from hfexport import DynamoConfig, DynamoExporter
from hfexport.core.errors import InputError
from hfexport.testing.corpus import load_entry
from hfexport.testing.corpus_check import check_entry, failures

CORPUS_ALL = Path(__file__).parent / "fixtures" / "corpus_all" / "vlm"


class _Vlm(torch.nn.Module):
    """Images projected to features that are scattered over the first tokens, as a VLM merges them; with
    `per_image`, the features also come back as a Python list with one tensor per image (LLaVA's
    `list(image_features)`), which fixes the image count of the traced program."""

    def __init__(self, per_image: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.per_image = per_image
        self.proj = torch.nn.Linear(3 * 4 * 4, 8)
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> tuple:
        features = self.proj(pixel_values.flatten(1))  # [images, 8]
        if self.per_image:
            listed = list(features)
            merged = torch.stack(listed).sum(0)
            return self.embed(input_ids) + merged, listed
        return (self.embed(input_ids) + features.sum(0),)


def _feed(images: int, tokens: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.rand(images, 3, 4, 4, generator=gen),
        "input_ids": torch.randint(0, 16, (2, tokens), generator=gen),
    }


def test_an_image_count_the_trace_keeps_is_recorded_and_another_is_refused(tmp_path: Path) -> None:
    model = _Vlm(per_image=True).eval()
    exporter = DynamoExporter()
    program = exporter.export(model, _feed(2), DynamoConfig(dynamic=True))
    assert exporter.report.used["image_count"] == {"pixel_values": 2}
    assert any("exported static at the sample's 2:" in w for w in exporter.report.warnings)

    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    for tokens in (5, 9):  # the text stays dynamic
        feed = _feed(2, tokens, seed=tokens)
        with torch.no_grad():
            expected = model(**feed)[0]
        assert torch.equal(next(iter(loaded.run(feed).values())), expected)
    with torch.no_grad():
        model(**_feed(3))  # eager takes 3 images: the artifact must refuse, not answer
    with pytest.raises(InputError, match=r"exported for pixel_values.shape\[0\] == 2 .*got 3: export again"):
        loaded.run(_feed(3))


def test_executorch_s_capped_shapes_record_the_image_count_too() -> None:
    """ExecuTorch derives bounded shapes from `dynamic=True` (every axis capped): those are not the caller's
    shapes, so the fixed image axis is recorded as for the other formats (the llava sweep row's refusal was the
    runtime's bound, 'planned for at most 2', counted as a failure, before). A caller's own shapes are not."""
    from hfexport import ExecutorchConfig
    from hfexport.frontends.torch_export import capture
    from hfexport.generation_spec import IMAGE_COUNT_META
    from hfexport.lowerings.executorch import capture_options
    from hfexport.rewrites.engine import RewriteContext

    model = _Vlm(per_image=True).eval()
    warnings: list[str] = []
    derived = capture_options(model, _feed(2), ExecutorchConfig(dynamic=True), warnings)
    assert derived.dynamic_shapes is not None and derived.derived_shapes
    own = {"pixel_values": {0: torch.export.Dim("images", min=1, max=4)}, "input_ids": None}
    assert not capture_options(model, _feed(2), ExecutorchConfig(dynamic_shapes=own), warnings).derived_shapes

    program = capture(model, _feed(2), derived, RewriteContext(backend="executorch"), warnings)
    assert program.graph_module.meta.get(IMAGE_COUNT_META) == {"pixel_values": 2}


def test_an_image_axis_the_model_keeps_as_a_tensor_stays_dynamic(tmp_path: Path) -> None:
    model = _Vlm(per_image=False).eval()
    exporter = DynamoExporter()
    program = exporter.export(model, _feed(2), DynamoConfig(dynamic=True))
    assert "image_count" not in exporter.report.used
    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    assert loaded["model"].image_count == {}
    feed = _feed(3)
    with torch.no_grad():
        expected = model(**feed)[0]
    assert torch.equal(next(iter(loaded.run(feed).values())), expected)


def test_the_corpus_check_skips_another_image_count_the_artifact_refuses_but_not_a_wrong_answer() -> None:
    entry = load_entry(CORPUS_ALL / "llava.json")  # no layout input: batch+1 grows the images 2 -> 3
    model = entry.build_model()

    def refusing(feed: dict) -> object:
        if feed["pixel_values"].shape[0] != 2:
            raise InputError("exported for pixel_values.shape[0] == 2")
        with torch.no_grad():
            return model(**feed)

    checks = {c.name: c for c in check_entry(entry, model, refusing, 1e-4, image_count={"pixel_values": 2})}
    assert checks["batch+1"].ok and checks["batch+1"].skipped.startswith("another image count")
    assert checks["grown"].ok and not checks["grown"].skipped

    def answering_the_sample(feed: dict) -> object:
        with torch.no_grad():
            return model(**entry.sample_inputs())  # a silently wrong answer for any other input

    bad = {c.name: c for c in check_entry(entry, model, answering_the_sample, 1e-4, image_count={"pixel_values": 2})}
    assert not bad["batch+1"].ok and not bad["grown"].ok


@pytest.mark.slow  # a tiny LLaVA on Dynamo, saved and loaded: about 40 s on the shared machine
def test_llava_exports_its_image_count_and_passes_every_text_length(tmp_path: Path) -> None:
    entry = load_entry(CORPUS_ALL / "llava.json")
    model = entry.build_model()
    exporter = DynamoExporter()
    program = exporter.export(model, entry.sample_inputs(), DynamoConfig(dynamic=True))
    assert exporter.report.used["image_count"] == {"pixel_values": 2}
    hfexport.save(program, tmp_path / "out", report=exporter.report)
    loaded = hfexport.load(tmp_path / "out", trust=True)
    checks = check_entry(entry, model, loaded.run, 1e-4, image_count=loaded["model"].image_count)
    assert not failures(checks), " | ".join(failures(checks))
    assert [c.name for c in checks if not c.skipped] == ["sample", "grown", "long", "longer"]
    (skipped,) = [c for c in checks if c.skipped]
    assert skipped.name == "batch+1" and "exported for pixel_values.shape[0] == 2" in skipped.skipped
    # Without the artifact's record the same refusal is a failure: the skip needs the export's word.
    plain = {c.name: c for c in check_entry(entry, model, loaded.run, 1e-4)}
    assert not plain["batch+1"].ok and "pixel_values.shape[0] == 2" in plain["batch+1"].problem
