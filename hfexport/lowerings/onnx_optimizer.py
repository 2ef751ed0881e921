"""The `optimize` stage of the ONNX lowering: onnxscript's optimizer, without its one quadratic pattern.

`onnxscript.optimizer.optimize` folds constants, applies its default rewrite rules and cleans up, twice. One of
those rules, `SlicesSplit` (two `Slice`s of the same input into one `Split`), has two output nodes; onnxscript's
matcher tries it on every pair of `Slice` nodes of the graph, so its cost grows with the square of the layer count:
on a 30-layer SmolLM2-shaped Llama it took 10.4 of the 12.8 s of a rewrite pass (two passes: ~20 of the optimizer's
22 s) and replaced nothing. torch.onnx writes the second half of a split as `Slice(x, d/2, INT64_MAX)`, which the
rule's check refuses (it wants `end == d`), so it does not fire on exported PyTorch graphs; a pair it would have
fused stays two `Slice`s, which compute the same values.

`optimize` runs the same passes in the same order with the same limits as `onnxscript.optimizer.optimize`
(onnxscript 0.7), every default rule but the multi-output ones.
"""

from __future__ import annotations

from typing import Any

#: The optimizer's loop count and early stop, as `onnxscript.optimizer.optimize` has them.
ITERATIONS = 2


def rewrite_rules() -> tuple[Any, ...]:
    """onnxscript's default rewrite rules whose pattern ends in a single node (matched once per node, not per pair
    or tuple of nodes)."""
    from onnxscript import rewriter

    defaults = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if defaults is None:  # an onnxscript without the list: `optimize` falls back to onnxscript's own optimizer
        return ()
    return tuple(rule for rule in defaults if _single_output(rule))


def _single_output(rule: Any) -> bool:
    pattern = getattr(rule, "_target_pattern", None)
    return bool(getattr(pattern, "has_single_output_node", True))


def optimize(model: Any) -> Any:
    """Optimize the `onnx_ir.Model` `model` in place (and return it) as onnxscript's optimizer does, without the
    rules whose matching is quadratic in the graph's size (`rewrite_rules`)."""
    import onnx_ir.passes.common as common
    import onnxscript.optimizer
    from onnxscript.rewriter import RewritePass

    rules = rewrite_rules()
    if not rules:
        return onnxscript.optimizer.optimize(model)
    common.InlinePass()(model)
    rewrite = RewritePass(list(rules))
    for _ in range(ITERATIONS):
        folded = onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True).modified
        rewritten = rewrite(model).modified
        cleaned = [
            step()(model).modified
            for step in (common.RemoveUnusedNodesPass, common.RemoveUnusedFunctionsPass, common.RemoveUnusedOpsetsPass)
        ]
        if not (folded or rewritten or any(cleaned)):
            break
    common.RemoveUnusedNodesPass()(model)
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common.LiftSubgraphInitializersToMainGraphPass()(model)
    common.DeduplicateInitializersPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.OutputFixPass()(model)
    common.NameFixPass()(model)
    return model
