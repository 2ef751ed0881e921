"""Explicit registration: each stage package exposes `RULES`, an ordered list; this module loads them.

Order matters within a stage (a later rule sees what an earlier one produced) and is reviewed in diffs.
Adding a stage means adding its package here.
"""

from __future__ import annotations

import importlib

from hfexport.rewrites.engine import RuleRegistry

STAGE_PACKAGES: dict[str, str] = {
    "patch": "hfexport.rewrites.rules.patch",
    "fx": "hfexport.rewrites.rules.fx",
    "aten": "hfexport.rewrites.rules.aten",
    "onnx": "hfexport.rewrites.rules.onnx",
    "executorch": "hfexport.rewrites.rules.executorch",
    "openvino": "hfexport.rewrites.rules.openvino",
}


def build_registry() -> RuleRegistry:
    registry = RuleRegistry()
    for stage, package in STAGE_PACKAGES.items():
        for rule in importlib.import_module(package).RULES:
            if rule.stage != stage:
                raise ValueError(f"{package} lists {rule.id}, which belongs to stage {rule.stage!r}")
            registry.register(rule)
    registry.check_requirements()
    return registry
