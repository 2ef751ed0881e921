"""A generation artifact stores each weight once: the ONNX graphs (OpenVINO IRs) of its components share one
weights file, the ExecuTorch programs are the methods of one `.pte`, and a component served by another's program
(prefill by decode) is stored and opened once. Loaded artifacts still generate the greedy tokens of
`model.generate`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import hfexport
from hfexport import ExecutorchConfig, ExecutorchExporter, OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter
from hfexport.artifacts import ArtifactError, ManifestError, UnsafePathError, read_manifest
from hfexport.runtime.generation import generate
from hfexport.tiny import get_tiny_model

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def _eager(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def _float_weight_bytes(model: torch.nn.Module) -> int:
    # parameters() lists a tied embedding once.
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _weight_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of the weight files the components list (`.data`, `.bin`), each file once. The graphs themselves are
    left out: a tiny model's graph (names, shapes, metadata: 270 KB) outweighs its weights (107 KB)."""
    listed = {path for comp in manifest["components"].values() for path in comp["files"]}
    return sum(manifest["checksums"][path]["size"] for path in listed if path.endswith((".data", ".bin")))


def _external_bytes(path: Path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    total = 0
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in tensor.external_data}["length"])
    return total


# format -> (exporter, config, graph suffix, the weights file the graphs share, the refusal when it is not listed)
SHARED = {
    "onnx": (OnnxExporter, OnnxConfig, "onnx", "weights.data", UnsafePathError),
    "openvino": (OpenVINOExporter, OpenVINOConfig, "xml", "weights.bin", ManifestError),
}


@pytest.mark.parametrize("export_format", list(SHARED))
def test_prefill_and_decode_graphs_share_one_weights_file(
    export_format: str, llama: torch.nn.Module, tmp_path: Path
) -> None:
    """A growing cache exports two graphs (prefill, decode); both read every weight from one shared file, so the
    artifact holds one copy of the weights (its weight files: ONNX float32, under 1.2x the model's parameters;
    OpenVINO float16; both under 0.6x a folder per component's), and the loaded artifact generates like eager.
    The layout saved before (`weights_once=False`: a folder per component, each with its weights) loads and
    generates as it did."""
    exporter, config, suffix, shared, refusal = SHARED[export_format]
    ids, mask = _prompt()
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    components = exporter().export_for_generation(llama, sample, config(dynamic=True))
    assert components["prefill"] is not components["decode"]  # two graphs: the case a shared file is for
    out = hfexport.save(components, tmp_path / "gen")
    manifest = read_manifest(out)
    comps = manifest["components"]
    assert {name: comp["main"] for name, comp in comps.items()} == {n: f"{n}.{suffix}" for n in ("prefill", "decode")}
    assert all(shared in comp["files"] for comp in comps.values()) and manifest["files"].count(shared) == 1
    per_component = hfexport.save(components, tmp_path / "per-component", weights_once=False)
    before = read_manifest(per_component)
    mains = [comp["main"] for comp in before["components"].values()]
    assert mains == [f"prefill/model.{suffix}", f"decode/model.{suffix}"]
    weights, on_disk = _float_weight_bytes(llama), _weight_bytes(manifest)
    assert on_disk < 0.6 * _weight_bytes(before), (on_disk, _weight_bytes(before))
    if export_format == "onnx":
        assert on_disk < 1.2 * weights, (on_disk, weights)
        # Shared, not split: each graph reads (nearly) all the weights from that one file.
        for name in ("prefill", "decode"):
            assert _external_bytes(out / f"{name}.onnx") > 0.8 * weights, name
        # The programs were not changed by the save: their weights are still in memory.
        assert all(v.const_value is not None for v in components["decode"].model.graph.initializers.values())

    expected = _eager(llama, ids, mask)
    for folder in (out, per_component):
        loaded = hfexport.load(folder)
        got = generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert torch.equal(got, expected), folder.name
    assert torch.equal(generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), expected)

    if export_format == "openvino":
        # An IR beside a `.bin` of its own would read that one: refused when the manifest does not list it.
        (out / "prefill.bin").write_bytes((out / shared).read_bytes())
        with pytest.raises(UnsafePathError, match=r"prefill\.bin"):
            hfexport.load(out)
        (out / "prefill.bin").unlink()
    # One graph per file on these formats: a component that names a method of its file is refused.
    with_method = json.loads(json.dumps(manifest))
    with_method["components"]["decode"]["method"] = "decode"
    (out / "manifest.json").write_text(json.dumps(with_method))
    with pytest.raises(ManifestError, match="has no methods"):
        hfexport.load(out)
    # The file both graphs read must be listed by each component that reads it: refused otherwise.
    manifest["components"]["prefill"]["files"].remove(shared)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(refusal, match=re.escape(shared)):
        hfexport.load(out)


# Two ExecuTorch lowerings (a minute each: `Backend.slow_lowering`); the CLI matrix's tiny-llama ExecuTorch
# `--generation --validate` cell saves and generates through the same one-program path in the default tier.
@pytest.mark.slow
def test_executorch_prefill_and_decode_are_methods_of_one_program(llama: torch.nn.Module, tmp_path: Path) -> None:
    """A growing cache exports two ExecuTorch programs (prefill, decode); saved, they are the methods `prefill` and
    `decode` of one `model.pte`, which stores each weight once: it is smaller than the two `.pte` files saved apart
    by more than the model's weights (each of those holds them all). The loaded artifact loads that
    program once, runs each component's method, and generates `model.generate`'s tokens; the layout saved before
    (a `.pte` per component) loads and generates as it did."""
    pytest.importorskip("executorch")
    ids, mask = _prompt()
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    components = ExecutorchExporter().export_for_generation(llama, sample, ExecutorchConfig(dynamic=True))
    assert components["prefill"] is not components["decode"]  # two programs: the case one file is for
    out = hfexport.save(components, tmp_path / "gen")
    manifest = read_manifest(out)
    comps = manifest["components"]
    assert {name: (comp["main"], comp.get("method")) for name, comp in comps.items()} == {
        "prefill": ("model.pte", "prefill"),
        "decode": ("model.pte", "decode"),
    }
    assert [path for path in manifest["files"] if path.endswith(".pte")] == ["model.pte"]
    per_component = hfexport.save(components, tmp_path / "per-component", weights_once=False)
    before = read_manifest(per_component)
    apart = {name: before["checksums"][f"{name}/model.pte"]["size"] for name in ("prefill", "decode")}
    one, weights = manifest["checksums"]["model.pte"]["size"], _float_weight_bytes(llama)
    assert sum(apart.values()) - one > weights, (apart, one, weights)  # one program's weights fewer

    expected = _eager(llama, ids, mask)
    loaded = hfexport.load(out)
    prefill, decode = loaded["prefill"], loaded["decode"]
    assert prefill.runtime.program is decode.runtime.program  # the file is loaded once, for both methods
    assert prefill.runtime.method is not decode.runtime.method
    assert torch.equal(generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), expected)
    old = hfexport.load(per_component)
    assert old["prefill"].runtime.program is not old["decode"].runtime.program
    assert torch.equal(generate(old, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), expected)

    # A component must name a method the program has: checked before the runtime sees the file.
    comps["prefill"]["method"] = "forward"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"has no method 'forward' \(its methods: \['decode', 'prefill'\]\)"):
        hfexport.load(out)


def _program(initializers: dict[str, np.ndarray]) -> Any:
    """An object with an onnx_ir `model` (what the writer reads of an `ONNXProgram`): each initializer is an output."""
    import onnx_ir as ir

    values, nodes, outputs = [], [], []
    for name, array in initializers.items():
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        values.append(value)
        node = ir.Node("", "Identity", [value], num_outputs=1)
        node.outputs[0].name = f"out_{name}"
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        node.outputs[0].shape = ir.Shape(array.shape)
        nodes.append(node)
        outputs.append(node.outputs[0])
    graph = ir.Graph([], outputs, nodes=nodes, initializers=values, opset_imports={"": 18})
    return SimpleNamespace(model=ir.Model(graph, ir_version=10))


def test_onnx_weights_are_stored_once_by_content_not_by_name(tmp_path: Path) -> None:
    """Equal bytes under two names are stored once; one name with other bytes in another graph is stored apart;
    each graph reads its own values back."""
    import onnx
    import onnx.numpy_helper
    from onnx.reference import ReferenceEvaluator

    from hfexport.backends.onnx.artifact import SHARED_WEIGHTS, _write_onnx_components

    rng = np.random.default_rng(0)
    shared, other, small = (rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3))
    small = small[:2, :4].copy()  # 32 bytes: stays inside the graph
    first = _program({"a": shared, "tiny": small})
    second = _program({"b": shared, "a": other, "tiny": small})
    written = _write_onnx_components({"first": first, "second": second}, tmp_path, {"first": None, "second": None})
    assert {name: [p.name for p in paths] for name, paths in written.items()} == {
        "first": ["first.onnx", SHARED_WEIGHTS],
        "second": ["second.onnx", SHARED_WEIGHTS],
    }
    assert (tmp_path / SHARED_WEIGHTS).stat().st_size == shared.nbytes + other.nbytes
    for name, program, expected in (("first", first, {"a": shared}), ("second", second, {"b": shared, "a": other})):
        outputs = ReferenceEvaluator(onnx.load(str(tmp_path / f"{name}.onnx"))).run(None, {})
        got = dict(zip([o.name for o in program.model.graph.outputs], outputs, strict=True))
        for init, array in {**expected, "tiny": small}.items():
            np.testing.assert_array_equal(got[f"out_{init}"], array)
        # The caller's program keeps its in-memory tensors.
        assert all(type(v.const_value).__name__ != "ExternalTensor" for v in program.model.graph.initializers.values())
    # Weights inside the graphs (`OnnxConfig(external_data=False)`): no shared file; `save` gives a folder each.
    inline = {"first": SimpleNamespace(external_data=False), "second": None}
    assert _write_onnx_components({"first": first, "second": second}, tmp_path / "inline", inline) is None


def test_onnx_sessions_of_one_artifact_hold_the_weights_once(llama: torch.nn.Module, tmp_path: Path) -> None:
    """Without prepacking (`RuntimeOptions(onnx_prepacking=False)`), the prefill and decode sessions of a
    two-graph ONNX artifact read the weights of `weights.data` from one set of buffers: the same `OrtValue`s,
    over one map of the file, which ONNX Runtime reads in place (buffers changed under both sessions change
    both graphs' logits). With prepacking (the default) each session packs its own. Either way, logits and
    greedy tokens equal those of sessions that load their own copies."""
    import onnxruntime as ort

    from hfexport.backends.onnx.driver import open_session, run_saved
    from hfexport.runtime import RuntimeOptions
    from hfexport.runtime.generation_session import generation_driver

    ids, mask = _prompt()
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    components = OnnxExporter().export_for_generation(llama, sample, OnnxConfig(dynamic=True))
    out = hfexport.save(components, tmp_path / "gen")
    names = ("prefill", "decode")
    loaded = hfexport.load(out)
    packed = {name: loaded[name].open() for name in names}
    assert packed["prefill"] is not packed["decode"]
    assert all(session.shared_weights == [] for session in packed.values())
    cpu = ["CPUExecutionProvider"]
    unpacked = {name: open_session(out / f"{name}.onnx", None, cpu, prepacking=False) for name in names}
    [shared] = unpacked["prefill"].shared_weights
    assert unpacked["decode"].shared_weights == [shared]  # the same object
    assert shared.file == (out / "weights.data").resolve()
    assert 0.8 * _float_weight_bytes(llama) < shared.nbytes <= shared.file.stat().st_size
    assert all(shared.values[key].data_ptr() == array.ctypes.data for key, array in shared.arrays.items())
    assert len({array.ctypes.data for array in shared.arrays.values()}) == len(shared.values)

    # Sessions that load their own copies (ONNX Runtime's defaults): the same logits, the same tokens.
    own = {name: ort.InferenceSession(str(out / f"{name}.onnx")) for name in names}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    outputs = loaded["prefill"].outputs
    first = run_saved(own["prefill"], feed, outputs)
    step = {
        "input_ids": first["logits"][:, -1:].argmax(-1),
        "attention_mask": torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
        "position_ids": positions[:, -1:] + 1,
        **{k.replace("cache.", "past_key_values.", 1): v for k, v in first.items() if k != "logits"},
    }
    second = run_saved(own["decode"], step, loaded["decode"].outputs)["logits"]
    for sessions in (packed, unpacked):
        got = run_saved(sessions["prefill"], feed, outputs)
        assert got.keys() == first.keys() and all(torch.equal(got[k], first[k]) for k in first)
        assert torch.equal(run_saved(sessions["decode"], step, loaded["decode"].outputs)["logits"], second)
    expected = _eager(llama, ids, mask)
    assert torch.equal(generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), expected)
    options = RuntimeOptions(onnx_prepacking=False)
    got = generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, runtime_options=options)
    assert torch.equal(got, expected)
    driver = generation_driver(loaded)
    assert all(driver.sessions[name].shared_weights == [shared] for name in names)

    # In place: the shared buffers zeroed change both graphs' logits; restored, the logits are back.
    saved = {key: array.copy() for key, array in shared.arrays.items()}
    on_disk = (out / "weights.data").read_bytes()
    for array in shared.arrays.values():
        array[...] = 0
    assert not torch.equal(run_saved(unpacked["prefill"], feed, outputs)["logits"], first["logits"])
    assert not torch.equal(run_saved(unpacked["decode"], step, loaded["decode"].outputs)["logits"], second)
    for key, array in shared.arrays.items():
        array[...] = saved[key]
    assert torch.equal(run_saved(unpacked["decode"], step, loaded["decode"].outputs)["logits"], second)
    assert (out / "weights.data").read_bytes() == on_disk  # the map is copy-on-write: the file is never written
