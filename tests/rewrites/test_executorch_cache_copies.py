"""What a cached grouped-query attention copies outside XNNPACK on ExecuTorch, with and without the copy rules.

`executorch/grouped-sdpa-without-repeat-kv` and `executorch/drop-identity-copies` exist to take whole-cache copies
out of a decode step; their examples (tests/rewrites/test_examples.py) prove the numbers, and this proves the
copies are gone: the lowered program's portable ops are counted with the rules off and on.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

pytest.importorskip("executorch")

from hfexport import ExecutorchConfig, RuleSelection
from hfexport.lowerings.executorch import lower
from hfexport.rewrites.engine import RewriteContext
from hfexport.rewrites.rules.executorch.grouped_sdpa_without_repeat_kv import grouped_sdpa_without_repeat_kv as gqa
from hfexport.runtime.executorch import ExecutorchProgram

RULES = ("executorch/grouped-sdpa-without-repeat-kv", "executorch/drop-identity-copies")


def _lowered(selection: RuleSelection) -> tuple[Counter[str], ExecutorchProgram, dict[str, int]]:
    module, inputs = gqa.meta.examples[0].build()
    shapes = {
        "x": {0: torch.export.Dim.AUTO(max=4), 1: torch.export.Dim.AUTO(max=16)},
        "past": {0: torch.export.Dim.AUTO(max=4), 2: torch.export.Dim.AUTO(max=16)},
        "keep": {0: torch.export.Dim.AUTO(max=4), 1: torch.export.Dim.AUTO(max=32)},
    }
    program = torch.export.export(module.eval(), (), inputs, dynamic_shapes=shapes)
    context = RewriteContext(backend="executorch", selection=selection)
    manager = lower(program, ExecutorchConfig(), context)
    # Ops outside the delegate run as portable kernels, named like `aten.expand_copy.out`.
    names = (re.match(r"aten\.(\w+)\.", str(node.target)) for node in manager.exported_program().graph.nodes)
    portable = Counter(name[1] for name in names if name)
    return portable, ExecutorchProgram(manager), dict(context.hits)


@pytest.mark.slow
def test_the_cache_is_no_longer_copied_outside_the_delegate() -> None:
    before, _, hits_before = _lowered(RuleSelection(disable=RULES))
    after, program, hits = _lowered(RuleSelection())
    # Without the rules: repeat_kv's expand of keys and values, the matmuls' same-shape expands, the full slices.
    assert before["expand_copy"] >= 4 and before["slice_copy"] >= 1 and before["mul"] >= 1, before
    assert all(rule not in hits_before for rule in RULES)
    assert hits[RULES[0]] == 1 and hits[RULES[1]] >= 1, hits
    # With them the one expand left is the small mask's, tiled over the query groups; no slice copies the cache.
    # The keys are no longer scaled by sqrt(scale) outside the delegate either: the query takes the whole scale.
    assert after["expand_copy"] == 1 and after["slice_copy"] == 0 and after["mul"] == 0, after
    module, inputs = gqa.meta.examples[0].build()
    other = gqa.meta.examples[0].other_inputs()
    for feed in (inputs, other):
        expected = module(**feed)
        (actual,) = program.run(feed)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
