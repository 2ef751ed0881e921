"""Rule kind of the converted OpenVINO model (stage `openvino`, phase `model`) and its applier.

The stage has two phases, on two targets: phase `program`, on the captured `ExportedProgram` before
`openvino.convert_model` (`NodeRule`s, `kinds/fx.py`, for graph shapes the converter mistranslates or refuses;
they run only in this lowering, so the program other backends see is never touched), and phase `model`, on the
converted `openvino.Model`: `OpenVINOModelRule`, a function that fixes the model in place and returns how many
sites it changed.

Examples are checked by `hfexport.testing.harness`, through `OpenVINOExporter` and OpenVINO CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hfexport.rewrites.rule import Applied, Rule


@dataclass
class OpenVINOModelRule(Rule):
    """A fix of the converted `openvino.Model`: `transform(model)` edits it in place, returns the sites changed."""

    transform: Callable[[Any], int] | None = None
    stages: ClassVar[tuple[str, ...]] = ("openvino",)
    phase: str = field(init=False, default="model")


def apply_model_rule(rule: Rule, model: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Apply an `OpenVINOModelRule` to an `openvino.Model` in place."""
    assert isinstance(rule, OpenVINOModelRule)
    return Applied(rule.transform(model))
