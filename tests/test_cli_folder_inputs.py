"""`hfexport export --model DIR` for image, speech and vision-language folders: sample inputs from the config.

Each folder is a tiny model saved with `save_pretrained` (seeded, offline); the command runs for real in a
subprocess, exports, validates against eager (the traced shape and the other shapes) and must exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfexport.tiny import TINY_MODELS

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
ENV.pop("HFEXPORT_DEBUG", None)


def _export(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfexport", "export", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=900,
    )


def _vit_folder(tmp_path: Path, preprocessor_size: int | None) -> Path:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    folder = tmp_path / "vit"
    ViTForImageClassification(config).eval().save_pretrained(folder)
    if preprocessor_size is not None:  # as ViTImageProcessor saves it (that class needs PIL and torchvision)
        pre = {"image_processor_type": "ViTImageProcessor", "size": {"height": 32, "width": 32}}
        (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    return folder


def _assert_validated(result: subprocess.CompletedProcess[str], first_output: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines()[0].startswith("• building "), result.stderr[:500]
    assert f"ok   {first_output}" in result.stdout, result.stdout


def test_image_classification_folder(tmp_path: Path) -> None:
    folder = _vit_folder(tmp_path, preprocessor_size=32)
    result = _export(
        "--model", str(folder), "--task", "image-classification", "--output", "out", "--validate", cwd=tmp_path
    )
    _assert_validated(result, "logits [2, 3]")
    # No text axis: the other shape checked is another batch.
    assert "ok   batch+1 (pixel_values [3, 3, 32, 32])" in result.stdout


def test_image_folder_without_preprocessor_uses_the_config(tmp_path: Path) -> None:
    folder = _vit_folder(tmp_path, preprocessor_size=None)
    result = _export("--model", str(folder), "--output", "out", "--validate", "--batch-size", "3", cwd=tmp_path)
    _assert_validated(result, "logits [3, 3]")  # --task auto: ViTForImageClassification


def test_speech_folder(tmp_path: Path) -> None:
    folder = tmp_path / "whisper"
    TINY_MODELS["tiny-whisper"].build().save_pretrained(folder)
    result = _export(
        "--model", str(folder), "--task", "automatic-speech-recognition", "--output", "out", "--validate",
        cwd=tmp_path,
    )  # fmt: skip
    _assert_validated(result, "logits [2, 4, 128]")
    assert "ok   grown (input_features [2, 16, 32], decoder_input_ids [2, 7])" in result.stdout


def test_speech_folder_task_auto(tmp_path: Path) -> None:
    """WhisperForConditionalGeneration is a speech model, not a text seq2seq one (it has no tokenizer here)."""
    from hfexport.cli.models import sample_inputs

    folder = tmp_path / "whisper"
    TINY_MODELS["tiny-whisper"].build().save_pretrained(folder)
    inputs = sample_inputs(str(folder), sequence_length=5)
    assert {k: list(v.shape) for k, v in inputs.items()} == {
        "input_features": [2, 16, 32],
        "decoder_input_ids": [2, 5],
    }
    assert inputs["decoder_input_ids"][:, 0].tolist() == [1, 1]  # decoder_start_token_id


@pytest.mark.slow
def test_vision_language_folder(tmp_path: Path) -> None:
    folder = tmp_path / "llava"
    TINY_MODELS["tiny-llava"].build().save_pretrained(folder)
    # Static: a dynamic LLaVA export specialises the image batch (pixel_values.size()[0] == 2), the built-in too.
    result = _export("--model", str(folder), "--output", "out", "--validate", "--no-dynamic", cwd=tmp_path)
    _assert_validated(result, "logits [2, 24, 128]")  # 16 image tokens + 8 text tokens


def test_vision_language_placeholders_match_the_builtin(tmp_path: Path) -> None:
    from hfexport.cli.models import sample_inputs

    folder = tmp_path / "llava"
    TINY_MODELS["tiny-llava"].build().save_pretrained(folder)
    inputs = sample_inputs(str(folder), task="image-text-to-text", sequence_length=6)
    builtin = TINY_MODELS["tiny-llava"].sample_inputs()
    assert {k: v.shape for k, v in inputs.items()} == {k: v.shape for k, v in builtin.items()}
    assert (inputs["input_ids"] == 127).sum().item() == (builtin["input_ids"] == 127).sum().item() == 32


def test_a_config_without_an_image_size_is_refused() -> None:
    from hfexport.cli.exits import UsageError
    from hfexport.cli.folder_inputs import FolderSpec, image_shape

    with pytest.raises(UsageError, match="the folder says no image size"):
        image_shape(FolderSpec(config=object(), preprocessor={"size": {"longest_edge": 30}}))
    assert image_shape(FolderSpec(config=object(), preprocessor={"crop_size": {"height": 5, "width": 7}})) == (3, 5, 7)


# -- text folders without a tokenizer; inputs the forward does not take ---------------------------------------


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_a_text_checkpoint_without_a_tokenizer_exports_with_inputs_from_its_config(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    # A checkpoint someone trained or converted: save_pretrained of the model alone, no tokenizer files.
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    torch.manual_seed(0)
    folder = tmp_path / "bert"
    BertModel(config).eval().save_pretrained(folder)
    # --task text-classification: the exported class is BertForSequenceClassification (a new head on BertModel).
    result = _export(
        "--model", str(folder), "--task", "text-classification", "--format", "onnx", "--output", "out",
        "--validate", cwd=tmp_path,
    )  # fmt: skip
    _assert_validated(result, "logits [2, 2]")
    note = f"note: {folder} has no tokenizer: sample inputs built from its config (input_ids [2, 8], attention_mask"
    assert note in result.stderr, result.stderr[-3000:]
    out = tmp_path / "out"
    manifest = _manifest(out)
    record = manifest["metadata"]["sample_inputs"]
    assert record["source"].startswith("the folder's config (no tokenizer") and record["shapes"] == {
        "input_ids": [2, 8],
        "attention_mask": [2, 8],
    }
    assert manifest["model_class"] == "BertForSequenceClassification"
    # The artifact says what it is: the copied config names the exported class, and AutoExportedModel follows.
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    import hfexport

    model = hfexport.AutoExportedModel.from_pretrained(out)
    assert type(model).__name__ == "ExportedModelForSequenceClassification"
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 2)


def test_a_decoder_only_model_does_not_get_the_tokenizer_s_token_type_ids(tmp_path: Path) -> None:
    # A WordPiece tokenizer returns token_type_ids; a Llama forward does not take them and generate refuses them.
    folder = tmp_path / "llama"
    TINY_MODELS["tiny-llama"].build().save_pretrained(folder)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",", "world", "!", "export", "me"]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    result = _export("--model", str(folder), "--generation", "--validate", "--output", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines()[0] == f"• building {folder}"
    assert (
        "note: dropped token_type_ids from the sample inputs: LlamaForCausalLM.forward does not take it"
        in result.stderr
    )
    manifest = _manifest(tmp_path / "out")
    assert manifest["validation"]["ok"] is True and manifest["validation"]["agreement"] == 1.0
    assert set(manifest["metadata"]["sample_inputs"]["shapes"]) == {"input_ids", "attention_mask"}
    assert manifest["metadata"]["sample_inputs"]["source"] == "the folder's tokenizer on fixed texts"


def test_a_checkpoint_without_a_tokenizer_exports_with_low_memory(tmp_path: Path) -> None:
    # --low-memory builds the model on weights that hold no memory: the inputs come from the config all the same.
    folder = tmp_path / "llama"
    TINY_MODELS["tiny-llama"].build().save_pretrained(folder)
    result = _export("--model", str(folder), "--format", "onnx", "--low-memory", "--output", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines()[0] == f"• building {folder}"
    assert f"note: {folder} has no tokenizer: sample inputs built from its config" in result.stderr
    manifest = _manifest(tmp_path / "out")
    assert manifest["config"]["low_memory"] is True
    assert manifest["metadata"]["sample_inputs"]["shapes"] == {"input_ids": [2, 8], "attention_mask": [2, 8]}
