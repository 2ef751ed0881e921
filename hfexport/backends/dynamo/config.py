"""`DynamoConfig`: the capture options every backend's config starts from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hfexport.configs import ExportConfigMixin
from hfexport.core.errors import ConfigError
from hfexport.rewrites.rule import RuleSelection


@dataclass
class DynamoConfig(ExportConfigMixin):
    """Capture options shared by every backend.

    dynamic: mark every axis of every input (and cache) `Dim.AUTO` when `dynamic_shapes` is not given.
    dynamic_shapes: passed to `torch.export.export` untouched (keys must be sample input names).
    strict: trace with TorchDynamo (`strict=True`) instead of the default Python-level tracer.
    prefer_deferred_runtime_asserts_over_guards: emit runtime asserts instead of failing on guards that
        do not hold over a whole explicit `Dim(min, max)` range.
    rules: which rewrite rules run (`RuleSelection(enable=..., disable=...)` by id or prefix).
    """

    export_format: ClassVar[str] = "dynamo"

    dynamic: bool = False
    dynamic_shapes: dict[str, Any] | None = None
    strict: bool = False
    prefer_deferred_runtime_asserts_over_guards: bool = False
    rules: RuleSelection = field(default_factory=RuleSelection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rules, dict):
            self.rules = RuleSelection(**self.rules)
        if not isinstance(self.rules, RuleSelection):
            raise ConfigError(f"rules must be a RuleSelection, got {type(self.rules).__name__}")
