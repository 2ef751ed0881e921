"""Per-group attribution of a recipe's error (`audit_quantization`, `hfexport audit --quant`) and `keep_float`
(mixed precision by module name) on every quantizer, on the trained code model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("nncf")

from hfexport import ConfigError, OnnxConfig, OnnxExporter
from hfexport.apps.quant_audit import audit_quantization, linear_groups
from hfexport.backends.onnx.ops import quantized_op_counts
from hfexport.quantizers.onnxruntime import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer
from hfexport.quantizers.scopes import module_matches
from tests.quant_checks import FIXTURE, HELDOUT, MEASURE, WrongScale, code_lm, sample, trained


def test_module_patterns() -> None:
    assert module_matches("model.layers.3.mlp.down_proj", ["model.layers.3.mlp"])
    assert module_matches("model.layers.3.mlp", ["model.layers.3.mlp"])
    assert not module_matches("model.layers.31.mlp", ["model.layers.3"])
    assert module_matches("model.layers.7.mlp.down_proj", ["model.layers.*.mlp.down_proj"])
    assert not module_matches("model.layers.7.mlp.up_proj", ["model.layers.*.mlp.down_proj"])


def test_linear_groups_are_each_blocks_attention_and_mlp_and_the_ends() -> None:
    groups = linear_groups(trained()[0])
    assert groups == {
        "model.embed_tokens": 1,
        **{f"model.layers.{i}.{part}": n for i in range(4) for part, n in (("self_attn", 4), ("mlp", 3))},
        "lm_head": 1,
    }


@pytest.mark.slow
def test_keep_float_leaves_a_module_unquantized_in_onnx_runtime() -> None:
    model, _, inputs = trained()
    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    quantizer.keep_float = ("model.layers.0.mlp", "lm_head")
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer))
    # 4 layers x 7 linears + the head, less the 3 of layer 0's MLP and the head.
    assert quantized_op_counts(program.model)["MatMulInteger"] == 4 * 7 + 1 - 3 - 1
    assert exporter.report.quantization.settings["keep_float"] == ["model.layers.0.mlp", "lm_head"]


def test_keep_float_that_names_no_module_is_refused() -> None:
    model, tokenizer = code_lm(layers=1)
    inputs = sample(tokenizer)
    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    quantizer.keep_float = ("model.layers.9",)
    with pytest.raises(Exception, match="names no module"):
        OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer))
    quantizer.keep_float = "lm_head"  # a string, not a sequence of names
    with pytest.raises(ConfigError, match="sequence of module names"):
        OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer))


@pytest.mark.slow
def test_audit_names_the_group_whose_quantization_is_broken() -> None:
    """A wrong scale in layer 1's MLP: the audit ranks that group first, and keeping it in float recovers the
    accuracy (2 layers: 6 groups, 8 exports)."""
    model, tokenizer = code_lm(layers=2)
    inputs = sample(tokenizer)
    config = OnnxConfig(dynamic=True, quantizer=WrongScale("model.layers.1.mlp", factor=1.5))
    audit = audit_quantization(model, inputs, config, tokenizer=tokenizer, text=HELDOUT, keep_worst=1, measure=MEASURE)
    assert audit.ranking[0] == "model.layers.1.mlp", audit.render()
    assert audit.kept == ["model.layers.1.mlp"]
    assert audit.mixed is not None and audit.mixed.kl_divergence < audit.full.kl_divergence / 10
    # Quantized alone, the broken group adds nearly all of the recipe's error; every other group far less.
    worst, second = audit.groups[0].accuracy, audit.groups[1].accuracy
    assert worst.kl_divergence > 0.5 * audit.full.kl_divergence > 10 * second.kl_divergence


@pytest.mark.slow
def test_audit_ranking_matches_a_direct_measurement_and_the_cli_prints_it(tmp_path: Path) -> None:
    """`hfexport audit --quant` on the trained model (NNCF int4 on OpenVINO): the group it ranks first, quantized
    alone in a separate export, gives the KL the audit reports for it."""
    out = tmp_path / "audit.json"
    command = [sys.executable, "-m", "hfexport", "audit", "--model", str(FIXTURE), "--format", "openvino"]
    command += ["--quantize", "nncf-int4", "--quant", "--keep-worst", "2", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "error each group adds when quantized alone" in result.stdout
    import json

    audit = json.loads(out.read_text())
    groups = [g for g in audit["groups"] if g["accuracy"]]
    assert len(groups) == 10 and audit["mixed"]["kl_divergence"] < audit["full"]["kl_divergence"]
    kls = [g["accuracy"]["kl_divergence"] for g in groups]
    assert kls == sorted(kls, reverse=True)
