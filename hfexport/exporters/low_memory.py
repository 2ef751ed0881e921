"""The weight source of a low-memory export (ONNX and OpenVINO), found and checked before any trace."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.checkpoints import Checkpoint, WeightSource
from hfexport.configs import check_streaming_quantizer
from hfexport.errors import ConfigError


def low_memory_weights(model: torch.nn.Module, config: Any) -> WeightSource:
    """The checkpoint (`config.checkpoint`, or the folder the model was built from) and which checkpoint tensor
    holds each weight of `model`. Refused before any trace when it cannot be."""
    from hfexport.exporters.preflight import check_devices
    from hfexport.frontends.empty_weights import weight_sources

    check_devices(model, {}, low_memory=True)
    check_streaming_quantizer(config)  # set after the config was built (the CLI's --quantize)
    folder = config.checkpoint or getattr(model, "name_or_path", None)
    if not folder or not Path(folder).is_dir():
        raise ConfigError(
            "low_memory=True needs the checkpoint folder the weights stream from: "
            f"{type(config).__name__}(checkpoint=folder), or a model built by hfexport.empty_model(folder)"
        )
    checkpoint = Checkpoint.open(folder)
    return WeightSource(checkpoint, weight_sources(model, checkpoint))


class LowMemoryExport:
    """The `export` of an exporter that can stream weights (ONNX, OpenVINO): with `config.low_memory`, the weight
    source is found and checked before the trace and handed to `lower` as `self._weights` for that one export."""

    # Set for the duration of one `export` (exports run one at a time).
    _weights: Any = None

    def export(self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: Any = None) -> Any:
        config = self.check_config(config)  # type: ignore[attr-defined]
        if not config.low_memory:
            return self._capture_and_lower(model, sample_inputs, config)  # type: ignore[attr-defined]
        self._weights = low_memory_weights(model, config)
        try:
            return self._capture_and_lower(model, sample_inputs, config)  # type: ignore[attr-defined]
        finally:
            self._weights = None
