"""ExecuTorch rules: the `executorch` stage's rule kind and checker, and the MoE experts patch end to end.

The registered rules' own examples run in tests/rewrites/test_examples.py; here the MoE patch is also
proven where it matters: without it the ExecuTorch lowering fails, with it the program runs in the
ExecuTorch runtime and matches eager, and the engine counts one hit per experts layer.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")

from hfexport import ExecutorchConfig, ExecutorchExporter, HfExportError, RuleSelection
from hfexport.rewrites.engine import RewriteContext, RuleRegistry, apply, apply_rule
from hfexport.rewrites.examples import ExampleFailure, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._moe_batched import qwen3_moe as _qwen3_moe
from hfexport.runtime.executorch import ExecutorchProgram
from hfexport.testing.harness import check_example

MOE_RULE = "patch/moe-batched-experts"


class Residual(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x - y) * 2


class Product(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * y)


def _pair(module: torch.nn.Module, length: int = 5) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return module, {"x": torch.randn(2, length, generator=generator), "y": torch.randn(2, length, generator=generator)}


def _sub_as_add_of_neg(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    with gm.graph.inserting_before(node):
        negated = gm.graph.call_function(torch.ops.aten.neg.default, (node.args[1],))
        added = gm.graph.call_function(torch.ops.aten.add.Tensor, (node.args[0], negated))
    added.meta = dict(node.meta)
    node.replace_all_uses_with(added)
    gm.graph.erase_node(node)


def _toy_rule(rewrite=_sub_as_add_of_neg) -> NodeRule:
    return NodeRule(
        RuleMeta(
            id="executorch/toy-sub-as-add",
            why="test of the rule kind",
            upstream="hfexport==0 tests",
            backends=("executorch",),
            examples=(
                Match(lambda: _pair(Residual()), "x - y", other_inputs=lambda: _pair(Residual(), 9)[1]),
                NoMatch(lambda: _pair(Product()), "no subtraction"),
            ),
        ),
        predicate=lambda node: node.target is torch.ops.aten.sub.Tensor,
        rewrite=rewrite,
    )


def test_node_rule_examples_run_in_the_executorch_runtime() -> None:
    rule = _toy_rule()
    match, no_match = rule.meta.examples
    assert check_example(rule, match) == 1
    assert check_example(rule, no_match) == 0


def test_a_rule_that_breaks_numerics_fails_its_match_example() -> None:
    def wrong(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        with gm.graph.inserting_before(node):
            added = gm.graph.call_function(torch.ops.aten.add.Tensor, node.args)
        added.meta = dict(node.meta)
        node.replace_all_uses_with(added)
        gm.graph.erase_node(node)

    rule = _toy_rule(wrong)
    with pytest.raises(ExampleFailure, match="differs from eager"):
        check_example(rule, rule.meta.examples[0])


def test_the_engine_counts_executorch_stage_hits() -> None:
    rule = _toy_rule()
    registry = RuleRegistry()
    registry.register(rule)
    module, inputs = _pair(Residual())
    program = torch.export.export(module, (), inputs)
    context = RewriteContext(backend="executorch")
    assert apply("executorch", program, context, registry).hits == {rule.id: 1}
    assert context.outcomes[rule.id].status == "fired" and "executorch" in context.stage_seconds
    other = RewriteContext(backend="onnx")
    assert apply("executorch", program, other, registry).hits == {}
    assert other.outcomes[rule.id].status == "other-backend"


def _moe_inputs(batch: int, tokens: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + tokens)
    return {"input_ids": torch.randint(0, 64, (batch, tokens), generator=generator)}


@pytest.mark.slow
def test_moe_experts_lower_to_xnnpack_only_with_the_batched_experts_patch() -> None:
    model, _ = _qwen3_moe(6)
    inputs = _moe_inputs(2, 6)
    shapes = {name: {0: torch.export.Dim.AUTO(max=4), 1: torch.export.Dim.AUTO(max=32)} for name in inputs}

    without = ExecutorchConfig(dynamic_shapes=shapes, rules=RuleSelection(disable=(MOE_RULE,)))
    # transformers' grouped_mm experts forward: aten.histc for the expert offsets, refused by to_edge.
    with pytest.raises(HfExportError, match=r"(?s)stage 'edge'.*histc"):
        ExecutorchExporter().export(model, inputs, without)

    exporter = ExecutorchExporter()
    manager = exporter.export(model, inputs, ExecutorchConfig(dynamic_shapes=shapes))
    assert exporter.report.hits["patch"][MOE_RULE] == model.config.num_hidden_layers
    program = ExecutorchProgram(manager)
    for feed in (inputs, _moe_inputs(3, 11), _moe_inputs(1, 1)):
        with torch.no_grad():
            expected = model(**feed).last_hidden_state
        actual = program.run(feed)[0]
        assert actual.shape == expected.shape
        assert (actual - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert model.config._experts_implementation == "grouped_mm", "the caller's config is untouched"


def test_the_sdpa_view_example_fails_to_lower_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.rewrites.rules.executorch.sdpa_output_contiguous_before_view import (
        sdpa_output_contiguous_before_view as rule,
    )

    module, inputs = rule.meta.examples[0].build()
    shapes = {"x": {0: torch.export.Dim.AUTO(max=8), 1: torch.export.Dim.AUTO(max=32)}}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    # The view of the attention output was traced against the fused kernel's strides.
    with pytest.raises(Exception, match="Cannot view a tensor"):
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def _lower_example_without_its_rule(rule, shapes: dict) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    module, inputs = rule.meta.examples[0].build()
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def test_the_dynamic_unsqueeze_example_fails_to_lower_without_its_rule() -> None:
    from hfexport.rewrites.rules.executorch.dynamic_trailing_unsqueeze_as_view import (
        dynamic_trailing_unsqueeze_as_view as rule,
    )

    # Batch and length dynamic: the trailing unsqueeze of `stack(..., -1)` has two dynamic axes.
    shapes = {"x": {0: torch.export.Dim.AUTO(max=8), 2: torch.export.Dim.AUTO(max=32)}}
    with pytest.raises(Exception, match="XNNPACK reshape only supports 1 dynamic dimension"):
        _lower_example_without_its_rule(rule, shapes)


def test_the_sym_min_example_fails_to_lower_without_its_rule() -> None:
    from hfexport.rewrites.rules.executorch.sym_size_functions_verifier import sym_size_functions_verifier as rule

    shapes = {"scores": {1: torch.export.Dim.AUTO(max=32)}}
    # The edge verifier asserts that a Python function in the graph is `alloc`: torch.sym_min is not.
    with pytest.raises(AssertionError):
        _lower_example_without_its_rule(rule, shapes)


def test_verifier_exceptions_reach_the_edge_compile_config_only_where_the_program_calls_them() -> None:
    from hfexport.rewrites.kinds.executorch import edge_compile_config
    from hfexport.rewrites.rules.executorch.sym_size_functions_verifier import sym_size_functions_verifier as rule

    module, inputs = rule.meta.examples[0].build()
    dynamic = torch.export.export(module, (), inputs, dynamic_shapes={"scores": {1: torch.export.Dim.AUTO(max=32)}})
    before = dynamic.graph_module.code
    applied = apply_rule(rule, dynamic)
    assert applied.hits == 1
    assert dynamic.graph_module.code == before, "the graph is left as it is"
    config = edge_compile_config(applied.outputs)
    assert config._core_aten_ops_exception_list == [torch.sym_min]
    # A static export folds min(4, 6): nothing to except, the caller's config (None: the default) is kept.
    static = apply_rule(rule, torch.export.export(module, (), inputs))
    assert static.hits == 0
    assert edge_compile_config(static.outputs) is None


def test_the_dynamic_empty_example_is_planned_at_the_sample_shape_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.core.errors import InputError
    from hfexport.rewrites.rules.executorch.dynamic_empty_as_zeros import dynamic_empty_as_zeros as rule

    match = rule.meta.examples[0]
    module, inputs = match.build()
    dims = {0: torch.export.Dim.AUTO(max=8), 2: torch.export.Dim.AUTO(max=32)}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes={"nope": dims, "rot": dims})
    # `_empty_dim_order` takes int sizes: to_edge guards batch and length to the sample's.
    lowered = ExecutorchProgram(
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    )
    with pytest.raises(InputError, match="planned for at most"):
        lowered.run(match.other_inputs())


def test_the_split_example_is_planned_at_the_sample_batch_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.core.errors import InputError
    from hfexport.rewrites.rules.executorch.split_as_slices import split_as_slices as rule

    match = rule.meta.examples[0]
    module, inputs = match.build()
    shapes = {"x": {0: torch.export.Dim.AUTO(max=8), 1: torch.export.Dim.AUTO(max=32)}}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    # The verifier's len() of the first split piece guards the batch axis to the sample's 2.
    lowered = ExecutorchProgram(
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    )
    with pytest.raises(InputError, match="planned for at most 2"):
        lowered.run(match.other_inputs())


def test_the_conv1d_example_fails_to_lower_without_its_rule() -> None:
    from hfexport.rewrites.rules.executorch.dynamic_conv1d_as_conv2d import dynamic_conv1d_as_conv2d as rule

    # Batch and length dynamic: XNNPACK's own unsqueeze of the conv1d input has two dynamic axes.
    shapes = {"x": {0: torch.export.Dim.AUTO(max=8), 1: torch.export.Dim.AUTO(max=32)}}
    with pytest.raises(Exception, match="XNNPACK reshape only supports 1 dynamic dimension"):
        _lower_example_without_its_rule(rule, shapes)


def test_node_rules_see_the_shapes_of_nodes_an_earlier_graph_rule_added() -> None:
    from hfexport.rewrites.kinds.fx import fill_missing_values

    module, inputs = _pair(Residual(), 6)
    program = torch.export.export(module, (), inputs, dynamic_shapes={"x": {1: torch.export.Dim.AUTO}, "y": None})
    gm = program.graph_module
    sub = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sub.Tensor)
    with gm.graph.inserting_after(sub):
        # As fx/complex-to-real adds its nodes: no fake value in meta.
        stacked = gm.graph.call_function(torch.ops.aten.stack.default, ([sub, sub], -1))
    assert "val" not in stacked.meta
    assert fill_missing_values(gm) == 1
    assert stacked.meta["val"].shape[-1] == 2 and stacked.meta["val"].shape[0] == 2


_LENGTH = torch.export.Dim.AUTO(max=32)


def _lowered_targets(rule, hits: int | None) -> list[str]:
    """The call targets of `rule`'s first Match example lowered to XNNPACK, batch 1 and the length dynamic, with the
    rule applied first (asserting `hits`) unless `hits` is None."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    module, inputs = rule.meta.examples[0].build()
    program = torch.export.export(module, (), inputs, dynamic_shapes={"x": {1: _LENGTH}})
    if hits is not None:
        assert apply_rule(rule, program).hits == hits
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return [str(node.target) for node in edge.exported_program().graph.nodes if node.op == "call_function"]


def _hits_with_batch_and_length_dynamic(rule) -> int:
    module, inputs = rule.meta.examples[0].build()
    two_rows = {"x": torch.cat([inputs["x"], inputs["x"]])}
    shapes = {"x": {0: torch.export.Dim.AUTO(max=8), 1: _LENGTH}}
    return apply_rule(rule, torch.export.export(module, (), two_rows, dynamic_shapes=shapes)).hits


def test_views_with_one_dynamic_axis_join_the_xnnpack_partition() -> None:
    from executorch.exir.delegate import executorch_call_delegate

    from hfexport.rewrites.rules.executorch.one_dynamic_axis_view_inferred import (
        one_dynamic_axis_view_inferred as rule,
    )

    delegate = str(executorch_call_delegate)
    # Without the rule both views run outside XNNPACK and cut the work into three partitions.
    assert _lowered_targets(rule, hits=None).count(delegate) == 3
    # The split into heads and the merge back.
    assert _lowered_targets(rule, hits=2).count(delegate) == 1
    # Batch and length both dynamic: two symbolic sizes in each view, which XNNPACK's reshape cannot infer.
    assert _hits_with_batch_and_length_dynamic(rule) == 0


def test_a_last_axis_mean_joins_the_xnnpack_partition() -> None:
    from executorch.exir.delegate import executorch_call_delegate

    from hfexport.rewrites.rules.executorch.last_axis_mean_as_pooling import last_axis_mean_as_pooling as rule

    delegate = str(executorch_call_delegate)
    # Without the rule the mean runs in the portable kernel between two partitions; with it, one partition.
    without = _lowered_targets(rule, hits=None)
    assert sum("mean" in target for target in without) == 1
    assert without.count(delegate) == 2
    assert _lowered_targets(rule, hits=1).count(delegate) == 1
    # Batch and length both dynamic: the views around the pooling would need two inferred sizes.
    assert _hits_with_batch_and_length_dynamic(rule) == 0
