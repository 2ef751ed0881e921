"""`HfExporter`, the base of every exporter: environment and config checks, the export lock, reports.

The export of generation components is `hfexport.exporters.generation`."""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from hfexport.configs import ExportConfigMixin
from hfexport.core.errors import ConfigError, HfExportError, InputError, MissingPackageError
from hfexport.core.versions import check_packages
from hfexport.exporters.preflight import check_generation_call
from hfexport.report import ExportReport

logger = logging.getLogger("hfexport")


# One export at a time per process (docs/reliability.md, "Concurrency"). torch.export itself is not
# thread-safe: it sets process-wide flags (torch.compiler.is_exporting), registers pytree nodes and patches
# dispatch tables while it traces, and the export switches the model's own state (eval mode, attention
# implementation) for the trace. Exports in other threads wait here; an eager forward in another thread does
# not wait and never sees a patch (patches are bound per instance and thread, or dispatch on a ContextVar).
# Reentrant: export_for_generation holds it across its components' exports.
EXPORT_LOCK = threading.RLock()


def _dynamo_compile_lock() -> AbstractContextManager[Any]:
    """TorchDynamo's lock around compiling a frame (torch==2.13.0 torch/_dynamo/convert_frame.py `compile_lock`).

    A torch.compile in another thread traces with the same process-wide torch.fx state as torch.export (the
    patched `Module.__call__`, `preserve_node_meta`, the proxy-mode stack): run together, either one fails
    ("Trying to pop empty mode stack", "ProxyTorchDispatchMode slot already occupied", KeyError 'custom', ...).
    Holding this lock makes such a compile wait for the export, and the export wait for a compile in progress. A
    torch without it: exports are still serialised among themselves (tests/test_reliability_concurrency.py checks
    that it is there).
    """
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:  # pragma: no cover - present in every supported torch
        return contextlib.nullcontext()
    return compile_lock


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold `EXPORT_LOCK` and TorchDynamo's compile lock, in that order: what every export runs under.

    Code in other threads that must not overlap an export (a compiled model's call, a forward that reads
    `torch.compiler.is_exporting()`) can take `EXPORT_LOCK` itself; see docs/reliability.md, "Concurrency".
    """
    with EXPORT_LOCK, _dynamo_compile_lock():
        yield


# Raised as they are: they say what to fix in the call, and are raised before the model is touched.
_API_ERRORS = (InputError, ConfigError, MissingPackageError, HfExportError)


class HfExporter(ABC):
    """Base of every exporter: environment checks, config checks, the export report.

    Subclasses set `export_format`, `config_class`, the package attributes, and implement `export`.
    """

    export_format: ClassVar[str] = ""
    config_class: ClassVar[type[ExportConfigMixin]] = ExportConfigMixin
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    min_versions: ClassVar[dict[str, str]] = {"torch": "2.9.0", "transformers": "5.0.0"}
    tested_versions: ClassVar[dict[str, str]] = {"torch": "2.13.0", "transformers": "5.24.0"}

    def __init__(self) -> None:
        self.report: ExportReport | None = None
        # Each component's report of the last `export_for_generation`.
        self.reports: dict[str, ExportReport] = {}

    def validate_environment(self) -> dict[str, str]:
        """Raise `MissingPackageError` for missing/too-old packages; warn once on drift from tested."""
        return check_packages(self.required_packages, self.min_versions, self.tested_versions, who=type(self).__name__)

    def check_config(self, config: ExportConfigMixin | None) -> ExportConfigMixin:
        if config is None:
            return self.config_class()
        # The config classes subclass DynamoConfig: an OnnxConfig is a DynamoConfig, but its ONNX options would be
        # silently ignored by the DynamoExporter, so the format must match too.
        if not isinstance(config, self.config_class) or str(config.export_format) != str(self.export_format):
            raise ConfigError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "AutoHfExporter.from_config(config) picks the exporter that fits a config"
            )
        return config

    @abstractmethod
    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        """Export `model`, traced on `sample_inputs` (its forward kwargs); return the backend's native object."""

    def export_for_generation(
        self,
        model: torch.nn.Module,
        generate_kwargs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None = None,
        *,
        generation_config: Any = None,
        multi_token_decode: bool = False,
        runtime_components: bool = True,
    ) -> dict[str, Any]:
        """Export the components of `decompose_for_generation`: `{name: native object}`, the documented ones.

        `config` is one config for all components or a dict keyed by component name that names every
        documented one. The programs `hfexport.runtime.generate` runs beyond those (a multimodal model's
        `<modality>_features` and `prefill`) are exported too and kept on `.runtime_components`, each with the
        config of the documented component it derives from (`runtime_config_source`); `runtime_components=False`
        leaves them out (the result then holds what the caller's own loop runs, and `generate` refuses it).
        `self.reports` holds each component's report (`self.report` is the last one's).
        """
        if isinstance(config, Mapping):
            for each in config.values():
                self.check_config(each)
        else:
            self.check_config(config)
        check_generation_call(model, generate_kwargs, generation_config)
        self.validate_environment()
        from hfexport.exporters.generation import export_components

        with exclusive():
            return export_components(
                self, model, generate_kwargs, config, generation_config, multi_token_decode, runtime_components
            )
