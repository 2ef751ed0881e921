"""ExecutorchExporter: XNNPACK programs run in the ExecuTorch runtime and match eager; bounds, flags, errors.

Every parity check saves a `.pte` (or uses the manager's buffer) and runs it with `executorch.runtime`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

pytest.importorskip("executorch")

from executorch.exir import ExecutorchProgramManager
from executorch.runtime import Runtime

from hfexport import AutoExportConfig, AutoHfExporter, ConfigError, DynamoConfig, ExecutorchConfig, ExecutorchExporter
from hfexport.core.errors import InputError
from hfexport.frontends.torch_export import capture
from hfexport.lowerings.executorch import (
    FALLBACK_MAX_SEQUENCE,
    MAX_BATCH,
    bounded_dynamic_shapes,
    capture_options,
    check_backend,
    lower,
    unbounded_inputs,
)
from hfexport.rewrites.engine import RewriteContext
from hfexport.runtime.executorch import ExecutorchProgram, executorch_feed
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
Dim = torch.export.Dim


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    assert tuple(actual.shape) == tuple(expected.shape), what
    diff = (actual - expected).abs().max().item()
    assert diff <= tol * max(1.0, expected.abs().max().item()), f"{what}: max abs diff {diff:.3g}"


def _bounded(model: torch.nn.Module, inputs: dict[str, Any], **fields: Any) -> ExecutorchConfig:
    # What ExecutorchExporter's capture does once exporters.py calls bounded_dynamic_shapes (see docs/executorch.md).
    config = ExecutorchConfig(dynamic=True, **fields)
    return dataclasses.replace(config, dynamic_shapes=bounded_dynamic_shapes(model, inputs, config, []))


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "dtypes": {k: (v.dtype, v.device, v.requires_grad) for k, v in model.named_parameters()},
        "training": model.training,
        "attn": model.config._attn_implementation,
        "forward": model.forward,
        "attributes": sorted(vars(model)),
    }


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model, inputs = TINY.build(), TINY.sample_inputs()
    before = _snapshot(model)
    exporter = ExecutorchExporter()
    manager = exporter.export(model, inputs, config=_bounded(model, inputs, backend="xnnpack"))
    path = tmp_path_factory.mktemp("executorch") / "model.pte"
    manager.save(str(path))
    report = exporter.report
    return {"model": model, "inputs": inputs, "manager": manager, "path": path, "report": report, "before": before}


@pytest.mark.slow
def test_returns_a_manager_whose_saved_program_matches_eager(llama_export: dict[str, Any]) -> None:
    model, inputs, path = llama_export["model"], llama_export["inputs"], llama_export["path"]
    assert isinstance(llama_export["manager"], ExecutorchProgramManager)
    assert path.is_file() and path.stat().st_size > 0
    # The plain runtime API, as the docs show it: flat inputs in forward-kwargs order.
    method = Runtime.get().load_program(str(path)).load_method("forward")
    with torch.no_grad():
        expected = model(**inputs).logits
    _assert_close(method.execute(executorch_feed(inputs))[0], expected, "sample shape")


def test_a_second_and_a_longer_shape_match_eager(llama_export: dict[str, Any]) -> None:
    model, path = llama_export["model"], llama_export["path"]
    program = ExecutorchProgram(path)
    generator = torch.Generator().manual_seed(1)
    for batch, length in ((3, 13), (1, 5), (MAX_BATCH, 40)):
        ids = torch.randint(3, 128, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1, :2] = 0  # left padding
        feed = {"input_ids": ids, "attention_mask": mask}
        with torch.no_grad():
            expected = model(**feed).logits
        _assert_close(program.run(feed)[0], expected, f"shape {(batch, length)}")


def test_the_program_is_planned_for_the_caps(llama_export: dict[str, Any]) -> None:
    program = ExecutorchProgram(llama_export["manager"])
    cap = llama_export["model"].config.max_position_embeddings
    assert [slot.max_sizes for slot in program.slots.values()] == [(MAX_BATCH, cap), (MAX_BATCH, cap)]
    assert [slot.dtype for slot in program.slots.values()] == [torch.int64, torch.int64]


def test_a_program_from_the_manager_feeds_kwargs_by_name(llama_export: dict[str, Any]) -> None:
    model = llama_export["model"]
    program = ExecutorchProgram(llama_export["manager"])
    assert program.input_names == ["input_ids", "attention_mask"]
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    _assert_close(program.run({"attention_mask": mask, "input_ids": ids})[0], expected, "kwargs in another order")
    with pytest.raises(InputError, match=r"missing \['attention_mask'\]"):
        program.run({"input_ids": ids})


def test_inputs_beyond_the_bounds_fail_with_a_clear_error(llama_export: dict[str, Any]) -> None:
    program = ExecutorchProgram(llama_export["path"])
    cap = llama_export["model"].config.max_position_embeddings
    too_long = torch.ones(1, cap + 1, dtype=torch.long)
    with pytest.raises(InputError, match=rf"'input_ids' has size {cap + 1} on axis 1.*at most {cap}"):
        program.run({"input_ids": too_long, "attention_mask": torch.ones_like(too_long)})
    too_many = torch.ones(MAX_BATCH + 1, 4, dtype=torch.long)
    with pytest.raises(InputError, match=rf"size {MAX_BATCH + 1} on axis 0"):
        program.run({"input_ids": too_many, "attention_mask": too_many})
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(InputError, match=r"is torch\.int32, the program takes torch\.int64"):
        program.run({"input_ids": ids.int(), "attention_mask": ids})
    with pytest.raises(InputError, match="has 1 axes, the program takes 2"):
        program.run({"input_ids": ids[0], "attention_mask": ids})


def test_report_has_the_executorch_stages(llama_export: dict[str, Any]) -> None:
    report = llama_export["report"]
    assert report.export_format == "executorch"
    assert {"patch", "trace", "executorch", "edge", "to_executorch"} <= set(report.stage_seconds)
    assert report.stage_seconds["edge"] > 0
    # The MoE rule is the executorch backend's, and this dense model has no experts.
    assert report.not_applicable["patch/moe-batched-experts"].startswith("the model has no")


def test_export_leaves_the_callers_model_as_it_was(llama_export: dict[str, Any]) -> None:
    model, before = llama_export["model"], llama_export["before"]
    after = _snapshot(model)
    assert after["dtypes"] == before["dtypes"]
    assert after["training"] == before["training"] and after["attn"] == before["attn"]
    assert after["forward"] == before["forward"] and after["attributes"] == before["attributes"]
    for name, value in before["state"].items():
        assert torch.equal(after["state"][name], value), name
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


# -- bounds ---------------------------------------------------------------------------------------------


def test_bounded_dynamic_shapes_caps_every_auto_axis_with_one_warning() -> None:
    model, inputs = TINY.build(), TINY.sample_inputs()
    warnings: list[str] = []
    shapes = bounded_dynamic_shapes(model, inputs, ExecutorchConfig(dynamic=True), warnings)
    cap = model.config.max_position_embeddings
    for name in ("input_ids", "attention_mask"):
        assert [(d.type, d.max) for d in shapes[name].values()] == [(Dim.AUTO.type, MAX_BATCH), (Dim.AUTO.type, cap)]
    assert len(warnings) == 1
    assert f"at {cap} (config.max_position_embeddings)" in warnings[0]
    assert "dynamic_shapes={'input_ids': {0: Dim('batch', min=1, max=4)" in warnings[0]
    assert bounded_dynamic_shapes(model, inputs, ExecutorchConfig(), warnings) is None, "static: no shapes"
    assert len(warnings) == 1


def test_bounded_dynamic_shapes_keeps_explicit_bounds_and_shares_named_dims(caplog: pytest.LogCaptureFixture) -> None:
    model, inputs = TINY.build(), TINY.sample_inputs()
    batch, seq = Dim("batch", max=4), Dim("seq")
    explicit = {"input_ids": {0: batch, 1: seq}, "attention_mask": [Dim.STATIC, seq]}
    with caplog.at_level(logging.WARNING, logger="hfexport"):
        shapes = bounded_dynamic_shapes(model, inputs, ExecutorchConfig(dynamic_shapes=explicit))
    assert shapes["input_ids"][0] is batch, "an explicit bound is honoured"
    capped = shapes["input_ids"][1]
    assert capped.__name__ == "seq" and capped.max == model.config.max_position_embeddings
    assert shapes["attention_mask"] == [Dim.STATIC, capped], "one Dim per name, so the axes stay equal"
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
    assert "input_ids axis 1" in caplog.records[0].message and "attention_mask axis 1" in caplog.records[0].message

    bounded = {"input_ids": {0: batch, 1: Dim("s", max=64)}, "attention_mask": None}
    warnings: list[str] = []
    assert bounded_dynamic_shapes(model, inputs, ExecutorchConfig(dynamic_shapes=bounded), warnings) == bounded
    assert warnings == [], "nothing to cap: no warning"


def test_the_sequence_cap_is_the_static_cache_length_or_a_documented_default() -> None:
    from transformers import StaticCache

    model = TINY.build()
    cache = StaticCache(config=model.config, max_cache_len=48)
    inputs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "past_key_values": cache}
    warnings: list[str] = []
    shapes = bounded_dynamic_shapes(model, inputs, ExecutorchConfig(dynamic=True), warnings)
    assert shapes["input_ids"][1].max == 48 and "static cache length of 'past_key_values'" in warnings[0]

    class NoConfig(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    big = {"x": torch.ones(2, FALLBACK_MAX_SEQUENCE + 10)}
    warnings = []
    shapes = bounded_dynamic_shapes(NoConfig(), big, ExecutorchConfig(dynamic=True), warnings)
    assert shapes["x"][1].max == FALLBACK_MAX_SEQUENCE + 10, "never below the sample"
    assert "names no maximum length" in warnings[0]


def test_capture_options_give_a_capture_with_every_axis_bounded() -> None:
    model, inputs = TINY.build(), TINY.sample_inputs()
    config = ExecutorchConfig(dynamic=True, strict=False)
    warnings: list[str] = []
    options = capture_options(model, inputs, config, warnings)
    assert options.dynamic and not options.strict and options.dynamic_shapes is not None
    program = capture(model, inputs, options, RewriteContext(backend="executorch"))
    assert unbounded_inputs(program) == []
    uppers = sorted({int(r.upper) for r in program.range_constraints.values()})
    assert uppers == [MAX_BATCH, model.config.max_position_embeddings]
    assert len(warnings) == 1
    one = {"input_ids": inputs["input_ids"][:1], "attention_mask": inputs["attention_mask"][:1]}
    capture_options(model, one, config, warnings)
    assert any("size 1 on axis [0]" in w for w in warnings), "the size-1 warning the capture gives for dynamic=True"


def test_unbounded_capture_is_planned_at_the_sample_size_and_refused_beyond(caplog: pytest.LogCaptureFixture) -> None:
    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.softmax(x * 3, dim=-1)

    x = torch.randn(2, 6)
    # A program captured with a plain Dim.AUTO: torch.export leaves the axis without an upper bound.
    captured = torch.export.export(Scale(), (), {"x": x}, dynamic_shapes={"x": {1: Dim.AUTO}})
    with caplog.at_level(logging.WARNING, logger="hfexport"):
        manager = lower(captured, ExecutorchConfig(), RewriteContext(backend="executorch"))
    assert [r.message for r in caplog.records if "at their sample size" in r.message] != []
    program = ExecutorchProgram(manager)
    assert program.slots[0].max_sizes == (2, 6)
    _assert_close(program.run({"x": x})[0], torch.softmax(x * 3, -1), "sample")
    with pytest.raises(InputError, match="size 7 on axis 1"):
        program.run({"x": torch.randn(2, 7)})


# -- memory planning flags ------------------------------------------------------------------------------


class Accumulate(torch.nn.Module):
    """A linear layer plus a running sum in a buffer: one input, one output, one mutable buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return self.linear(x) + 1


def _planning(manager: ExecutorchProgramManager) -> dict[str, Any]:
    plan = manager.executorch_program.execution_plan[0]
    tensors = {i: v.val for i, v in enumerate(plan.values) if hasattr(v.val, "allocation_info")}
    named = [t for t in tensors.values() if t.extra_tensor_info and t.extra_tensor_info.fully_qualified_name]
    named_buffer = named[0] if named else None
    return {
        "input": tensors[plan.inputs[0]].allocation_info is not None,
        "output": tensors[plan.outputs[0]].allocation_info is not None,
        "buffer_named": named_buffer is not None,
        "buffer": named_buffer.allocation_info is not None if named_buffer is not None else True,
        "arena": sum(plan.non_const_buffer_sizes),
    }


def test_each_memory_planning_flag_changes_the_program() -> None:
    x = torch.randn(3, 4)
    default = ExecutorchExporter().export(Accumulate(), {"x": x}, ExecutorchConfig())
    base = _planning(default)
    assert base == {"input": True, "output": True, "buffer_named": False, "buffer": True, "arena": base["arena"]}
    with torch.no_grad():
        expected = Accumulate()(x)
    _assert_close(ExecutorchProgram(default).run({"x": x})[0], expected, "all planned")
    for flag, key in (("alloc_graph_input", "input"), ("alloc_graph_output", "output")):
        manager = ExecutorchExporter().export(Accumulate(), {"x": x}, ExecutorchConfig(**{flag: False}))
        planning = _planning(manager)
        assert planning[key] is False, flag
        assert all(planning[k] is base[k] for k in ("input", "output", "buffer") if k != key), flag
        assert planning["arena"] < base["arena"], f"{flag}: the arena no longer holds the {key}"
        meta = ExecutorchProgram(manager).method.metadata
        info = meta.input_tensor_meta(0) if key == "input" else meta.output_tensor_meta(0)
        assert info.is_memory_planned() is False, flag
    manager = ExecutorchExporter().export(Accumulate(), {"x": x}, ExecutorchConfig(alloc_mutable_buffers=False))
    planning = _planning(manager)
    # Left out of the plan and named, so the runtime can bind a caller-owned tensor to it.
    assert planning["buffer_named"] and planning["buffer"] is False
    assert planning["input"] and planning["output"] and planning["arena"] < base["arena"]


# -- errors and config ----------------------------------------------------------------------------------


class MustNotTrace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("traced")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_backend_without_a_device_fails_before_tracing() -> None:
    config = ExecutorchConfig(backend="cuda", dynamic=True)
    with pytest.raises(RuntimeError, match=r"backend='cuda'\) needs a CUDA device.*backend='xnnpack'"):
        check_backend(config)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        ExecutorchExporter().export(MustNotTrace(), {"x": torch.ones(2)}, config)
    check_backend(ExecutorchConfig(backend="xnnpack"))


def test_config_checks_and_auto_classes() -> None:
    config = AutoExportConfig.from_dict({"export_format": "executorch", "alloc_graph_input": False})
    assert isinstance(config, ExecutorchConfig) and config.backend == "xnnpack" and not config.alloc_graph_input
    assert isinstance(AutoHfExporter.from_config(config), ExecutorchExporter)
    assert ExecutorchConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="backend"):
        ExecutorchConfig(backend="mps")
    with pytest.raises(ConfigError, match="ExecutorchConfig"):
        ExecutorchExporter().export(MustNotTrace(), {"x": torch.ones(2)}, DynamoConfig())


def test_unbounded_inputs_lists_the_axes_without_an_upper_bound() -> None:
    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    x = torch.ones(2, 5)
    auto = torch.export.export(Double(), (x,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},))
    assert unbounded_inputs(auto) == ["x axis 0", "x axis 1"]
    bounded = torch.export.export(Double(), (x,), dynamic_shapes=({0: Dim.AUTO(max=8), 1: Dim.AUTO},))
    assert unbounded_inputs(bounded) == ["x axis 1"]
    assert unbounded_inputs(torch.export.export(Double(), (x,))) == []
