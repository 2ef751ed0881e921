"""Auto classes and registration, config/exporter mismatch, and the lazy top-level import."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import hfexport
from hfexport import auto
from hfexport.auto import (
    AUTO_CONFIG_MAPPING,
    AUTO_EXPORTER_MAPPING,
    AutoExportConfig,
    AutoHfExporter,
    register_export_config,
    register_exporter,
)
from hfexport.configs import DynamoConfig, ExportConfigMixin, ExportFormat
from hfexport.core.errors import ConfigError
from hfexport.exporters import DynamoExporter, HfExporter

TEST_FORMAT = "hfexport-test-backend"


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Snapshot the auto mappings and restore them, so test-only registrations never leak."""
    exporters, configs = dict(AUTO_EXPORTER_MAPPING), dict(AUTO_CONFIG_MAPPING)
    yield
    AUTO_EXPORTER_MAPPING.clear()
    AUTO_EXPORTER_MAPPING.update(exporters)
    AUTO_CONFIG_MAPPING.clear()
    AUTO_CONFIG_MAPPING.update(configs)
    assert TEST_FORMAT not in AUTO_EXPORTER_MAPPING
    assert TEST_FORMAT not in AUTO_CONFIG_MAPPING


class CountingModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


@dataclass
class UnrelatedConfig(ExportConfigMixin):
    export_format: ClassVar[str] = "unrelated"
    level: int = 1


# -- AutoExportConfig ------------------------------------------------------------------------------


def test_auto_config_from_dict_builds_dynamo_config() -> None:
    config = AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})
    assert type(config) is DynamoConfig
    assert config == DynamoConfig(dynamic=True)


def test_auto_config_from_dict_accepts_enum() -> None:
    config = AutoExportConfig.from_dict({"export_format": ExportFormat.DYNAMO, "strict": True})
    assert config == DynamoConfig(strict=True)


def test_auto_config_from_json_round_trips() -> None:
    original = DynamoConfig(dynamic=True, strict=True)
    assert AutoExportConfig.from_json(original.to_json()) == original


def test_auto_config_unknown_format_lists_known_formats() -> None:
    with pytest.raises(ValueError) as info:
        AutoExportConfig.from_dict({"export_format": "tflite"})
    message = str(info.value)
    assert "'tflite'" in message
    for known in AUTO_CONFIG_MAPPING:
        assert known in message
    assert "dynamo" in message


def test_auto_config_missing_export_format() -> None:
    with pytest.raises(ValueError, match="export_format") as info:
        AutoExportConfig.from_dict({"dynamic": True})
    assert "dynamo" in str(info.value)


def test_auto_config_passes_unknown_fields_to_config_check() -> None:
    with pytest.raises(ConfigError, match="not_a_field"):
        AutoExportConfig.from_dict({"export_format": "dynamo", "not_a_field": 1})


def test_auto_classes_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError, match="from_dict"):
        AutoExportConfig()
    with pytest.raises(TypeError, match="from_config"):
        AutoHfExporter()


# -- AutoHfExporter --------------------------------------------------------------------------------


def test_auto_exporter_from_config() -> None:
    exporter = AutoHfExporter.from_config(DynamoConfig())
    assert type(exporter) is DynamoExporter
    assert exporter.report is None
    # A fresh exporter each call.
    assert AutoHfExporter.from_config(DynamoConfig()) is not exporter


def test_auto_exporter_rejects_non_config() -> None:
    with pytest.raises(ConfigError, match="dict"):
        AutoHfExporter.from_config({"export_format": "dynamo"})


def test_auto_exporter_unknown_format(clean_registry: None) -> None:
    with pytest.raises(ValueError) as info:
        AutoHfExporter.from_config(UnrelatedConfig())
    assert "'unrelated'" in str(info.value)
    assert "dynamo" in str(info.value)


# -- registration ----------------------------------------------------------------------------------


def test_register_third_party_backend(clean_registry: None) -> None:
    @register_export_config(TEST_FORMAT)
    @dataclass
    class TestBackendConfig(DynamoConfig):
        level: int = 0

    @register_exporter(TEST_FORMAT)
    class TestBackendExporter(DynamoExporter):
        export_format: ClassVar[str] = TEST_FORMAT
        config_class: ClassVar[type[ExportConfigMixin]] = TestBackendConfig

    # The decorators return the class itself, and the config learns its format.
    assert TestBackendConfig.export_format == TEST_FORMAT
    assert DynamoConfig.export_format == "dynamo"
    assert AUTO_CONFIG_MAPPING[TEST_FORMAT] is TestBackendConfig
    assert AUTO_EXPORTER_MAPPING[TEST_FORMAT] is TestBackendExporter

    config = AutoExportConfig.from_dict({"export_format": TEST_FORMAT, "level": 3, "dynamic": True})
    assert type(config) is TestBackendConfig
    assert config.level == 3 and config.dynamic is True
    assert config.to_dict()["export_format"] == TEST_FORMAT
    assert AutoExportConfig.from_json(config.to_json()) == config

    exporter = AutoHfExporter.from_config(config)
    assert type(exporter) is TestBackendExporter
    # Existing formats still dispatch as before.
    assert type(AutoHfExporter.from_config(DynamoConfig())) is DynamoExporter
    assert type(AutoExportConfig.from_dict({"export_format": "dynamo"})) is DynamoConfig

    # The third-party exporter refuses a plain DynamoConfig before touching anything.
    with pytest.raises(ConfigError, match="TestBackendConfig"):
        exporter.check_config(DynamoConfig())


def test_register_accepts_export_format_enum(clean_registry: None) -> None:
    class OtherDynamoExporter(DynamoExporter):
        pass

    register_exporter(ExportFormat.DYNAMO)(OtherDynamoExporter)
    assert AUTO_EXPORTER_MAPPING["dynamo"] is OtherDynamoExporter
    assert type(AutoHfExporter.from_config(DynamoConfig())) is OtherDynamoExporter


def test_registration_is_undone_by_fixture() -> None:
    # Runs after the registering tests (file order): nothing test-only is left behind.
    assert TEST_FORMAT not in AUTO_EXPORTER_MAPPING
    assert TEST_FORMAT not in AUTO_CONFIG_MAPPING
    assert AUTO_EXPORTER_MAPPING["dynamo"] is DynamoExporter
    assert AUTO_CONFIG_MAPPING["dynamo"] is DynamoConfig


@pytest.mark.parametrize("bad", [object, DynamoConfig, dict, "DynamoExporter", DynamoExporter()])
def test_register_exporter_rejects_non_exporters(clean_registry: None, bad: object) -> None:
    with pytest.raises(TypeError, match="HfExporter"):
        register_exporter(TEST_FORMAT)(bad)
    assert TEST_FORMAT not in AUTO_EXPORTER_MAPPING


@pytest.mark.parametrize("bad", [object, DynamoExporter, dict, "DynamoConfig", DynamoConfig()])
def test_register_export_config_rejects_non_configs(clean_registry: None, bad: object) -> None:
    with pytest.raises(TypeError, match="ExportConfigMixin"):
        register_export_config(TEST_FORMAT)(bad)
    assert TEST_FORMAT not in AUTO_CONFIG_MAPPING


@pytest.mark.parametrize("name", ["", None, 3])
def test_register_rejects_bad_names(name: object) -> None:
    with pytest.raises(ConfigError):
        register_exporter(name)
    with pytest.raises(ConfigError):
        register_export_config(name)


# -- config/exporter mismatch ----------------------------------------------------------------------


@pytest.mark.parametrize("config", [UnrelatedConfig(), {"export_format": "dynamo"}, "dynamo"])
def test_export_with_wrong_config_raises_before_touching_model(config: object) -> None:
    torch.manual_seed(0)
    model = CountingModule()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    training = model.training
    exporter = DynamoExporter()

    with pytest.raises(ConfigError) as info:
        exporter.export(model, {"x": torch.randn(2, 4)}, config=config)

    message = str(info.value)
    assert "DynamoExporter" in message and "DynamoConfig" in message
    assert type(config).__name__ in message
    assert model.calls == 0
    assert model.training is training
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert exporter.report is None


def test_check_config_defaults_and_passes_through() -> None:
    exporter = DynamoExporter()
    assert exporter.check_config(None) == DynamoConfig()
    config = DynamoConfig(strict=True)
    assert exporter.check_config(config) is config


# -- top-level package -----------------------------------------------------------------------------

_HEAVY = ("torch", "transformers", "onnx", "onnxscript", "executorch", "openvino", "nncf", "torchao")


def test_import_hfexport_is_light() -> None:
    code = f"import json, sys; import hfexport; print(json.dumps(sorted(m for m in {_HEAVY!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_import_check_would_see_heavy_modules() -> None:
    # Guards the test above against passing vacuously: importing a name that needs torch does show it.
    code = (
        "import json, sys; import hfexport; hfexport.DynamoConfig; hfexport.DynamoExporter; "
        f"print(json.dumps(sorted(m for m in {_HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "torch" in json.loads(result.stdout.strip().splitlines()[-1])


def test_every_public_name_resolves() -> None:
    assert hfexport.__all__, "hfexport.__all__ is empty"
    assert hfexport.__all__ == sorted(hfexport.__all__)
    for name in hfexport.__all__:
        value = getattr(hfexport, name)
        assert value is not None, name
        assert getattr(value, "__name__", name) == name
    assert hfexport.AutoHfExporter is auto.AutoHfExporter
    assert hfexport.DynamoExporter is DynamoExporter
    assert hfexport.HfExporter is HfExporter
    assert set(hfexport.__all__) <= set(dir(hfexport))


def test_unknown_top_level_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = hfexport.NoSuchThing
