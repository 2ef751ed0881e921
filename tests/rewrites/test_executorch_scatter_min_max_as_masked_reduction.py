"""executorch/scatter-min-max-as-masked-reduction: without the rule its first example lowers but does not load (no
scatter_reduce kernel in the runtime); the rule's examples (tests/rewrites/test_examples.py) show the program
matching eager with it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")


@pytest.mark.slow  # a lowering of its own; the rule's examples (default tier) run the fixed program
def test_the_segment_min_example_does_not_load_without_its_rule() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.rewrites.rules.executorch.scatter_min_max_as_masked_reduction import (
        scatter_min_max_as_masked_reduction as rule,
    )
    from hfexport.runtime.executorch import ExecutorchProgram

    module, inputs = rule.meta.examples[0].build()
    dims = {0: torch.export.Dim.AUTO(max=8), 1: torch.export.Dim.AUTO(max=32)}
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes={"values": dims, "index": dims})
    manager = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    # The portable kernels have scatter and scatter_add but no scatter_reduce: OperatorMissing (0x14) at load.
    with pytest.raises(RuntimeError, match=r"0x:?14"):
        ExecutorchProgram(manager).run(inputs)
