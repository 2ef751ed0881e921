"""Rule kinds of the ONNX lowering: ATen translation overrides (stage `aten`) and ONNX IR rewrites (`onnx`).

- `AtenOverride`: an onnxscript function that translates one `torch.ops.aten.<op>.<overload>` (and the overloads in
  `also`, where torch.onnx's decompositions write one op under several). Its applier hands `(op, function)` to the
  lowering for each, the function wrapped to count every dispatch to it (a call during
  translation is one hit): `dict(engine.apply("aten", opset, context).outputs)` is torch.onnx's
  `custom_translation_table`.
- `OnnxRewriteRule`: an onnxscript rewriter rule (`pattern` / `check` / `rewrite`, e.g. a
  `RewriteRuleClassBase` subclass) applied to the `onnx_ir` model in one of the stage's phases (`phase`: "fix",
  right after translation; "fusion", after the optimizer; "quantized", on what the export's quantizer wrote); the
  applier counts replacements and stamps the rule id on the nodes it produced (`metadata_props["hfexport.rule"]`).

Both bodies are factories, called only when the stage runs: the rule registry is built for every export,
and building it must not import onnx or onnxscript.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hfexport.rewrites.declines import clean_reason, explaining
from hfexport.rewrites.rule import Applied, Rule

RULE_ID_KEY = "hfexport.rule"


@dataclass
class AtenOverride(Rule):
    """Translate `target` ("aten.<op>.<overload>") with the onnxscript function `translation()` returns."""

    target: str = ""
    translation: Callable[[], Callable[..., Any]] | None = None
    # More overloads the same translation takes: one op that torch.onnx's decompositions write under another name
    # depending on its operands (`x >> 4` on a graph input is `aten.__rshift__.Scalar`, on a constant
    # `aten.bitwise_right_shift.Tensor`).
    also: tuple[str, ...] = ()
    # The override is used only for exports at opsets up to this one (newer opsets have a native op).
    max_opset: int | None = None
    # ... and only from this opset on (an override of a translation torch.onnx has only at newer opsets).
    min_opset: int | None = None
    # Which dispatches count as hits, given the translation's arguments: an override that keeps the default
    # translation for most calls (a real squeeze) is reported only where it changes the result.
    counts: Callable[..., bool] | None = None
    stages: ClassVar[tuple[str, ...]] = ("aten",)
    phase: str = field(init=False, default="translation")

    def resolve_target(self, target: str | None = None) -> torch._ops.OpOverload | None:
        """`target` ("aten.<op>.<overload>", by default the rule's) as an OpOverload of the installed torch."""
        namespace, op, overload = ([*(target or self.target).split("."), "", "", ""])[:3]
        packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace and op else None
        resolved = getattr(packet, overload or "default", None) if packet is not None else None
        return resolved if isinstance(resolved, torch._ops.OpOverload) else None


@dataclass
class OnnxRewriteRule(Rule):
    """Rewrite the ONNX IR model with the onnxscript rewriter rule that `rewrite_rule()` returns."""

    rewrite_rule: Callable[[], Any] | None = None
    # "fix": right after translation, before the optimizer (the default of a fix); "fusion": after the optimizer
    # (the default of an optimization); "quantized": on the model the export's quantizer returned (a rewrite of what
    # the quantizer writes; an export without a quantizer runs it after lowering).
    phase: str = ""
    stages: ClassVar[tuple[str, ...]] = ("onnx",)

    def __post_init__(self) -> None:
        if not self.phase:
            self.phase = "fusion" if self.meta.kind == "optimization" else "fix"
        super().__post_init__()


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


def apply_aten(rule: Rule, opset: int, hit: Callable[[], None] | None = None) -> Applied:
    """Hand `(op, translation)` to the lowering for an export at `opset`, the translation wrapped to call `hit()` at
    every dispatch it counts; not applicable where the op or the opset is not the override's."""
    assert isinstance(rule, AtenOverride)
    op = rule.resolve_target()
    if op is None:
        return Applied(not_applicable=f"{rule.target} is not an op of the installed torch")
    if rule.max_opset is not None and opset > rule.max_opset:
        return Applied(not_applicable=f"only for opset <= {rule.max_opset}, exporting {opset}")
    if rule.min_opset is not None and opset < rule.min_opset:
        return Applied(not_applicable=f"only for opset >= {rule.min_opset}, exporting {opset}")
    translation = _counting(rule.translation(), hit or (lambda: None), rule.counts)
    others = [resolved for resolved in map(rule.resolve_target, rule.also) if resolved is not None]
    return Applied(outputs=tuple((each, translation) for each in (op, *others)))


def apply_onnx_rule(rule: Rule, model: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Apply one IR rule to `model` (an `onnx_ir.Model`) in place: the replacements are its hits."""
    assert isinstance(rule, OnnxRewriteRule)
    from onnxscript.rewriter import pattern

    before = {id(node) for node in model.graph.all_nodes()}
    built = rule.rewrite_rule()
    # A factory returns one rewriter rule, or a RewriteRuleSet (e.g. with `commute=True` for patterns of
    # commutative ops, whose operand order torch.onnx does not fix).
    rule_set = built if isinstance(built, pattern.RewriteRuleSet) else pattern.RewriteRuleSet([built])
    count = rule_set.apply_to_model(model)
    declined: Counter[str] = Counter()
    if explaining():
        # With a tracer onnxscript's rewriter only matches (changes nothing): a second, dry pass over the
        # rewritten model reports why the rule's checks refused the sites it left alone.
        rule_set.apply_to_model(model, tracer=_decline_tracer(rule.id, declined))
    if count:
        for node in model.graph.all_nodes():
            if id(node) not in before:
                node.metadata_props[RULE_ID_KEY] = rule.id
    return Applied(count, declined)


def _decline_tracer(rule_id: str, declined: Counter[str]) -> Any:
    """An onnxscript matching tracer that counts in `declined` the reason of each match the rule's checks refused.

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
                declined[clean_reason(reason or status.name.lower().replace("_", " "))] += 1

    return DeclineTracer()
