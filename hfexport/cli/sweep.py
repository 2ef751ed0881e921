"""`hfexport sweep`: export many tiny-config models; write the models x rules hit matrix."""

from __future__ import annotations

import argparse
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Any

from hfexport.cli.exits import UsageError
from hfexport.cli.export_config import config_json
from hfexport.cli.models import split as _split
from hfexport.cli.progress import step as _step

LOCAL_RAY = "local"  # `--ray` alone: start a local cluster


def cmd_sweep(args: argparse.Namespace) -> int:
    from hfexport.apps.sweep import find_configs, run_sweep
    from hfexport.apps.sweep_case import GenerationCheck

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
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, not {args.jobs}")
    if args.static and not args.generation:
        raise UsageError("--static sizes the cache of a generation sweep: add --generation")
    if args.static < 0:
        raise UsageError(f"--static must be a number of cache slots, not {args.static}")
    generation = GenerationCheck(static=args.static) if args.generation else None
    with _runner(args) as runner:
        purpose = " for generation" if generation else ""
        _step(f"sweeping {len(paths)} model(s) to {args.format}{purpose} {runner.describe()}")
        sweep = run_sweep(
            paths,
            args.format,
            config=extra,
            timeout=args.timeout,
            progress=_step,
            runner=runner,
            generation=generation,
        )
    print(sweep.table())
    outputs = (
        (args.markdown, sweep.to_markdown()),
        (args.csv, sweep.to_csv()),
        (args.json, sweep.to_json()),
        (args.html, sweep.to_html()),
    )
    for path, text in outputs:
        if path:
            Path(path).write_text(text)
            _step(f"wrote {path}")
    if args.png:
        sweep.save_png(args.png)
        _step(f"wrote {args.png}")
    return 0


def _runner(args: argparse.Namespace) -> Any:
    """The local runner, or the Ray one connected before any case runs (a missing ray or an unreachable
    cluster is refused as a usage error, exit 2)."""
    from hfexport.apps.sweep import LocalRunner

    if args.ray is None:
        return nullcontext(LocalRunner(args.jobs or 1))
    from hfexport.apps.sweep_ray import RayRunner, RayUnavailableError

    runner = RayRunner(address=None if args.ray == LOCAL_RAY else args.ray, jobs=args.jobs)
    try:
        runner.connect()
    except RayUnavailableError as exc:
        raise UsageError(str(exc)) from None
    return closing(runner)  # shut down however the sweep ends (Ctrl-C included)
