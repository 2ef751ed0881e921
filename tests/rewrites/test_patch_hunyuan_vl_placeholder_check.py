"""patch/hunyuan-vl-placeholder-check: without the rule its example does not export (its examples, run in
tests/rewrites/test_examples.py, show that with it the graph matches eager)."""

from __future__ import annotations

import pytest
import torch


def test_the_placeholder_check_example_does_not_export_without_its_rule() -> None:
    from hfexport.rewrites.rules.patch.hunyuan_vl_placeholder_check import hunyuan_vl_placeholder_check as rule

    module, inputs = rule.meta.examples[0].build()
    with pytest.raises(Exception, match=r"data-dependent"):
        torch.export.export(module, (), inputs, strict=False)
