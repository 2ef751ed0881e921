"""Package checks: missing and too-old packages raise with a pip command; drift warns once per version."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator

import pytest

from hfexport.core import versions
from hfexport.core.errors import MissingPackageError
from hfexport.core.versions import check_packages, install_hint
from hfexport.exporters import DynamoExporter

MISSING = "hfexport-test-package-that-is-not-installed"


@pytest.fixture(autouse=True)
def fresh_drift_cache() -> Iterator[None]:
    versions._warn_drift.cache_clear()
    yield
    versions._warn_drift.cache_clear()


def _fake_installed(monkeypatch: pytest.MonkeyPatch, table: dict[str, str | None]) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda package: table.get(package))


def _drift_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "hfexport" and "was tested with" in r.getMessage()]


def test_installed_version_reads_metadata() -> None:
    assert versions.installed_version("packaging") == importlib.metadata.version("packaging")
    assert versions.installed_version(MISSING) is None


def test_missing_package_names_pip_command() -> None:
    with pytest.raises(MissingPackageError) as info:
        check_packages(("packaging", MISSING), {}, {MISSING: "1.2.3"}, who="TestExporter")
    message = str(info.value)
    assert "TestExporter" in message
    assert MISSING in message
    assert f'pip install "{MISSING}==1.2.3"' in message


def test_missing_package_without_tested_version_is_unpinned() -> None:
    with pytest.raises(MissingPackageError) as info:
        check_packages((MISSING,), {}, {})
    assert f'pip install "{MISSING}"' in str(info.value)


def test_missing_optional_package_points_at_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, {})
    with pytest.raises(MissingPackageError) as info:
        check_packages(("onnxscript",), {}, {"onnxscript": "0.7.2"})
    message = str(info.value)
    assert 'pip install "hfexport[onnx]"' in message
    assert 'pip install "onnxscript==0.7.2"' in message


def test_missing_package_error_is_import_error() -> None:
    assert issubclass(MissingPackageError, ImportError)


def test_too_old_package_raises() -> None:
    installed = importlib.metadata.version("packaging")
    with pytest.raises(MissingPackageError) as info:
        check_packages(("packaging",), {"packaging": "9999.0"}, {})
    message = str(info.value)
    assert "packaging>=9999.0" in message
    assert installed in message
    assert 'pip install "packaging==9999.0"' in message


def test_too_old_faked_version_raises_with_tested_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, {"torch": "2.8.1+cu126"})
    with pytest.raises(MissingPackageError) as info:
        check_packages(("torch",), {"torch": "2.9.0"}, {"torch": "2.13.0"})
    assert "torch>=2.9.0" in str(info.value)
    assert "2.8.1+cu126" in str(info.value)
    assert 'pip install "torch==2.13.0"' in str(info.value)


def test_exact_minimum_with_local_suffix_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, {"torch": "2.9.0+cpu"})
    assert check_packages(("torch",), {"torch": "2.9.0"}, {}) == {"torch": "2.9.0+cpu"}


def test_returns_installed_versions_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    installed = importlib.metadata.version("packaging")
    caplog.set_level(logging.WARNING, logger="hfexport")
    found = check_packages(("packaging",), {"packaging": "1.0"}, {"packaging": installed})
    assert found == {"packaging": installed}
    assert _drift_records(caplog) == []


def test_drift_warns_once_per_package_and_version(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    table = {"torch": "2.12.0"}
    _fake_installed(monkeypatch, table)
    caplog.set_level(logging.WARNING, logger="hfexport")

    assert check_packages(("torch",), {}, {"torch": "2.13.0"}) == {"torch": "2.12.0"}
    assert check_packages(("torch",), {}, {"torch": "2.13.0"}) == {"torch": "2.12.0"}
    records = _drift_records(caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "torch 2.12.0 is installed" in message
    assert "2.13.0" in message
    assert 'pip install "torch==2.13.0"' in message

    # A different installed version is a different drift: one more warning, then silence again.
    table["torch"] = "2.11.0"
    check_packages(("torch",), {}, {"torch": "2.13.0"})
    check_packages(("torch",), {}, {"torch": "2.13.0"})
    records = _drift_records(caplog)
    assert len(records) == 2
    assert "torch 2.11.0 is installed" in records[1].getMessage()


def test_drift_warns_for_each_package(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fake_installed(monkeypatch, {"torch": "2.12.0", "transformers": "5.20.0"})
    caplog.set_level(logging.WARNING, logger="hfexport")
    for _ in range(2):
        check_packages(("torch", "transformers"), {}, {"torch": "2.13.0", "transformers": "5.24.0"})
    messages = sorted(r.getMessage().split(" is installed")[0] for r in _drift_records(caplog))
    assert messages == ["hfexport: torch 2.12.0", "hfexport: transformers 5.20.0"]


def test_drift_warns_once_per_class(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # An exporter warned about torch; a quantizer tested against the same torch still warns, naming itself.
    _fake_installed(monkeypatch, {"torch": "2.12.0"})
    caplog.set_level(logging.WARNING, logger="hfexport")
    for who in ("OnnxExporter", "OnnxExporter", "NNCFOnnxQuantizer", "NNCFOnnxQuantizer"):
        check_packages(("torch",), {}, {"torch": "2.13.0"}, who=who)
    messages = [r.getMessage() for r in _drift_records(caplog)]
    assert [m.split(":")[0] for m in messages] == ["OnnxExporter", "NNCFOnnxQuantizer"]
    assert all("torch 2.12.0 is installed" in m for m in messages)


@pytest.mark.parametrize("installed", ["2.13.0+cpu", "2.13.0+cu126", "2.13.0", "2.13"])
def test_local_suffix_is_not_drift(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, installed: str
) -> None:
    _fake_installed(monkeypatch, {"torch": installed})
    caplog.set_level(logging.WARNING, logger="hfexport")
    assert check_packages(("torch",), {"torch": "2.9.0"}, {"torch": "2.13.0"}) == {"torch": installed}
    assert _drift_records(caplog) == []


def test_local_suffix_on_drifted_version_still_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_installed(monkeypatch, {"torch": "2.12.0+cpu"})
    caplog.set_level(logging.WARNING, logger="hfexport")
    check_packages(("torch",), {}, {"torch": "2.13.0"})
    assert len(_drift_records(caplog)) == 1


def test_install_hint() -> None:
    assert install_hint("somepkg") == 'pip install "somepkg"'
    assert install_hint("somepkg", "1.0") == 'pip install "somepkg==1.0"'
    assert 'pip install "hfexport[openvino]"' in install_hint("openvino", "2026.0")
    assert 'pip install "hfexport[quantization]"' in install_hint("nncf")


def test_validate_environment_reports_torch_and_transformers() -> None:
    found = DynamoExporter().validate_environment()
    assert set(found) >= {"torch", "transformers"}
    assert found["torch"] == importlib.metadata.version("torch")
    assert found["transformers"] == importlib.metadata.version("transformers")


def test_validate_environment_raises_for_missing_required() -> None:
    class NeedsMissing(DynamoExporter):
        required_packages = ("torch", MISSING)

    with pytest.raises(MissingPackageError) as info:
        NeedsMissing().validate_environment()
    assert "NeedsMissing" in str(info.value)
    assert f'pip install "{MISSING}"' in str(info.value)
