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

from hfexport.rewrites.declines import note_declined, recording_declines
from hfexport.rewrites.rule import Rule

RULE_ID_KEY = "hfexport.rule"


@dataclass
class AtenOverride(Rule):
    """Translate `target` ("aten.<op>.<overload>") with the onnxscript function `translation()` returns."""

    target: str = ""
    translation: Callable[[], Callable[..., Any]] | None = None
    # The override is used only for exports at opsets up to this one (newer opsets have a native op).
    max_opset: int | None = None
    # ... and only from this opset on (an override of a translation torch.onnx has only at newer opsets).
    min_opset: int | None = None
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
    # Runs on the quantized model, after the export's quantizer (a rewrite of what the quantizer writes), instead
    # of with the fixes or the fusions of the lowering; an export without a quantizer runs it after lowering.
    after_quantizer: bool = False
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
    if rule.min_opset is not None and target.opset < rule.min_opset:
        target.context.skip(rule, "not-applicable", f"only for opset >= {rule.min_opset}, exporting {target.opset}")
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
