"""Weight-only quantization while streaming (issue #22, docs/low-memory.md): NNCF's data-free weight compression
on a low-memory export, each weight read, compressed and written one at a time, checked against the in-memory
export with the same quantizer (bytes of every weight, scale and zero point) and run in ONNX Runtime / OpenVINO.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nncf")
pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")

import onnx
import onnxruntime as ort
import openvino as ov
import transformers

from hfexport import ConfigError, OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter, empty_model
from hfexport.artifacts.low_memory import check_streamed_ir, check_streamed_quantized
from hfexport.core.checkpoints import Checkpoint
from hfexport.naming import onnx_feed
from hfexport.quantizers import (
    NNCFOnnxQuantizer,
    NNCFOpenVINOQuantizer,
    NNCFQuantizationConfig,
    NNCFTorchFXQuantizer,
    NNCFWeightCompressionConfig,
    OnnxRuntimeDynamicConfig,
    OnnxRuntimeQuantizer,
)
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
# Wider than tiny-llama: the linear weights (128 x 128 and up) are over OpenVINO's placeholder size and take int4
# groups of 32; tied embeddings, so the head reads the embedding's weight (int8 backup on both paths).
CONFIG = {**TINY.config, "hidden_size": 128, "intermediate_size": 256}
SHAPES = (TINY.sample_inputs(), TINY.sample_inputs(seed=1, batch=3, length=11))


def _compression(mode: str) -> NNCFWeightCompressionConfig:
    return NNCFWeightCompressionConfig(mode=mode, group_size=None if mode.startswith("int8") else 32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    return {"folder": folder, "model": model}


def _onnx_pair(checkpoint: dict[str, Any], tmp: Path, mode: str) -> tuple[Path, Path]:
    """The in-memory and the streamed ONNX export with the same NNCF weight compression."""
    memory, streamed = tmp / "memory" / "model.onnx", tmp / "streamed" / "model.onnx"
    quantizer = NNCFOnnxQuantizer(_compression(mode))
    # A low-memory export with weight compression is made at opset 20 (NNCF's MatMulNBits, which the streamed
    # save recomputes); the in-memory one defaults to the newest opset, so it is asked for 20 here.
    memory_config = OnnxConfig(dynamic=True, output_path=str(memory), quantizer=quantizer, opset_version=20)
    OnnxExporter().export(checkpoint["model"], SHAPES[0], memory_config)
    config = OnnxConfig(dynamic=True, low_memory=True, output_path=str(streamed), quantizer=quantizer)
    OnnxExporter().export(empty_model(checkpoint["folder"]), SHAPES[0], config)
    return memory, streamed


def _openvino_pair(checkpoint: dict[str, Any], tmp: Path, mode: str) -> tuple[Path, Path]:
    memory, streamed = tmp / "memory" / "model.xml", tmp / "streamed" / "model.xml"
    quantizer = NNCFOpenVINOQuantizer(_compression(mode))
    OpenVINOExporter().export(
        checkpoint["model"], SHAPES[0], OpenVINOConfig(dynamic=True, output_path=str(memory), quantizer=quantizer)
    )
    config = OpenVINOConfig(dynamic=True, low_memory=True, output_path=str(streamed), quantizer=quantizer)
    OpenVINOExporter().export(empty_model(checkpoint["folder"]), SHAPES[0], config)
    return memory, streamed


@pytest.fixture(scope="module")
def onnx_int4(checkpoint: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _onnx_pair(checkpoint, tmp_path_factory.mktemp("onnx-int4"), "int4_sym")


@pytest.fixture(scope="module")
def openvino_int4(checkpoint: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _openvino_pair(checkpoint, tmp_path_factory.mktemp("openvino-int4"), "int4_asym")


def _initializers(path: Path) -> dict[str, tuple[int, list[int], bytes]]:
    proto = onnx.load(str(path), load_external_data=True)
    return {
        t.name: (t.data_type, list(t.dims), onnx.numpy_helper.to_array(t).tobytes()) for t in proto.graph.initializer
    }


def _run_onnx(path: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]


def _run_openvino(xml: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({k: v.numpy() for k, v in inputs.items()})[compiled.outputs[0]]


def _assert_same_onnx(memory: Path, streamed: Path) -> None:
    ours, theirs = _initializers(streamed), _initializers(memory)
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []
    ops = [n.op_type for n in onnx.load(str(streamed), load_external_data=False).graph.node]
    assert ops == [n.op_type for n in onnx.load(str(memory), load_external_data=False).graph.node]
    for inputs in SHAPES:
        np.testing.assert_array_equal(_run_onnx(streamed, inputs), _run_onnx(memory, inputs))


@pytest.mark.slow
def test_onnx_streamed_int4_equals_the_in_memory_export(onnx_int4: tuple[Path, Path]) -> None:
    memory, streamed = onnx_int4
    _assert_same_onnx(memory, streamed)
    proto = onnx.load(str(streamed), load_external_data=False)
    ops = {n.op_type for n in proto.graph.node}
    assert "MatMulNBits" in ops and "DequantizeLinear" in ops  # int4 linears, int8 embedding and tied head


def test_onnx_quantized_weights_check_recomputes_from_the_checkpoint(
    checkpoint: dict[str, Any], onnx_int4: tuple[Path, Path], tmp_path: Path
) -> None:
    _, streamed = onnx_int4
    source = Checkpoint.open(checkpoint["folder"])
    result = check_streamed_quantized(streamed, source)
    assert result.ok and not result.mismatched
    # Every compressed weight (14 linears, the embedding and the tied head's transposed copy) with its scale.
    assert len([n for n in result.checked if n.endswith("_quantized")]) == 16
    # A changed byte in one compressed weight is found.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(streamed.parent, copy)
    proto = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    target = next(t for t in proto.graph.initializer if t.name.endswith("_quantized") and t.external_data)
    offset = int({e.key: e.value for e in target.external_data}.get("offset", 0))
    with open(copy / "model.onnx.data", "r+b") as data:
        data.seek(offset)
        byte = data.read(1)
        data.seek(offset)
        data.write(bytes([byte[0] ^ 0xFF]))
    assert check_streamed_quantized(copy / "model.onnx", source).mismatched == [target.name]


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda e: "text", id="not-a-list"),
        pytest.param(lambda e: e[:-1], id="short"),
        pytest.param(lambda e: [*e[:7], "no.such.weight", *e[8:]], id="unknown-tensor"),
        pytest.param(lambda e: [*e[:2], "int99", *e[3:]], id="unknown-mode"),
        pytest.param(lambda e: [*e[:5], "Gemm", *e[6:]], id="unknown-op"),
        pytest.param(lambda e: [*e[:3], 0, *e[4:]], id="group-size-0"),
        pytest.param(lambda e: [*e[:4], 2**40, *e[5:]], id="axis-2^40"),
        pytest.param(lambda e: [*e[:8], [0, 0], e[9]], id="perm-repeats"),
        pytest.param(lambda e: [*e[:8], ["a"], e[9]], id="perm-not-axes"),
        pytest.param(lambda e: [*e[:9], 999], id="data-type-999"),
        pytest.param(lambda e: [*e[:3], 7, 1, *e[5:]], id="layout-nncf-refuses"),
    ],
)
def test_a_forged_quantized_record_is_an_artifact_error(
    checkpoint: dict[str, Any], onnx_int4: tuple[Path, Path], tmp_path: Path, edit: Any
) -> None:
    """The record of which checkpoint tensor and layout each quantized initializer came from is data of the
    artifact: an entry of the wrong shape, type or range is refused as `ArtifactError`, never a raw `KeyError`,
    `TypeError` or NNCF's own exception."""
    import json
    import shutil

    from hfexport.artifacts.errors import ArtifactError
    from hfexport.lowerings.quantize_streaming import ONNX_QUANTIZED_KEY

    _, streamed = onnx_int4
    copy = tmp_path / "copy"
    shutil.copytree(streamed.parent, copy)
    proto = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    prop = next(p for p in proto.metadata_props if p.key == ONNX_QUANTIZED_KEY)
    record = json.loads(prop.value)
    name = next(n for n, e in record.items() if e[7] is not None and n.endswith("_quantized"))
    record[name] = edit(record[name])
    prop.value = json.dumps(record)
    onnx.save(proto, str(copy / "model.onnx"))
    with pytest.raises(ArtifactError, match=r"model\.onnx records"):
        check_streamed_quantized(copy / "model.onnx", Checkpoint.open(checkpoint["folder"]))


def _bin_consts(xml: Path) -> list[tuple[str, str, str, int, int]]:
    root = ET.parse(xml).getroot()
    return [
        (
            layer.get("name", ""),
            d.get("element_type", ""),
            d.get("shape", ""),
            int(d.get("offset", 0)),
            int(d.get("size", 0)),
        )
        for layer in root.iter("layer")
        if layer.get("type") == "Const" and (d := layer.find("data")) is not None
    ]


def _assert_same_openvino(memory: Path, streamed: Path) -> None:
    types = [c[1:] for c in _bin_consts(streamed)]
    assert types == [c[1:] for c in _bin_consts(memory)]
    assert memory.with_suffix(".bin").read_bytes() == streamed.with_suffix(".bin").read_bytes()
    for inputs in SHAPES:
        np.testing.assert_array_equal(_run_openvino(streamed, inputs), _run_openvino(memory, inputs))


@pytest.mark.slow
def test_openvino_streamed_int4_bin_is_the_in_memory_bin(openvino_int4: tuple[Path, Path]) -> None:
    memory, streamed = openvino_int4
    _assert_same_openvino(memory, streamed)
    element_types = {c[1] for c in _bin_consts(streamed)}
    assert {"u4", "u8"} <= element_types  # int4_asym linears, the int8_asym backup (tied embedding)


def test_openvino_streamed_ir_check_recomputes_quantized_consts(
    checkpoint: dict[str, Any], openvino_int4: tuple[Path, Path], tmp_path: Path
) -> None:
    _, streamed = openvino_int4
    source = Checkpoint.open(checkpoint["folder"])
    result = check_streamed_ir(streamed, source)
    assert result.ok and not result.mismatched
    names = set(result.checked)
    # The streamed weights (over the placeholder size; k/v_proj, 8192 elements, are read whole and compressed by
    # NNCF from their real values) with their decompression constants.
    compressed = [c for c in _bin_consts(streamed) if c[1] == "u4" and c[0].endswith(".weight")]
    assert compressed and all(f"{c[0]}/scale" in names and f"{c[0]}/zero_point" in names for c in compressed)
    # A changed scale is found.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(streamed.parent, copy)
    name, _, _, offset, _ = next(c for c in _bin_consts(streamed) if c[0] == f"{compressed[0][0]}/scale")
    with open(copy / "model.bin", "r+b") as data:
        data.seek(offset)
        byte = data.read(1)
        data.seek(offset)
        data.write(bytes([byte[0] ^ 0xFF]))
    assert name in check_streamed_ir(copy / "model.xml", source).mismatched


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8_asym", "int8_sym", "int4_asym"])
def test_onnx_streamed_modes_equal_the_in_memory_export(checkpoint: dict[str, Any], tmp_path: Path, mode: str) -> None:
    _assert_same_onnx(*_onnx_pair(checkpoint, tmp_path, mode))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8_asym", "int8_sym", "int4_sym"])
def test_openvino_streamed_modes_equal_the_in_memory_export(
    checkpoint: dict[str, Any], tmp_path: Path, mode: str
) -> None:
    _assert_same_openvino(*_openvino_pair(checkpoint, tmp_path, mode))


@pytest.mark.parametrize(
    ("quantizer", "reason"),
    [
        (NNCFOnnxQuantizer(NNCFQuantizationConfig()), "quantizes activations, calibrated"),
        (NNCFOnnxQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", awq=True)), "awq read"),
        (NNCFOnnxQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", gptq=True)), "gptq read"),
        (NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", scale_estimation=True)), "scale_est"),
        (NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", ratio=0.8)), "ranks the weights"),
        (NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="nf4")), "mode 'nf4'"),
        (NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int4_sym"), [{"input_ids": [1]}]), "calibration_"),
        (NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_sym")), "real weights"),
        (OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig()), "real weights"),
    ],
)
def test_quantizers_that_need_data_or_the_whole_model_are_refused(quantizer: Any, reason: str) -> None:
    config_class = OpenVINOConfig if isinstance(quantizer, NNCFOpenVINOQuantizer) else OnnxConfig
    with pytest.raises(ConfigError, match=rf"low_memory=True cannot quantize with .*{reason}"):
        config_class(low_memory=True, quantizer=quantizer)


def test_a_quantizer_set_after_the_config_is_refused_before_the_trace(checkpoint: dict[str, Any]) -> None:
    config = OnnxConfig(low_memory=True)
    config.quantizer = NNCFOnnxQuantizer(NNCFQuantizationConfig())
    with pytest.raises(ConfigError, match="quantizes activations"):
        OnnxExporter().export(empty_model(checkpoint["folder"]), SHAPES[0], config)


def test_cli_low_memory_takes_only_the_streaming_recipe(
    checkpoint: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hfexport.cli import main

    for recipe in ("nncf-int8", "ort-dynamic", "pt2e-x86"):
        args = ["export", "--low-memory", "--model", str(checkpoint["folder"]), "--format", "onnx"]
        assert main([*args, "--quantize", recipe, "--output", str(tmp_path / "out")]) == 2, recipe
        assert f"--quantize {recipe}: only nncf-int4" in capsys.readouterr().err, recipe


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["onnx", "openvino"])
def test_cli_low_memory_int4_export_and_validation(
    checkpoint: dict[str, Any], tmp_path: Path, export_format: str
) -> None:
    import json
    import subprocess
    import sys

    from tests.test_low_memory import _with_tokenizer

    folder = _with_tokenizer(checkpoint["folder"])
    out = tmp_path / "out"
    command = [sys.executable, "-m", "hfexport", "export", "--model", str(folder), "--format", export_format]
    command += ["--low-memory", "--quantize", "nncf-int4", "--validate", "--check-layers", "1"]
    command += ["--atol", "1", "--rtol", "1", "--output", str(out)]  # int4 against eager: a loose bound
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    validation = json.loads((out / "manifest.json").read_text())["validation"]
    # OpenVINO: 10 streamed linears (int4_sym: compressed weight and scale) and the tied embedding (int8_asym
    # backup: with a zero point); ONNX: the float weights left (norms) and every compressed part, 14 linears too.
    assert validation["ok"] and validation["streamed_weights"]["checked"] >= 23
    assert not validation["streamed_weights"]["mismatched"]


@pytest.mark.slow
def test_onnx_streamed_keep_float_stays_float(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """`keep_float` reaches NNCF's ignored scope on the low-memory path too: layer 0's MLP keeps float MatMuls."""
    quantizer = NNCFOnnxQuantizer(_compression("int4_sym"))
    quantizer.keep_float = ("model.layers.0.mlp",)
    config = OnnxConfig(dynamic=True, low_memory=True, quantizer=quantizer, output_path=str(tmp_path / "model.onnx"))
    program = OnnxExporter().export(empty_model(checkpoint["folder"]), SHAPES[0], config)
    ops = [node.op_type for node in program.model.graph.all_nodes()]
    # 7 linears a layer in int4, less layer 0's three MLP projections (the tied head: NNCF's int8 backup).
    assert ops.count("MatMulNBits") == 7 * CONFIG["num_hidden_layers"] - 3
