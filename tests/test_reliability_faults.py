"""Issue #8, item 1: a failure at any point of an export reaches the caller naming the stage and rule, and
leaves nothing behind.

The points are not listed by hand: a first export records every point it passes through the engine's test
hook (`hfexport.rewrites.engine.fault_injection`): entering a stage, installing each patch rule, each call of a
patch replacement during the trace, each FX/ATen/ONNX/backend rule, the lowering's own steps (translate,
convert, edge, to_executorch), quantize and save. Then, for each point, an export with an exception injected
there must raise `HfExportError` whose `stage`, `rule_id` and message name the point and whose `__cause__` is
the injected exception; the model, the sample inputs and the process must be untouched (the snapshots of
tests/test_reliability_invariants.py), nothing may be left on disk, and a following normal export must succeed
and match eager.

Cheap points (everything before each backend's expensive conversion) run in the default tier; the points after
it (ONNX rules and save, OpenVINO model rules and save, ExecuTorch to_executorch), the quantizer and the ONNX
optimizer run in the slow tier.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from hfexport import AutoHfExporter
from hfexport.core.errors import HfExportError
from hfexport.rewrites.engine import fault_injection
from tests.test_reliability_invariants import (
    assert_close_to,
    eager_logits,
    export,
    micro_moe,
    run_logits,
    sample_inputs,
    skip_without,
    untouched,
)

Point = tuple[str, str | None]
# The stage whose entry starts each backend's expensive conversion: the default tier injects up to it.
EXPENSIVE = {"dynamo": None, "onnx": "translate", "openvino": "convert", "executorch": "edge"}


class Injected(RuntimeError):
    """The fault the tests inject."""


class _Stop(BaseException):
    """Ends a recording export early (a BaseException, so no stage wraps it)."""


def record_points(backend: str, stop_at: str | None = None, **fields: Any) -> list[Point]:
    """The distinct points an export passes, in order; with `stop_at`, up to and including that stage's entry."""
    points: list[Point] = []

    def hook(stage: str, rule_id: str | None) -> None:
        if (stage, rule_id) not in points:
            points.append((stage, rule_id))
        if stop_at is not None and (stage, rule_id) == (stop_at, None):
            raise _Stop

    model, inputs = micro_moe(), sample_inputs()
    with fault_injection(hook), contextlib.suppress(_Stop):
        export(model, inputs, backend, **fields)
    return points


def split_points(points: list[Point], shared: frozenset[Point] = frozenset()) -> tuple[list[Point], list[Point]]:
    """(default tier, slow tier). Default: every point before the trace (no trace needed: cheap), every stage entry
    and the first rule of each later stage, except the `shared` points another backend's default tier covers
    (the common frontend). Slow: all the others."""
    default: list[Point] = []
    rest: list[Point] = []
    traced = False
    seen_stages: set[str] = set()
    for stage, rule_id in points:
        traced = traced or stage == "trace"
        if (stage, rule_id) in shared:
            rest.append((stage, rule_id))
        elif rule_id is None or not traced or stage not in seen_stages:
            default.append((stage, rule_id))
            if rule_id is not None:
                seen_stages.add(stage)
        else:
            rest.append((stage, rule_id))
    return default, rest


def inject(backend: str, point: Point, tmp_path: Path | None = None, **fields: Any) -> HfExportError:
    """Export with `Injected` raised at `point`; check the error and that nothing was left behind."""
    model, inputs = micro_moe(), sample_inputs()

    def hook(stage: str, rule_id: str | None) -> None:
        if (stage, rule_id) == point:
            raise Injected(f"fault injected at {point}")

    with untouched(model, inputs), fault_injection(hook), pytest.raises(HfExportError) as info:
        export(model, inputs, backend, **fields)
    error = info.value
    stage, rule_id = point
    assert isinstance(error.__cause__, Injected), f"{point}: cause is {error.__cause__!r}"
    assert error.stage == stage and f"stage {stage!r}" in str(error), f"{point}: {error}"
    assert error.rule_id == rule_id, f"{point}: {error}"
    if rule_id is not None:
        assert f"rule {rule_id!r}" in str(error), f"{point}: {error}"
    assert "fault injected" in str(error)
    if tmp_path is not None:
        assert list(tmp_path.iterdir()) == [], f"{point}: left {sorted(p.name for p in tmp_path.iterdir())}"
    return error


def assert_normal_export_matches_eager(backend: str, **fields: Any) -> Any:
    model, inputs = micro_moe(), sample_inputs()
    program, exporter = export(model, inputs, backend, **fields)
    assert_close_to(run_logits(program, backend, inputs), eager_logits(model, inputs), backend)
    return exporter


def _check_coverage(backend: str, points: list[Point]) -> None:
    """The recording passed the points the issue names, so the injections below cover them."""
    stages = {stage for stage, _ in points}
    rules = {rule for _, rule in points if rule}
    assert {"patch", "trace", "fx"} <= stages, stages
    assert any(r.startswith("patch/") for r in rules), "no patch install point"
    # A patch replacement runs inside the trace where the backend batches the experts (OpenVINO, ExecuTorch);
    # ONNX translates transformers' grouped_mm op instead, and Dynamo keeps it.
    batched = "patch/moe-batched-experts"
    assert ("trace", batched) in points or backend not in ("openvino", "executorch"), points
    assert ("aten", "aten/grouped-mm-fallback") in points or backend != "onnx", points
    if backend != "dynamo":
        assert any(r.startswith("fx/") for r in rules), "no FX rule point"
    expected = {"onnx": "aten/", "openvino": "openvino/", "executorch": "executorch/"}.get(backend)
    if expected:
        assert any(r.startswith(expected) for r in rules), f"no {expected} rule point"


# The frontend points every backend passes (patch installs, the trace, the `fx` stage entry): the Dynamo test
# injects at them; the other backends' default tier injects only at their own points, the slow tier at all.
_FRONTEND = frozenset({("patch", None), ("trace", None), ("fx", None)})


def _shared(backend: str) -> frozenset[Point]:
    if backend == "dynamo":
        return frozenset()
    from hfexport.rewrites.engine import default_registry

    dynamo_rules = {rule.id for rule in default_registry().rules() if rule.applies_to("dynamo")}
    return _FRONTEND | {("patch", rule) for rule in dynamo_rules} | {("trace", rule) for rule in dynamo_rules}


# ExecuTorch's own points cost ~20 s under load (its import and five traces): slow tier, with everything after.
@pytest.mark.parametrize("backend", ["dynamo", "onnx", "openvino", pytest.param("executorch", marks=pytest.mark.slow)])
def test_a_fault_before_the_conversion_names_its_point_and_leaves_nothing_behind(backend: str) -> None:
    skip_without(backend)
    points = record_points(backend, stop_at=EXPENSIVE[backend])
    _check_coverage(backend, points)
    default, _ = split_points(points, _shared(backend))
    for point in default:
        inject(backend, point)
    if backend == "dynamo":
        # ONNX and OpenVINO's following normal exports are in the save test below; ExecuTorch's is in the slow
        # tier (its edge lowering takes 20-50 s).
        assert_normal_export_matches_eager(backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["dynamo", "onnx", "openvino", "executorch"])
def test_every_rule_before_the_conversion_fails_cleanly(backend: str) -> None:
    skip_without(backend)
    _, rest = split_points(record_points(backend, stop_at=EXPENSIVE[backend]), _shared(backend))
    for point in rest:
        inject(backend, point)


# OpenVINO's conversion is the slower one under load: its save runs in the slow tier.
@pytest.mark.parametrize("backend", ["onnx", pytest.param("openvino", marks=pytest.mark.slow)])
def test_a_save_that_fails_midway_leaves_no_file_and_the_next_save_works(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lowered model is written into a staging folder and moved into place only when complete."""
    skip_without(backend)
    target = tmp_path / "out" / ("model.onnx" if backend == "onnx" else "model.xml")
    fields: dict[str, Any] = {"output_path": str(target)}
    if backend == "onnx":
        from torch.onnx import ONNXProgram

        write = ONNXProgram.save
        owner, name = ONNXProgram, "save"
    else:
        import openvino

        write = openvino.save_model
        owner, name = openvino, "save_model"

    def half_written(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)  # every file written, then the disk "fills up"
        raise Injected("fault injected: disk full")

    monkeypatch.setattr(owner, name, half_written)
    model, inputs = micro_moe(), sample_inputs()
    with untouched(model, inputs), pytest.raises(HfExportError) as info:
        export(model, inputs, backend, **fields)
    assert info.value.stage == "save" and isinstance(info.value.__cause__, Injected)
    assert list(tmp_path.iterdir()) == [], "a failed save left files or folders"
    monkeypatch.undo()
    # The following normal export, which is also this backend's invariance-on-success check.
    model, inputs = micro_moe(), sample_inputs()
    expected = eager_logits(model, inputs)
    with untouched(model, inputs):
        program, exporter = export(model, inputs, backend, **fields)
    assert torch.equal(eager_logits(model, inputs), expected), "eager outputs changed"
    assert_close_to(run_logits(program, backend, inputs), expected, backend)
    assert "save" in exporter.report.stage_seconds
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(
        [target.name, target.name + ".data"] if backend == "onnx" else [target.name, "model.bin"]
    )


# -- slow tier: the points after each backend's conversion ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnx", "openvino", "executorch"])
def test_a_fault_after_the_conversion_names_its_point_and_leaves_nothing_behind(backend: str, tmp_path: Path) -> None:
    skip_without(backend)
    fields: dict[str, Any] = {}
    if backend != "executorch":
        fields["output_path"] = str(tmp_path / ("model.onnx" if backend == "onnx" else "model.xml"))
    points = record_points(backend, **fields)
    later = points[points.index((EXPENSIVE[backend], None)) + 1 :]
    assert later, points
    if backend != "executorch":
        assert later[-1] == ("save", None), later
    for path in tmp_path.iterdir():  # the recording export's files
        path.unlink()
    for point in later:
        inject(backend, point, tmp_path, **fields)
    assert_normal_export_matches_eager(backend)


@pytest.mark.slow
def test_a_quantizer_fault_names_the_quantize_stage() -> None:
    skip_without("onnx")
    from hfexport import OnnxConfig
    from hfexport.quantizers import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer

    def quantized_export(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
        config = OnnxConfig(quantizer=OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig()))
        return AutoHfExporter.from_config(config).export(model, inputs, config=config)

    points: list[Point] = []
    with fault_injection(lambda stage, rule: points.append((stage, rule))):
        quantized_export(micro_moe(), sample_inputs())
    assert ("quantize", None) in points

    def hook(stage: str, rule_id: str | None) -> None:
        if stage == "quantize":
            raise Injected("fault injected in the quantizer")

    model, inputs = micro_moe(), sample_inputs()
    with untouched(model, inputs), fault_injection(hook), pytest.raises(HfExportError) as info:
        quantized_export(model, inputs)
    assert info.value.stage == "quantize" and "stage 'quantize'" in str(info.value)
    assert isinstance(info.value.__cause__, Injected)


@pytest.mark.slow
def test_an_onnx_optimizer_failure_names_the_onnx_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer has no point of its own in the lowering yet: it runs inside stage 'onnx' (between the
    fix rules and the fusions), and a failure there names that stage."""
    skip_without("onnx")
    import onnxscript.optimizer

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise Injected("fault injected in the optimizer")

    monkeypatch.setattr(onnxscript.optimizer, "optimize", broken)
    model, inputs = micro_moe(), sample_inputs()
    with untouched(model, inputs), pytest.raises(HfExportError) as info:
        export(model, inputs, "onnx")
    assert info.value.stage in ("onnx", "optimize") and isinstance(info.value.__cause__, Injected)
    monkeypatch.undo()
    assert_normal_export_matches_eager("onnx")
