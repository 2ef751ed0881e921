"""Run the command line's matrix (every built-in model x format x {plain, --validate, --generation --validate})
and print the table docs/cli.md holds, with each command's time.

    python tools/cli_matrix.py                       # every cell, one command per core at a time
    python tools/cli_matrix.py --models tiny-llama --formats onnx,dynamo --jobs 1 --json matrix.json

The same commands and verdicts as tests/test_cli_matrix.py (`hfexport.testing.cli_matrix`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from hfexport.formats import FORMATS
from hfexport.testing.cli_matrix import COLUMNS, MODES, cell, markdown_table, run_cell
from hfexport.tiny import TINY_MODELS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(TINY_MODELS), help="comma-separated built-in models")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="commands at once")
    parser.add_argument("--json", help="also write the cells (verdict, detail, seconds) as JSON")
    args = parser.parse_args()
    keys = [
        (model, export_format, mode)
        for mode in MODES
        for model in args.models.split(",")
        for export_format in args.formats.split(",")
    ]
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="cli-matrix-") as root,
        concurrent.futures.ThreadPoolExecutor(args.jobs) as pool,
    ):
        runs = dict(zip(keys, pool.map(lambda key: run_cell(*key, Path(root)), keys), strict=True))
        cells = [cell(runs[(m, f, mode)], column) for (m, f, mode) in keys for column, wanted in COLUMNS.items()
                 if wanted == mode]  # fmt: skip
    print(markdown_table(cells))
    print()
    for (model, export_format, mode), run in runs.items():
        print(f"{model:15s} {export_format:10s} {mode:10s} exit {run.returncode}  {run.seconds:6.0f}s", file=sys.stderr)
    print(f"{len(runs)} commands in {time.perf_counter() - start:.0f}s with {args.jobs} at a time", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(c) for c in cells], indent=2))
    return 0 if all(c.verdict in ("works", "refused") for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
