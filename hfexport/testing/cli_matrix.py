"""The command line's matrix: every built-in tiny model x every format x {plain, `--validate`, `--generation
--validate`}, each cell the real `python -m hfexport export` in a subprocess.

Two commands per (model, format): `export --validate` and `export --generation --validate`. The plain
`export` is the first of them without its last step (validation runs on the artifact the save published), so
its cell is read from that run: the export and the save succeeded and left the artifact's files. A cell either
works, or is refused before any work (exit 2, one `error:` line, no output folder); a shape the eager model itself
refuses, or that the export keeps static by design, is a skipped check with the reason, never a failure.

`tests/test_cli_matrix.py` runs it (each command once per test session) and `tools/cli_matrix.py` prints the
table of docs/cli.md from the same runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.formats import FORMATS
from hfexport.tiny import TINY_MODELS

MODES: dict[str, tuple[str, ...]] = {
    "validate": ("--validate",),
    "generation": ("--generation", "--validate"),
}
# The columns of the table: the plain export is read from the `--validate` run (see the module docstring).
COLUMNS = {"plain": "validate", "--validate": "validate", "--generation --validate": "generation"}


@dataclass
class CliRun:
    """One `hfexport export` run: its arguments, exit code, output, time and the folder it wrote."""

    model: str
    export_format: str
    mode: str
    args: list[str]
    output: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def first_stderr_line(self) -> str:
        return (self.stderr.splitlines() or [""])[0]

    @property
    def errors(self) -> list[str]:
        """The lines of stderr that report a failure (`error:`, `validation failed:`) or a traceback."""
        marks = ("error:", "validation failed:", "Traceback")
        return [line for line in self.stderr.splitlines() if line.startswith(marks)]

    @property
    def manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.output / "manifest.json").read_text())
        except (OSError, ValueError):
            return None


@dataclass
class Cell:
    """The verdict of one cell of the matrix, as the table prints it."""

    model: str
    export_format: str
    column: str
    verdict: str  # "works", "refused", "FAILED"
    detail: str = ""
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)

    def text(self) -> str:
        words = self.verdict + (f" ({self.detail})" if self.detail else "")
        return words


def run_command(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """`python -m hfexport ARGS` in a subprocess (Python's warnings off, `HFEXPORT_DEBUG` unset)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("HFEXPORT_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def run_cell(model: str, export_format: str, mode: str, root: Path, timeout: float = 1800) -> CliRun:
    """Run `hfexport export --model M --format F <mode's flags> --output root/M.F.mode` in a subprocess."""
    output = root / f"{model}.{export_format}.{mode}"
    args = ["export", "--model", model, "--format", export_format, "--output", str(output), *MODES[mode]]
    start = time.perf_counter()
    result = run_command(*args, timeout=timeout)
    return CliRun(
        model,
        export_format,
        mode,
        args,
        output,
        result.returncode,
        result.stdout,
        result.stderr,
        time.perf_counter() - start,
    )


def skipped_checks(manifest: Mapping[str, Any] | None) -> list[str]:
    """The other-shape checks a validation skipped, each with its reason (`name: reason`)."""
    shapes = ((manifest or {}).get("validation") or {}).get("shapes") or []
    return [f"{s['name']}: {s['skipped']}" for s in shapes if isinstance(s, Mapping) and s.get("skipped")]


def cell(run: CliRun, column: str) -> Cell:
    """The verdict of `column` read from `run` (the plain column from the `--validate` run's export and save)."""
    base = Cell(run.model, run.export_format, column, "FAILED", seconds=run.seconds)
    if run.returncode == 2 and run.first_stderr_line.startswith("error:") and not run.output.exists():
        base.verdict, base.detail = "refused", run.first_stderr_line.removeprefix("error: ")
        return base
    manifest = run.manifest
    if column == "plain":
        saved = manifest is not None and "• saved in" in run.stderr
        if saved:
            base.verdict = "works"
        else:
            base.detail = (run.errors or [f"exit {run.returncode}"])[0]
        return base
    validation = (manifest or {}).get("validation") or {}
    if run.returncode == 0 and validation.get("ok") is True:
        base.verdict = "works"
        base.skipped = skipped_checks(manifest)
        if base.skipped:
            base.detail = "; ".join(f"{s.split(':')[0]} skipped" for s in base.skipped)
        return base
    base.detail = (run.errors or [f"exit {run.returncode}"])[0]
    return base


def markdown_table(cells: list[Cell]) -> str:
    """model x format rows, one column per mode: the table of docs/cli.md."""
    by_key = {(c.model, c.export_format, c.column): c for c in cells}
    rows = ["| model | format | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for model in TINY_MODELS:
        for export_format in FORMATS:
            texts = [
                by_key[(model, export_format, column)].text()
                for column in COLUMNS
                if (model, export_format, column) in by_key
            ]
            if texts:
                rows.append(f"| `{model}` | {export_format} | " + " | ".join(texts) + " |")
    return "\n".join(rows)
