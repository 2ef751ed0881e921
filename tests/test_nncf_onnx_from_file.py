"""NNCF's ONNX weight compression reading the weights from a file, one at a time (`compress_onnx_from_file`, the
in-memory export's path): the same graph and bytes as `nncf.compress_weights` on the whole model in memory, the
same logits in ONNX Runtime, and a peak RSS bounded by the weights (issue #41)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nncf")
pytest.importorskip("onnxruntime")

import onnx
import onnxruntime as ort
import transformers

from hfexport import NNCFOnnxQuantizer, OnnxConfig, OnnxExporter
from hfexport.apps.bench import quantizer_for
from hfexport.lowerings.quantize_streaming import compress_onnx_from_file
from hfexport.naming import onnx_feed
from hfexport.rewrites.rule import RuleSelection
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
# Wide enough for int4 groups of 32 on every matrix; tied, so the head reads the embedding's table.
CONFIG = {**TINY.config, "hidden_size": 128, "intermediate_size": 256}
SHAPES = (TINY.sample_inputs(), TINY.sample_inputs(seed=1, batch=3, length=11))


def _float_model() -> Any:
    """The lowered float ONNX model (`onnx_ir.Model`) of a tied tiny Llama, as `NNCFOnnxQuantizer` receives it: the
    newest opset, with the rule it enables (the head's own transposed table, which NNCF can read)."""
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    rules = RuleSelection(enable=NNCFOnnxQuantizer.enabled_rules)
    return OnnxExporter().export(model, SHAPES[0], OnnxConfig(dynamic=True, rules=rules)).model


def _bytes(proto: onnx.ModelProto) -> dict[str, tuple[int, list[int], bytes]]:
    return {
        t.name: (t.data_type, list(t.dims), onnx.numpy_helper.to_array(t).tobytes()) for t in proto.graph.initializer
    }


def _run(proto: onnx.ModelProto, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]


@pytest.mark.slow
def test_compression_from_a_file_equals_nncf_on_the_whole_model() -> None:
    import nncf
    import onnx_ir as ir

    quantizer = quantizer_for("onnx", "int4")  # the bench's recipe: int4_sym, groups of 32, every layer
    model = _float_model()
    whole = nncf.compress_weights(ir.to_proto(model), **quantizer.config.nncf_kwargs())
    from_file = ir.to_proto(compress_onnx_from_file(model, quantizer._compress_external))

    ours, theirs = _bytes(from_file), _bytes(whole)
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if ours[name] != theirs[name]] == []
    assert [(n.op_type, list(n.input)) for n in from_file.graph.node] == [
        (n.op_type, list(n.input)) for n in whole.graph.node
    ]
    # int4 tables for the embedding (Gather) and the head and every linear (MatMul)
    readers = {n.op_type for n in whole.graph.node if any(i.endswith("_quantized") for i in n.input)}
    assert readers == {"DequantizeLinear"}
    assert (
        sum(t.data_type == onnx.TensorProto.INT4 for t in whole.graph.initializer)
        == 2 + 7 * CONFIG["num_hidden_layers"]
    )


def _saved(path: Path) -> dict[str, tuple[int, list[int], bytes]]:
    return _bytes(onnx.load(str(path), load_external_data=True))


def test_the_int4_export_equals_the_whole_model_path(tmp_path: Path) -> None:
    """The bench's int4 export (weights read from a file) against the same recipe through NNCF on the whole model
    (`advanced_parameters` given, at their defaults, keep the whole-model path): the same artifact, bytes and
    logits, after the rules that write MatMulNBits and GatherBlockQuantized."""
    import dataclasses

    import nncf

    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    recipe = quantizer_for("onnx", "int4")
    whole_recipe = dataclasses.replace(recipe.config, advanced_parameters=nncf.AdvancedCompressionParameters())
    # The bench's recipe takes the from-file path (`NNCFOnnxQuantizer._compress_weightwise`), the other does not.
    assert recipe.streaming_refusal("onnx") is None
    assert NNCFOnnxQuantizer(whole_recipe).streaming_refusal("onnx") is not None
    paths = {}
    for name, quantizer in (("from_file", recipe), ("whole", NNCFOnnxQuantizer(whole_recipe))):
        paths[name] = tmp_path / name / "model.onnx"
        OnnxExporter().export(
            model, SHAPES[0], OnnxConfig(dynamic=True, quantizer=quantizer, output_path=str(paths[name]))
        )
    ours, theirs = _saved(paths["from_file"]), _saved(paths["whole"])
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if ours[name] != theirs[name]] == []
    ops = [n.op_type for n in onnx.load(str(paths["whole"]), load_external_data=False).graph.node]
    assert {"MatMulNBits", "GatherBlockQuantized"} <= set(ops)
    assert [n.op_type for n in onnx.load(str(paths["from_file"]), load_external_data=False).graph.node] == ops
    for inputs in SHAPES:
        got = _run(onnx.load(str(paths["from_file"])), inputs)
        np.testing.assert_array_equal(got, _run(onnx.load(str(paths["whole"])), inputs))
        assert np.isfinite(got).all()


# A process that exports a warm-up model, then a tied Llama of ~114 MB of fp32 weights (vocabulary 32000, hidden
# 512, 4 layers) to ONNX with the bench's int4 recipe, and prints its peak RSS over the RSS before the export.
_PEAK_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys, tempfile
    import torch, transformers
    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.apps.bench import PeakRss, quantizer_for

    def build(hidden, intermediate, layers, vocab):
        config = transformers.LlamaConfig(
            hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=256,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with tempfile.TemporaryDirectory() as tmp:
        def export(model, name):
            quantizer, path = quantizer_for("onnx", "int4"), f"{tmp}/{name}/m.onnx"
            OnnxExporter().export(model, sample, OnnxConfig(dynamic=True, quantizer=quantizer, output_path=path))
        export(build(64, 128, 1, 1024), "warm")  # imports and first-call caches out of the measurement
        model = build(512, 1536, 4, 32000)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        gc.collect()
        with PeakRss() as peak:
            export(model, "measured")
    print(json.dumps({"weights": weights, "peak": peak.peak - peak.start}))
    """
)


@pytest.mark.slow
def test_int4_export_peak_rss_is_bounded_by_the_weights() -> None:
    """The int4 export's peak RSS over the weight bytes: 3.6x measured (NNCF's reading and compressing the tied
    table twice, embedding and head, holds the peak), 8.6x when NNCF compressed the whole model in memory."""
    import json

    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["weights"] > 100e6
    assert measured["peak"] / measured["weights"] < 5.0, measured


@pytest.mark.slow
def test_keep_float_holds_on_the_from_file_path() -> None:
    """`keep_float` reaches NNCF as its ignored scope on the from-file path: layer 0's MLP stays float32 MatMuls."""
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    quantizer = quantizer_for("onnx", "int4")
    quantizer.keep_float = ("model.layers.0.mlp",)
    program = OnnxExporter().export(model, SHAPES[0], OnnxConfig(dynamic=True, quantizer=quantizer))
    ops = [node.op_type for node in program.model.graph.all_nodes()]
    # 2 layers x 7 linears and the head, less layer 0's three MLP projections, in MatMulNBits; those three float.
    assert ops.count("MatMulNBits") == 7 * CONFIG["num_hidden_layers"] + 1 - 3
    assert "GatherBlockQuantized" in ops
    floats = [
        node
        for node in program.model.graph.all_nodes()
        if node.op_type == "MatMul" and any(v is not None and v.const_value is not None for v in node.inputs)
    ]
    assert len(floats) == 3
