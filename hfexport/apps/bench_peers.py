"""The rows and the table of tools/bench_peers.py (hfexport's generation exports beside the tools users deploy with):
which rows run, the script's arguments, and the readings of a run as one Markdown table. The peers themselves are
never imported: the script runs them in their own environments."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hfexport.apps.bench import token_agreement

SHAPES = ("smollm2-135m", "qwen2.5-0.5b")
DEFAULT_PEERS = Path.home() / ".cache" / "hfexport-peers"
# Weight bits of each precision (the ceiling of a row is the fp32 one times 32 / bits). optimum-intel's "default"
# row reads the same weights as its fp32 row.
BITS = {"fp32": 32, "default": 32, "int4": 4, "8da4w": 4}


@dataclass(frozen=True)
class RowSpec:
    """A row: who builds it, at which precision, in which environment (None: this interpreter, with hfexport)."""

    name: str
    precision: str
    env: str | None = None
    build_precision: str | None = None  # a row that runs another row's artifact (optimum-intel's default hint)
    builds: bool = True

    @property
    def key(self) -> str:
        return f"{self.name}:{self.precision}"

    @property
    def artifact_key(self) -> str:
        return f"{self.name}:{self.build_precision or self.precision}"


ROWS: tuple[RowSpec, ...] = (
    RowSpec("eager", "fp32", builds=False),
    RowSpec("hfexport-onnx", "fp32"),
    RowSpec("onnxruntime-genai", "fp32", env="onnxruntime-genai"),
    RowSpec("hfexport-onnx", "int4"),
    RowSpec("onnxruntime-genai", "int4", env="onnxruntime-genai"),
    RowSpec("hfexport-openvino", "fp32"),
    RowSpec("optimum-intel", "fp32", env="optimum-intel"),
    RowSpec("optimum-intel", "default", env="optimum-intel", build_precision="fp32", builds=False),
    RowSpec("hfexport-openvino", "int4"),
    RowSpec("optimum-intel", "int4", env="optimum-intel"),
    RowSpec("hfexport-executorch", "fp32"),
    RowSpec("optimum-executorch", "fp32", env="optimum-executorch"),
    RowSpec("hfexport-executorch", "int4"),
    RowSpec("optimum-executorch", "8da4w", env="optimum-executorch"),
)


def select_rows(spec: str | None) -> list[RowSpec]:
    """The rows named in `spec` (comma-separated keys `name:precision` or names), in table order; eager always first,
    and a row that runs another row's artifact brings that row's build along."""
    if not spec:
        return list(ROWS)
    wanted = [part.strip() for part in spec.split(",") if part.strip()]
    known = {row.key for row in ROWS} | {row.name for row in ROWS}
    unknown = [part for part in wanted if part not in known]
    if unknown:
        raise ValueError(f"row {unknown[0]!r}: one of {', '.join(sorted(known))}")
    chosen = [row for row in ROWS if row.key in wanted or row.name in wanted or row.name == "eager"]
    keys = {row.key for row in chosen}
    needed = {row.artifact_key for row in chosen if row.build_precision}
    return [row for row in ROWS if row.key in keys or (row.key in needed and row.builds)]


def parse_args(argv: list[str] | None = None, description: str = "") -> argparse.Namespace:
    """tools/bench_peers.py's arguments, `--rows` parsed into the rows it runs (`select_rows`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--layers", type=int, help="override the shapes' layer counts (e.g. 2 for a quick check)")
    parser.add_argument("--rows", help="comma-separated rows (name:precision or a name); default every row")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, rows alternating (default 2)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new", type=int, default=64, help="greedy new tokens (default 64)")
    parser.add_argument("--peers", type=Path, default=Path(os.environ.get("HFEXPORT_PEERS", DEFAULT_PEERS)))
    parser.add_argument("--work", type=Path, help="model folders and artifacts (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="keep artifacts already built under --work")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one build or run may take")
    parser.add_argument("--json", type=Path, help="also write the record (rows, rounds, bandwidth, load) here")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        parser.error(f"--shapes {bad[0]!r}: one of {', '.join(SHAPES)}")
    args.shapes = shapes
    try:
        args.rows = select_rows(args.rows)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1 or args.new < 2 or args.prompt < 1:
        parser.error("--rounds >= 1, --new >= 2 and --prompt >= 1")
    return args


@dataclass
class RowResult:
    """A row's build and its rounds' readings."""

    key: str
    precision: str
    export_s: float = float("nan")
    peak_rss_mb: float = float("nan")
    disk_bytes: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    note: str = ""

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else float("nan")


COLUMNS = (
    "row",
    "TTFT ms",
    "decode tok/s",
    "% of ceiling",
    "x eager",
    "tokens = eager",
    "export s",
    "export peak RSS MB",
    "MB on disk",
    "note",
)


def table(results: list[RowResult], ceiling: float, new: int) -> str:
    """The rows as one Markdown table; `ceiling` is the fp32 decode ceiling (tokens/s), the first row eager's."""
    eager = results[0]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        rate = r.median("decode_tokens_per_s")
        share = 100 * rate / (ceiling * 32 / BITS.get(r.precision, 32))
        if r is eager:
            tokens = "reference"
        elif r.tokens:
            same, prefix = token_agreement(r.tokens, eager.tokens)
            tokens = f"{same}/{new}, first {prefix}"
        else:
            tokens = "-"
        cells = (
            r.key,
            f"{r.median('ttft_s') * 1e3:.0f}",
            f"{rate:.1f}",
            f"{share:.0f}%",
            f"{rate / eager.median('decode_tokens_per_s'):.2f}",
            tokens,
            f"{r.export_s:.0f}" if r.export_s == r.export_s else "-",
            f"{r.peak_rss_mb:.0f}" if r.peak_rss_mb == r.peak_rss_mb else "-",
            f"{r.disk_bytes / 1e6:.0f}" if r.disk_bytes else "-",
            r.note.replace("|", "/"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
