"""Architecture sweep: export every corpus entry with an hfexport exporter and check parity with eager.

    python tools/sweep.py --format dynamo --family causal_lm --jobs 2 --out sweep.md

Each model runs in its own subprocess (one hang or crash cannot stop the sweep). For each: export with
`dynamic=True`, compare the first output with eager on the sample and on the grown input (tolerance
1e-4 x max(1, max|ref|)), and list the rules that fired. Prints a markdown table and a summary line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def child_script(imports: str, export: str, tolerance: float, after: str = "") -> str:
    """The script a sweep runs per corpus entry (argv[1]: the entry's JSON; argv[2:]: the tool's own args).

    Shared by every backend: eager references on the sample and grown inputs, the comparison, the error
    summary and the ROW line. `imports` adds the backend's imports; `export` (top-level statements) exports
    `model` on `inputs` with `timed_export(exporter, config)` and defines `run(feed) -> tensor`, the main output
    of the exported artifact (it may write files under `tmp`); `after` runs once both inputs matched.
    """

    def block(code: str) -> str:
        return textwrap.indent(textwrap.dedent(code).strip("\n"), "    ")

    return (
        _CHILD_HEAD
        + textwrap.dedent(imports).strip("\n")
        + _CHILD_SETUP
        + block(export)
        + "\n"
        + _CHILD_COMPARE.replace("TOLERANCE", repr(tolerance))
        + (block(after) + "\n" if after.strip() else "")
        + _CHILD_TAIL
    )


_CHILD_HEAD = r"""
import json, shutil, sys, tempfile, time, warnings
warnings.filterwarnings("ignore")
import logging
logging.disable(logging.WARNING)
import torch
from hfexport.testing.corpus import load_entry
"""

_CHILD_SETUP = r"""

entry = load_entry(sys.argv[1])
row = {"model": entry.model_type, "status": "eager-error"}
tmp = tempfile.mkdtemp()

def first(out):
    return out[entry.output] if hasattr(out, "keys") else out[0]

def timed_export(exporter, config):
    start = time.perf_counter()
    result = exporter.export(model, inputs, config=config)
    row["export_s"] = round(time.perf_counter() - start, 2)
    row["rules"] = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    return result

try:
    model = entry.build_model()
    inputs, grown = entry.sample_inputs(), entry.grown_inputs()
    with torch.no_grad():
        expected = [first(model(**inputs)), first(model(**grown))]
    row["status"] = "export-error"
"""

_CHILD_COMPARE = r"""
    for what, feed, ref in (("sample", inputs, expected[0]), ("grown", grown, expected[1])):
        row["status"] = f"{what}-error"
        with torch.no_grad():
            actual = run(feed)
        if actual.shape != ref.shape:
            row["status"] = f"{what}-shape"
            row["error"] = f"{list(actual.shape)} != {list(ref.shape)}"
            raise SystemExit(0)
        diff = (ref.float() - actual.float()).abs().max().item()
        row[f"{what}_diff"] = diff
        if not diff <= TOLERANCE * max(1.0, ref.abs().max().item()):
            row["status"] = f"{what}-mismatch"
            raise SystemExit(0)
    row["status"] = "ok"
"""

_CHILD_TAIL = r"""
except SystemExit:
    pass
except BaseException as exc:
    text = str(exc).strip()
    row["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
    if "Summary:" in text:  # OpenVINO's converter puts the failing ops after its first line
        row["error"] += " " + " ".join(text[text.find("Summary:"):].split())[:300]
    elif exc.__cause__ is not None:
        row["error"] += f" <- {type(exc.__cause__).__name__}: {str(exc.__cause__).strip()[:300]}"
finally:
    shutil.rmtree(tmp, ignore_errors=True)
    print("ROW " + json.dumps(row))
"""

_CHILD = child_script(
    """
    from hfexport import AutoExportConfig, AutoHfExporter
    """,
    """
    config = AutoExportConfig.from_dict({"export_format": sys.argv[2], "dynamic": True})
    module = timed_export(AutoHfExporter.from_config(config), config).module()

    def run(feed):
        return first(module(**feed))
    """,
    tolerance=1e-4,
)


def run_one(path: Path, child: str, child_args: list[str], timeout: int) -> dict:
    """Run the `child` script on one corpus entry in a subprocess; return its ROW (or why there is none)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", child, str(path), *child_args], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"model": path.stem, "status": "timeout", "error": f">{timeout}s"}
    rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    row = json.loads(rows[-1]) if rows else {"model": path.stem, "status": "crash", "error": proc.stderr[-300:]}
    row["wall_s"] = round(time.perf_counter() - start, 1)
    return row


def run_sweep(
    argv: list[str] | None, child: str, label: str, with_format: bool = True, child_args: list[str] | None = None
) -> int:
    """Shared command line of the sweep tools: select entries, run `child` on each, print the table.

    The child gets the entry path, then `--format` (when `with_format`), then `child_args`.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if with_format:
        parser.add_argument("--format", default="dynamo")
    parser.add_argument("--family", default="causal_lm")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "tests/fixtures/corpus")
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    child_args = ([args.format] if with_format else []) + list(child_args or [])
    label = f"{label} {args.format}" if with_format and label != "dynamo" else (args.format if with_format else label)

    # `_skipped.json` and other underscore files are the generator's notes, not entries
    paths = sorted(p for p in (args.root / args.family).glob("*.json") if not p.name.startswith("_"))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [p for p in paths if p.stem in wanted]
    done = 0

    def one(path: Path) -> dict:
        nonlocal done
        row = run_one(path, child, child_args, args.timeout)
        done += 1
        # Progress on stderr: a sweep of the corpus takes minutes to hours.
        print(f"[{done}/{len(paths)}] {row['model']}: {row['status']}", file=sys.stderr, flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, paths))

    lines = [
        "| model | status | export s | sample diff | grown diff | rules fired | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rules = ", ".join(f"{k}×{v}" for k, v in r.get("rules", {}).items())
        diffs = [f"{r[k]:.2g}" if k in r else "" for k in ("sample_diff", "grown_diff")]
        # One line per model: errors are cut to their first line (the JSON keeps them whole).
        error = " ".join(r.get("error", "").split())[:240]
        cells = [r["model"], r["status"], str(r.get("export_s", "")), *diffs, rules, error]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    ok = sum(r["status"] == "ok" for r in rows)
    summary = f"{label} {args.family}: {ok}/{len(rows)} ok ({100 * ok / max(1, len(rows)):.0f}%)"
    table = "\n".join([*lines, "", summary])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "dynamo")


if __name__ == "__main__":
    raise SystemExit(main())
