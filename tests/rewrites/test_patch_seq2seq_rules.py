"""patch/longt5-pad-blocks, patch/nllb-moe-*, patch/moonshine-conv-lengths: without the rule, the rule's first
example does not export, or its program refuses the example's second input (the rule's examples, run in
tests/rewrites/test_examples.py, show that with it the program matches eager on both)."""

from __future__ import annotations

import pytest
import torch

from hfexport.testing.harness import export_program as _export


def _first_example_without_rule(rule) -> None:
    example = rule.meta.examples[0]
    module, inputs = example.build()
    with torch.no_grad():
        program = _export(module.eval(), inputs, dynamic=example.other_inputs is not None)
        if example.other_inputs is not None:
            program.module()(**example.other_inputs())


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("longt5_pad_blocks", r"Guard failed"),
        ("nllb_moe_router_cast", r"Couldn't swap"),
        ("nllb_moe_dense_experts", r"data-dependent|Could not guard|GuardOnDataDependent"),
        ("moonshine_conv_lengths", r"Guard failed|[Cc]onstraint|specializ"),
    ],
)
def test_the_first_example_fails_without_its_rule(name: str, error: str) -> None:
    import importlib

    rule = getattr(importlib.import_module(f"hfexport.rewrites.rules.patch.{name}"), name)
    with pytest.raises(Exception, match=error):
        _first_example_without_rule(rule)


def test_the_rules_are_registered() -> None:
    from hfexport.rewrites.rules.patch import RULES

    ids = {rule.meta.id for rule in RULES}
    assert {
        "patch/longt5-pad-blocks",
        "patch/nllb-moe-router-cast",
        "patch/nllb-moe-dense-experts",
        "patch/moonshine-conv-lengths",
    } <= ids
