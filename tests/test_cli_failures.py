"""An architecture that cannot be exported: a few lines that name the stage, the model's source line and what to
do next, not torch's partial graph (that is `--debug`'s); and `hfexport scan` finds the cause the line names.

The model is a corpus architecture whose trace fails on a data-dependent branch (FastSpeech2's length
regulator, `docs/sweeps/causes.json`: fastspeech2-length-regulator-data-dependent), saved as a folder without a
tokenizer; the commands run in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport.testing.corpus import load_entry

CORPUS = Path(__file__).parent / "fixtures" / "corpus_all" / "feature_extraction"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
ENV.pop("HFEXPORT_DEBUG", None)
SOURCE = "transformers/models/fastspeech2_conformer/modeling_fastspeech2_conformer.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV, timeout=900
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fastspeech2") / "model"
    load_entry(CORPUS / "fastspeech2_conformer.json").build_model().save_pretrained(path)
    return path


def test_a_failed_architecture_says_where_and_what_next_in_a_few_lines(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _run("export", "--model", str(folder), "--output", str(out))
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert lines[0] == f"• building {folder}"
    failed = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[failed].startswith(
        "error: export failed at stage 'trace' (FastSpeech2ConformerModel): GuardOnDataDependentSymNode: "
    )
    line = lines[failed + 1]
    assert line.startswith(f"  at {SOURCE}:") and line.endswith(" in length_regulator: if duration_labels.sum() == 0:")
    assert lines[failed + 2].startswith("  next: `hfexport scan --models fastspeech2_conformer` finds export hazards")
    assert "--explain" in lines[failed + 2] and "docs/authoring-rules.md" in lines[failed + 2]
    # The whole story in a dozen lines (torch's message and its partial graph were ~600), nothing left behind.
    assert len(lines) < 15 and "def forward(self" not in result.stderr, result.stderr[-3000:]
    assert not out.exists()
    # The cause the line names is a site `hfexport scan` reports.
    number = line.split(f"{SOURCE}:")[1].split(" ")[0]
    scan = _run("scan", "--models", "fastspeech2_conformer")
    assert scan.returncode == 0, scan.stderr[-2000:]
    assert any(s.split()[:2] == [number, "tensor-control-flow"] for s in scan.stdout.splitlines()), scan.stdout


@pytest.mark.slow
def test_debug_shows_the_partial_graph_and_the_whole_error(folder: Path, tmp_path: Path) -> None:
    result = _run("export", "--model", str(folder), "--output", str(tmp_path / "out"), "--debug")
    assert result.returncode == 3
    assert "def forward(self" in result.stderr and "error: export failed: [stage 'trace']" in result.stderr
