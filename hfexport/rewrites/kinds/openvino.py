"""Rule kinds of the OpenVINO lowering (stage `openvino`) and its applier.

The stage runs twice per export, on two targets:

- before conversion, on the captured `ExportedProgram`: `OpenVINOFxNodeRule`, the
  FX rule forms of `graph.py` (single node, or `pattern` / `replacement`) for graph shapes that
  `openvino.convert_model` mistranslates or refuses. They are FX rules that run only in this lowering, so
  the program other backends see is never touched.
- after conversion, on the `openvino.Model`: `OpenVINOModelRule`, a function that fixes the converted model
  in place and returns how many sites it changed.

Examples are checked by `hfexport.testing.harness`, through `OpenVINOExporter` and OpenVINO CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.rewrites.kinds.fx import FxNodeRule, apply_fx_rule
from hfexport.rewrites.rule import Rule


@dataclass
class OpenVINOFxNodeRule(FxNodeRule):
    """A single-node FX fix applied to the program just before `openvino.convert_model`."""

    stage: str = field(init=False, default="openvino")


@dataclass
class OpenVINOModelRule(Rule):
    """A fix of the converted `openvino.Model`: `transform(model)` edits it in place, returns the sites changed."""

    transform: Callable[[Any], int] | None = None
    stage: str = field(init=False, default="openvino")


PROGRAM_RULES = (OpenVINOFxNodeRule,)


def apply_openvino_rule(rule: Rule, target: Any) -> int:
    """Apply one rule to its target (an `ExportedProgram` or a `GraphModule`, or an `openvino.Model`)."""
    if isinstance(rule, PROGRAM_RULES):
        gm = target.graph_module if hasattr(target, "graph_module") else target
        if not isinstance(gm, torch.fx.GraphModule):
            return 0
        return apply_fx_rule(rule, gm)
    if isinstance(rule, OpenVINOModelRule):
        if isinstance(target, (torch.export.ExportedProgram, torch.fx.GraphModule)):
            return 0
        return rule.transform(target)
    raise TypeError(f"not an openvino rule: {rule!r}")
