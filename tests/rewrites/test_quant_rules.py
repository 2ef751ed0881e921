"""The rules that carry NNCF's Torch FX weight compression to ExecuTorch and OpenVINO.

Each rule's examples run here (as they do in test_examples.py once registered), and each rule is shown to be
needed: its Match example fails to lower without it, with the error the rule's `why` names. When an upstream
release fixes the cause, the "needed" test fails and says which rule to retire.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.testing.harness import check_example

pytest.importorskip("nncf")

RULE_MODULES = (
    "hfexport.rewrites.rules.executorch.quant_slice_keeps_qparams",
    "hfexport.rewrites.rules.executorch.quant_identity_requantize",
    "hfexport.rewrites.rules.executorch._quant_weight_decompression",
    "hfexport.rewrites.rules.openvino.quant_right_shift_as_floor_scale",
)


def _rules() -> list:
    import importlib

    from hfexport.rewrites.rule import Rule

    found = []
    for name in RULE_MODULES:
        module = importlib.import_module(name)
        found += [value for value in vars(module).values() if isinstance(value, Rule)]
    return found


def _examples() -> list:
    return [
        pytest.param(rule, example, id=f"{rule.id}[{type(example).__name__.lower()}{i}]")
        for rule in _rules()
        for i, example in enumerate(rule.meta.examples)
    ]


# Slow: once the rules are listed in RULES, tests/rewrites/test_examples.py runs the same examples in CI.
@pytest.mark.slow
@pytest.mark.parametrize(("rule", "example"), _examples())
def test_quant_rule_example(rule, example: Match | NoMatch) -> None:
    if rule.stage == "executorch":
        pytest.importorskip("executorch")
    else:
        pytest.importorskip("openvino")
    hits = check_example(rule, example)
    assert hits > 0 if isinstance(example, Match) else hits == 0


def test_quant_rules_are_registered() -> None:
    from hfexport.rewrites.engine import default_registry

    registered = set(default_registry().ids())
    missing = sorted(rule.id for rule in _rules() if rule.id not in registered)
    assert not missing, f"listed in no stage package's RULES: {missing}"


def test_floor_scale_equals_the_shift_on_every_byte() -> None:
    # The identity the OpenVINO rule rests on, in torch itself, for every value and shift amount.
    for dtype, low in ((torch.uint8, 0), (torch.int8, -128)):
        values = torch.arange(low, low + 256).to(dtype)
        for k in range(8):
            rewritten = torch.floor(values.to(torch.float32) * 2.0**-k).to(dtype)
            assert torch.equal(rewritten, torch.bitwise_right_shift(values, k)), (dtype, k)


# -- each rule is needed with the installed versions ----------------------------------------------------------------


def _program(example: Match) -> torch.export.ExportedProgram:
    module, inputs = example.build()
    with torch.no_grad():
        return torch.export.export(module.eval(), (), inputs, strict=False)


def test_executorch_refuses_the_shift_without_the_rule() -> None:
    pytest.importorskip("executorch")
    from hfexport.rewrites.rules.executorch.quant_right_shift_verifier import quant_right_shift_verifier
    from hfexport.testing.harness import lower_to_executorch as _lower

    with pytest.raises(Exception, match="bitwise_right_shift"):
        _lower(_program(quant_right_shift_verifier.meta.examples[0]))


def test_xnnpack_fails_the_decompressed_linear_without_the_rule() -> None:
    pytest.importorskip("executorch")
    from hfexport.rewrites.rules.executorch.quant_computed_weight_linear_untagged import (
        quant_computed_weight_linear_untagged,
    )
    from hfexport.testing.harness import lower_to_executorch as _lower

    with pytest.raises(Exception, match="ConvertToLinearPass"):
        _lower(_program(quant_computed_weight_linear_untagged.meta.examples[0]))


@pytest.mark.slow  # a lowering and a run of its own
def test_xnnpack_computes_the_decompressed_linear_of_rows_wrongly_without_the_rule() -> None:
    pytest.importorskip("executorch")
    from hfexport.rewrites.rules.executorch.quant_computed_weight_linear_untagged import (
        quant_computed_weight_linear_untagged,
    )
    from hfexport.testing.harness import lower_to_executorch as _lower

    example = quant_computed_weight_linear_untagged.meta.examples[1]  # a 2-D input: view + addmm
    module, inputs = example.build()
    (actual,) = _lower(_program(example)).run(inputs)
    # ConvertToLinearPass rebuilt a linear that does not use the weight the graph computes.
    assert (actual - module.eval()(**inputs)).abs().max() > 100


def test_xnnpack_cannot_load_slices_that_change_qparams_without_the_rule() -> None:
    pytest.importorskip("executorch")
    pytest.importorskip("torchao")
    from hfexport.rewrites.rules.executorch.quant_slice_keeps_qparams import quant_slice_keeps_qparams
    from hfexport.testing.harness import lower_to_executorch as _lower

    # The program lowers; XNNPACK refuses its slices when the method is loaded.
    with pytest.raises(Exception, match="load method"):
        _lower(_program(quant_slice_keeps_qparams.meta.examples[0]))


# Lowers the rule's first example without the rule, loads and runs it, then destroys the method: in a child
# process, since XNNPACK's double free aborts it.
_REQUANTIZE_WITHOUT_THE_RULE = """
import torch
from hfexport.rewrites.rules.executorch.quant_identity_requantize import quant_identity_requantize
from hfexport.testing.harness import lower_to_executorch as _lower
module, inputs = quant_identity_requantize.meta.examples[0].build()
with torch.no_grad():
    program = torch.export.export(module.eval(), (), inputs, strict=False)
lowered = _lower(program)
lowered.run(inputs)
print("ran", flush=True)
del lowered
print("destroyed", flush=True)
"""


@pytest.mark.slow
def test_xnnpack_double_frees_an_identity_requantize_without_the_rule() -> None:
    pytest.importorskip("executorch")
    pytest.importorskip("torchao")
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _REQUANTIZE_WITHOUT_THE_RULE], capture_output=True, text=True, timeout=600
    )
    assert "ran" in child.stdout, child.stderr[-2000:]
    if child.returncode == 0 and "destroyed" in child.stdout:
        pytest.fail("XNNPACK destroys the method cleanly now: executorch/quant-identity-requantize may go")
    assert "double free" in child.stderr or "corruption" in child.stderr, child.stderr[-2000:]


def test_openvino_cannot_convert_the_shift_without_the_rule() -> None:
    ov = pytest.importorskip("openvino")
    from hfexport.rewrites.rules.openvino.quant_right_shift_as_floor_scale import quant_right_shift_as_floor_scale

    with pytest.raises(Exception, match="bitwise_right_shift"):
        ov.convert_model(_program(quant_right_shift_as_floor_scale.meta.examples[0]))


def test_openvino_integer_floor_division_is_no_alternative() -> None:
    # Why the OpenVINO rule goes through float32: on a constant u8 tensor (packed weights are constants) OpenVINO
    # computes `div(x, 16, rounding_mode="floor")` rounded to nearest (9 // 16 gives 1).
    ov = pytest.importorskip("openvino")

    class Divide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("packed", torch.arange(256).to(torch.uint8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.div(self.packed, 16, rounding_mode="floor").to(torch.float32)

    zeros = torch.zeros(256)
    model = ov.convert_model(torch.export.export(Divide(), (zeros,)))
    result = ov.Core().compile_model(model, "CPU")([zeros.numpy()])[0]
    expected = (torch.arange(256) // 16).to(torch.float32).numpy()
    if np.array_equal(result, expected):
        pytest.fail("OpenVINO's u8 floor division is exact now: a plain division would do in the OpenVINO rule")


def _nncf_onnx_int4(*, rule: bool, disable: tuple[str, ...] = ()) -> tuple[Any, dict[str, torch.Tensor]]:
    from hfexport import NNCFOnnxQuantizer, NNCFWeightCompressionConfig, OnnxConfig, OnnxExporter, RuleSelection
    from hfexport.rewrites.rules.onnx.fold_shared_weight_transpose import fold_shared_weight_transpose

    model, inputs = fold_shared_weight_transpose.meta.examples[0].build()
    model.eval()
    rules = RuleSelection(disable=disable if rule else (fold_shared_weight_transpose.id, *disable))
    quantizer = NNCFOnnxQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=16))
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer, rules=rules))
    return (program, exporter.report), inputs


def test_nncf_onnx_fails_on_a_tied_head_without_the_rule() -> None:
    pytest.importorskip("onnxruntime")
    from hfexport import HfExportError

    with pytest.raises(HfExportError, match="There is no tensor with the name val_"):
        _nncf_onnx_int4(rule=False)


def test_nncf_onnx_compresses_a_tied_head_with_the_rule() -> None:
    ort = pytest.importorskip("onnxruntime")
    from hfexport.naming import onnx_feed
    from hfexport.rewrites.rules.onnx.fold_shared_weight_transpose import fold_shared_weight_transpose

    (program, report), inputs = _nncf_onnx_int4(rule=True)
    assert report.hits["onnx"].get(fold_shared_weight_transpose.id) == 1
    # The head's own copy was compressed (int8, NNCF's backup precision for the first and last layers).
    assert report.quantization.quantized_ops > 0
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]
    model, _ = fold_shared_weight_transpose.meta.examples[0].build()
    with torch.no_grad():
        expected = model(**inputs).numpy()
    cosine = (logits * expected).sum() / (np.linalg.norm(logits) * np.linalg.norm(expected))
    assert cosine > 0.99, cosine


def test_nncf_embedding_rows_are_dequantized_after_the_gather() -> None:
    """NNCF keeps the tied embedding in int8 per row: `onnx/dequantized-gather-rows` rewrites NNCF's own graph
    (after the quantizer) so no DequantizeLinear feeds a Gather, and the logits are those of NNCF's graph, bit
    for bit."""
    ort = pytest.importorskip("onnxruntime")
    from hfexport.naming import onnx_feed
    from hfexport.rewrites.rules.onnx.dequantized_gather_rows import dequantized_gather_rows

    def run(program: Any, inputs: dict[str, torch.Tensor]) -> Any:
        session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]

    (program, report), inputs = _nncf_onnx_int4(rule=True)
    (plain, plain_report), _ = _nncf_onnx_int4(rule=True, disable=(dequantized_gather_rows.id,))
    assert report.hits["onnx"].get(dequantized_gather_rows.id) == 1
    assert not plain_report.hits["onnx"].get(dequantized_gather_rows.id)

    def gathered_tables(model: Any) -> int:
        producers = {out: node.op_type for node in model.graph.node for out in node.output}
        gathers = [node for node in model.graph.node if node.op_type == "Gather"]
        return sum(producers.get(node.input[0]) == "DequantizeLinear" for node in gathers)

    assert gathered_tables(plain.model_proto) == 1 and gathered_tables(program.model_proto) == 0
    np.testing.assert_array_equal(run(program, inputs), run(plain, inputs))


def test_ort_dynamic_quantizes_a_tied_head_with_the_rule() -> None:
    """onnxruntime.quantization quantizes a MatMul only on an initializer weight: the tied head read through a
    Transpose stayed float until `onnx/fold-shared-weight-transpose` (switched on by OnnxRuntimeQuantizer)."""
    pytest.importorskip("onnxruntime")
    from hfexport import OnnxConfig, OnnxExporter, OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer, RuleSelection
    from hfexport.rewrites.rules.onnx.fold_shared_weight_transpose import fold_shared_weight_transpose

    model, inputs = fold_shared_weight_transpose.meta.examples[0].build()
    model.eval()

    def float_matmuls(rules: RuleSelection) -> int:
        quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
        program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer, rules=rules))
        return sum(node.op_type == "MatMul" for node in program.model_proto.graph.node)

    assert float_matmuls(RuleSelection(disable=(fold_shared_weight_transpose.id,))) == 1
    assert float_matmuls(RuleSelection()) == 0


def test_a_quantizer_enables_its_rules_unless_the_config_disables_them() -> None:
    from hfexport import NNCFOnnxQuantizer, NNCFWeightCompressionConfig, OnnxConfig, RuleSelection
    from hfexport.exporters.pipeline import effective_selection
    from hfexport.rewrites.rules.onnx.fold_shared_weight_transpose import fold_shared_weight_transpose

    meta = fold_shared_weight_transpose.meta
    quantizer = NNCFOnnxQuantizer(NNCFWeightCompressionConfig(mode="int4_sym"))
    assert not meta.enabled_by_default and not effective_selection(OnnxConfig()).is_enabled(meta)
    assert effective_selection(OnnxConfig(quantizer=quantizer), quantizer).is_enabled(meta)
    for disabled in (meta.id, "onnx"):
        config = OnnxConfig(quantizer=quantizer, rules=RuleSelection(disable=(disabled,)))
        assert not effective_selection(config, quantizer).is_enabled(meta), disabled


@pytest.mark.slow
def test_ort_dynamic_int8_attention_runs_as_float_matmuls_after_the_tool() -> None:
    """OnnxRuntimeQuantizer turns `onnx/attention-as-matmul` off (the tool would quantize the scores); its
    after-quantizer twin rewrites each `Attention` once the tool is done: no Attention node is left for ORT to
    inline, the tool's integer MatMuls are the same, and the logits agree with the model that kept Attention."""
    ort = pytest.importorskip("onnxruntime")
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfexport import OnnxConfig, OnnxExporter, OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer, RuleSelection
    from hfexport.naming import onnx_feed
    from hfexport.rewrites.rules.onnx.quantized_attention_as_matmul import quantized_attention_as_matmul as rule

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": mask}

    def export(rules: RuleSelection) -> tuple[Any, Any]:
        quantizer = OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
        program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer, rules=rules))
        proto = program.model_proto
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        logits = session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]
        return Counter(node.op_type for node in proto.graph.node), logits

    kept, kept_logits = export(RuleSelection(disable=(rule.id,)))
    ops, logits = export(RuleSelection())
    assert kept["Attention"] == 2 and ops["Attention"] == 0, (kept, ops)
    assert ops["MatMulInteger"] == kept["MatMulInteger"] > 0
    rows = mask.bool().numpy()  # padded positions' logits are not compared
    np.testing.assert_allclose(logits[rows], kept_logits[rows], rtol=1e-4, atol=1e-4)


class _TinyMlpLM(torch.nn.Module):
    """An embedding, one MLP (whose two linears NNCF puts in int4) and a head: the first and last layers stay in
    NNCF's int8 backup precision. 512 x 64 weights pack to 16384 bytes each, above the optimizer's folding limit, so
    the ONNX graph keeps the unpacking as a model's weights do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(128, 64)
        self.up = torch.nn.Linear(64, 512, bias=False)
        self.down = torch.nn.Linear(512, 64, bias=False)
        self.head = torch.nn.Linear(64, 128, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        return self.head(hidden + self.down(torch.relu(self.up(hidden))))


def _nncf_fx_int4_onnx_session(*, rule: bool) -> tuple[Any, torch.nn.Module, dict[str, torch.Tensor]]:
    """`NNCFTorchFXQuantizer` int4 (groups of 32) of the tiny MLP, exported to ONNX and opened in ONNX Runtime."""
    import onnxruntime as ort

    from hfexport import NNCFTorchFXQuantizer, NNCFWeightCompressionConfig, OnnxConfig, OnnxExporter, RuleSelection

    model = _TinyMlpLM().eval()
    inputs = {"input_ids": torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))}
    quantizer = NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))
    rules = RuleSelection() if rule else RuleSelection(disable=("aten/unsigned-right-shift",))
    program = OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, quantizer=quantizer, rules=rules))
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session, model, inputs


def test_nncf_fx_int4_onnx_does_not_load_without_the_unsigned_shift_rule() -> None:
    """torchlib casts `packed >> 4` (uint8) to int8, and the stack with `packed & 15` (uint8) is a Concat of two
    types; when onnxscript translates an unsigned shift in its own dtype this passes, and the rule can go."""
    pytest.importorskip("onnxruntime")
    with pytest.raises(Exception, match=r"Concat\) bound to different types \(tensor\(uint8\) and tensor\(int8\)"):
        _nncf_fx_int4_onnx_session(rule=False)


def test_nncf_fx_int4_onnx_runs_with_the_unsigned_shift_rule() -> None:
    from hfexport.naming import onnx_feed

    pytest.importorskip("onnxruntime")
    session, model, inputs = _nncf_fx_int4_onnx_session(rule=True)
    logits = session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]
    with torch.no_grad():
        expected = model(**inputs).numpy()
    cosine = (logits * expected).sum() / (np.linalg.norm(logits) * np.linalg.norm(expected))
    assert cosine > 0.99, cosine


def _nncf_fx_int8_tied_head(*, rule: bool) -> tuple[Any, torch.nn.Module, dict[str, torch.Tensor]]:
    """`NNCFTorchFXQuantizer` int8 (`nncf.quantize`, calibrated on four batches) of a tied head, on Dynamo."""
    from hfexport import DynamoConfig, DynamoExporter, NNCFTorchFXQuantizer, RuleSelection
    from hfexport.rewrites.rules.fx.untie_shared_weights import untie_shared_weights

    model, inputs = untie_shared_weights.meta.examples[0].build()
    model.eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [{"input_ids": torch.randint(0, 64, (2, 5), generator=generator)} for _ in range(4)]
    quantizer = NNCFTorchFXQuantizer(calibration_dataset=calibration)
    rules = RuleSelection() if rule else RuleSelection(disable=(untie_shared_weights.id,))
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=False, quantizer=quantizer, rules=rules))
    return (program, exporter.report), model, inputs


def test_nncf_fx_int8_fails_on_a_tied_head_without_the_untie_rule() -> None:
    """nncf.quantize replaces the head's weight for every reader of its get_attr node: the embedding gets the int8
    table, and the layer norm after it cannot trace (a Llama's `.to(float32)` there fails as "Tensor dtype mismatch!
    Expected: torch.float32, Got: torch.int8"). When NNCF updates one reader only, this passes and the rule can go."""
    from hfexport import HfExportError

    with pytest.raises(HfExportError, match=r"(?s)stage 'quantize'.*Got: torch\.int8.*layer_norm"):
        _nncf_fx_int8_tied_head(rule=False)


def test_nncf_fx_int8_quantizes_a_tied_head_with_the_untie_rule() -> None:
    from hfexport.rewrites.rules.fx.untie_shared_weights import untie_shared_weights

    (program, report), model, inputs = _nncf_fx_int8_tied_head(rule=True)
    assert report.hits["fx"].get(untie_shared_weights.id) == 1
    assert report.quantization.quantized_ops > 0
    with torch.no_grad():
        expected = model(**inputs)
        logits = program.module()(**inputs)
    # The embedding's table stays float (exact rows); the head is int8.
    assert logits.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99, cosine


def test_nncf_fx_weight_compression_keeps_the_tied_weight_shared() -> None:
    """The untie rule is for nncf.quantize only: weight compression decompresses a shared weight once for both
    readers, and untied it would store the table twice."""
    from hfexport import NNCFTorchFXQuantizer, NNCFWeightCompressionConfig

    assert NNCFTorchFXQuantizer().enabled_rules == ("fx/untie-shared-weights",)
    assert NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_sym")).enabled_rules == ()
