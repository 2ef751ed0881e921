"""Auto classes: pick the config class from a dict and the exporter from a config, by `export_format`.

Third-party backends register with `@register_export_config(name)` and `@register_exporter(name)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hfexport.backends.registry import backends
from hfexport.configs import ExportConfigMixin
from hfexport.core.errors import ConfigError
from hfexport.exporters.base import HfExporter
from hfexport.formats import ExportFormat

E = TypeVar("E", bound=type[HfExporter])
C = TypeVar("C", bound=type[ExportConfigMixin])

# Every backend's exporter and config class (`hfexport.backends`), then what third parties register.
AUTO_EXPORTER_MAPPING: dict[str, type[HfExporter]] = {b.name: b.exporter.load() for b in backends()}
AUTO_CONFIG_MAPPING: dict[str, type[ExportConfigMixin]] = {b.name: b.config.load() for b in backends()}


def _format_name(name: str | ExportFormat) -> str:
    name = name.value if isinstance(name, ExportFormat) else name
    if not isinstance(name, str) or not name:
        raise ConfigError(f"export format names are non-empty strings, got {name!r}")
    return name


def register_exporter(name: str | ExportFormat) -> Callable[[E], E]:
    """Class decorator: make `AutoHfExporter` dispatch `export_format == name` to the class."""
    key = _format_name(name)

    def decorator(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, HfExporter)):
            raise TypeError(f"@register_exporter({key!r}) needs a subclass of HfExporter, got {cls!r}")
        AUTO_EXPORTER_MAPPING[key] = cls
        return cls

    return decorator


def register_export_config(name: str | ExportFormat) -> Callable[[C], C]:
    """Class decorator: make `AutoExportConfig` build the class for `export_format == name`."""
    key = _format_name(name)

    def decorator(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, ExportConfigMixin)):
            raise TypeError(f"@register_export_config({key!r}) needs a subclass of ExportConfigMixin, got {cls!r}")
        cls.export_format = key
        AUTO_CONFIG_MAPPING[key] = cls
        return cls

    return decorator


def _lookup(mapping: dict[str, Any], fmt: Any, what: str) -> Any:
    key = fmt.value if isinstance(fmt, ExportFormat) else fmt
    if key not in mapping:
        raise ValueError(f"unknown export_format {fmt!r} for {what}; known formats: {sorted(mapping)}")
    return mapping[key]


class AutoExportConfig:
    """`AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})` -> `DynamoConfig`."""

    def __init__(self) -> None:
        raise TypeError("use AutoExportConfig.from_dict(...) or AutoExportConfig.from_json(...)")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ExportConfigMixin:
        if not isinstance(data, dict) or "export_format" not in data:
            raise ValueError(f"the config dict needs an 'export_format' key (one of {sorted(AUTO_CONFIG_MAPPING)})")
        if not isinstance(data["export_format"], str):
            raise ConfigError(f"export_format must be a string (one of {sorted(AUTO_CONFIG_MAPPING)})")
        cls = _lookup(AUTO_CONFIG_MAPPING, data["export_format"], "AutoExportConfig")
        return cls.from_dict(data)

    @staticmethod
    def from_json(text: str) -> ExportConfigMixin:
        import json

        return AutoExportConfig.from_dict(json.loads(text))


class AutoHfExporter:
    """`AutoHfExporter.from_config(config)` -> the exporter registered for `config.export_format`."""

    def __init__(self) -> None:
        raise TypeError("use AutoHfExporter.from_config(config)")

    @staticmethod
    def from_config(config: ExportConfigMixin) -> HfExporter:
        if not isinstance(config, ExportConfigMixin):
            raise ConfigError(f"AutoHfExporter.from_config needs an export config, got {type(config).__name__}")
        return _lookup(AUTO_EXPORTER_MAPPING, config.export_format, "AutoHfExporter")()
