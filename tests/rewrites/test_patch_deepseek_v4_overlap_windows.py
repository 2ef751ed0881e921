"""patch/deepseek-v4-overlap-windows: without the rule its first example's program is bounded by the sample's
window count (8 to 11 tokens); the rule's examples, run in tests/rewrites/test_examples.py, show that with it the
program matches eager on a longer input. Eagerly the patched compressor gives the original's values bit for
bit, with and without a cache."""

from __future__ import annotations

import pytest
import torch

from hfexport.rewrites.rules.patch.deepseek_v4_overlap_windows import deepseek_v4_overlap_windows as rule
from hfexport.testing.harness import export_program as _export
from tests.rewrites.patch_checks import assert_patch_keeps_values


@pytest.mark.slow
def test_the_first_example_is_bounded_by_the_sample_without_the_rule() -> None:
    example = rule.meta.examples[0]
    module, inputs = example.build()
    with torch.no_grad():
        program = _export(module.eval(), inputs, dynamic=True)
        with pytest.raises(Exception, match=r"Guard failed: input_ids.size\(\)\[1\] <= 11"):
            program.module()(**example.other_inputs())


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_patched_compressor_changes_no_value_in_eager(use_cache: bool) -> None:
    module, _ = rule.meta.examples[0].build()
    for length in (3, 4, 6, 8, 13):
        ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(length))
        feed = {"input_ids": ids, "use_cache": use_cache}
        assert_patch_keeps_values(rule, module, feed)
