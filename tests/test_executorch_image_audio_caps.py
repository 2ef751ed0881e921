"""The caps ExecuTorch gets for image and raw-audio axes (`bounded_dynamic_shapes`), and one real program
planned for a larger image than its sample.

A sequence cap (`max_position_embeddings`, else 2048) on an image's height and width planned dinov2's attention
over (2048/4)^2 patches: 17.6 TB of buffers. Images are capped at the config's `image_size` instead, raw audio
at `MAX_AUDIO_SAMPLES` (the sequence fallback, under the 4000-sample sample, had kept it at the sample's size).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfexport.configs import ExecutorchConfig
from hfexport.lowerings.executorch import (
    FALLBACK_MAX_SEQUENCE,
    MAX_AUDIO_SAMPLES,
    MAX_BATCH,
    axis_kinds,
    bounded_dynamic_shapes,
)

Dim = torch.export.Dim


class _WithConfig(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config


def _maxes(shapes: dict[str, Any], name: str) -> list[Any]:
    spec = shapes[name]
    dims = spec.values() if isinstance(spec, dict) else spec
    return [getattr(d, "max", None) for d in dims]


def test_image_axes_are_capped_at_the_config_image_size_not_the_sequence_cap() -> None:
    from transformers import Dinov2Config, YolosConfig

    pixels = {"pixel_values": torch.rand(2, 3, 32, 32)}
    warnings: list[str] = []
    model = _WithConfig(Dinov2Config(image_size=64, patch_size=4))
    shapes = bounded_dynamic_shapes(model, pixels, ExecutorchConfig(dynamic=True), warnings)
    # batch, channels (the sample's: the first convolution fixes them), height, width.
    assert _maxes(shapes, "pixel_values") == [MAX_BATCH, 3, 64, 64]
    assert "image height and width at (64, 64) (config.image_size)" in warnings[0]
    assert "pixel_values axis 2 (height) <= 64" in warnings[0]

    # A (height, width) pair, as YOLOS gives it; never below the sample.
    yolos = _WithConfig(YolosConfig(image_size=[512, 864]))
    tall = {"pixel_values": torch.rand(2, 3, 600, 32)}
    assert _maxes(bounded_dynamic_shapes(yolos, tall, ExecutorchConfig(dynamic=True)), "pixel_values") == [
        MAX_BATCH,
        3,
        600,
        864,
    ]


def test_a_nested_tensor_axis_is_never_capped_below_its_sample() -> None:
    """A VLM prefill takes its image features nested (`mm_encoder_outputs.image.pooler_output.0`: one image's 16
    rows); capped at the batch cap, that axis was planned for 8 rows, and the program refused its own sample."""
    from transformers import LlamaConfig
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    image = BaseModelOutputWithPooling(last_hidden_state=torch.rand(2, 16, 8), pooler_output=(torch.rand(16, 8),))
    sample = {"input_ids": torch.ones(2, 20, dtype=torch.long), "mm_encoder_outputs": {"image": image}}
    model = _WithConfig(LlamaConfig(max_position_embeddings=64))
    shapes = bounded_dynamic_shapes(model, sample, ExecutorchConfig(dynamic=True))
    hidden, (pooled,) = shapes["mm_encoder_outputs"]["image"]  # a ModelOutput's spec: the list of its fields
    assert [d.max for d in pooled.values()] == [16, 64]
    assert [d.max for d in hidden.values()] == [MAX_BATCH, 64, 64]
    assert _maxes(shapes, "input_ids") == [MAX_BATCH, 64]


def test_image_cap_from_a_vision_sub_config_else_the_sample_size() -> None:
    from transformers import CLIPConfig

    pixels = {"pixel_values": torch.rand(2, 3, 24, 40), "input_ids": torch.ones(2, 7, dtype=torch.long)}
    clip = _WithConfig(CLIPConfig(vision_config={"image_size": 48}))
    warnings: list[str] = []
    shapes = bounded_dynamic_shapes(clip, pixels, ExecutorchConfig(dynamic=True), warnings)
    assert _maxes(shapes, "pixel_values") == [MAX_BATCH, 3, 48, 48]
    assert _maxes(shapes, "input_ids") == [MAX_BATCH, clip.config.text_config.max_position_embeddings]
    assert "(config.vision_config.image_size)" in warnings[0]

    # No image_size anywhere (SegFormer, ResNet): the sample's size, with a warning that says so.
    class NoConfig(torch.nn.Module):
        pass

    warnings = []
    shapes = bounded_dynamic_shapes(NoConfig(), pixels, ExecutorchConfig(dynamic=True), warnings)
    assert _maxes(shapes, "pixel_values") == [MAX_BATCH, 3, 24, 40]
    assert _maxes(shapes, "input_ids") == [MAX_BATCH, FALLBACK_MAX_SEQUENCE]
    assert "the sample's size: the model config names no image_size" in warnings[0]


def test_explicit_image_bounds_are_kept_and_a_named_dim_is_capped_once() -> None:
    from transformers import Dinov2Config

    model = _WithConfig(Dinov2Config(image_size=64))
    side = Dim("side")
    explicit = {"pixel_values": {0: Dim("batch", max=2), 2: Dim("h", max=128), 3: side}}
    shapes = bounded_dynamic_shapes(
        model, {"pixel_values": torch.rand(2, 3, 32, 32)}, ExecutorchConfig(dynamic_shapes=explicit)
    )
    assert shapes["pixel_values"][0].max == 2 and shapes["pixel_values"][2].max == 128, "user bounds are kept"
    assert shapes["pixel_values"][3].__name__ == "side" and shapes["pixel_values"][3].max == 64


def test_raw_audio_is_capped_at_max_audio_samples() -> None:
    from transformers import HubertConfig

    model = _WithConfig(HubertConfig())
    warnings: list[str] = []
    audio = {"input_values": torch.randn(2, 4000)}
    shapes = bounded_dynamic_shapes(model, audio, ExecutorchConfig(dynamic=True), warnings)
    assert _maxes(shapes, "input_values") == [MAX_BATCH, MAX_AUDIO_SAMPLES]
    assert MAX_AUDIO_SAMPLES == 160_000, "10 s at 16 kHz, as docs/executorch.md says"
    assert f"raw audio at {MAX_AUDIO_SAMPLES} samples" in warnings[0]
    longer = {"input_values": torch.randn(1, MAX_AUDIO_SAMPLES + 5)}
    assert _maxes(bounded_dynamic_shapes(model, longer, ExecutorchConfig(dynamic=True)), "input_values")[1] == (
        MAX_AUDIO_SAMPLES + 5
    ), "never below the sample"


def test_axis_kinds_by_rank_dtype_and_name() -> None:
    assert axis_kinds("pixel_values", torch.rand(1, 3, 8, 8)) == {1: "channels", 2: "height", 3: "width"}
    assert axis_kinds("pixel_values_videos", torch.rand(1, 4, 3, 8, 8)) == {2: "channels", 3: "height", 4: "width"}
    assert axis_kinds("input_values", torch.randn(1, 100)) == {1: "audio"}
    assert axis_kinds("input_ids", torch.ones(1, 100, dtype=torch.long)) == {}
    assert axis_kinds("input_features", torch.randn(1, 80, 3000)) == {}, "spectrogram frames are a sequence"
    assert axis_kinds("pixel_values", torch.rand(16, 1176)) == {}, "flattened patches (Qwen2-VL) are a sequence"
    assert axis_kinds("pixel_mask", torch.ones(1, 1, 8, 8, dtype=torch.long)) == {}


def test_a_waveform_s_attention_mask_takes_the_audio_cap() -> None:
    """moonshine: `attention_mask` is `(batch, samples)` beside `input_values`; with the text cap (its 512
    positions, so the 1279-sample sample) the program refused the sweep's 1679-sample run."""
    from hfexport.lowerings.executorch import _waveform_mask_kinds

    inputs = {"input_values": torch.randn(2, 1279), "attention_mask": torch.ones(2, 1279, dtype=torch.long)}
    assert _waveform_mask_kinds("attention_mask", inputs["attention_mask"], inputs) == {1: "audio"}
    text = {"input_values": torch.randn(2, 1279), "decoder_attention_mask": torch.ones(2, 9, dtype=torch.long)}
    assert _waveform_mask_kinds("decoder_attention_mask", text["decoder_attention_mask"], text) == {}
    assert _waveform_mask_kinds("attention_mask", torch.ones(2, 9), {"input_ids": torch.ones(2, 9)}) == {}


@pytest.mark.slow
def test_a_dinov2_program_runs_larger_images_than_its_sample_and_refuses_beyond_image_size(tmp_path: Any) -> None:
    pytest.importorskip("executorch")
    from transformers import Dinov2Config, Dinov2ForImageClassification

    from hfexport import ExecutorchExporter
    from hfexport.core.errors import InputError
    from hfexport.runtime.executorch import ExecutorchProgram

    torch.manual_seed(0)
    config = Dinov2Config(
        image_size=64,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    model = Dinov2ForImageClassification(config).eval()
    sample = {"pixel_values": torch.rand(2, 3, 32, 32)}
    exporter = ExecutorchExporter()
    manager = exporter.export(model, sample, config=ExecutorchConfig(dynamic=True))
    path = tmp_path / "model.pte"
    manager.save(str(path))
    program = ExecutorchProgram(path)
    assert [slot.max_sizes for slot in program.slots.values()] == [(MAX_BATCH, 3, 64, 64)]
    generator = torch.Generator().manual_seed(1)
    # The sample, a larger square, the cap itself, odd non-square sizes, another batch.
    for shape in ((2, 3, 32, 32), (1, 3, 48, 48), (3, 3, 64, 64), (2, 3, 40, 56), (1, 3, 37, 61)):
        pixels = torch.rand(*shape, generator=generator)
        with torch.no_grad():
            expected = model(pixel_values=pixels).logits
        actual = program.run({"pixel_values": pixels})[0]
        assert actual.shape == expected.shape, shape
        diff = (actual - expected).abs().max().item()
        assert diff <= 1e-4, f"{shape}: max abs diff {diff:.3g}"
    with pytest.raises(InputError, match=r"'pixel_values' has size 72 on axis 2.*at most 64"):
        program.run({"pixel_values": torch.rand(1, 3, 72, 64)})
