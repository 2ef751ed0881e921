"""`hfexport bench`: how fast a model's exported generation runs on this machine, per backend and precision."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hfexport.cli.exits import ExitCode, UsageError
from hfexport.cli.models import load_model
from hfexport.cli.models import split as _split
from hfexport.cli.progress import step as _step


def bench_choices(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The backends and precisions `args` names, refused with the valid choices before anything is loaded."""
    from hfexport.apps.bench import BACKENDS, DEFAULT_BACKENDS, PRECISION_BITS

    backends = list(_split(args.backends)) if args.backends else list(DEFAULT_BACKENDS)
    precisions = list(_split(args.precisions)) if args.precisions else ["fp32"]
    for flag, given, valid in (("--backends", backends, BACKENDS), ("--precisions", precisions, PRECISION_BITS)):
        wrong = [value for value in given if value not in valid]
        if wrong or not given:
            raise UsageError(f"{flag} {','.join(wrong) or '(none)'}: choose from {', '.join(valid)}")
    for flag, value in (("--prompt", args.prompt), ("--new", args.new), ("--repeats", args.repeats)):
        if value < (2 if flag == "--new" else 1):
            raise UsageError(f"{flag} must be at least {2 if flag == '--new' else 1}, not {value}")
    return backends, precisions


def cmd_bench(args: argparse.Namespace) -> int:
    from hfexport.apps.bench import bench_generation

    backends, precisions = bench_choices(args)
    _step(f"loading {args.model}")
    model, _ = load_model(args.model, "causal-lm", dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    if not hasattr(model, "generate"):
        raise UsageError(f"--model {args.model}: {type(model).__name__} has no generate(); bench times generation")
    result = bench_generation(
        model,
        backends=backends,
        precisions=precisions,
        prompt=args.prompt,
        new=args.new,
        repeats=args.repeats,
        bandwidth_mb=args.bandwidth_mb,
        on_step=_step,
    )
    print(result.summary())
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
        _step(f"wrote {args.json}")
    # The table is printed whole first; a backend or precision that failed (its note says why) fails the command.
    return int(ExitCode.EXPORT_FAILED) if any(row.note for row in result.rows[1:]) else int(ExitCode.OK)
