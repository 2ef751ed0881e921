"""Progress per stage: the engine's stage listener (scoped to the caller's context) and the CLI's display."""

from __future__ import annotations

import threading

import pytest

from hfexport import DynamoConfig, DynamoExporter
from hfexport.cli import Progress
from hfexport.rewrites.engine import RewriteContext, stage_listener
from hfexport.tiny import TINY_MODELS


def test_stage_listener_hears_each_stage_of_an_export_in_order_once() -> None:
    tiny = TINY_MODELS["tiny-gpt2"]
    heard: list[str] = []
    with stage_listener(heard.append):
        DynamoExporter().export(tiny.build(), tiny.sample_inputs(), config=DynamoConfig(dynamic=True))
    assert heard == ["patch", "trace", "fx"]
    assert RewriteContext(backend="dynamo").on_stage is None, "the listener ends with its block"


def test_stage_listener_is_scoped_to_the_thread_that_set_it() -> None:
    heard: list[str] = []
    other: list[object] = []
    with stage_listener(heard.append):
        thread = threading.Thread(target=lambda: other.append(RewriteContext(backend="onnx").on_stage))
        thread.start()
        thread.join()
        context = RewriteContext(backend="onnx")
        context.current_stage = "aten"
        context.current_stage = "aten"  # the same stage again is not a new one
        context.current_stage = None
        context.current_stage = "onnx"
    assert heard == ["aten", "onnx"] and other == [None]


def test_plain_progress_prints_steps_and_stages(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(live=False)
    progress.step("exporting")
    progress.stage("patch")
    progress.stage("trace")
    progress.step("saving")
    progress.close()
    assert capsys.readouterr().err.splitlines() == ["• exporting", "  › stage patch", "  › stage trace", "• saving"]


def test_live_progress_reports_each_finished_stage_with_its_time(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    progress = Progress(live=True)
    progress.step("exporting")
    progress.stage("patch")
    progress.stage("trace")
    progress.step("saving")
    progress.close()
    lines = [line.strip() for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[0] == "• exporting" and lines[-1] == "• saving"
    assert [line.split()[1] for line in lines if line.startswith("✓")] == ["patch", "trace"]


def test_a_stage_entered_twice_in_one_export_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # ONNX runs its rules in two passes (fixes before the optimizer, fusions after): one `onnx` line. The next
    # export (a generation export's next component) starts at `patch` and shows its stages again.
    progress = Progress(live=False)
    for stage in ("patch", "trace", "onnx", "optimize", "onnx", "patch", "trace", "onnx", "optimize", "onnx"):
        progress.stage(stage)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"  › stage {s}" for s in ("patch", "trace", "onnx", "optimize") * 2]
