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
        ("nllb_moe_routed_experts", r"data-dependent|Could not guard|GuardOnDataDependent"),
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
        "patch/nllb-moe-routed-experts",
        "patch/moonshine-conv-lengths",
    } <= ids


def test_nllb_moe_experts_run_on_their_routed_tokens_only() -> None:
    """The routed form runs each expert on the tokens routed to it (not every expert on every token) and still
    equals the original, with a capacity that leaves tokens without an expert."""
    from hfexport.rewrites.rules.patch._nllb_moe import experts_example, routed_experts

    module, inputs = experts_example(0.0, capacity_drop=True)
    experts = module.experts
    rows: dict[int, int] = {}
    hooks = [
        experts[f"expert_{e}"].register_forward_hook(lambda m, args, out, e=e: rows.__setitem__(e, args[0].shape[0]))
        for e in range(experts.num_experts)
    ]
    with torch.no_grad():
        want = experts(**inputs)
        rows.clear()
        got = routed_experts(None, experts, **inputs)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(got, want)
    routed = [int((inputs["router_mask"] == e).any(-1).sum()) for e in range(experts.num_experts)]
    assert [rows[e] for e in range(experts.num_experts)] == routed
    tokens = inputs["hidden_states"].shape[0]
    assert 0 < sum(routed) < experts.num_experts * tokens
