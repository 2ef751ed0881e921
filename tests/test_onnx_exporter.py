"""OnnxExporter: ONNX Runtime parity with eager, saved files, naming, and the effect of each OnnxConfig field.

Every check runs the exported graph in a real `onnxruntime.InferenceSession` (CPU).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx
import onnxruntime as ort

from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    ConfigError,
    DynamoConfig,
    OnnxConfig,
    OnnxExporter,
)
from hfexport.lowerings.onnx import newest_opset
from hfexport.naming import onnx_feed
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _assert_close(actual: np.ndarray, expected: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    assert tuple(actual.shape) == tuple(expected.shape), what
    diff = np.abs(actual - expected.numpy()).max()
    assert diff <= tol * max(1.0, expected.abs().max().item()), f"{what}: max abs diff {diff:.3g}"


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model, inputs = TINY.build(), TINY.sample_inputs()
    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, config=OnnxConfig(dynamic=True, output_path=str(path)))
    return {"model": model, "inputs": inputs, "program": program, "path": path, "report": exporter.report}


def test_returns_an_onnx_program_that_matches_eager(llama_export: dict[str, Any]) -> None:
    program, model, inputs = llama_export["program"], llama_export["model"], llama_export["inputs"]
    assert isinstance(program, torch.onnx.ONNXProgram)
    with torch.no_grad():
        expected = model(**inputs).logits
    # ONNXProgram is callable on the forward kwargs (it runs ONNX Runtime)
    _assert_close(program(**inputs)[0].numpy(), expected, "ONNXProgram call")
    assert [v.name for v in program.model.graph.inputs] == ["input_ids", "attention_mask"]
    assert program.model.graph.outputs[0].name == "logits"


def test_saved_model_runs_in_a_plain_session_on_a_second_shape(llama_export: dict[str, Any]) -> None:
    model, path = llama_export["model"], llama_export["path"]
    session = _session(path)
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    generator = torch.Generator().manual_seed(1)
    for batch, length in ((2, 8), (3, 13), (1, 1)):
        ids = torch.randint(3, 128, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        if length > 2:
            mask[0, :2] = 0  # left padding
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
        (logits, *_) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        _assert_close(logits, expected, f"shape {(batch, length)}")


def test_output_path_writes_external_data_at_the_newest_opset(llama_export: dict[str, Any]) -> None:
    path: Path = llama_export["path"]
    assert path.is_file()
    assert (path.parent / (path.name + ".data")).is_file(), sorted(p.name for p in path.parent.iterdir())
    proto = onnx.load(str(path), load_external_data=False)
    assert {o.domain: o.version for o in proto.opset_import}[""] == newest_opset()
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def test_report_has_the_onnx_stages(llama_export: dict[str, Any]) -> None:
    report = llama_export["report"]
    assert report.export_format == "onnx"
    assert {"trace", "aten", "translate", "onnx", "optimize", "save"} <= set(report.stage_seconds)
    # at the newest opset SDPA becomes the ONNX Attention op: the override stays out
    assert report.not_applicable["aten/sdpa-fully-masked-rows"].startswith("only for opset <= 22")
    assert all(count > 0 for stage in report.hits.values() for count in stage.values())


def test_config_fields_change_the_model(tmp_path: Path) -> None:
    model, inputs = TINY.build(), TINY.sample_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits

    path = tmp_path / "plain.onnx"
    config = OnnxConfig(output_path=str(path), external_data=False, optimize=False, opset_version=18)
    exporter = OnnxExporter()
    raw = exporter.export(model, inputs, config=config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.onnx"], "external_data=False: one file"
    proto = onnx.load(str(path))
    assert {o.domain: o.version for o in proto.opset_import}[""] == 18
    (logits, *_) = _session(path).run(None, onnx_feed([i.name for i in proto.graph.input], inputs))
    _assert_close(logits, expected, "opset 18, not optimized")
    # below opset 23 attention goes through the SDPA override, which keeps left-padded rows right
    assert exporter.report.hits["aten"]["aten/sdpa-fully-masked-rows"] == 2
    padded = {**inputs, "attention_mask": inputs["attention_mask"].clone()}
    padded["attention_mask"][0, :3] = 0
    with torch.no_grad():
        expected_padded = model(**padded).logits
    (logits, *_) = _session(path).run(None, onnx_feed([i.name for i in proto.graph.input], padded))
    _assert_close(logits, expected_padded, "opset 18, left padding")

    optimized = OnnxExporter().export(model, inputs, config=OnnxConfig(opset_version=18))
    # the optimizer folds the constants and shape arithmetic that translation leaves behind
    assert len(list(optimized.model.graph)) < len(list(raw.model.graph))

    bare = tmp_path / "bare.onnx"
    config = OnnxConfig(output_path=str(bare), export_params=False, keep_initializers_as_inputs=True)
    weightless = OnnxExporter().export(model, inputs, config=config)
    assert len(weightless.model.graph.initializers) == 0
    proto = onnx.load(str(bare))
    assert not proto.graph.initializer
    assert not (tmp_path / "bare.onnx.data").exists() or (tmp_path / "bare.onnx.data").stat().st_size == 0
    names = {i.name for i in proto.graph.input}
    # every weight is an input now (the optimizer may have folded some into new constants, e.g. a transpose)
    assert {"input_ids", "attention_mask", "model.embed_tokens.weight"} <= names
    assert len(names) > 10


def test_static_cache_inputs_and_outputs_are_paired(tmp_path: Path) -> None:
    from transformers import StaticCache

    model = TINY.build()
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=16)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(2, cfg.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(3)[None].expand(2, 3)
    inputs = {"input_ids": ids, "position_ids": positions, "cache": cache}
    path = tmp_path / "decode.onnx"
    OnnxExporter().export(model, inputs, config=OnnxConfig(dynamic=True, output_path=str(path)))

    session = _session(path)
    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]
    paired = [n.removeprefix("input.") for n in input_names if n.startswith("input.")]
    assert "cache.layers_0_keys" in paired and "cache.layers_1_values" in paired, input_names
    assert {f"output.{n}" for n in paired} <= set(output_names), output_names
    assert output_names[0] == "logits"
    assert cache.layers[0].keys.abs().sum() == 0, "the caller's sample cache is untouched"

    eager_cache = copy.deepcopy(cache)
    with torch.no_grad():
        expected = model(**{**inputs, "cache": eager_cache}).logits
    outputs = dict(zip(output_names, session.run(None, onnx_feed(input_names, inputs)), strict=True))
    _assert_close(outputs["logits"], expected, "logits")
    _assert_close(outputs["output.cache.layers_0_keys"], eager_cache.layers[0].keys, "updated keys")
    _assert_close(outputs["output.cache.layers_1_values"], eager_cache.layers[1].values, "updated values")


def test_onnx_exporter_refuses_a_dynamo_config() -> None:
    model = TINY.build()
    with pytest.raises(ConfigError, match="OnnxConfig"):
        OnnxExporter().export(model, TINY.sample_inputs(), config=DynamoConfig(dynamic=True))


def test_auto_classes_pick_onnx_and_the_config_round_trips() -> None:
    config = AutoExportConfig.from_dict({"export_format": "onnx", "dynamic": True, "opset_version": 20})
    assert isinstance(config, OnnxConfig) and config.opset_version == 20 and config.optimize
    assert isinstance(AutoHfExporter.from_config(config), OnnxExporter)
    assert OnnxConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="opset_version"):
        OnnxConfig(opset_version=9)


def _op_count(program: Any, op_type: str) -> int:
    return sum(node.op_type == op_type for node in program.model.graph)


def test_cpu_fusions_fuse_every_norm_residual_and_rotary(llama_export: dict[str, Any]) -> None:
    program, model, report = llama_export["program"], llama_export["model"], llama_export["report"]
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1  # input and post-attention norm per layer, final norm
    assert OnnxConfig().fusions == "cpu"
    hits = report.hits["onnx"]
    # Every RMSNorm is fused with its weight; all but the first (on the embeddings) then take in the
    # residual Add before them.
    assert hits["onnx/rms-norm-fusion"] == norms
    assert "onnx/rms-norm-core-fusion" not in hits, "float32: the weight is fused too"
    assert hits["onnx/skip-rms-norm-fusion"] == norms - 1
    assert _op_count(program, "SimplifiedLayerNormalization") == 1
    assert _op_count(program, "SkipSimplifiedLayerNormalization") == norms - 1
    assert _op_count(program, "Pow") == 0, "no unfused RMSNorm left"
    # Query and key rotation of every layer.
    assert hits["onnx/rotary-embedding-fusion"] == _op_count(program, "RotaryEmbedding") == 2 * layers
    assert _op_count(program, "Neg") == 0, "no rotate_half left"
    for op_type, rule_id in (
        ("SimplifiedLayerNormalization", "onnx/rms-norm-fusion"),
        ("SkipSimplifiedLayerNormalization", "onnx/skip-rms-norm-fusion"),
        ("RotaryEmbedding", "onnx/rotary-embedding-fusion"),
    ):
        fused = [n for n in program.model.graph if n.op_type == op_type]
        assert all(n.metadata_props["hfexport.rule"] == rule_id for n in fused)
    norm_nodes = [n for n in program.model.graph if n.op_type.endswith("SimplifiedLayerNormalization")]
    assert all(n.attributes["epsilon"].value == pytest.approx(model.config.rms_norm_eps) for n in norm_nodes)
    # parity on a second shape, through the saved file (left padding included)
    ids = torch.randint(3, 128, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    (logits, *_) = _session(llama_export["path"]).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    _assert_close(logits, expected, "fused, shape (3, 11)")


def test_fusions_none_leaves_the_rms_norms_alone() -> None:
    model, inputs = TINY.build(), TINY.sample_inputs()
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, config=OnnxConfig(dynamic=True, fusions=None))
    assert _op_count(program, "SimplifiedLayerNormalization") == 0
    assert _op_count(program, "Pow") == 2 * model.config.num_hidden_layers + 1
    assert "onnx" not in exporter.report.hits
    outcomes = {o.id: o for o in exporter.report.rules}
    assert outcomes["onnx/rms-norm-fusion"].status == "disabled"
    with torch.no_grad():
        expected = model(**inputs).logits
    _assert_close(program(**inputs)[0].numpy(), expected, "unfused")
    assert OnnxConfig.from_json(OnnxConfig(fusions=None).to_json()).fusions is None
    with pytest.raises(ConfigError, match="fusions"):
        OnnxConfig(fusions="gpu")
