"""Fuzzing (hypothesis, derandomized): the manifest loader and `AutoExportConfig.from_dict` raise only their
documented exceptions on arbitrary input."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from hfexport.artifacts import MANIFEST, ManifestError, check_manifest, read_manifest
from hfexport.errors import ConfigError

# Hypothesis caches what it learns under ./.hypothesis by default: keep the checkout clean.
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "hfexport-hypothesis"))

# -- fuzz ------------------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)


@_SETTINGS
@given(data=_json)
def test_fuzz_check_manifest_on_arbitrary_json_raises_only_manifest_error(data: Any) -> None:
    with contextlib.suppress(ManifestError):
        check_manifest(data)


_VALID = {
    "manifest_version": 1,
    "format": "onnx",
    "components": {
        "model": {
            "format": "onnx",
            "main": "model.onnx",
            "files": ["model.onnx"],
            "inputs": ["input_ids"],
            "outputs": ["logits"],
            "config": None,
            "report": None,
        }
    },
    "files": ["model.onnx"],
    "checksums": {"model.onnx": {"size": 1, "sha256": "0" * 64}},
    "config": {"export_format": "onnx", "dynamic": True},
    "versions": {"torch": "2.13.0"},
}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, (*prefix, i))
    return found


def test_the_fuzz_seed_manifest_is_valid() -> None:
    assert check_manifest(copy.deepcopy(_VALID))["format"] == "onnx"


@_SETTINGS
@given(where=st.sampled_from(_paths(_VALID)), value=_json | st.sampled_from(["../x", "/abs", "os.system", "a\\b"]))
def test_fuzz_one_edited_field_of_a_valid_manifest_raises_only_manifest_error(where: tuple[Any, ...], value: Any):
    manifest = copy.deepcopy(_VALID)
    target = manifest
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with contextlib.suppress(ManifestError):
        check_manifest(manifest)


@_SETTINGS
@given(raw=st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_fuzz_read_manifest_on_arbitrary_bytes_raises_only_artifact_errors(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / MANIFEST).write_bytes(raw)
        with contextlib.suppress(ManifestError):
            read_manifest(tmp)


def _config_fields() -> list[str]:
    from hfexport.auto import AUTO_CONFIG_MAPPING

    return sorted({f.name for cls in AUTO_CONFIG_MAPPING.values() for f in dataclasses.fields(cls)})


@settings(max_examples=150, deadline=None, database=None, derandomize=True, phases=[Phase.generate])
@given(
    fmt=st.sampled_from(["dynamo", "onnx", "executorch", "openvino"]) | _json,
    data=st.dictionaries(st.sampled_from(_config_fields()) | st.text(max_size=6), _json, max_size=4),
)
def test_fuzz_auto_export_config_from_dict_raises_only_documented_errors(fmt: Any, data: dict[str, Any]) -> None:
    from hfexport.auto import AutoExportConfig

    with contextlib.suppress(ConfigError, ValueError):
        AutoExportConfig.from_dict({"export_format": fmt, **data})


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"export_format": "dynamo", "dynamic_shapes": [1]}, id="dynamic-shapes-list"),
        pytest.param({"export_format": "onnx", "dynamic_shapes": 5}, id="dynamic-shapes-number"),
        pytest.param({"export_format": "dynamo", "dynamic_shapes": {"x": {"0": "NOPE"}}}, id="unknown-dim-name"),
        pytest.param({"export_format": {}}, id="unhashable-format"),
        pytest.param({"export_format": "dynamo", "rules": {"nope": []}}, id="rules-unknown-key"),
        pytest.param({"export_format": "dynamo", "dynamic": "yes"}, id="bool-field-string"),
        pytest.param({"export_format": "onnx", "opset_version": 1.5}, id="int-field-float"),
    ],
)
def test_auto_export_config_from_dict_known_bad_inputs_raise_documented_errors(data: dict[str, Any]) -> None:
    from hfexport.auto import AutoExportConfig

    with pytest.raises((ConfigError, ValueError)):
        AutoExportConfig.from_dict(data)
