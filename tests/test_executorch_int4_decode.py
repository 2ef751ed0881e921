"""ExecuTorch int4 decode (issue #19, goal 2): `quantizer_for("executorch", "int4")` is torchao's 8da4w (dynamic int8
activations, int4 weights in groups of 32, `TorchAOQuantizer`), and XNNPACK runs every linear of the exported
generation components with 4-bit weights.

XNNPACK's partitioner takes torchao's quantized linear (`choose_qparams_affine`, `quantize_affine`,
`dequantize_affine` around a linear) whole and serializes its weight as `xnn_datatype_qbint4` (blockwise 4-bit: its
qd8-f32-qb4w GEMM). The test reads the XNNPACK payload of every delegate the lowered program calls (header, then the
flatbuffer of backends/xnnpack/serialization/schema.fbs) and checks each fully-connected node's filter and input
types, and that no linear, matmul or (de)quantize is left outside the delegates. The NNCF int4 recipe it replaced
rebuilt every float weight before its linear outside the delegate (portable kernels): 3.7 tok/s against fp32's 125
on the 2-layer SmolLM2 shape.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("executorch")
pytest.importorskip("torchao")

from transformers import GenerationConfig

from hfexport import AutoHfExporter, ExecutorchConfig
from hfexport.apps.bench import quantizer_for
from hfexport.runtime.generation import generate, prompt_logits
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
PROMPT, NEW = 8, 6
# Measured 0.9947 on the random tiny Llama's prompt logits (fp32 eager against torchao 8da4w; 0.9935 with
# XNNPACKQuantizer's int4 per channel); 4 of the 12 new tokens equal eager's (random weights give near-flat logits).
MIN_COSINE = 0.97


def _delegate_graphs(manager: Any) -> list[dict[str, Any]]:
    """The XNNGraph (as JSON) of every XNNPACK delegate the lowered program calls."""
    from executorch.backends.xnnpack.serialization.xnnpack_graph_serialize import XNNHeader, _get_schema_bytes
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    program = manager.exported_program()
    graphs = []
    for node in program.graph.nodes:
        if node.op != "get_attr" or not node.target.startswith("lowered_module"):
            continue
        lowered = getattr(program.graph_module, node.target)
        assert lowered.backend_id == "XnnpackBackend"
        data = lowered.processed_bytes
        header = XNNHeader.from_bytes(data[: XNNHeader.EXPECTED_LENGTH])
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "schema.fbs").write_bytes(_get_schema_bytes())
            start = header.flatbuffer_offset
            (Path(folder) / "graph.bin").write_bytes(data[start : start + header.flatbuffer_size])
            _flatc_decompile(folder, f"{folder}/schema.fbs", f"{folder}/graph.bin", ["--raw-binary"])
            graphs.append(json.loads((Path(folder) / "graph.json").read_text()))
    return graphs


def _fully_connected_types(graphs: list[dict[str, Any]]) -> collections.Counter[tuple[str, str]]:
    """(input type, filter type) of every fully-connected node, over all delegates."""
    types: collections.Counter[tuple[str, str]] = collections.Counter()
    for graph in graphs:
        datatype = {}
        for value in graph["xvalues"]:
            union = value["xvalue_union"]
            tensor = union.get("tensor_value", union)
            datatype[tensor["id_out"]] = tensor["datatype"]
        for xnode in graph["xnodes"]:
            if xnode["xnode_union_type"] == "XNNFullyConnected":
                fc = xnode["xnode_union"]
                types[(datatype[fc["input1_id"]], datatype[fc["filter_id"]])] += 1
    return types


@pytest.mark.slow
def test_int4_executorch_generation_runs_every_linear_with_4bit_weights_in_xnnpack() -> None:
    model = TINY.build()
    ids = torch.randint(3, TINY.config["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    config = dataclasses.replace(ExecutorchConfig(dynamic=True), quantizer=quantizer_for("executorch", "int4"))
    static = GenerationConfig(cache_implementation="static", max_cache_len=PROMPT + NEW)
    components = AutoHfExporter.from_config(config).export_for_generation(
        model, {"input_ids": ids, "attention_mask": mask}, config, generation_config=static, multi_token_decode=True
    )
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # 7 per layer and the head
    for name in dict.fromkeys(components):
        types = _fully_connected_types(_delegate_graphs(components[name]))
        assert types == {("xnn_datatype_qdint8", "xnn_datatype_qbint4"): linears}, (name, types)
        outside = {
            str(n.target)
            for n in components[name].exported_program().graph.nodes
            if n.op == "call_function" and str(n.target) != "executorch_call_delegate"
        }
        left = [t for t in outside if any(k in t for k in ("linear", "mm", "quantize", "addmm", "matmul"))]
        assert not left, (name, left)

    with torch.no_grad():
        expected = model(input_ids=ids).logits
    logits = prompt_logits(components, ids)
    cosine = torch.nn.functional.cosine_similarity(logits.flatten().double(), expected.flatten().double(), dim=0)
    print(f"prompt logits cosine {cosine.item():.4f}")
    assert cosine.item() >= MIN_COSINE

    tokens = generate(components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW)
    assert tokens.shape == (2, PROMPT + NEW) and torch.equal(tokens[:, :PROMPT], ids)
    assert ((tokens >= 0) & (tokens < TINY.config["vocab_size"])).all()
    with torch.no_grad():
        eager = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
        )
    print(f"new tokens equal to fp32 eager's: {int((tokens[:, PROMPT:] == eager[:, PROMPT:]).sum())}/{2 * NEW}")
