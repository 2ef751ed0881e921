"""patch/fake-constant-layouts: without the rule a baked multi-image layout is still data-dependent for
torch.export (its examples, run in tests/rewrites/test_examples.py, show that with it the graph matches eager)."""

from __future__ import annotations

import pytest
import torch


def test_the_baked_layout_example_does_not_export_without_its_rule() -> None:
    from hfexport.rewrites.rules.patch.fake_constant_layouts import fake_constant_layouts as rule

    module, inputs = rule.meta.examples[0].build()
    with pytest.raises(Exception, match=r"data-dependent"):
        torch.export.export(module.eval(), (), inputs, strict=False)
