"""Export configs: defaults, dict/JSON round trips (dynamic shapes, rule selection), strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.export import Dim

from hfexport.configs import DynamoConfig, ExportConfigMixin, ExportFormat
from hfexport.core.errors import ConfigError
from hfexport.rewrites.rule import RuleSelection


def _full_config() -> DynamoConfig:
    batch = Dim("batch", min=1, max=32)
    return DynamoConfig(
        dynamic=True,
        dynamic_shapes={
            "input_ids": {0: batch, 1: Dim.AUTO},
            "attention_mask": {0: batch, 1: Dim.STATIC},
            "pixel_values": [batch, None, Dim.DYNAMIC, 224],
        },
        strict=True,
        prefer_deferred_runtime_asserts_over_guards=True,
        rules=RuleSelection(enable=("fx/", "patch/sdpa"), disable=("fx/drop-assert",)),
    )


def _assert_dim(dim: object, name: str, low: int, high: int) -> None:
    assert dim is not None
    assert not isinstance(dim, (int, str, dict))
    assert dim.__name__ == name
    assert dim.min == low
    assert dim.max == high


def _assert_full_config_restored(restored: ExportConfigMixin) -> None:
    assert type(restored) is DynamoConfig
    assert restored.dynamic is True
    assert restored.strict is True
    assert restored.prefer_deferred_runtime_asserts_over_guards is True
    assert restored.rules == RuleSelection(enable=("fx/", "patch/sdpa"), disable=("fx/drop-assert",))
    assert isinstance(restored.rules.enable, tuple)
    shapes = restored.dynamic_shapes
    assert set(shapes) == {"input_ids", "attention_mask", "pixel_values"}
    # Axis keys are ints again (JSON object keys are strings).
    assert set(shapes["input_ids"]) == {0, 1}
    assert set(shapes["attention_mask"]) == {0, 1}
    _assert_dim(shapes["input_ids"][0], "batch", 1, 32)
    _assert_dim(shapes["attention_mask"][0], "batch", 1, 32)
    assert shapes["input_ids"][1] is Dim.AUTO
    assert shapes["attention_mask"][1] is Dim.STATIC
    pixel = shapes["pixel_values"]
    _assert_dim(pixel[0], "batch", 1, 32)
    assert pixel[1] is None
    assert pixel[2] is Dim.DYNAMIC
    assert pixel[3] == 224


def test_dynamo_config_defaults() -> None:
    config = DynamoConfig()
    assert config.dynamic is False
    assert config.strict is False
    assert config.dynamic_shapes is None
    assert config.prefer_deferred_runtime_asserts_over_guards is False
    assert config.rules == RuleSelection()
    assert config.rules.enable == () and config.rules.disable == ()
    assert DynamoConfig.export_format == "dynamo"


def test_default_rules_are_not_shared_between_instances() -> None:
    a, b = DynamoConfig(), DynamoConfig()
    assert a.rules == b.rules
    a.rules = RuleSelection(disable=("fx/",))
    assert b.rules == RuleSelection()


def test_to_dict_of_defaults() -> None:
    assert DynamoConfig().to_dict() == {
        "export_format": "dynamo",
        "dynamic": False,
        "dynamic_shapes": None,
        "strict": False,
        "prefer_deferred_runtime_asserts_over_guards": False,
        "rules": {"enable": [], "disable": []},
        "quantizer": None,
    }


def test_to_dict_serialises_dims_and_rules() -> None:
    data = _full_config().to_dict()
    assert data["export_format"] == "dynamo"
    assert data["rules"] == {"enable": ["fx/", "patch/sdpa"], "disable": ["fx/drop-assert"]}
    shapes = data["dynamic_shapes"]
    assert shapes["input_ids"] == {0: {"dim": "batch", "min": 1, "max": 32}, 1: "AUTO"}
    assert shapes["attention_mask"] == {0: {"dim": "batch", "min": 1, "max": 32}, 1: "STATIC"}
    assert shapes["pixel_values"] == [{"dim": "batch", "min": 1, "max": 32}, None, "DYNAMIC", 224]
    # Everything in the dict is plain JSON.
    json.dumps(data)


def test_dict_round_trip() -> None:
    config = _full_config()
    restored = DynamoConfig.from_dict(config.to_dict())
    _assert_full_config_restored(restored)
    assert restored.to_dict() == config.to_dict()


def test_json_round_trip() -> None:
    config = _full_config()
    text = config.to_json()
    assert json.loads(text)["export_format"] == "dynamo"
    restored = DynamoConfig.from_json(text)
    _assert_full_config_restored(restored)
    assert restored.to_json() == text
    assert restored.to_dict() == config.to_dict()


def test_json_round_trip_of_defaults_is_equal() -> None:
    # Without Dim objects (which compare by identity) the dataclasses compare equal.
    assert DynamoConfig.from_json(DynamoConfig().to_json()) == DynamoConfig()
    config = DynamoConfig(dynamic=True, rules=RuleSelection(enable=("patch/x",)))
    assert DynamoConfig.from_json(config.to_json(indent=None)) == config


def test_unbounded_dim_round_trips() -> None:
    config = DynamoConfig(dynamic_shapes={"x": {0: Dim("seq")}})
    assert config.to_dict()["dynamic_shapes"] == {"x": {0: {"dim": "seq", "min": 0, "max": None}}}
    restored = DynamoConfig.from_json(config.to_json())
    dim = restored.dynamic_shapes["x"][0]
    assert dim.__name__ == "seq"
    assert dim.min == 0
    assert dim.max == Dim("other").max  # unbounded again
    assert restored.to_dict() == config.to_dict()


def test_nested_dict_input_keeps_string_keys() -> None:
    batch = Dim("batch", min=1, max=8)
    config = DynamoConfig(dynamic_shapes={"inputs": {"a": {0: batch}, "b": {1: Dim.AUTO}}})
    restored = DynamoConfig.from_json(config.to_json())
    inner = restored.dynamic_shapes["inputs"]
    assert set(inner) == {"a", "b"}
    _assert_dim(inner["a"][0], "batch", 1, 8)
    assert inner["b"] == {1: Dim.AUTO}


def test_derived_dim_is_refused_on_serialisation() -> None:
    batch = Dim("batch", min=1, max=32)
    config = DynamoConfig(dynamic_shapes={"x": {0: batch}, "y": {0: 2 * batch}})
    with pytest.raises(ConfigError, match="cannot serialise"):
        config.to_json()


def test_rules_dict_is_coerced_and_bad_rules_rejected() -> None:
    config = DynamoConfig(rules={"enable": ["fx/a"], "disable": "fx/b"})
    assert config.rules == RuleSelection(enable=("fx/a",), disable=("fx/b",))
    with pytest.raises(ConfigError, match="RuleSelection"):
        DynamoConfig(rules=["fx/a"])


def test_from_dict_without_export_format_uses_class_format() -> None:
    config = DynamoConfig.from_dict({"dynamic": True})
    assert config == DynamoConfig(dynamic=True)


def test_from_dict_does_not_mutate_input() -> None:
    data = _full_config().to_dict()
    snapshot = json.dumps(data, sort_keys=True)
    DynamoConfig.from_dict(data)
    assert json.dumps(data, sort_keys=True) == snapshot


@pytest.mark.parametrize("fmt", ["onnx", "executorch", "openvino", "nope"])
def test_from_dict_rejects_wrong_export_format(fmt: str) -> None:
    with pytest.raises(ConfigError) as info:
        DynamoConfig.from_dict({"export_format": fmt, "dynamic": True})
    message = str(info.value)
    assert "DynamoConfig" in message
    assert repr(fmt) in message
    assert "'dynamo'" in message


def test_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ConfigError) as info:
        DynamoConfig.from_dict({"export_format": "dynamo", "dynamik": True, "opset": 18, "strict": True})
    message = str(info.value)
    assert "dynamik" in message
    assert "opset" in message
    # The valid field is listed among the fields, not among the unknown ones.
    unknown_part = message.split(";")[0]
    assert "strict" not in unknown_part
    assert "dynamic" in message.split(";")[1]


def test_from_json_rejects_unknown_fields() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        DynamoConfig.from_json('{"export_format": "dynamo", "bogus": 1}')


def test_config_error_is_a_type_error() -> None:
    assert issubclass(ConfigError, TypeError)


def test_export_format_values() -> None:
    assert {f.value for f in ExportFormat} == {"dynamo", "onnx", "executorch", "openvino", "aoti"}
    assert ExportFormat.DYNAMO == "dynamo"
    assert ExportFormat("onnx") is ExportFormat.ONNX
    assert str(ExportFormat.EXECUTORCH) == "executorch"
    assert f"{ExportFormat.OPENVINO}" == "openvino"
    with pytest.raises(ValueError):
        ExportFormat("tflite")


def test_from_dict_accepts_enum_export_format() -> None:
    config = DynamoConfig.from_dict({"export_format": ExportFormat.DYNAMO, "strict": True})
    assert config == DynamoConfig(strict=True)


def test_backend_configs_validate_their_fields_before_tracing() -> None:
    from hfexport.configs import ExecutorchConfig, OpenVINOConfig

    assert ExecutorchConfig().backend == "xnnpack"
    assert (ExecutorchConfig().alloc_graph_input, ExecutorchConfig().alloc_mutable_buffers) == (True, True)
    with pytest.raises(ConfigError, match="backend must be one of"):
        ExecutorchConfig(backend="mps")
    assert OpenVINOConfig(output_path=Path("out/model.xml")).output_path == "out/model.xml"
    with pytest.raises(ConfigError, match=r"\.xml"):
        OpenVINOConfig(output_path="out/model.onnx")
    restored = OpenVINOConfig.from_json(OpenVINOConfig(compress_to_fp16=False).to_json())
    assert restored == OpenVINOConfig(compress_to_fp16=False)
