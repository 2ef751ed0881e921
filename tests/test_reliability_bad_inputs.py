"""Issue #8, item 5: the bad-input table of the export pipeline (docs/reliability.md, "Bad inputs: exporting").

Every row is one case: a call, the exception type it must raise, and words of the message that tell the caller
what to do. In each case the model, the sample inputs and the process are left untouched (the snapshots of
tests/test_reliability_invariants.py), nothing is written under the test's folder, and, for the export calls,
nothing was traced: the engine's test hook records every point an export passes, and none may be the trace.
The saving/loading rows of the table are tests/test_reliability_artifacts.py and tests/test_save_load.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import GenerationConfig

from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    ExecutorchExporter,
    OnnxConfig,
    OnnxExporter,
    OpenVINOConfig,
    OpenVINOExporter,
)
from hfexport.core.errors import ConfigError, InputError, MissingPackageError, OutputPathError
from hfexport.rewrites.engine import fault_injection
from hfexport.rewrites.rule import RuleSelection
from hfexport.tiny import get_tiny_model
from tests.test_reliability_invariants import micro_llama, sample_inputs, untouched

Call = Callable[[torch.nn.Module, dict[str, Any], Path], Any]


@dataclass(frozen=True)
class Case:
    id: str
    call: Call
    error: type[BaseException]
    match: str
    model: Callable[[], torch.nn.Module] = micro_llama


def _gen(**kwargs: Any) -> Call:
    """export_for_generation with generate kwargs built from the sample inputs, overridden by `kwargs`."""

    def call(model: torch.nn.Module, inputs: dict[str, Any], tmp: Path) -> Any:
        generation_config = kwargs.pop("generation_config", None)
        config = kwargs.pop("config", None)
        generate_kwargs = {**inputs, "max_new_tokens": 2, **kwargs}
        return DynamoExporter().export_for_generation(
            model, generate_kwargs, config, generation_config=generation_config
        )

    return lambda model, inputs, tmp: call(model, inputs, tmp)


def _ort(**kwargs: Any) -> Any:
    from hfexport.quantizers import OnnxRuntimeQuantizer, OnnxRuntimeStaticConfig

    return OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(), **kwargs)


class _NeedsMissingPackage(DynamoExporter):
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "hfexport-test-no-such-package")


class _NeedsNewerTorch(DynamoExporter):
    min_versions: ClassVar[dict[str, str]] = {"torch": "99.0"}


def _with_attention(impl: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        model = micro_llama()
        model.config._attn_implementation_internal = impl
        return model

    return build


def _a_file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("a file, not a folder")
    return tmp / "notes.txt"


CASES = [
    # -- config and format --------------------------------------------------------------------------------------
    Case(
        "wrong-config-class",
        lambda m, x, t: DynamoExporter().export(m, x, OnnxConfig()),
        ConfigError,
        "DynamoExporter takes a DynamoConfig, got OnnxConfig; AutoHfExporter.from_config",
    ),
    Case(
        "config-is-a-dict",
        lambda m, x, t: DynamoExporter().export(m, x, {"dynamic": True}),
        ConfigError,
        "takes a DynamoConfig, got dict",
    ),
    Case(
        "unknown-format",
        lambda m, x, t: AutoExportConfig.from_dict({"export_format": "tflite"}),
        ValueError,
        "unknown export_format 'tflite'.*known formats",
    ),
    Case(
        "no-format",
        lambda m, x, t: AutoExportConfig.from_dict({"dynamic": True}),
        ValueError,
        "needs an 'export_format' key",
    ),
    Case(
        "exporter-for-a-non-config",
        lambda m, x, t: AutoHfExporter.from_config("onnx"),
        ConfigError,
        "needs an export config, got str",
    ),
    Case(
        "unknown-config-field",
        lambda m, x, t: AutoExportConfig.from_dict({"export_format": "onnx", "opset": 18}),
        ConfigError,
        r"OnnxConfig has no field\(s\) \['opset'\]; fields:",
    ),
    Case(
        "config-field-of-wrong-type",
        lambda m, x, t: AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": "yes"}),
        ConfigError,
        "DynamoConfig.dynamic takes bool",
    ),
    Case(
        "opset-too-old", lambda m, x, t: OnnxConfig(opset_version=17), ConfigError, "opset_version must be an int >= 18"
    ),
    Case("unknown-fusions", lambda m, x, t: OnnxConfig(fusions="gpu"), ConfigError, "fusions must be 'cpu' or None"),
    Case(
        "unsupported-executorch-backend",
        lambda m, x, t: ExecutorchConfig(backend="mlx"),
        ConfigError,
        r"backend must be one of \('xnnpack', 'cuda'\), got 'mlx'",
    ),
    Case(
        "openvino-path-not-xml",
        lambda m, x, t: OpenVINOConfig(output_path=str(t / "model.onnx")),
        ConfigError,
        "must name the IR's .xml file",
    ),
    Case(
        "executorch-cuda-without-a-device",
        lambda m, x, t: ExecutorchExporter().export(m, x, ExecutorchConfig(backend="cuda")),
        RuntimeError,
        "needs a CUDA device.*export with backend='xnnpack' on a CPU-only machine",
    ),
    # -- rule selection -----------------------------------------------------------------------------------------
    Case(
        "unknown-rule-enabled",
        lambda m, x, t: DynamoExporter().export(m, x, DynamoConfig(rules=RuleSelection(enable=["fx/no-such-rule"]))),
        ValueError,
        r"names no registered rule: \['fx/no-such-rule'\].*hfexport rules list",
    ),
    Case(
        "unknown-rule-disabled",
        lambda m, x, t: DynamoExporter().export(m, x, DynamoConfig(rules=RuleSelection(disable=["patch/nope"]))),
        ValueError,
        r"names no registered rule: \['patch/nope'\]",
    ),
    Case(
        "rules-not-a-selection",
        lambda m, x, t: DynamoConfig(rules=["fx/x"]),
        ConfigError,
        "rules must be a RuleSelection, got list",
    ),
    Case(
        "strict-with-a-gated-patch",
        # Mamba's selective scan patch is a gated module function.
        lambda m, x, t: DynamoExporter().export(m, x, DynamoConfig(strict=True)),
        InputError,
        r"strict=True cannot trace the module-function patches \['patch/mamba-selective-scan-hop'\]",
        model=lambda: get_tiny_model("tiny-mamba").build(),
    ),
    # -- sample inputs and shapes -------------------------------------------------------------------------------
    Case(
        "model-not-a-module",
        lambda m, x, t: DynamoExporter().export(lambda **kw: kw, x),
        InputError,
        "model must be a torch.nn.Module",
    ),
    Case(
        "inputs-not-a-mapping",
        lambda m, x, t: DynamoExporter().export(m, x["input_ids"]),
        InputError,
        r"sample_inputs must be a mapping of forward argument names to tensors \(e.g. a tokenizer.s "
        r"BatchEncoding\), got Tensor",
    ),
    Case(
        "empty-inputs",
        lambda m, x, t: DynamoExporter().export(m, {}),
        InputError,
        "sample_inputs is empty: pass the forward kwargs of one real call",
    ),
    Case(
        "non-tensor-input",
        lambda m, x, t: DynamoExporter().export(m, {**x, "input_ids": "hello world"}),
        InputError,
        "'input_ids' is a str; export takes tensors.*return_tensors='pt'",
    ),
    Case(
        "input-name-not-an-identifier",
        lambda m, x, t: DynamoExporter().export(m, {"input ids": x["input_ids"]}),
        InputError,
        "'input ids' is not a valid forward argument name",
    ),
    Case(
        "dynamic-shapes-name-unknown-input",
        lambda m, x, t: DynamoExporter().export(
            m, x, DynamoConfig(dynamic_shapes={"input_idz": {1: torch.export.Dim("seq")}})
        ),
        InputError,
        r"dynamic_shapes names \['input_idz'\], which are not sample inputs; the sample inputs are",
    ),
    Case(
        "dynamic-shapes-axis-out-of-range",
        lambda m, x, t: DynamoExporter().export(
            m, x, DynamoConfig(dynamic_shapes={"input_ids": {2: torch.export.Dim("seq")}})
        ),
        InputError,
        "names axis 2, but the input has 2 axes",
    ),
    Case(
        "dynamic-shapes-not-a-dict",
        lambda m, x, t: DynamoExporter().export(m, x, DynamoConfig(dynamic_shapes=[{1: None}])),
        InputError,
        "dynamic_shapes must be a dict keyed by sample input name",
    ),
    Case(
        "dim-bounds-inverted", lambda m, x, t: torch.export.Dim("seq", min=10, max=2), AssertionError, "min=10, max=2"
    ),
    Case(
        "dim-bounds-inverted-in-a-config-dict",
        lambda m, x, t: AutoExportConfig.from_dict(
            {"export_format": "dynamo", "dynamic_shapes": {"input_ids": {"1": {"dim": "seq", "min": 10, "max": 2}}}}
        ),
        ConfigError,
        "min 10 is greater than max 2",
    ),
    Case(
        "unsupported-attention",
        lambda m, x, t: DynamoExporter().export(m, x),
        InputError,
        r"attn_implementation='paged_attention', which cannot be exported; load the model with "
        r"attn_implementation='sdpa'",
        model=_with_attention("paged_attention"),
    ),
    Case(
        "inputs-on-the-meta-device",
        # torch.export traced this "successfully" into a program that ran on neither device (issue #21, item 6).
        lambda m, x, t: DynamoExporter().export(m, {k: v.to("meta") for k, v in x.items()}),
        InputError,
        r"sample input 'input_ids' is on meta, the model on cpu: the program would run on neither; move the inputs",
    ),
    Case(
        "one-input-on-another-device",
        lambda m, x, t: OnnxExporter().export(m, {**x, "attention_mask": x["attention_mask"].to("meta")}),
        InputError,
        r"sample input 'attention_mask' is on meta, the model on cpu",
    ),
    Case(
        "model-on-the-meta-device",
        lambda m, x, t: DynamoExporter().export(m, x),
        InputError,
        r"weight\(s\) of LlamaForCausalLM are on the meta device \(e.g. 'model.embed_tokens.weight'\).*load",
        model=lambda: micro_llama().to("meta"),
    ),
    # -- generation ---------------------------------------------------------------------------------------------
    Case(
        "max-cache-len-smaller-than-prompt",
        _gen(generation_config=GenerationConfig(cache_implementation="static", max_cache_len=3)),
        InputError,
        "max_cache_len=3 leaves no room after the 5-token prompt",
    ),
    Case(
        "offloaded-cache",
        _gen(generation_config=GenerationConfig(cache_implementation="offloaded")),
        ConfigError,
        "cache_implementation='offloaded' cannot be exported.*use cache_implementation='static'",
    ),
    Case(
        "quantized-cache",
        _gen(generation_config=GenerationConfig(cache_implementation="quantized")),
        ConfigError,
        "cache_implementation='quantized' cannot be exported",
    ),
    Case(
        "generate-kwargs-non-tensor",
        _gen(input_ids="hello world"),
        InputError,
        r"generate_kwargs\['input_ids'\] is a str, not a tensor; tokenize with return_tensors='pt'",
    ),
    Case(
        "generate-kwargs-empty",
        lambda m, x, t: DynamoExporter().export_for_generation(m, {}),
        InputError,
        "generate_kwargs must be a non-empty mapping",
    ),
    Case(
        "component-config-dict-missing-one",
        _gen(config={"prefill": DynamoConfig()}),
        InputError,
        r"must name every component \['prefill', 'decode'\]: missing \['decode'\]",
    ),
    # -- quantization -------------------------------------------------------------------------------------------
    Case(
        "quantizer-format-mismatch",
        lambda m, x, t: DynamoExporter().export(m, x, DynamoConfig(quantizer=_ort())),
        ConfigError,
        "OnnxRuntimeQuantizer quantizes onnx exports, not 'dynamo'; see docs/quantization.md",
    ),
    Case(
        "quantizer-not-a-quantizer",
        lambda m, x, t: OnnxConfig(quantizer="int8"),
        ConfigError,
        "quantizer must be an ExportQuantizer",
    ),
    Case(
        "calibration-samples-with-wrong-keys",
        lambda m, x, t: OnnxExporter().export(
            m, x, OnnxConfig(quantizer=_ort(calibration_dataset=[{"input_idz": x["input_ids"]}]))
        ),
        InputError,
        r"calibration sample 0 lacks \['input_ids', 'attention_mask'\].*give every sample the keys of sample_inputs",
    ),
    Case(
        "calibration-dataset-a-single-sample",
        lambda m, x, t: OnnxExporter().export(m, x, OnnxConfig(quantizer=_ort(calibration_dataset=dict(x)))),
        InputError,
        "calibration_dataset must be an iterable of samples.*wrap a single sample in a list",
    ),
    # -- environment and output ---------------------------------------------------------------------------------
    Case(
        "missing-optional-package",
        lambda m, x, t: _NeedsMissingPackage().export(m, x),
        MissingPackageError,
        "hfexport-test-no-such-package.*pip install",
    ),
    Case("package-too-old", lambda m, x, t: _NeedsNewerTorch().export(m, x), MissingPackageError, "torch.*99.0"),
    Case(
        "output-path-under-a-file",
        lambda m, x, t: OnnxExporter().export(m, x, OnnxConfig(output_path=str(_a_file(t) / "model.onnx"))),
        OutputPathError,
        "notes.txt' is a file, not a folder; choose another path",
    ),
    Case(
        "output-path-is-a-folder",
        lambda m, x, t: OpenVINOExporter().export(m, x, OpenVINOConfig(output_path=str(_folder_xml(t)))),
        OutputPathError,
        "is a folder; name the model file in it",
    ),
]


def _folder_xml(tmp: Path) -> Path:
    (tmp / "model.xml").mkdir()
    return tmp / "model.xml"


# Cases that create a file or folder of their own under the test's folder (to be refused); it must stay alone.
_OWN_FILES = {"output-path-under-a-file": ["notes.txt"], "output-path-is-a-folder": ["model.xml"]}


def test_the_table_has_at_least_thirty_cases() -> None:
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_is_refused_before_tracing_with_an_actionable_message(case: Case, tmp_path: Path) -> None:
    if "openvino" in case.id or "output-path-is-a-folder" in case.id:
        pytest.importorskip("openvino")
    if "calibration" in case.id or "quantizer-format" in case.id or "output-path-under" in case.id:
        pytest.importorskip("onnxruntime")
    if case.id == "executorch-cuda-without-a-device":
        pytest.importorskip("executorch")
        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    model, inputs = case.model(), sample_inputs()
    points: list[tuple[str, str | None]] = []
    with (
        untouched(model, inputs),
        fault_injection(lambda stage, rule: points.append((stage, rule))),
        pytest.raises(case.error) as info,
    ):
        case.call(model, inputs, tmp_path)
    assert re.search(case.match, str(info.value)), f"message {str(info.value)!r} lacks {case.match!r}"
    assert ("trace", None) not in points, f"{case.id}: raised after tracing began ({points})"
    assert sorted(p.name for p in tmp_path.iterdir()) == _OWN_FILES.get(case.id, []), "something was written"
