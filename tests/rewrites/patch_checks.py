"""A check shared by patch-rule tests: eagerly, the patched module gives the original's outputs bit for bit."""

from __future__ import annotations

from typing import Any

import torch


def assert_patch_keeps_values(rule: Any, module: torch.nn.Module, feed: dict[str, Any]) -> None:
    """`module(**feed).last_hidden_state` with `rule` installed equals it without, exactly; the rule fires once."""
    from hfexport.rewrites.engine import RewriteContext
    from hfexport.rewrites.kinds.patch import PatchSession

    with torch.no_grad():
        expected = module(**feed).last_hidden_state
    context = RewriteContext(backend="dynamo")
    with PatchSession(context.hit) as session:
        assert session.install(rule, module) is None
        with session.active(), torch.no_grad():
            actual = module(**feed).last_hidden_state
    assert context.hits[rule.id] == 1
    torch.testing.assert_close(actual, expected, atol=0.0, rtol=0.0)
