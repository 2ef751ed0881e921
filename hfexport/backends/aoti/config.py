"""`AOTInductorConfig`: the options of the AOTInductor compile."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from hfexport.backends.dynamo.config import DynamoConfig
from hfexport.core.errors import ConfigError


@dataclass
class AOTInductorConfig(DynamoConfig):
    """Options of the AOTInductor compile, on top of the capture options of `DynamoConfig`.

    output_path: where to save the compiled package (`.pt2`); None keeps it in a temporary file that the returned
        `AOTInductorPackage` owns (removed with it; `hfexport.save` copies it into an artifact).
    inductor_configs: `torch._inductor.config` settings for this compile (`aoti_compile_and_package`'s
        `inductor_configs`, e.g. `{"aot_inductor.compile_wrapper_opt_level": "O0"}`), plain JSON values.
    """

    export_format: ClassVar[str] = "aoti"

    output_path: str | None = None
    inductor_configs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.output_path is not None:
            self.output_path = str(self.output_path)
            if not self.output_path.endswith(".pt2"):
                raise ConfigError(f"output_path must name the package's .pt2 file, got {self.output_path!r}")
        if self.inductor_configs is not None:
            if not isinstance(self.inductor_configs, dict) or not all(
                isinstance(k, str) for k in self.inductor_configs
            ):
                raise ConfigError("inductor_configs takes a dict of torch._inductor.config names to values")
            try:
                json.dumps(self.inductor_configs)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"inductor_configs must be plain JSON values (the config round-trips): {exc}"
                ) from None
