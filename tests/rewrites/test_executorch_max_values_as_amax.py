"""executorch/max-values-as-amax: without the rule its first example fails to lower (the rule's examples, run in
tests/rewrites/test_examples.py, show that with it the program matches eager)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")


@pytest.mark.slow  # a lowering of its own; the rule's examples (default tier) run the fixed program
def test_the_max_values_example_fails_to_lower_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.rewrites.rules.executorch.max_values_as_amax import max_values_as_amax as rule

    module, inputs = rule.meta.examples[0].build()
    shapes = {"logits": {0: torch.export.Dim.AUTO(max=8), 2: torch.export.Dim.AUTO(max=32)}}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    # XNNPACK's partitioner took max(dim=-1).values; its amax visitor only writes dim 2 or 3 as spelled.
    with pytest.raises(Exception, match=r"amax\.default only supports dim == 2 or dim == 3"):
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


@pytest.mark.slow  # a lowering of its own
def test_without_the_rule_xnnpack_computes_the_form_it_writes_wrongly() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from hfexport.rewrites.rules.executorch.max_values_as_amax import _built

    module, inputs = _built(dim=3)
    program = torch.export.export(module.eval(), (), inputs)
    manager = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    method = Runtime.get().load_program(manager.buffer).load_method("forward")
    (actual,) = method.execute([inputs["logits"]])
    expected = module(**inputs)
    # max(dim=3, keepdim=True) lowered as XNNPACK's NHWC max pooling: the row maxima are wrong.
    assert (actual - expected).abs().max() > 0.1
