"""The weight source of a low-memory export (ONNX and OpenVINO), found and checked before any trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hfexport.configs import check_streaming_quantizer
from hfexport.core.checkpoints import Checkpoint, WeightSource
from hfexport.core.errors import ConfigError


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
