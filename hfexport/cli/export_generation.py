"""`hfexport export --generation`: every component `generate` runs, exported, saved as one artifact and (with
`--validate`) compared with `model.generate`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hfexport.cli import accuracy as quantized
from hfexport.cli.exits import ExitCode
from hfexport.cli.export_records import save_with_records, write_report_files
from hfexport.cli.failure import debugging, say_failed, without_partial_graphs
from hfexport.cli.models import GENERATION_TASKS
from hfexport.cli.progress import Progress
from hfexport.cli.validation import check_generation, conclude, crashed

# hfexport's warning for a size-1 sample axis (`frontends.torch_export.size_one_axis_warnings`).
_SIZE_ONE = "has size 1 on axis"


class _HoldSizeOne(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SIZE_ONE not in record.getMessage()


@contextlib.contextmanager
def _step_sizes_held() -> Iterator[None]:
    """While generation components export: their size-1 axes are not warned about on stderr as they come
    (`_step_sizes_as_notes` says them once, as what they are)."""
    log = logging.getLogger("hfexport")
    held = _HoldSizeOne()
    log.addFilter(held)
    try:
        yield
    finally:
        log.removeFilter(held)


def _step_sizes_as_notes(reports: dict[str, Any]) -> None:
    """A generation component's size-1 axes are the step `generate` ran (a decode step's one token, Whisper's
    decoder start token): not a sample to retrace with a larger size, as the warning of a single export advises,
    but what that graph takes. Each becomes a note of its report saying so."""
    for name, report in reports.items():
        held = [w for w in report.warnings if _SIZE_ONE in w]
        if not held:
            continue
        report.warnings = [w for w in report.warnings if _SIZE_ONE not in w]
        axes = "; ".join(w.split(" in the sample")[0] for w in held)
        report.notes.append(
            f"{axes} in the call generate made to {name}: that axis is static, the size this step takes "
            "(--multi-token-decode exports a decode step that takes any number of tokens)"
        )


def _generation_config(args: argparse.Namespace) -> Any:
    """`--static-cache N`: a static cache of N slots (None: generate's default, a growing cache)."""
    if not args.static_cache:
        return None
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=args.static_cache)


def export_generation(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, Any],
    exporter: Any,
    config: Any,
    progress: Progress,
    start: float,
) -> int:
    """`export --generation`: every component `generate` runs, saved as one artifact of several components.

    `--validate` loads the saved artifact (every component must open and run on the inputs recorded for it)
    and compares `--new-tokens` greedy tokens of the exported components with `model.generate`.
    """
    from hfexport.artifacts import update_manifest
    from hfexport.core.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener

    why = f" (--task {args.task}: what generate runs, as --generation)" if args.task in GENERATION_TASKS else ""
    progress.step(f"exporting the generation components of {type(model).__name__} to {args.format}{why}")
    try:
        with stage_listener(progress.stage), without_partial_graphs(debugging(args)), _step_sizes_held():
            programs = exporter.export_for_generation(
                model,
                inputs,
                config,
                generation_config=_generation_config(args),
                multi_token_decode=args.multi_token_decode,
            )
    except HfExportError as exc:
        progress.close()
        for report in getattr(exporter, "reports", {}).values():
            print(report.table(all_rules=args.all))
        if getattr(exporter, "reports", None):
            write_report_files(args, exporter.reports)
        say_failed(args, exc)
        return int(ExitCode.EXPORT_FAILED)
    reports = exporter.reports
    _step_sizes_as_notes(reports)
    for name, report in reports.items():
        progress.step(f"{name}: exported in {report.total_seconds:.1f}s; {len(report.fired)} rule(s) fired")
    # The programs generate() runs besides the documented components (a VLM's features and prefill) are saved too.
    names = [*programs, *getattr(programs, "runtime_components", {})]
    t0 = progress.step(f"saving {len(names)} components ({', '.join(names)}) to {args.output}/")
    save_with_records(args, programs, args.output, config, reports, model, inputs)
    progress.step(f"saved in {time.perf_counter() - t0:.1f}s")
    status = 0
    validation: dict[str, Any] | None = None
    if args.validate:
        try:
            validation, lines = check_generation(
                Path(args.output),
                model,
                inputs,
                programs,
                _generation_config(args),
                args.new_tokens or 8,
                progress.step,
            )
            accuracy = quantized.measure(args, model, Path(args.output), inputs, config)
            if accuracy is not None:  # a quantized export: the accuracy gates it, not token equality
                validation.update(ok=all(validation["components_run"].values()) and accuracy.ok)
                validation["accuracy"] = accuracy.to_dict()
                for report in reports.values():
                    report.accuracy = accuracy
                lines += quantized.accuracy_lines(accuracy)
        except Exception as exc:  # the check could not run: a failed validation, never success
            validation, lines, debug_exc = crashed(exc), [], exc
        else:
            debug_exc = None
        update_manifest(args.output, validation=validation)
        progress.close()
        for line in lines:
            print(line)
        status = conclude(Path(args.output), validation, debug_exc if debugging(args) else None)
    progress.close()
    for report in reports.values():
        print(report.table(all_rules=args.all))
    write_report_files(args, reports, validation)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {args.output}")
    return status
