"""executorch/integer-sort-as-topk: without the rule its first example lowers but does not load (no sort kernel in
the runtime); the rule's examples (tests/rewrites/test_examples.py) show the program matching eager with it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")


@pytest.mark.slow  # a lowering of its own; the rule's examples (default tier) run the fixed program
def test_the_sort_example_does_not_load_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.rewrites.rules.executorch.integer_sort_as_topk import integer_sort_as_topk as rule
    from hfexport.runtime.executorch import ExecutorchProgram

    module, inputs = rule.meta.examples[0].build()
    shapes = {"ids": {0: torch.export.Dim.AUTO(max=64)}, "x": {0: torch.export.Dim.AUTO(max=64)}}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    manager = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    # The portable kernels have topk but no sort: loading the method fails with OperatorMissing (0x14).
    with pytest.raises(RuntimeError, match=r"0x:?14"):
        ExecutorchProgram(manager).run(inputs)
