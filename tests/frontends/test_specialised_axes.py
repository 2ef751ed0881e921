"""An axis asked dynamic that the trace fixes (the model's code loops over it) is said, and recorded: the
report's `used["static_axes"]` (the CLI's --validate skips other sizes there, saying why)."""

from __future__ import annotations

import torch

from hfexport import DynamoConfig, DynamoExporter


class LoopOverSequence(torch.nn.Module):
    """A recurrence written as a Python loop over the sequence: the trace unrolls it for the sample's length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[:, 0])
        for step in range(x.shape[1]):
            state = 0.5 * state + x[:, step]
        return state


class Elementwise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_an_axis_the_trace_fixes_is_warned_about_and_recorded() -> None:
    exporter = DynamoExporter()
    program = exporter.export(LoopOverSequence(), {"x": torch.randn(3, 5, 4)}, config=DynamoConfig(dynamic=True))
    report = exporter.report
    assert report.used["static_axes"] == {"x": {"1": 5}}
    assert any(
        w.startswith("x: axis 1 at 5 exported static, the sample's size, though asked dynamic") for w in report.warnings
    )
    # The batch stayed dynamic: another batch runs, another length does not.
    assert program.module()(x=torch.randn(6, 5, 4)).shape == (6, 4)


def test_an_export_that_keeps_every_axis_dynamic_records_none() -> None:
    exporter = DynamoExporter()
    exporter.export(Elementwise(), {"x": torch.randn(3, 5)}, config=DynamoConfig(dynamic=True))
    assert "static_axes" not in exporter.report.used
    assert not any("exported static" in w for w in exporter.report.warnings)
