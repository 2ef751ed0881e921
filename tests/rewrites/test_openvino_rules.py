"""The OpenVINO rule kinds, and proof that each OpenVINO rule is needed: without it OpenVINO fails or differs.

The rules' own Match/NoMatch examples run in tests/rewrites/test_examples.py with every other rule's.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("openvino")

import openvino as ov

from hfexport import HfExportError, OpenVINOConfig, OpenVINOExporter
from hfexport.rewrites.engine import RewriteContext, apply, apply_rule, default_registry
from hfexport.rewrites.examples import ExampleFailure, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.kinds.openvino import OpenVINOModelRule
from hfexport.rewrites.rule import RuleMeta, RuleSelection
from hfexport.rewrites.rules import _moe_batched as moe_batched
from hfexport.rewrites.rules import _symbolic as symbolic
from hfexport.rewrites.rules.patch.moe_batched_experts import moe_batched_experts
from hfexport.runtime.openvino import F32_HINT
from hfexport.testing.harness import check_example, export_program

# The rule modules themselves: the package's attribute of each name is the rule it re-exports.
concat = importlib.import_module("hfexport.rewrites.rules.openvino.cat_drop_legacy_empty")
outputs = importlib.import_module("hfexport.rewrites.rules.openvino.distinct_repeated_outputs")
inputs = importlib.import_module("hfexport.rewrites.rules.openvino.drop_constant_inputs")
attention = importlib.import_module("hfexport.rewrites.rules.openvino.sdpa_fully_masked_rows")


def _compile_and_run(ov_model: Any, feed: dict[str, torch.Tensor]) -> np.ndarray:
    compiled = ov.Core().compile_model(ov_model, "CPU", F32_HINT)
    return compiled([t.numpy() for t in feed.values()])[0]


def test_every_openvino_rule_is_backend_scoped_and_registered() -> None:
    registry = default_registry()
    ids = {rule.id for rule in registry.rules("openvino")}
    assert ids == {
        "openvino/cat-drop-legacy-empty",
        "openvino/sdpa-fully-masked-rows",
        "openvino/drop-constant-inputs",
        "openvino/sym-mod-to-floordiv",
        "openvino/sym-min-max-to-floordiv",
        "openvino/sym-ceil-to-int",
        "openvino/distinct-repeated-outputs",
        "openvino/exact-int-floor-divide",
        "openvino/quant-right-shift-as-floor-scale",
        "openvino/grouped-sdpa-without-repeat-kv",
        "openvino/copy-back-without-broadcast",
        "openvino/passthrough-outputs-own-tensor",
    }
    assert "openvino" in moe_batched_experts.meta.backends
    for rule in registry.rules("openvino"):
        assert rule.meta.backends == ("openvino",), rule.id
        assert rule.meta.upstream and rule.meta.why, rule.id
    # the lowering runs the program phase's rules before conversion and the model phase's after, in RULES order
    assert [r.id for r in _rules_of("program")] == [
        "openvino/cat-drop-legacy-empty",
        "openvino/sdpa-fully-masked-rows",
        "openvino/grouped-sdpa-without-repeat-kv",
        "openvino/sym-mod-to-floordiv",
        "openvino/sym-min-max-to-floordiv",
        "openvino/sym-ceil-to-int",
        "openvino/distinct-repeated-outputs",
        "openvino/quant-right-shift-as-floor-scale",
    ]
    assert [r.id for r in _rules_of("model")] == [
        "openvino/drop-constant-inputs",
        "openvino/exact-int-floor-divide",
        "openvino/copy-back-without-broadcast",
        "openvino/passthrough-outputs-own-tensor",
    ]


def test_without_the_cat_rule_conversion_fails() -> None:
    module, feed = concat._cat_onto_empty()
    program = export_program(module, feed)
    with pytest.raises(Exception, match=r"aten\.cat"):
        ov.convert_model(program)
    assert apply_rule(concat.cat_drop_legacy_empty, program).hits == 1
    np.testing.assert_allclose(_compile_and_run(ov.convert_model(program), feed), module(**feed).numpy(), atol=1e-6)


def test_without_the_sdpa_rule_fully_masked_rows_are_nan() -> None:
    module, feed = attention._Attention(), attention._attention_inputs(2, 5, padded=3)
    expected = module(**feed).numpy()
    assert not np.isnan(expected).any() and (expected[0, :, :3] == 0).all(), "torch gives 0 on masked rows"
    program = export_program(module, feed, dynamic=True)
    raw = _compile_and_run(ov.convert_model(program), feed)
    assert np.isnan(raw[0, :, :3]).all() and not np.isnan(raw[1]).any()
    assert apply_rule(attention.sdpa_fully_masked_rows, program).hits == 1
    assert apply_rule(attention.sdpa_fully_masked_rows, program).hits == 0, "a rewritten node is left alone"
    np.testing.assert_allclose(_compile_and_run(ov.convert_model(program), feed), expected, atol=1e-5)


class _Flagged(torch.nn.Module):
    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        return x * 2 if double else x + 1


def test_without_the_constant_input_rule_compilation_fails() -> None:
    program = export_program(_Flagged(), {"x": torch.randn(2, 3), "double": True})
    ov_model = ov.convert_model(program)
    with pytest.raises(RuntimeError, match="dynamic rank"):
        ov.Core().compile_model(ov_model, "CPU")
    assert inputs.drop_constant_parameters(ov_model) == 1
    assert [p.get_any_name() for p in ov_model.inputs] == ["x"]
    x = torch.randn(4, 3)
    np.testing.assert_allclose(_compile_and_run(ov_model, {"x": x}), (x * 2).numpy())


def test_without_the_moe_patch_conversion_fails_and_rules_can_be_disabled() -> None:
    model, feed = moe_batched.qwen3_moe(5)
    # The rule's former OpenVINO-only id still disables it (an alias of patch/moe-batched-experts).
    config = OpenVINOConfig(rules=RuleSelection(disable=("patch/openvino-moe-batched-experts",)))
    exporter = OpenVINOExporter()
    with pytest.raises(HfExportError, match=r"aten\.histc") as failure:
        exporter.export(model, feed, config=config)
    assert failure.value.stage == "convert"
    outcomes = {o.id: o.status for o in exporter.report.rules}
    # No other rule stood in: grouped_mm ran as transformers has it, histc offsets and all.
    assert outcomes["patch/moe-batched-experts"] == "disabled"


def _mul_to_add_rule(examples_: tuple) -> NodeRule:
    def rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        node.target = torch.ops.aten.add.Tensor

    return NodeRule(
        RuleMeta(
            id="openvino/test-wrong",
            why="test",
            upstream="hfexport==0 tests",
            backends=("openvino",),
            examples=examples_,
        ),
        predicate=lambda node: node.target is torch.ops.aten.mul.Tensor,
        rewrite=rewrite,
    )


class _Mul(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_the_checker_catches_a_rule_that_changes_numerics_or_fires_on_a_nomatch() -> None:
    match = Match(lambda: (_Mul(), {"x": torch.randn(3)}))
    nomatch = NoMatch(lambda: (_Mul(), {"x": torch.randn(3)}))
    rule = _mul_to_add_rule((match, nomatch))
    with pytest.raises(ExampleFailure, match="differs from eager"):
        check_example(rule, match)
    with pytest.raises(ExampleFailure, match="fired 1 time"):
        check_example(rule, nomatch)
    with pytest.raises(ExampleFailure, match="did not fire"):
        check_example(rule, Match(lambda: (attention._Attention(), attention._attention_inputs(1, 3, 0))))


def test_model_rules_are_counted_by_the_engine_in_the_model_phase() -> None:
    meta = RuleMeta(
        id="openvino/test-count",
        why="test",
        upstream="hfexport==0 tests",
        backends=("openvino",),
        examples=(Match(lambda: (_Mul(), {})), NoMatch(lambda: (_Mul(), {}))),
    )
    rule = OpenVINOModelRule(meta, transform=lambda model: len(model.get_parameters()))
    program = export_program(_Mul(), {"x": torch.randn(3)})
    registry = _registry_of(rule)
    context = RewriteContext(backend="openvino")
    assert apply("openvino", program, context, registry, phase="program").hits == {}
    assert apply("openvino", ov.convert_model(program), context, registry, phase="model").hits == {rule.id: 1}
    assert context.outcomes["openvino/test-count"].status == "fired" and "openvino" in context.stage_seconds
    other = RewriteContext(backend="onnx")
    assert apply("openvino", ov.convert_model(program), other, registry, phase="model").hits == {}
    assert other.outcomes["openvino/test-count"].status == "other-backend"


def _registry_of(*rules: Any) -> Any:
    from hfexport.rewrites.engine import RuleRegistry

    registry = RuleRegistry()
    for rule in rules:
        registry.register(rule)
    return registry


def test_without_the_symbolic_rules_conversion_fails() -> None:
    for module, feed in (
        (symbolic.PadToMultiple(), {"x": torch.randn(2, 7, 3)}),
        (symbolic.TopKOfAtMost(), {"x": torch.randn(2, 3)}),
    ):
        program = export_program(module, feed, dynamic=True)
        with pytest.raises(Exception, match="No conversion rule found"):
            ov.convert_model(program)


def test_the_ceil_rule_declines_a_fraction_whose_integer_ceiling_differs() -> None:
    # 0.1 is 3602879701896397 / 2**55: at 10 tokens the exact product is just above 1, the float one is 1.0.
    assert math.ceil(0.1 * 10) == 1 and -((-10 * 3602879701896397) // 2**55) == 2
    program = export_program(symbolic._CapacityOfTokens(0.1), {"x": torch.randn(7, 3)}, dynamic=True)
    rule = default_registry().get("openvino/sym-ceil-to-int")
    applied = apply_rule(rule, program)
    assert applied.hits == 0
    # The predicate's reason is counted among the rule's declines (the audit shows it).
    assert any("3602879701896397" in reason for reason in applied.declined), applied.declined
    # 0.75 is 3 / 4: exact, so it is rewritten; the float chain feeding the ceiling is gone with it.
    program = export_program(symbolic._CapacityOfTokens(0.75), {"x": torch.randn(7, 3)}, dynamic=True)
    assert apply_rule(rule, program).hits == 1
    targets = {n.target for n in program.graph.nodes}
    assert math.ceil not in targets and torch.sym_float not in targets


def test_without_the_floor_divide_rule_negative_sizes_truncate() -> None:
    # L + (-L) // 4 keeps 5 of 7 positions in torch; the CPU plugin's truncating division keeps 6.
    feed = {"x": torch.randn(2, 7)}
    program = export_program(symbolic.ShortenByCeil(), feed, dynamic=True)
    ov_model = ov.convert_model(program)
    assert _compile_and_run(ov_model, feed).shape == (2, 6)
    assert symbolic.exact_floor_divides(ov_model) == 1
    assert _compile_and_run(ov_model, feed).shape == (2, 5)


def test_without_the_outputs_rule_a_repeated_output_fails_conversion() -> None:
    program = export_program(outputs._ReturnsTwice(), outputs._returns_twice(5), dynamic=True)
    with pytest.raises(Exception, match="Tensor name is not a number"):
        ov.convert_model(program)


def _rules_of(phase: str) -> list[Any]:
    """The registered openvino rules of this phase, in their order."""
    return [r for r in default_registry().rules("openvino") if r.phase == phase]


def _agrees_with_eager(module: torch.nn.Module, ov_model: Any, feed: dict[str, torch.Tensor]) -> bool:
    from hfexport.rewrites.examples import assert_same_outputs
    from hfexport.testing.harness import eager, leaves, run

    try:
        assert_same_outputs(eager(module, feed), leaves(run("openvino", ov_model, feed)))
    except (ExampleFailure, RuntimeError):  # wrong sizes or values, or a size the CPU plugin refuses
        return False
    return True


@pytest.mark.parametrize(
    "rule_id", ["openvino/sym-mod-to-floordiv", "openvino/sym-min-max-to-floordiv", "openvino/sym-ceil-to-int"]
)
def test_the_symbolic_size_rules_require_the_exact_floor_divide(rule_id: str) -> None:
    registry = default_registry()
    rule, floor = registry.get(rule_id), registry.get("openvino/exact-int-floor-divide")
    assert floor.id in rule.meta.requires
    example = rule.meta.examples[0]
    module, feed = example.build()
    program = export_program(module.eval(), feed, dynamic=True)
    # --disable of the requirement drops the dependent, in the lowering's program-rule registry too (whose
    # plan must see the model rule it requires).
    context = RewriteContext(backend="openvino", selection=RuleSelection(disable=(floor.id,)))
    apply("openvino", program, context, phase="program")
    assert context.outcomes[rule_id].status == "disabled", context.outcomes[rule_id]
    assert floor.id in context.outcomes[rule_id].reason and context.hits[rule_id] == 0
    # The dependent alone converts, but its floor divisions of negative sizes truncate: wrong sizes.
    assert apply_rule(rule, program).hits == 1
    ov_model = ov.convert_model(program)
    assert not _agrees_with_eager(module, ov_model, feed)
    # With its requirement (and no other rule) the example is right, on both sizes.
    assert apply_rule(floor, ov_model).hits >= 1
    assert _agrees_with_eager(module, ov_model, feed)
    assert _agrees_with_eager(module, ov_model, example.other_inputs())
