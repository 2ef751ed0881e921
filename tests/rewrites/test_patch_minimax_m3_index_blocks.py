"""patch/minimax-m3-index-blocks: without the rule its first example's program refuses a longer input (the
sequence is bounded by the sample's one key block); the rule's examples, run in tests/rewrites/test_examples.py,
show that with it the program matches eager on both lengths."""

from __future__ import annotations

import pytest
import torch

from hfexport.rewrites.rules.patch.minimax_m3_index_blocks import minimax_m3_index_blocks as rule
from hfexport.testing.harness import export_program as _export
from tests.rewrites.patch_checks import assert_patch_keeps_values


def test_the_first_example_is_bounded_by_the_sample_without_the_rule() -> None:
    example = rule.meta.examples[0]
    module, inputs = example.build()
    with torch.no_grad():
        program = _export(module.eval(), inputs, dynamic=True)
        with pytest.raises(Exception, match=r"Guard failed: input_ids.size\(\)\[1\] <= 4"):
            program.module()(**example.other_inputs())


def test_the_extra_block_changes_no_output_in_eager() -> None:
    # Eagerly (no export) the patched attention gives the original's outputs bit for bit, at lengths that are
    # and are not whole blocks, with and without left padding.
    module, _ = rule.meta.examples[0].build()
    for length in (3, 4, 8, 13):
        ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        feed = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
        assert_patch_keeps_values(rule, module, feed)
