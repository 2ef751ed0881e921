"""Export the components of a generation (`HfExporter.export_for_generation`): decompose, calibrate, export each.

`export_components` records `generate` (`frontends.generation.decompose_for_generation`), gives each component its
config (and its quantizer its calibration data), exports each with the exporter, and exports the prefill once with
the decode program when the two would be the same graph.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.configs import ExportConfigMixin
from hfexport.core.errors import ConfigError, HfExportError, InputError, MissingPackageError

logger = logging.getLogger("hfexport")


def export_components(
    exporter: Any,
    model: torch.nn.Module,
    generate_kwargs: Mapping[str, Any],
    config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None,
    generation_config: Any,
    multi_token_decode: bool,
    runtime_components: bool = True,
) -> dict[str, Any]:
    """`exporter.export_for_generation`'s work, under the export lock: `{name: native object}` (a
    `GenerationComponents`), each component's report on `exporter.reports`."""
    from hfexport.frontends.generation import (
        GenerationComponents,
        decompose_for_generation,
        describe,
        runtime_configs,
        split_config,
    )

    # The decode step's rule selection also decides the patches that run while generate is recorded.
    decode_config = config.get("decode") if isinstance(config, Mapping) else config
    model = _quantized_once(exporter.export_format, model, generate_kwargs, config)
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
    configs = _calibrate_components(
        exporter.export_format, model, config, configs, generation_config, multi_token_decode
    )
    layouts = {name: layout for name, layout in decomposition.layouts.items() if name in components}
    results = GenerationComponents()
    results.spec = describe(components, generation_config, model, multi_token_decode, generate_kwargs)
    results.spec.runtime_components = extra
    for name, layout in layouts.items():
        results.spec.components[name].layout = layout
    results.samples = {name: kwargs for name, (_, kwargs) in components.items()}
    results.runtime_components = {}
    exporter.reports = {}
    shared = _prefill_shares_decode(components, configs, results.spec)
    for name, (submodule, kwargs) in components.items():
        if name == shared:
            continue  # exported below, once "decode" is
        logger.info("exporting component %s (%s)", name, type(submodule).__name__)
        exporter.report = None
        held = results.runtime_components if name in extra else results
        try:
            held[name] = exporter.export(submodule, kwargs, configs[name])
        except Exception as exc:
            raise HfExportError(
                f"{type(exc).__name__}: {exc}",
                stage=getattr(exc, "stage", "export"),
                rule_id=getattr(exc, "rule_id", None),
                model=f"component {name!r} ({type(submodule).__name__}, inputs {sorted(kwargs)})",
            ) from exc
        finally:
            if exporter.report is not None:
                exporter.report.component = name
                exporter.reports[name] = exporter.report
    if shared is not None:
        order = list(results)
        results[shared] = results["decode"]
        # The documented order (prefill before decode), as the components were recorded.
        for name in [n for n in components if n in order]:
            results[name] = results.pop(name)
        if "decode" in exporter.reports:
            decode_report = exporter.reports["decode"]
            exporter.reports[shared] = dataclasses.replace(
                decode_report,
                component=shared,
                notes=[*decode_report.notes, SHARED_PREFILL_NOTE],
                rules=list(decode_report.rules),
                stage_seconds={},
                total_seconds=0.0,
            )
    return results


def _quantized_once(
    export_format: str,
    model: torch.nn.Module,
    generate_kwargs: Mapping[str, Any],
    config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None,
) -> torch.nn.Module:
    """The model to record `generate` on: where every component's config holds the same eager-model quantizer,
    its one quantized copy (each component's export then finds its quantization done, `quantize_eager_model`);
    otherwise `model`."""
    from hfexport.quantizers.apply import check_quantizer, failure_message, quantize_eager_model

    each = list(config.values()) if isinstance(config, Mapping) else [config]
    quantizers = {id(q): q for q in (getattr(c, "quantizer", None) for c in each)}
    quantizer = next(iter(quantizers.values()), None)
    if len(quantizers) != 1 or quantizer is None or not quantizer.quantizes_eager_model:
        return model
    check_quantizer(quantizer, export_format)
    try:
        return quantize_eager_model(quantizer, model, generate_kwargs, export_format)[0]
    except (InputError, ConfigError, MissingPackageError, HfExportError):
        raise  # the API's own errors, as the pipeline passes them
    except Exception as exc:
        # Named as a component export's quantize stage names its failure.
        raise HfExportError(failure_message(quantizer)(exc), stage="quantize", model=type(model).__name__) from exc


def _calibrate_components(
    export_format: str,
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
            check_quantizer(each.quantizer, export_format, quantizer_defaults(each.quantizer, each)[0])
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
    program is returned for both and the export takes half the time (issue #19, goal 5), and the artifact stores
    it once. A quantizer that reads no calibration data (weight-only, data-free) quantizes both alike; one that
    calibrates sees each component's own samples, so each is exported."""
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
    quantizer = getattr(config, "quantizer", None)
    if quantizer is not None and quantizer.needs_calibration:
        return None  # calibrated per component: the components' calibration data differ
    return "prefill" if same_graph(components["prefill"], components["decode"]) else None
