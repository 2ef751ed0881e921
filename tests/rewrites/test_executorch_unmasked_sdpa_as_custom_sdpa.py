"""`executorch/unmasked-sdpa-as-custom-sdpa`: what the rule is for, the memory plan. Its examples (tests/rewrites/
test_examples.py) show the numbers match eager; here the same attention, bounded at 8 x 1024 tokens, is planned
with and without the rule, and the fused program runs a long input in the ExecuTorch runtime."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch")

from hfexport.rewrites.engine import apply_rule
from hfexport.rewrites.rules.executorch.unmasked_sdpa_as_custom_sdpa import (
    _PatchAttention,
    _tokens,
    unmasked_sdpa_as_custom_sdpa,
)
from hfexport.runtime.executorch import ExecutorchProgram

Dim = torch.export.Dim
BATCH, TOKENS, HEADS = 8, 1024, 2


def _planned(rule: bool) -> tuple[int, ExecutorchProgram]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    module = _PatchAttention().eval()
    shapes = {"x": {0: Dim("batch", max=BATCH), 1: Dim("tokens", min=2, max=TOKENS)}}
    program = torch.export.export(module, (), _tokens(2, 7), dynamic_shapes=shapes, strict=False)
    hits = apply_rule(unmasked_sdpa_as_custom_sdpa, program).hits if rule else 0
    assert hits == (1 if rule else 0)
    manager = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    planned = sum(manager.executorch_program.execution_plan[0].non_const_buffer_sizes)
    return planned, ExecutorchProgram(manager)


@pytest.mark.slow
def test_the_fused_attention_plans_no_score_tensor_and_runs_a_long_input() -> None:
    scores = BATCH * HEADS * TOKENS * TOKENS * 4  # one float32 score tensor at the caps: 64 MiB
    without, _ = _planned(rule=False)
    fused, program = _planned(rule=True)
    assert without >= scores, f"the decomposition plans the scores: {without} bytes"
    assert fused < scores // 4, f"custom_sdpa plans inputs and output only: {fused} bytes"
    module = _PatchAttention().eval()
    feed = _tokens(3, TOKENS - 1, seed=3)  # an odd length near the cap
    with torch.no_grad():
        expected = module(**feed)
    actual = program.run({"x": feed["x"]})[0]
    assert (actual - expected).abs().max().item() <= 1e-5
