"""`AOTInductorExporter`: the captured program compiled by AOTInductor into a `.pt2` package (`AOTInductorPackage`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.backends.aoti.config import AOTInductorConfig
from hfexport.backends.dynamo.exporter import DynamoExporter
from hfexport.configs import ExportConfigMixin
from hfexport.core.files import save_atomically
from hfexport.exporters.pipeline import Lowering, functionalized


class AOTInductorLowering(Lowering):
    def check(self, config: ExportConfigMixin) -> None:
        from hfexport.backends.aoti.lowering import check_compiler

        check_compiler()  # before tracing: without a C++ compiler the compile would fail after the trace

    def lower(
        self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any, weights: Any
    ) -> Any:
        from hfexport.backends.aoti.lowering import compile_package

        assert isinstance(config, AOTInductorConfig)
        # In-place writes as USER_INPUT_MUTATION (the Dynamo form): the package then writes into the caller's tensors.
        return compile_package(functionalized(program, context), config.inductor_configs, context)

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        return {"package": f"{result.path.stat().st_size / 1e6:.1f} MB of compiled C++ kernels and weights (CPU)"}

    def save(self, result: Any, config: ExportConfigMixin) -> None:
        assert isinstance(config, AOTInductorConfig)
        save_atomically(Path(config.output_path), lambda path: shutil.copyfile(result.path, path))


class AOTInductorExporter(DynamoExporter):
    """Export to an AOTInductor package (`AOTInductorPackage`: callable on forward kwargs, `.save("model.pt2")`,
    loadable with `torch._inductor.aoti_load_package` or torch's C++ runtime)."""

    export_format: ClassVar[str] = "aoti"
    config_class: ClassVar[type[ExportConfigMixin]] = AOTInductorConfig
    lowering: ClassVar[Lowering] = AOTInductorLowering()
