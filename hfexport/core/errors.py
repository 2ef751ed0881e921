"""Exceptions that are part of the API: each names what went wrong and what to do."""

from __future__ import annotations


class HfExportError(RuntimeError):
    """An export failed at a pipeline stage; `stage` and `rule_id` say where."""

    def __init__(self, message: str, *, stage: str, rule_id: str | None = None, model: str | None = None) -> None:
        where = f"stage {stage!r}" + (f", rule {rule_id!r}" if rule_id else "")
        subject = f" exporting {model}" if model else ""
        super().__init__(f"[{where}]{subject}: {message}")
        self.detail = message
        self.stage = stage
        self.rule_id = rule_id
        self.model = model


class InputError(ValueError):
    """Sample inputs or dynamic shapes that cannot be exported (raised before tracing)."""


class ConfigError(TypeError):
    """A config that does not fit the exporter, format or backend (raised before tracing)."""


class MissingPackageError(ImportError):
    """A package the exporter needs is missing or older than the minimum it supports."""


class OutputPathError(ConfigError):
    """An `output_path` that cannot be written (a folder, under a file, no permission); raised before tracing."""
