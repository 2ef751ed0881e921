"""Rule kinds of the ONNX lowering: ATen translation overrides (stage `aten`) and ONNX IR rewrites (`onnx`).

- `AtenOverride`: an onnxscript function that translates one `torch.ops.aten.<op>.<overload>`. The engine
  builds `torch.onnx.export(custom_translation_table=...)` from the selected overrides and counts every
  dispatch to one (a call of the function during translation is one hit).
- `OnnxRewriteRule`: an onnxscript rewriter rule (`pattern` / `check` / `rewrite`, e.g. a
  `RewriteRuleClassBase` subclass) applied to the `onnx_ir` model; the engine counts replacements per rule
  and stamps the rule id on the nodes it produced (`metadata_props["hfexport.rule"]`).

Both bodies are factories, called only when the stage runs: the rule registry is built for every export,
and building it must not import onnx or onnxscript.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.rewrites import engine, examples
from hfexport.rewrites.declines import note_declined, recording_declines
from hfexport.rewrites.engine import RewriteContext
from hfexport.rewrites.examples import Example, ExampleFailure, Match, assert_same_outputs
from hfexport.rewrites.rule import Rule

RULE_ID_KEY = "hfexport.rule"


@dataclass
class AtenOverride(Rule):
    """Translate `target` ("aten.<op>.<overload>") with the onnxscript function `translation()` returns."""

    target: str = ""
    translation: Callable[[], Callable[..., Any]] | None = None
    # The override is used only for exports at opsets up to this one (newer opsets have a native op).
    max_opset: int | None = None
    # Which dispatches count as hits, given the translation's arguments: an override that keeps the default
    # translation for most calls (a real squeeze) is reported only where it changes the result.
    counts: Callable[..., bool] | None = None
    stage: str = field(init=False, default="aten")

    def resolve_target(self) -> torch._ops.OpOverload | None:
        namespace, op, overload = ([*self.target.split("."), "", "", ""])[:3]
        packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace and op else None
        resolved = getattr(packet, overload or "default", None) if packet is not None else None
        return resolved if isinstance(resolved, torch._ops.OpOverload) else None


@dataclass
class OnnxRewriteRule(Rule):
    """Rewrite the ONNX IR model with the onnxscript rewriter rule that `rewrite_rule()` returns."""

    rewrite_rule: Callable[[], Any] | None = None
    stage: str = field(init=False, default="onnx")


@dataclass
class TranslationTable:
    """The `custom_translation_table` being built for one export, and the overrides in it."""

    context: Any  # the export's RewriteContext: hits and skips are recorded on it
    opset: int
    functions: dict[Any, Callable[..., Any]] = field(default_factory=dict)
    rules: list[AtenOverride] = field(default_factory=list)

    def finish(self) -> None:
        """Record the dispatch counts after translation (the stage itself only built the table)."""
        for rule in self.rules:
            self.context.finish(rule)


def _counting(
    function: Callable[..., Any], on_call: Callable[[], None], counts: Callable[..., bool] | None = None
) -> Callable[..., Any]:
    # functools.wraps keeps the signature and annotations that torch.onnx reads to dispatch the function.
    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if counts is None or counts(*args, **kwargs):
            on_call()
        return function(*args, **kwargs)

    return counted


def apply_aten(rule: Rule, target: TranslationTable) -> int:
    """The engine's applier of stage `aten`: put the override, wrapped to count dispatches, in the table."""
    assert isinstance(rule, AtenOverride)
    op = rule.resolve_target()
    if op is None:
        target.context.skip(rule, "not-applicable", f"{rule.target} is not an op of the installed torch")
        return 0
    if rule.max_opset is not None and target.opset > rule.max_opset:
        target.context.skip(rule, "not-applicable", f"only for opset <= {rule.max_opset}, exporting {target.opset}")
        return 0
    rule_id = rule.id
    target.functions[op] = _counting(rule.translation(), lambda: target.context.hit(rule_id), rule.counts)
    target.rules.append(rule)
    return 0


def apply_onnx_rule(rule: OnnxRewriteRule, model: Any) -> int:
    """Apply one IR rule to `model` (an `onnx_ir.Model`) in place; return the number of replacements."""
    from onnxscript.rewriter import pattern

    before = {id(node) for node in model.graph.all_nodes()}
    built = rule.rewrite_rule()
    # A factory returns one rewriter rule, or a RewriteRuleSet (e.g. with `commute=True` for patterns of
    # commutative ops, whose operand order torch.onnx does not fix).
    rule_set = built if isinstance(built, pattern.RewriteRuleSet) else pattern.RewriteRuleSet([built])
    count = rule_set.apply_to_model(model)
    if recording_declines(costly=True):
        # With a tracer onnxscript's rewriter only matches (changes nothing): a second, dry pass over the
        # rewritten model reports why the rule's checks refused the sites it left alone.
        rule_set.apply_to_model(model, tracer=_decline_tracer(rule.id))
    if count:
        for node in model.graph.all_nodes():
            if id(node) not in before:
                node.metadata_props[RULE_ID_KEY] = rule.id
    return count


def _decline_tracer(rule_id: str) -> Any:
    """An onnxscript matching tracer that keeps the reason of each match the rule's checks refused.

    onnxscript's rewriter reports a `check` that returns a failed `MatchResult` (`result.fail("why")`) only
    to a tracer, and a tracer turns `apply_to_model` into a dry run: hence the second pass above.
    """
    from onnxscript.rewriter import _basics

    refused = (_basics.MatchStatus.CONDITION_FAILED, _basics.MatchStatus.REPLACEMENT_FAILED)

    class DeclineTracer(_basics.MatchingTracer):
        def log(self, rule: Any, container: Any, node: Any, match_result: Any, status: Any) -> None:
            # A node this rule produced is no declined site: the dry pass runs after the rewrite.
            if status in refused and node.metadata_props.get(RULE_ID_KEY) != rule_id:
                reason = match_result.reason if match_result is not None else ""
                note_declined(rule_id, reason or f"{status.name.lower().replace('_', ' ')}")

    return DeclineTracer()


def apply_onnx(rule: Rule, target: Any) -> int:
    """The engine's applier of stage `onnx`."""
    assert isinstance(rule, OnnxRewriteRule)
    return apply_onnx_rule(rule, target)


# -- example checkers ------------------------------------------------------------------------------


def _ort_outputs(onnx_model: Any, feeds: dict[str, Any]) -> list[Any]:
    import onnx_ir as ir
    import onnxruntime as ort

    proto = ir.serde.serialize_model(onnx_model) if isinstance(onnx_model, ir.Model) else onnx_model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _export_module(
    module: torch.nn.Module, inputs: dict[str, Any], dynamic: bool, table: dict[Any, Any], opset: int | None = None
) -> Any:
    import torch.onnx

    program = examples._export(module, inputs, dynamic=dynamic)
    return torch.onnx.export(
        program,
        (),
        dynamo=True,
        custom_translation_table=table or None,
        opset_version=opset,
        optimize=False,
        verbose=False,
    )


def _feeds(onnx_program: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    return {value.name: t.numpy() for value, t in zip(onnx_program.model.graph.inputs, tensors, strict=True)}


def _check_onnx_against_eager(rule: Rule, example: Match, module: Any, program: Any, inputs: dict[str, Any]) -> None:
    with torch.no_grad():
        expected = module(**inputs)
    actual = [torch.from_numpy(a) for a in _ort_outputs(program.model, _feeds(program, inputs))]
    assert_same_outputs(expected, actual, example.atol, example.rtol, rule.id)


def _check_aten(rule: Any, example: Example) -> int:
    from hfexport.lowerings.onnx import newest_opset

    context = RewriteContext(backend="onnx")
    # Examples run at the newest opset the override is for.
    opset = min(rule.max_opset or newest_opset(), newest_opset())
    table = TranslationTable(context, opset)
    apply_aten(rule, table)
    module, inputs = example.build()
    module.eval()
    dynamic = isinstance(example, Match) and example.other_inputs is not None
    with torch.no_grad():
        program = _export_module(module, inputs, dynamic, table.functions, opset)
    hits = context.hits[rule.id]
    if isinstance(example, Match):
        if hits == 0:
            raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not dispatch to the override")
        _check_onnx_against_eager(rule, example, module, program, inputs)
        if example.other_inputs is not None:
            _check_onnx_against_eager(rule, example, module, program, example.other_inputs())
    elif hits:
        raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} dispatched {hits} time(s)")
    return hits


def _graph_structure(model: Any) -> list[tuple[Any, ...]]:
    """Nodes, wiring and attributes, without metadata: onnxscript's rewriter annotates Constant nodes even
    when no rule matches, so a text comparison would call an untouched graph changed."""
    return [
        (
            node.domain,
            node.op_type,
            tuple(v.name if v is not None else "" for v in node.inputs),
            tuple(v.name for v in node.outputs),
            tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())),
        )
        for node in model.graph
    ]


def _check_onnx(rule: Any, example: Example) -> int:
    """IR rule examples build either (ONNX text, feeds) or (torch module, inputs).

    Text: the rule runs on the parsed model; a Match must fire and give what the unrewritten model gives
    in the ONNX reference evaluator; a NoMatch must leave the model text unchanged. Module: the module is
    exported (torchlib, no optimizer), the rule runs on it, and ORT must match eager (a fix's Match after
    the optimizer too, as in the lowering).
    """
    import onnx
    import onnx_ir as ir

    built, inputs = example.build()
    if isinstance(built, str):
        proto = onnx.parser.parse_model(built)
        model = ir.serde.deserialize_model(proto)
        before_text = onnx.printer.to_text(proto)
        hits = apply_onnx_rule(rule, model)
        after = ir.serde.serialize_model(model)
        if isinstance(example, Match):
            if hits == 0:
                raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not fire")
            from onnx.reference import ReferenceEvaluator

            expected = ReferenceEvaluator(proto).run(None, inputs)
            actual = _ort_outputs(after, inputs)
            assert_same_outputs(
                [torch.from_numpy(e) for e in expected],
                [torch.from_numpy(a) for a in actual],
                example.atol,
                example.rtol,
                rule.id,
            )
        elif hits or onnx.printer.to_text(after) != before_text:
            raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} changed the model")
        return hits
    module = built.eval()
    with torch.no_grad():
        program = _export_module(module, inputs, False, {}, example.opset)
    if rule.meta.kind == "optimization":
        import onnxscript

        # Fusions run after the optimizer in the lowering; their examples see the same folded graph.
        program.model = onnxscript.optimizer.optimize(program.model)
    # Rules this one requires (e.g. the RMSNorm fusion before the skip-norm fusion) produce what it matches.
    registry = engine.default_registry()
    for required in rule.meta.requires:
        prerequisite = registry.get(required)
        if prerequisite.stage == "onnx":
            apply_onnx_rule(prerequisite, program.model)
    before = _graph_structure(program.model)
    hits = apply_onnx_rule(rule, program.model)
    if isinstance(example, Match):
        if hits == 0:
            raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not fire")
        if rule.meta.kind == "fix":
            import onnxscript

            # Fixes run before the optimizer in the lowering; what they fix must survive it.
            program.model = onnxscript.optimizer.optimize(program.model)
        _check_onnx_against_eager(rule, example, module, program, inputs)
    elif hits or _graph_structure(program.model) != before:
        raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} changed the model")
    return hits


examples.register_checker("aten", _check_aten)
examples.register_checker("onnx", _check_onnx)
