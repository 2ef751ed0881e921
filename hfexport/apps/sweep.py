"""Sweep: export many tiny-config models, and tabulate which rules fired on which model (the hit matrix).

    hfexport sweep --configs tests/fixtures/corpus/causal_lm --format onnx --html heatmap.html --csv hits.csv

Each config is a corpus entry (the JSON format of `tests/fixtures/corpus`, read by
`hfexport.testing.corpus`). Each model runs in its own process, so a crash or hang costs one row, not
the sweep (a `CaseRunner` runs them: `LocalRunner`, child processes of this one, or `hfexport.apps.sweep_ray.RayRunner`,
Ray tasks): build from the config (fixed seed), export with `dynamic=True`, save with `hfexport.save`,
load with `hfexport.load` and run in the format's runtime on the sample input and on a longer one, and
compare the entry's main output with eager (|diff| <= tolerance * max(1, max|eager|)).

The result is a models x rules matrix of hit counts with pass/fail and the max abs diff per model, written
as CSV, JSON, a static HTML heatmap and (with matplotlib) a PNG. Rules of the format that fired on no model
are *dead* here; rules whose `expires` requirement the installed packages meet are *expired*: both lists
are candidates for removal (confirm with `hfexport audit --ablate`).
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hfexport.apps.sweep_case import GENERATION, GenerationCheck
from hfexport.backends.registry import backend
from hfexport.core.timing import eta

Progress = Callable[[str], None]


@dataclass
class SweepRow:
    """One model of a sweep: its status, the worst diff against eager, and the rules that fired."""

    model: str
    model_type: str = ""
    status: str = "crash"
    max_abs_diff: float | None = None
    tolerance: float | None = None
    hits: dict[str, int] = field(default_factory=dict)
    error: str = ""
    export_s: float | None = None
    wall_s: float = 0.0
    shapes: list[str] = field(default_factory=list)  # the inputs checked against eager: sample, grown, long, ...
    # Generation cases (`--generation`): the components exported, the share of new tokens that differ from the
    # model's own `generate`, and whether the prompt ran unpadded (the model's own generate refused the padding).
    components: list[str] = field(default_factory=list)
    tokens_differ: float | None = None
    unpadded: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Sweep:
    """A models x rules hit matrix for one format, with the rules that never fired and those expired."""

    export_format: str
    rows: list[SweepRow]
    rules: list[str]  # every rule of the format, in registry order (the matrix's columns)
    expired: dict[str, str] = field(default_factory=dict)  # rule id -> why (installed version)
    check: str = "export"  # what each case checked: "export" (outputs against eager) or "generation" (tokens)

    @property
    def fired(self) -> list[str]:
        """The rules that fired on at least one model, in registry order."""
        return [r for r in self.rules if any(row.hits.get(r) for row in self.rows)]

    @property
    def dead(self) -> list[str]:
        return [r for r in self.rules if not any(row.hits.get(r) for row in self.rows)]

    @property
    def passed(self) -> int:
        return sum(row.ok for row in self.rows)

    def summary(self) -> str:
        n = len(self.rows)
        what = self.export_format + (f" {self.check}" if self.check != "export" else "")
        return (
            f"{what}: {self.passed}/{n} models ok; {len(self.fired)} of {len(self.rules)} rules fired, "
            f"{len(self.dead)} dead, {len(self.expired)} expired"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.export_format,
            "check": self.check,
            "summary": self.summary(),
            "rules": self.rules,
            "fired": self.fired,
            "dead_rules": self.dead,
            "expired_rules": self.expired,
            "rows": [{**asdict(row), "ok": row.ok} for row in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_csv(self) -> str:
        """One row per model: status, max diff, then the hit count of every rule of the format."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["model", "status", "max_abs_diff", "tolerance", "export_s", *self.rules])
        for row in self.rows:
            diff = "" if row.max_abs_diff is None else f"{row.max_abs_diff:.3g}"
            tolerance = "" if row.tolerance is None else f"{row.tolerance:.3g}"
            export_s = "" if row.export_s is None else row.export_s
            writer.writerow(
                [row.model, row.status, diff, tolerance, export_s, *(row.hits.get(r, 0) for r in self.rules)]
            )
        return out.getvalue()

    def table(self) -> str:
        """The terminal view: one line per model, then the dead and expired rules."""
        rows = [("model", "status", "max diff", "rules fired")]
        for row in self.rows:
            diff = "" if row.max_abs_diff is None else f"{row.max_abs_diff:.2g}"
            fired = ", ".join(f"{k}x{v}" for k, v in row.hits.items())
            status = row.status + (f" ({_shorten(row.error, 80)})" if row.error and not row.ok else "")
            rows.append((row.model, status, diff, fired))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
        lines.append(f"dead rules (0 hits on every model): {', '.join(self.dead) or 'none'}")
        expired = ", ".join(f"{k} ({v})" for k, v in self.expired.items())
        lines.append(f"expired rules: {expired or 'none'}")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """One table row per model (status, export seconds, max diff or share of tokens that differ, rules fired,
        the error's first 240 characters), then the summary line."""
        lines = [
            "| model | status | export s | diff | rules fired | error |",
            "|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            diff = row.tokens_differ if self.check == "generation" else row.max_abs_diff
            fired = ", ".join(f"{k}×{v}" for k, v in row.hits.items())
            export_s = "" if row.export_s is None else str(row.export_s)
            cells = [
                row.model,
                row.status,
                export_s,
                "" if diff is None else f"{diff:.2g}",
                fired,
                _shorten(row.error, 240),
            ]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        return "\n".join([*lines, "", self.summary()]) + "\n"

    def to_html(self) -> str:
        """A static heatmap: models x fired rules, cell shade by hit count; dead and expired rules below."""
        fired = self.fired
        top = max((row.hits.get(r, 0) for row in self.rows for r in fired), default=1) or 1

        def shade(hits: int) -> str:
            if not hits:
                return "#ffffff"
            level = 0.25 + 0.75 * math.log1p(hits) / math.log1p(top)
            return f"rgba(200, 60, 20, {level:.2f})"

        head = "".join(f'<th class="rule"><div>{html.escape(r)}</div></th>' for r in fired)
        body = []
        for row in self.rows:
            verdict = "pass" if row.ok else "fail"
            diff = "" if row.max_abs_diff is None else f"{row.max_abs_diff:.2g}"
            title = html.escape(row.error or row.status, quote=True)
            cells = "".join(
                f'<td style="background:{shade(row.hits.get(r, 0))}">{row.hits.get(r, 0) or ""}</td>' for r in fired
            )
            body.append(
                f'<tr><th class="model">{html.escape(row.model)}</th>'
                f'<td class="{verdict}" title="{title}">{html.escape(row.status)}</td><td>{diff}</td>{cells}</tr>'
            )
        dead = "".join(f"<li>{html.escape(r)}</li>" for r in self.dead) or "<li>none</li>"
        expired = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in self.expired.items())
        return _HTML.format(
            title=html.escape(f"hfexport sweep: {self.export_format}"),
            summary=html.escape(self.summary()),
            head=head,
            body="\n".join(body),
            dead=dead,
            expired=expired or "<li>none</li>",
        )

    def save_png(self, path: str | Path) -> Path:
        """The heatmap as a picture (needs matplotlib: `pip install matplotlib`)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fired = self.fired or self.rules[:1]
        grid = [[row.hits.get(r, 0) for r in fired] for row in self.rows]
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(fired) + 3), max(3, 0.3 * len(self.rows) + 2)))
        ax.imshow([[math.log1p(v) for v in line] for line in grid] or [[0]], cmap="Reds", aspect="auto")
        ax.set_xticks(range(len(fired)), fired, rotation=90, fontsize=7)
        labels = [f"{'✓' if row.ok else '✗'} {row.model}" for row in self.rows]
        ax.set_yticks(range(len(self.rows)), labels, fontsize=7)
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                if value:
                    ax.text(j, i, str(value), ha="center", va="center", fontsize=6)
        ax.set_title(self.summary(), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return Path(path)


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; font-size: 13px; }}
table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 2px 5px; text-align: center; }}
th.model {{ text-align: left; white-space: nowrap; }}
th.rule {{ height: 220px; vertical-align: bottom; }}
th.rule div {{ writing-mode: vertical-rl; transform: rotate(180deg); white-space: nowrap; }}
td.pass {{ background: #cdeccd; }}
td.fail {{ background: #f4c2c2; }}
</style></head>
<body>
<h1>{title}</h1>
<p>{summary}</p>
<table>
<thead><tr><th>model</th><th>status</th><th>max abs diff</th>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<h2>Dead rules (0 hits on every model)</h2>
<ul>{dead}</ul>
<h2>Expired rules (their <code>expires</code> requirement is met)</h2>
<ul>{expired}</ul>
</body></html>
"""


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def find_configs(root: str | Path, only: Sequence[str] | None = None) -> list[Path]:
    """The corpus entries under `root` (a JSON file or a folder searched recursively), sorted."""
    root = Path(root)
    if root.is_file():
        paths = [root]
    elif root.is_dir():
        # `_skipped.json` and other `_`-named files describe a corpus folder; they are not entries.
        paths = sorted(p for p in root.rglob("*.json") if not p.name.startswith("_"))
    else:
        raise FileNotFoundError(f"--configs {root} is neither a corpus JSON file nor a folder of them")
    if only:
        wanted = set(only)
        paths = [p for p in paths if p.stem in wanted]
    if not paths:
        raise FileNotFoundError(f"no corpus configs (*.json) under {root}" + (f" named {sorted(only)}" if only else ""))
    return paths


def _rule_columns(export_format: str) -> tuple[list[str], dict[str, str]]:
    from hfexport.rewrites.catalogue import expiry_status
    from hfexport.rewrites.engine import default_registry

    rules = [r for r in default_registry().rules() if r.applies_to(str(export_format))]
    expired = {}
    for rule in default_registry().rules():
        is_expired, why = expiry_status(rule.meta)
        if is_expired:
            expired[rule.id] = why
    return [r.id for r in rules], expired


def _case_names(path: Path) -> tuple[str, str]:
    """(row name, model type) of a case that never reported a row: the entry's ``family/model_type`` as its
    finished rows are named, read from the JSON alone; the file stem when that cannot be read."""
    try:
        raw = json.loads(Path(path).read_text())
        variant = f"@{raw['variant']}" if raw.get("variant") else ""  # a config variant of the type
        return f"{raw['family']}/{raw['model_type']}{variant}", str(raw["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return path.stem, ""


def timeout_row(path: Path, timeout: float) -> SweepRow:
    """The row of a case still running after `timeout` seconds (its process was killed)."""
    name, model_type = _case_names(path)
    return SweepRow(name, model_type, status="timeout", error=f"over {timeout:.0f}s", wall_s=round(timeout, 1))


def crash_row(path: Path, error: str, wall_s: float) -> SweepRow:
    """The row of a case whose process died without reporting one (a segfault, out of memory, a kill)."""
    name, model_type = _case_names(path)
    return SweepRow(name, model_type, status="crash", error=error[-400:], wall_s=round(wall_s, 1))


def run_one(path: Path, export_format: str, config: dict[str, Any], timeout: float) -> SweepRow:
    """Run one corpus entry in a child process (`python -m hfexport.apps.sweep_case ...`); return its row."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "hfexport.apps.sweep_case", str(path), export_format, json.dumps(config)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return timeout_row(path, timeout)
    found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if not found:
        tail = proc.stderr.strip().splitlines()[-3:] if proc.stderr else [f"exit code {proc.returncode}"]
        return crash_row(path, " | ".join(tail), time.perf_counter() - start)
    row = SweepRow(**json.loads(found[-1]))
    row.wall_s = round(time.perf_counter() - start, 1)
    return row


@dataclass
class SweepProgress:
    """The progress lines of a sweep, the same whichever runner runs it: one when a case starts, and one when
    it ends with its status, time, the sweep's elapsed time and an ETA. Thread-safe (runners call it from
    worker threads)."""

    total: int
    export_format: str
    say: Progress
    started: int = 0
    done: int = 0
    start: float = field(default_factory=time.perf_counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def case_started(self, path: Path) -> None:
        with self.lock:
            self.started += 1
            self.say(f"[{self.started}/{self.total}] {path.stem}: exporting to {self.export_format}")

    def case_done(self, row: SweepRow) -> None:
        with self.lock:
            self.done += 1
            diff = "" if row.max_abs_diff is None else f", max diff {row.max_abs_diff:.2g}"
            left = eta(self.done, self.total, time.perf_counter() - self.start)
            self.say(f"[{self.done}/{self.total} done] {row.model}: {row.status}{diff} ({row.wall_s:.0f}s); {left}")


class CaseRunner(Protocol):
    """Runs the cases of a sweep, each in a process of its own, and returns their rows in the order of
    `paths`. A case that crashes or outlives `timeout` becomes a row (`crash_row`, `timeout_row`), never an
    exception. It calls `progress.case_started` and `progress.case_done` once per case."""

    def describe(self) -> str:
        """How the cases run, for the sweep's first progress line ("with 2 job(s)")."""
        ...

    def run(
        self,
        paths: Sequence[Path],
        export_format: str,
        config: dict[str, Any],
        timeout: float,
        progress: SweepProgress,
    ) -> list[SweepRow]: ...


@dataclass
class LocalRunner:
    """Cases as child processes of this one (`run_one`), `jobs` at a time."""

    jobs: int = 1

    def describe(self) -> str:
        return f"with {self.jobs} job(s)"

    def run(
        self,
        paths: Sequence[Path],
        export_format: str,
        config: dict[str, Any],
        timeout: float,
        progress: SweepProgress,
    ) -> list[SweepRow]:
        def one(path: Path) -> SweepRow:
            progress.case_started(path)
            row = run_one(path, export_format, config, timeout)
            progress.case_done(row)
            return row

        with ThreadPoolExecutor(max(1, self.jobs)) as pool:
            return list(pool.map(one, paths))


def run_sweep(
    paths: Sequence[Path],
    export_format: str,
    *,
    config: dict[str, Any] | None = None,
    jobs: int = 1,
    timeout: float = 600.0,
    progress: Progress | None = None,
    runner: CaseRunner | None = None,
    generation: GenerationCheck | None = None,
) -> Sweep:
    """Export, save, load and compare every entry of `paths` for `export_format`; return the hit matrix.

    With `generation`, each case exports for generation and compares `hfexport.runtime.generate`'s tokens with
    the model's own `generate` instead (`hfexport.apps.sweep_case.generation_case`). The cases run on `runner` (default:
    `LocalRunner(jobs)`; `hfexport.apps.sweep_ray.RayRunner` runs them as Ray tasks): the rows are the same records
    whichever runs them.
    """
    from hfexport.auto import AutoExportConfig

    # Each backend's comparison settings (`Backend.compare_config`: OpenVINO keeps float32 weights), then the
    # caller's; a generation case exports as `export_for_generation` does by default.
    merged = {**(backend(export_format).compare_config if generation is None else {}), **(config or {})}
    # A bad format or config field fails here, once, not in every child.
    AutoExportConfig.from_dict({"export_format": export_format, "dynamic": True, **merged})
    if generation is not None:
        merged[GENERATION] = generation.to_dict()
    rules, expired = _rule_columns(export_format)
    counter = SweepProgress(len(paths), export_format, progress or (lambda _message: None))
    rows = (runner or LocalRunner(jobs)).run(paths, export_format, merged, timeout, counter)
    return Sweep(export_format, rows, rules, expired, check="export" if generation is None else "generation")
