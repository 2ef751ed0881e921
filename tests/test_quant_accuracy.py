"""`quantization_accuracy` and `export --validate` on quantized exports: the export against the float model on
held-out text, on the trained code model (tests/fixtures/code_lm), gated by the budget of the recipe's precision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("nncf")

from hfexport import OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter
from hfexport.artifacts.accuracy import BUDGETS, precision_from_settings, quantization_accuracy
from hfexport.quantizers.nncf import NNCFOpenVINOQuantizer, NNCFWeightCompressionConfig
from hfexport.quantizers.onnxruntime import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer
from tests.quant_checks import FIXTURE, HELDOUT, MEASURE, WrongScale, trained


def _measure(export: Any, model: Any, tokenizer: Any, inputs: dict[str, Any], quantizer: Any) -> Any:
    return quantization_accuracy(
        export, model, tokenizer=tokenizer, text=HELDOUT, sample_inputs=inputs, quantizer=quantizer, **MEASURE
    )


@pytest.mark.slow
def test_int8_on_the_trained_model_is_within_budget_and_a_wrong_scale_is_not() -> None:
    model, tokenizer, inputs = trained()
    good = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    record = _measure(
        OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=good)), model, tokenizer, inputs, good
    )
    assert record.meaningful and record.ok, record.summary()
    assert record.float_perplexity < 100  # trained: far below the uniform 4096
    assert record.kl_divergence < 0.02 and record.top1_agreement > 0.95
    assert record.budget == BUDGETS["int8"].to_dict()

    broken = WrongScale("model.layers.1.mlp", factor=1.5)
    program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=broken))
    bad = _measure(program, model, tokenizer, inputs, broken)
    assert bad.meaningful and not bad.ok, bad.summary()
    assert any(limit.startswith("perplexity") for limit in bad.exceeded)
    assert bad.kl_divergence > 10 * record.kl_divergence


def test_random_weights_are_reported_as_not_meaningful() -> None:
    from hfexport.tiny import TINY_MODELS

    tiny = TINY_MODELS["tiny-llama"]
    model, inputs = tiny.build(), tiny.sample_inputs()
    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer))
    record = quantization_accuracy(program, model, text=HELDOUT, sample_inputs=inputs, quantizer=quantizer, **MEASURE)
    assert not record.meaningful and record.ok and not record.exceeded
    assert "not meaningful" in record.notes[0] and "bytes as ids" in record.text
    assert record.float_perplexity > 0.1 * record.vocab_size


@pytest.mark.slow
def test_generation_components_are_measured_with_greedy_divergence() -> None:
    model, tokenizer, inputs = trained()
    quantizer = NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))
    components = OpenVINOExporter().export_for_generation(
        model, inputs, OpenVINOConfig(dynamic=True, quantizer=quantizer)
    )
    record = _measure(components, model, tokenizer, inputs, quantizer)
    assert record.precision == "int4" and record.budget == BUDGETS["int4"].to_dict()
    assert record.meaningful and record.ok, record.summary()
    assert record.greedy_tokens == MEASURE["greedy_tokens"]
    assert record.first_divergence is None or 0 <= record.first_divergence < record.greedy_tokens
    assert 0 < record.kl_divergence < 0.2


def test_precision_of_each_recipe() -> None:
    assert (
        precision_from_settings("NNCFOpenVINOQuantizer", {"recipe": "NNCFWeightCompressionConfig", "mode": "int4_sym"})
        == "int4"
    )
    assert precision_from_settings(
        "NNCFOnnxQuantizer", {"recipe": "NNCFWeightCompressionConfig", "mode": "int8_asym"}
    ) == ("int8-weights")
    assert precision_from_settings("NNCFOnnxQuantizer", {"recipe": "NNCFQuantizationConfig"}) == "int8"
    assert precision_from_settings("PT2EQuantizer", {"pt2e_quantizer": "XNNPACKQuantizer", "weight_bits": 4}) == "int4"
    assert (
        precision_from_settings("PT2EQuantizer", {"pt2e_quantizer": "X86InductorQuantizer", "weight_bits": 8}) == "int8"
    )
    assert precision_from_settings("OnnxRuntimeQuantizer", {"recipe": "OnnxRuntimeDynamicConfig"}) == "int8"


@pytest.mark.slow
def test_cli_validate_records_the_accuracy_of_a_quantized_export(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "hfexport", "export", "--model", str(FIXTURE), "--format", "onnx"]
    command += ["--quantize", "ort-dynamic", "--validate", "--eval-text", str(FIXTURE / "heldout.txt")]
    result = subprocess.run([*command, "--output", str(out)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accuracy against the float model (heldout.txt" in result.stdout
    validation = json.loads((out / "manifest.json").read_text())["validation"]
    accuracy = validation["accuracy"]
    assert validation["ok"] and accuracy["ok"] and accuracy["meaningful"]
    assert accuracy["precision"] == "int8" and accuracy["tokens"] == 8 * 127
    assert validation["tolerance_ok"] is False  # int8 differs from eager beyond 1e-4: not what decides


def test_cli_refuses_accuracy_flags_without_a_quantizer(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "hfexport", "export", "--model", "tiny-llama", "--validate"]
    result = subprocess.run(
        [*command, "--max-perplexity-increase", "1", "--output", str(tmp_path / "x")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "--max-perplexity-increase: used only with --quantize" in result.stderr
