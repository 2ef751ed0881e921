"""`HfExporter`, the base of every exporter: environment and config checks, generation components, reports."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from hfexport.configs import ExportConfigMixin
from hfexport.errors import ConfigError, HfExportError, InputError, MissingPackageError
from hfexport.exporters.preflight import check_generation_call
from hfexport.report import ExportReport
from hfexport.versions import check_packages

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
        with exclusive():
            return self._export_components(
                model, generate_kwargs, config, generation_config, multi_token_decode, runtime_components
            )

    def _export_components(
        self,
        model: torch.nn.Module,
        generate_kwargs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None,
        generation_config: Any,
        multi_token_decode: bool,
        runtime_components: bool = True,
    ) -> dict[str, Any]:
        from hfexport.frontends.generation import (
            GenerationComponents,
            decompose_for_generation,
            describe,
            runtime_configs,
            split_config,
        )

        # The decode step's rule selection also decides the patches that run while generate is recorded.
        decode_config = config.get("decode") if isinstance(config, Mapping) else config
        decomposition = decompose_for_generation(
            model,
            generate_kwargs,
            generation_config=generation_config,
            multi_token_decode=multi_token_decode,
            rules=getattr(decode_config, "rules", None),
        )
        documented = list(decomposition)
        extra = list(decomposition.runtime)
        configs = split_config(config, documented)
        if runtime_components:
            configs.update(runtime_configs(configs, extra, per_component=isinstance(config, Mapping)))
        components = decomposition.all() if runtime_components else dict(decomposition)
        configs = self._calibrate_components(model, config, configs, generation_config, multi_token_decode)
        layouts = {name: layout for name, layout in decomposition.layouts.items() if name in components}
        results = GenerationComponents()
        results.spec = describe(components, generation_config, model, multi_token_decode, generate_kwargs)
        results.spec.runtime_components = extra
        for name, layout in layouts.items():
            results.spec.components[name].layout = layout
        results.samples = {name: kwargs for name, (_, kwargs) in components.items()}
        results.runtime_components = {}
        self.reports: dict[str, ExportReport] = {}
        shared = _prefill_shares_decode(components, configs, results.spec)
        for name, (submodule, kwargs) in components.items():
            if name == shared:
                continue  # exported below, once "decode" is
            logger.info("exporting component %s (%s)", name, type(submodule).__name__)
            self.report = None
            held = results.runtime_components if name in extra else results
            try:
                held[name] = self.export(submodule, kwargs, configs[name])
            except Exception as exc:
                raise HfExportError(
                    f"{type(exc).__name__}: {exc}",
                    stage=getattr(exc, "stage", "export"),
                    rule_id=getattr(exc, "rule_id", None),
                    model=f"component {name!r} ({type(submodule).__name__}, inputs {sorted(kwargs)})",
                ) from exc
            finally:
                if self.report is not None:
                    self.report.component = name
                    self.reports[name] = self.report
        if shared is not None:
            order = list(results)
            results[shared] = results["decode"]
            # The documented order (prefill before decode), as the components were recorded.
            for name in [n for n in components if n in order]:
                results[name] = results.pop(name)
            if "decode" in self.reports:
                decode_report = self.reports["decode"]
                self.reports[shared] = dataclasses.replace(
                    decode_report,
                    component=shared,
                    notes=[*decode_report.notes, SHARED_PREFILL_NOTE],
                    rules=list(decode_report.rules),
                    stage_seconds={},
                    total_seconds=0.0,
                )
        return results

    def _calibrate_components(
        self,
        model: torch.nn.Module,
        config: Any,
        configs: dict[str, Any],
        generation_config: Any,
        multi_token_decode: bool,
    ) -> dict[str, Any]:
        """Per-component quantizer calibration: a single config's dataset holds generate kwargs, and each component
        calibrates on the forward kwargs recorded for it (a `{component: config}` dict is used as it is)."""
        from hfexport.exporters.preflight import quantizer_defaults
        from hfexport.quantizers.apply import check_quantizer
        from hfexport.quantizers.generation import calibrate_components

        # Every component's quantizer is checked before the first component is traced, on the config each
        # component's export will use (an unset ONNX opset filled in as its preflight does).
        for each in configs.values():
            if getattr(each, "quantizer", None) is not None:
                check_quantizer(each.quantizer, self.export_format, quantizer_defaults(each.quantizer, each)[0])
        return calibrate_components(
            model, config, configs, generation_config=generation_config, multi_token_decode=multi_token_decode
        )


SHARED_PREFILL_NOTE = (
    "prefill shares the decode program: with a static cache and multi_token_decode the decode graph takes the "
    "whole prompt on an empty cache (what hfexport.runtime.generate runs), and the prefill call traces to the "
    "same graph"
)


def _prefill_shares_decode(components: Mapping[str, Any], configs: Mapping[str, Any], spec: Any) -> str | None:
    """`"prefill"` when its program would be the decode program, exported a second time; else None.

    With a static cache and `multi_token_decode`, `generate` runs the prompt through the decode graph and never
    calls prefill. The prefill call is the decode call with a longer query on an empty cache: when both are
    exported with every axis dynamic (`dynamic=True`, no explicit `dynamic_shapes`), under equal configs, from
    the same module with inputs of one structure (`same_graph`), the two traces give one graph, so the decode
    program is returned for both and the export takes half the time (issue #19, goal 5)."""
    from hfexport.frontends.calls import same_graph

    if "prefill" not in components or "decode" not in components:
        return None
    if not (getattr(spec, "static_cache", False) and getattr(spec, "multi_token_decode", False)):
        return None
    config = configs.get("decode")
    if config is None or configs.get("prefill") != config:
        return None
    if not getattr(config, "dynamic", False) or getattr(config, "dynamic_shapes", None) is not None:
        return None
    if getattr(config, "quantizer", None) is not None:
        return None  # calibrated per component: the components' calibration data differ
    return "prefill" if same_graph(components["prefill"], components["decode"]) else None
