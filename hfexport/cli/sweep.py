"""`hfexport sweep`: export many tiny-config models; write the models x rules hit matrix."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hfexport.cli.exits import UsageError
from hfexport.cli.models import config_json
from hfexport.cli.models import split as _split
from hfexport.cli.progress import step as _step


def cmd_sweep(args: argparse.Namespace) -> int:
    from hfexport.sweep import find_configs, run_sweep

    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            # Refused before the sweep: a PNG that silently never appears after an hour is worse.
            raise UsageError(
                "--png needs matplotlib, which is not installed (pip install matplotlib); "
                "--html writes the same heatmap as a static page without it"
            ) from None
    extra: dict[str, Any] = config_json(args.config)
    try:
        paths = find_configs(args.configs, _split(args.only) or None)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    _step(f"sweeping {len(paths)} model(s) to {args.format} with {args.jobs} job(s)")
    sweep = run_sweep(
        paths, args.format, config=extra, jobs=args.jobs, timeout=args.timeout, progress=lambda m: _step(m)
    )
    print(sweep.table())
    for path, text in ((args.csv, sweep.to_csv()), (args.json, sweep.to_json()), (args.html, sweep.to_html())):
        if path:
            Path(path).write_text(text)
            _step(f"wrote {path}")
    if args.png:
        sweep.save_png(args.png)
        _step(f"wrote {args.png}")
    return 0
