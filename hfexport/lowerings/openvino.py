"""Lower a captured `ExportedProgram` to an `openvino.Model`.

Order: stage `openvino` program fixes (FX, on the captured program) -> `openvino.convert_model(program)` ->
stage `openvino` model fixes (on the `openvino.Model`) -> named inputs and outputs. `OpenVINOExporter` saves
`output_path` as IR (`model.xml` + `model.bin`) itself, atomically, after any quantizer.

Naming follows the ONNX lowering: every model input and output is named after its place in the forward
kwargs / model output (`input_ids`, `logits`, `past_key_values.layers_0_keys`), and a name that is both an
input and an output (a cache the graph updates) becomes `input.<name>` / `output.<name>`.

Precision: the returned model computes in f32; the CPU plugin picks its compute precision at compile time
from `INFERENCE_PRECISION_HINT` (bf16 or f16 on CPUs that have them). Compile with
`{"INFERENCE_PRECISION_HINT": "f32"}` for results within 1e-4 of eager (docs/openvino.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.configs import OpenVINOConfig
from hfexport.errors import HfExportError
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger("hfexport")

INPUT_PREFIX = "input."
OUTPUT_PREFIX = "output."


def _spec_names(spec: pytree.TreeSpec) -> list[str]:
    from hfexport.lowerings.onnx import leaf_names

    # Tensor placeholders: a cache pytree re-flattens only its tensors as leaves (ints are context).
    # A bare tensor (an lm_head's output) has the empty path; a port needs a name.
    leaves = leaf_names(pytree.tree_unflatten([torch.empty(0)] * spec.num_leaves, spec))
    return [name or "output" for name, _ in leaves]


def signature_names(program: torch.export.ExportedProgram) -> tuple[list[str], list[str]] | None:
    """Names of the program's tensor user inputs and outputs, in order, or None when they cannot be mapped.

    `openvino.convert_model` keeps one model input per tensor user input and one output per tensor user
    output (constants such as `use_cache=True` are folded in), in the program's flattened order.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument

    args_spec = program.call_spec.in_spec
    if args_spec is None or program.call_spec.out_spec is None:
        return None
    # in_spec is ((args), {kwargs}); hfexport calls the forward with kwargs only.
    in_names = _spec_names(args_spec)
    in_names = [n.split(".", 1)[1] for n in in_names]
    out_names = _spec_names(program.call_spec.out_spec)
    inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if len(inputs) != len(in_names) or len(outputs) != len(out_names):
        return None
    in_names = [n for n, s in zip(in_names, inputs, strict=True) if isinstance(s.arg, TensorArgument)]
    out_names = [n for n, s in zip(out_names, outputs, strict=True) if not isinstance(s.arg, ConstantArgument)]
    return in_names, out_names


def name_inputs_and_outputs(model: Any, input_names: list[str], output_names: list[str]) -> None:
    """Give the inputs and outputs of `model` (an `openvino.Model`) their signature names, in place."""
    shared = set(input_names) & set(output_names)
    inputs = [INPUT_PREFIX + n if n in shared else n for n in input_names]
    outputs = [OUTPUT_PREFIX + n if n in shared else n for n in output_names]
    for port, name in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, outputs, strict=True):
        # A Result's names are its own (OpenVINO >= 2025.0), so an output that is an input passed through, or
        # one tensor returned twice, still gets one name per output.
        port.get_tensor().set_names({name})


def _program_rules() -> engine.RuleRegistry:
    from hfexport.rewrites.kinds.openvino import PROGRAM_RULES, rules_of

    return rules_of(PROGRAM_RULES)


def _model_rules() -> engine.RuleRegistry:
    from hfexport.rewrites.kinds.openvino import OpenVINOModelRule, rules_of

    return rules_of((OpenVINOModelRule,))


def _apply(target: Any, context: RewriteContext, registry: engine.RuleRegistry) -> None:
    try:
        engine.apply("openvino", target, context, registry)
    except Exception as exc:
        raise HfExportError(f"{type(exc).__name__}: {exc}", stage="openvino", rule_id=context.current_rule) from exc


def lower(program: torch.export.ExportedProgram, config: OpenVINOConfig, context: RewriteContext) -> Any:
    """Convert `program` to an `openvino.Model` with the `openvino` stage applied; save it when asked."""
    import openvino as ov

    # Names first: the program rules edit the graph, never the signature, but read it from the capture.
    names = signature_names(program)
    _apply(program, context, _program_rules())

    context.current_stage = "convert"
    start = time.perf_counter()
    try:
        ov_model = ov.convert_model(program)
    except Exception as exc:
        text = str(exc).strip()
        # OpenVINO's conversion report is long; its summary names the ops that failed.
        summary = text[text.find("Summary:") :] if "Summary:" in text else text[:2000]
        raise HfExportError(f"openvino.convert_model failed: {type(exc).__name__}: {summary}", stage="convert") from exc
    finally:
        context.stage_seconds["convert"] = time.perf_counter() - start

    _apply(ov_model, context, _model_rules())

    if names is None or len(names[0]) != len(ov_model.inputs) or len(names[1]) != len(ov_model.outputs):
        logger.warning("could not map the OpenVINO inputs/outputs to the forward signature; converter names kept")
    else:
        name_inputs_and_outputs(ov_model, *names)
    # The exporter saves `output_path` itself (atomically, after any quantizer).
    return ov_model
