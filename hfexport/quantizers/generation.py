"""Calibration for `export_for_generation`: each component calibrates on the forward kwargs it saw.

With one config for every component, the quantizer's `calibration_dataset` holds `generate` kwargs (e.g.
tokenized prompts). Each sample is run through `decompose_for_generation`, which records what every component
(prefill, decode, an image encoder, ...) received, and each component gets a copy of the quantizer whose
`calibration_dataset` is the list of its own forward kwargs. With a `{component: config}` dict, each
quantizer's dataset already holds that component's forward kwargs and is used as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


def calibrate_components(
    model: torch.nn.Module,
    config: Any,
    configs: dict[str, Any],
    *,
    generation_config: Any = None,
    multi_token_decode: bool = False,
) -> dict[str, Any]:
    """`configs` (one per component, from `split_config`) with per-component calibration data where `config`
    is a single config whose quantizer reads a dataset of generate kwargs; otherwise `configs` unchanged."""
    quantizer = getattr(config, "quantizer", None)
    if isinstance(config, Mapping) or quantizer is None or not quantizer.needs_calibration:
        return configs
    if quantizer.calibration_dataset is None:
        # Each component calibrates on its own sample kwargs (with the usual warning).
        return configs
    from hfexport.frontends.generation import decompose_for_generation

    per_component: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for sample in quantizer.calibration_dataset:
        parts = decompose_for_generation(
            model, sample, generation_config=generation_config, multi_token_decode=multi_token_decode
        )
        for name, (_, kwargs) in parts.all().items():  # the runtime components calibrate too
            if name in per_component:
                per_component[name].append(kwargs)
    result = {}
    for name, each in configs.items():
        component_quantizer = copy.copy(quantizer)
        component_quantizer.calibration_dataset = per_component[name] or None
        result[name] = dataclasses.replace(each, quantizer=component_quantizer)
    return result
