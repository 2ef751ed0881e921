"""Low-memory OpenVINO export (`OpenVINOConfig(low_memory=True)`, docs/low-memory.md): the IR built on
placeholder weights, its `.bin` written from a sharded safetensors checkpoint one tensor at a time, checked
against the in-memory export (bytes) and run in the real OpenVINO runtime (CPU, f32 inference precision).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("openvino")

import openvino as ov
import transformers

from hfexport import HfExportError, OpenVINOConfig, OpenVINOExporter, empty_model
from hfexport.artifacts.low_memory import check_streamed_ir
from hfexport.artifacts.reduced_depth import check_reduced_depth
from hfexport.core.checkpoints import Checkpoint
from hfexport.lowerings.openvino_weights import SMALL_WEIGHT, is_streamed
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
# Wider than tiny-llama, so that the linear weights (128 x 128 and up) are over SMALL_WEIGHT and become
# placeholders; the norms (128) are read for real.
CONFIG = {**TINY.config, "hidden_size": 128, "intermediate_size": 256}


def _run(xml: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({k: v.numpy() for k, v in inputs.items()})[compiled.outputs[0]]


def _consts(xml: Path) -> list[tuple[str, str, int]]:
    """(element type, shape, size) of every Const of an IR, in order."""
    root = ET.parse(xml).getroot()
    return [
        (d.get("element_type", ""), d.get("shape", ""), int(d.get("size", "0")))
        for layer in root.iter("layer")
        if layer.get("type") == "Const" and (d := layer.find("data")) is not None
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small llama with tied embeddings in several safetensors shards, and its in-memory IR (fp16 weights)."""
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    inputs = TINY.sample_inputs()
    out = tmp_path_factory.mktemp("in-memory") / "model.xml"
    OpenVINOExporter().export(model, inputs, OpenVINOConfig(dynamic=True, output_path=str(out)))
    return {"folder": folder, "model": model, "inputs": inputs, "in_memory": out}


@pytest.fixture(scope="module")
def streamed(checkpoint: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("low-memory") / "model.xml"
    exporter = OpenVINOExporter()
    config = OpenVINOConfig(dynamic=True, low_memory=True, output_path=str(out))
    result = exporter.export(empty_model(checkpoint["folder"]), checkpoint["inputs"], config)
    return {"path": out, "result": result, "report": exporter.report}


def test_the_fixture_has_weights_over_the_placeholder_size(checkpoint: dict[str, Any]) -> None:
    shapes = [info.shape for info in Checkpoint.open(checkpoint["folder"]).tensors.values()]
    assert sum(int(np.prod(shape)) > SMALL_WEIGHT for shape in shapes) >= 10
    assert len({info.shard for info in Checkpoint.open(checkpoint["folder"]).tensors.values()}) >= 2


def test_streamed_bin_is_the_in_memory_bin_byte_for_byte(checkpoint: dict[str, Any], streamed: dict[str, Any]) -> None:
    # The same constants, in the same order, at the same offsets: the whole .bin is identical (fp16 compression
    # and OpenVINO's storing identical blobs once included).
    assert _consts(streamed["path"]) == _consts(checkpoint["in_memory"])
    ours = streamed["path"].with_suffix(".bin").read_bytes()
    assert ours == checkpoint["in_memory"].with_suffix(".bin").read_bytes()


def _graph(xml: Path) -> tuple[list[tuple[str, str, list[str], list[str]]], list[tuple[str, ...]]]:
    """Every layer's type, `data` attributes, runtime attribute names and output tensor names, and the edges: the
    IR without the layers' names."""
    root = ET.parse(xml).getroot()
    layers = [
        (
            layer.get("type", ""),
            str(sorted((d.attrib if (d := layer.find("data")) is not None else {}).items())),
            [a.get("name", "") for a in layer.iterfind("rt_info/attribute")],
            [port.get("names", "") for port in layer.iterfind("output/port")],
        )
        for layer in root.iter("layer")
    ]
    edges = [tuple(sorted(edge.attrib.items())) for edge in root.iter("edge")]
    return layers, edges


def test_streamed_xml_is_openvinos_own_compression(checkpoint: dict[str, Any], streamed: dict[str, Any]) -> None:
    # The streamed f32 placeholders are given to OpenVINO's writer already as f16 Consts behind Converts marked
    # `decompression` (so that it does not convert them into buffers of their own): the graph it writes is the one
    # its own compress_to_fp16 writes for the in-memory model, Const for Const and Convert for Convert.
    ours, theirs = _graph(streamed["path"]), _graph(checkpoint["in_memory"])
    assert ours == theirs
    assert sum(rt == ["decompression"] for kind, _, rt, _ in ours[0] if kind == "Convert") >= 10


def test_streamed_ir_runs_like_the_in_memory_ir_and_eager(checkpoint: dict[str, Any], streamed: dict[str, Any]) -> None:
    inputs = checkpoint["inputs"]
    got = _run(streamed["path"], inputs)
    np.testing.assert_array_equal(got, _run(checkpoint["in_memory"], inputs))
    with torch.no_grad():
        expected = checkpoint["model"](**inputs).logits.numpy()
    assert np.abs(got - expected).max() <= 1e-2 * max(1.0, np.abs(expected).max())  # fp16 weights
    longer = TINY.sample_inputs(seed=1, batch=3, length=11)
    np.testing.assert_array_equal(_run(streamed["path"], longer), _run(checkpoint["in_memory"], longer))


def test_saved_consts_are_named_after_their_weights_and_checked(
    checkpoint: dict[str, Any], streamed: dict[str, Any]
) -> None:
    result = check_streamed_ir(streamed["path"], Checkpoint.open(checkpoint["folder"]))
    assert result.ok and len(result.checked) >= 10, result
    assert "model.layers.0.self_attn.q_proj.weight_compressed" in result.checked
    # The checkpoint folder the save read is not written into the artifact.
    assert str(checkpoint["folder"]) not in streamed["path"].read_text()
    # The returned model holds placeholders until saved, and says so.
    assert is_streamed(streamed["result"])
    assert "placeholders" in streamed["report"].used["weights"]


@pytest.mark.slow
def test_uncompressed_weights_stream_byte_for_byte(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """compress_to_fp16=False: every streamed Const is the checkpoint's float32 tensor; same .bin as in memory."""
    ours, theirs = tmp_path / "low" / "model.xml", tmp_path / "mem" / "model.xml"
    inputs = checkpoint["inputs"]
    config = OpenVINOConfig(compress_to_fp16=False, low_memory=True, output_path=str(ours))
    OpenVINOExporter().export(empty_model(checkpoint["folder"]), inputs, config)
    OpenVINOExporter().export(
        checkpoint["model"], inputs, OpenVINOConfig(compress_to_fp16=False, output_path=str(theirs))
    )
    assert ours.with_suffix(".bin").read_bytes() == theirs.with_suffix(".bin").read_bytes()
    assert {t for t, _, _ in _consts(ours)} >= {"f32"} and "f16" not in {t for t, _, _ in _consts(ours)}
    np.testing.assert_array_equal(_run(ours, inputs), _run(theirs, inputs))


def test_a_weight_outside_float16_is_refused_when_compressed(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """OpenVINO keeps such a weight in f32 (a graph decided on real values); the streamed export refuses it."""
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(1e6)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder, safe_serialization=True)
    out = tmp_path / "out" / "model.xml"
    with pytest.raises(HfExportError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has .* outside float16"):
        OpenVINOExporter().export(
            empty_model(folder), checkpoint["inputs"], OpenVINOConfig(low_memory=True, output_path=str(out))
        )
    assert not out.exists()  # the save is atomic: nothing half written


@pytest.mark.slow
def test_reduced_depth_check_runs_openvino(checkpoint: dict[str, Any]) -> None:
    config = OpenVINOConfig(dynamic=True, compress_to_fp16=False)
    result = check_reduced_depth(checkpoint["folder"], checkpoint["inputs"], config, layers=1)
    assert result.ok, str(result.validation)
    assert result.to_dict()["reduced_depth_layers"] == 1


def test_openvino_low_memory_refusals(checkpoint: dict[str, Any]) -> None:
    from hfexport import ConfigError

    with pytest.raises(ConfigError, match="set low_memory=True"):
        OpenVINOConfig(checkpoint=str(checkpoint["folder"]))
    empty = empty_model(checkpoint["folder"])
    empty.name_or_path = ""
    with pytest.raises(ConfigError, match=r"OpenVINOConfig\(checkpoint=folder\)"):
        OpenVINOExporter().export(empty, checkpoint["inputs"], OpenVINOConfig(low_memory=True))
    with pytest.raises(Exception, match=r"are FakeTensors"):
        OpenVINOExporter().export(empty_model(checkpoint["folder"]), checkpoint["inputs"], OpenVINOConfig())


@pytest.mark.slow
def test_cli_openvino_low_memory_export_and_validation(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    from tests.test_low_memory import _with_tokenizer, cli_low_memory_export

    cli_low_memory_export(_with_tokenizer(checkpoint["folder"]), "openvino", tmp_path / "out")
