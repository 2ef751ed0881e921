"""`hfexport scan`: find export-breaking patterns in transformers' modeling sources."""

from __future__ import annotations

import argparse
from pathlib import Path

from hfexport.cli.exits import UsageError
from hfexport.cli.models import split as _split
from hfexport.cli.progress import step as _step


def cmd_scan(args: argparse.Namespace) -> int:
    from hfexport.apps.scan import scan

    models = list(_split(args.models)) or None
    try:
        result = scan(models=models, paths=args.path, progress=lambda message: _step(message), jobs=args.jobs)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    print(result)
    if args.json:
        Path(args.json).write_text(result.to_json())
        _step(f"wrote {args.json}")
    return 0
