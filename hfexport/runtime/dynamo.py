"""Load a saved `ExportedProgram` (`.pt2`) whose inputs or outputs hold transformers objects."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """`torch.export.load` after registering what a transformers export needs to deserialise.

    A program's pytree specs name transformers classes (model outputs, caches); a fresh process knows
    them only once they are imported and, for caches, registered as pytree nodes.
    """
    from hfexport.core.cache_classes import cache_module_classes
    from hfexport.core.cache_pytree import register_program_types

    register_program_types()
    # The example inputs saved in the archive hold transformers' cache objects. torch loads them with the
    # weights-only unpickler first; without these classes on its allow-list that fails, torch falls back to
    # the full unpickler and logs the failure. With them the weights-only load succeeds for a cache. A
    # `ModelOutput` (an encoder-decoder's `encoder_outputs`, a VLM's image features) still falls back: the
    # weights-only unpickler sets items only on plain dicts. The fallback is what `trust=True` allows.
    # A file object, as `torch.export.save` is given one: a path that is not UTF-8 fails in torch's reader.
    with (
        torch.serialization.safe_globals(list(cache_module_classes())),
        _quiet_fallback_record(),
        open(path, "rb") as f,
    ):
        return torch.export.load(f)


class _FallbackRecord(logging.Filter):
    """Drops torch's record of the full-unpickle fallback (`torch._export.serde.serialize.deserialize_torch_artifact`,
    torch 2.13): its format string has two `%s` for one argument, so formatting it fails and the logging module
    prints "--- Logging error ---" with two tracebacks (146 lines on stderr for a T5 generation artifact). The
    fallback itself is expected here: it is why a `.pt2` needs `trust=True`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Fallback to weights_only=False succeeded")


@contextlib.contextmanager
def _quiet_fallback_record() -> Iterator[None]:
    log = logging.getLogger("torch._export.serde.serialize")
    record_filter = _FallbackRecord()
    log.addFilter(record_filter)
    try:
        yield
    finally:
        log.removeFilter(record_filter)
