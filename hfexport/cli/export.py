"""`hfexport export`: export a model, save the artifact with its manifest, and (`--validate`) run it against eager."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hfexport.cli import accuracy as quantized
from hfexport.cli.exits import ExitCode, UsageError
from hfexport.cli.models import export_config, load_empty_model, load_model, other_samples
from hfexport.cli.progress import Progress
from hfexport.formats import MAIN_FILE


def _default_rtol(config: Any) -> float:
    # fp16 weights (OpenVINO's save default) are within ~1e-3 of f32 relative to the output's scale.
    return 1e-2 if getattr(config, "compress_to_fp16", False) else 1e-3


def _stage_times(report: Any) -> str:
    return ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in report.stage_seconds.items())


def check_writable(output: Path) -> None:
    """Refuse, before any work, an output folder that cannot be created or written."""
    existing = next((p for p in (output, *output.parents) if p.exists()), Path.cwd())
    if not existing.is_dir():
        raise UsageError(f"--output {output}: {existing} is a file, not a folder")
    # A probe folder, created and removed where the output will go: permissions alone do not show a read-only
    # or pseudo file system (root may write everywhere the mode bits say).
    try:
        probe = tempfile.mkdtemp(prefix=".hfexport-probe-", dir=existing)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot create a folder in {existing} ({exc.strerror})") from None
    os.rmdir(probe)


def check_file_target(flag: str, path: Path, output: Path | None = None) -> None:
    """Refuse, before any work, a file to write whose folder does not exist or that is a folder itself (a file
    in the `--output` folder is fine: the save creates that folder first)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; name a file, e.g. {path / 'report.html'}")
    parent = path.parent
    if output is not None and parent.resolve() == output.resolve():
        return
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")


def hf_files(spec: str, model: Any) -> dict[str, bytes]:
    """The Hugging Face files saved beside the export: a folder model's own (config, generation config, tokenizer,
    processor files, copied byte for byte), and what the model object adds (a built-in's config and generation
    config; a folder without generation_config.json gets the one transformers derived from its config)."""
    from hfexport.artifacts.hf_files import collect
    from hfexport.tiny import TINY_MODELS

    return collect(model=model, files=None if spec in TINY_MODELS else Path(spec))


def auto_low_memory(args: argparse.Namespace) -> bool:
    """Whether an export without `--low-memory`/`--no-low-memory` streams its weights: a folder model whose
    checkpoint takes more than half the available memory, exported to ONNX or OpenVINO as one graph; said on
    stderr. Other formats and options cannot stream: they load the model as before."""
    from hfexport.checkpoints import low_memory_reason
    from hfexport.tiny import TINY_MODELS

    if args.format not in ("onnx", "openvino") or args.generation or args.quantize or args.model in TINY_MODELS:
        return False
    if not Path(args.model).is_dir():
        return False
    reason = low_memory_reason(args.model)
    if reason is None:
        return False
    print(
        f"note: {reason}: exporting with --low-memory (weights streamed from the checkpoint; --no-low-memory "
        "loads the model instead)",
        file=sys.stderr,
    )
    return True


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `load_model` options the export flags give."""
    return {
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "sequence_length": args.sequence_length,
        "trust_remote_code": args.trust_remote_code,
    }


def _manifest_bytes(output: Path) -> bytes | None:
    try:
        return (output / "manifest.json").read_bytes()
    except OSError:
        return None


@contextlib.contextmanager
def nothing_left_on_interrupt(output: Path, reports: list[Path]) -> Iterator[None]:
    """Ctrl-C in the block: remove the artifact the command published in `output` before the interruption.

    An interrupted export leaves no folder that looks finished: its validation, report and "done" never came
    (docs/cli.md, exit 130: "nothing half-written is left"). Only what this command wrote goes: the artifact
    whose manifest differs from the one `output` held before (an `--overwrite` interrupted before its publish
    keeps the previous artifact), the files its manifest lists, the manifest, the report files this command
    created in it; then the folders left empty, `output` itself when this command created it.
    """
    existed = output.exists()
    before = _manifest_bytes(output)
    new_reports = [path for path in reports if not path.exists()]
    try:
        yield
    except KeyboardInterrupt:
        if _manifest_bytes(output) not in (None, before):
            _remove_artifact(output, new_reports, remove_folder=not existed)
        raise


def _remove_artifact(output: Path, reports: list[Path], remove_folder: bool) -> None:
    try:
        listed = json.loads((output / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a manifest this command wrote whole: nothing is removed
    root = output.resolve()
    for path in [*(output / str(rel) for rel in listed), *reports, output / "manifest.json"]:
        resolved = path.resolve()
        if resolved != root and resolved.is_relative_to(root) and resolved.is_file():
            resolved.unlink()
    folders = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts))
    for folder in [*folders, *([root] if remove_folder else [])]:
        with contextlib.suppress(OSError):  # not empty: a file this command did not write stays
            folder.rmdir()
    print(f"removed the unfinished artifact in {output}/", file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    output = Path(args.output)
    reports = [Path(path) for path in (args.report_html, args.report_markdown) if path]
    with nothing_left_on_interrupt(output, reports):
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    from hfexport.artifacts import ArtifactExistsError, check_destination, save, update_manifest, validate
    from hfexport.auto import AutoHfExporter
    from hfexport.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener
    from hfexport.runtime.devices import resolve_device, use_device

    output = Path(args.output)
    device = resolve_device(args.format, args.device) if args.device else None
    try:
        # Before minutes of export: a destination the save would refuse is refused now.
        check_destination(output, args.overwrite)
    except ArtifactExistsError as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "low_memory", None) is None:
        args.low_memory = auto_low_memory(args)
    config = export_config(args)
    progress = Progress()
    try:
        start = progress.step(f"building {args.model}")
        auto_class = None
        if args.low_memory:
            model, inputs, auto_class = load_empty_model(args.model, args.task, **model_options(args))
        else:
            model, inputs = load_model(args.model, args.task, **model_options(args))
        exporter = AutoHfExporter.from_config(config)
        if args.generation:
            return _export_generation(args, model, inputs, exporter, config, progress, start)
        progress.step(f"exporting {type(model).__name__} to {args.format} (dynamic={config.dynamic})")
        try:
            with stage_listener(progress.stage):
                program = exporter.export(model, inputs, config=config)
        except HfExportError as exc:
            progress.close()
            if exporter.report is not None:
                print(exporter.report.table(all_rules=args.all))
                write_report_files(args, exporter.report)  # what ran before the failure, for a browser too
            print(f"error: export failed: {exc}", file=sys.stderr)
            return int(ExitCode.EXPORT_FAILED)
        report = exporter.report
        progress.step(
            f"exported in {report.total_seconds:.1f}s ({_stage_times(report)}); {len(report.fired)} rule(s) fired"
        )
        t0 = progress.step(f"saving {args.format} artifact to {output}/")
        save(
            program,
            output,
            overwrite=args.overwrite,
            config=config,
            report=report,
            model=args.model,
            hf_files=hf_files(args.model, model),
        )
        progress.step(f"saved in {time.perf_counter() - t0:.1f}s")

        status = 0
        validation = None
        if args.validate and args.low_memory:
            status = _validate_low_memory(args, model, inputs, config, auto_class, output, progress)
        elif args.validate:
            rtol = args.rtol if args.rtol is not None else _default_rtol(config)
            where = f" on {device.name}" if device else ""
            progress.step(f"validating {MAIN_FILE[args.format]} in the {args.format} runtime{where} against eager")
            # Other shapes too: a baked length or batch shows up here, not at the user's first other input.
            others = other_samples(args.model, inputs, task=args.task, **model_options(args)) if config.dynamic else {}
            if not config.dynamic:
                progress.step("static export (--no-dynamic): only the traced shape is checked")
            # trust: the .pt2 is the one this process wrote a moment ago.
            with use_device(device):
                validation = validate(output, model, inputs, atol=args.atol, rtol=rtol, trust=True, other_inputs=others)
                accuracy = quantized.measure(args, model, output, inputs, config)
            report.parity = validation.max_abs_diff
            ok = validation.ok if accuracy is None else quantized.runs_everywhere(validation) and accuracy.ok
            record = {**validation.to_dict(), "ok": ok, "device": device.name if device else "cpu"}
            if accuracy is not None:  # a quantized export: the accuracy gates it, not the tolerance
                report.accuracy = accuracy
                record.update(tolerance_ok=validation.ok, accuracy=accuracy.to_dict())
                print("(quantized: its outputs differ from eager by design; the accuracy below decides)")
            update_manifest(output, validation=record)
            print(validation)
            if accuracy is not None:
                quantized.print_accuracy(accuracy)
            if not ok:
                why = "beyond the tolerance" if accuracy is None else "beyond the recipe's accuracy budget"
                print(f"validation failed: the artifact differs from eager {why}", file=sys.stderr)
                status = int(ExitCode.DIFFERS)
    finally:
        progress.close()
    print(report.table(all_rules=args.all))
    write_report_files(args, report, validation.to_dict() if validation is not None else None)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {output}")
    return status


def write_report_files(args: argparse.Namespace, reports: Any, validation: dict[str, Any] | None = None) -> None:
    """`--report-html` / `--report-markdown`: the report (or `{component: report}`) and validation as files."""
    targets = [("html", args.report_html), ("markdown", args.report_markdown)]
    if not any(path for _, path in targets):
        return
    from hfexport.render import export_document, write_documents

    for path in write_documents(export_document(reports, validation, model=args.model), targets):
        print(f"report written to {path}", file=sys.stderr)


def _validate_low_memory(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, Any],
    config: Any,
    auto_class: str | None,
    output: Path,
    progress: Progress,
) -> int:
    """`--low-memory --validate`: the checks that fit in memory (docs/low-memory.md). The saved weights are
    compared with the checkpoint tensor by tensor; the first `--check-layers` layers of the same checkpoint are
    exported on the same path and run against eager. The full artifact is not run: that needs its weights."""
    import torch

    from hfexport.artifacts import update_manifest
    from hfexport.artifacts.low_memory import (
        StreamedWeights,
        check_reduced_depth,
        check_streamed_ir,
        check_streamed_quantized,
        check_streamed_weights,
    )
    from hfexport.checkpoints import Checkpoint

    progress.step("validating: the saved weights against the checkpoint, one tensor at a time")
    check = check_streamed_ir if args.format == "openvino" else check_streamed_weights
    weights = check(output / MAIN_FILE[args.format], Checkpoint.open(args.model))
    if args.format == "onnx" and config.quantizer is not None:
        # The quantized initializers, recomputed from the checkpoint; the weights left in float, as above.
        quantized = check_streamed_quantized(output / MAIN_FILE[args.format], Checkpoint.open(args.model))
        weights = StreamedWeights(
            weights.checked + quantized.checked, weights.mismatched + quantized.mismatched, quantized.recorded
        )
    layers = args.check_layers or 2
    progress.step(f"validating: an export of the first {layers} layer(s) of the same checkpoint against eager")
    rtol = args.rtol if args.rtol is not None else _default_rtol(config)
    others = other_samples(args.model, inputs, task=args.task, **model_options(args)) if config.dynamic else {}
    reduced = check_reduced_depth(
        args.model,
        inputs,
        config,
        layers=layers,
        auto_class=auto_class or "AutoModelForCausalLM",
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        atol=args.atol,
        rtol=rtol,
        trust_remote_code=args.trust_remote_code,
        other_inputs=others,
    )
    ok = weights.ok and reduced.ok
    streamed = {"checked": len(weights.checked), "mismatched": weights.mismatched}
    update_manifest(output, validation={**reduced.to_dict(), "ok": ok, "streamed_weights": streamed})
    if weights.recorded == 0:
        print("streamed weights: none (every weight is small enough to be read whole)")
    else:
        equal = len(weights.checked) - len(weights.mismatched)
        print(f"streamed weights: {equal} equal their checkpoint tensors, {len(weights.mismatched)} differ")
        if config.quantizer is not None:
            print("  (quantized weights: recomputed from the checkpoint with the quantizer's arithmetic)")
    print(f"reduced depth ({layers} layer(s)): {reduced.validation}")
    if not ok:
        print("validation failed: the low-memory checks found a difference", file=sys.stderr)
        return int(ExitCode.DIFFERS)
    return 0


def _generation_config(args: argparse.Namespace) -> Any:
    """`--static-cache N`: a static cache of N slots (None: generate's default, a growing cache)."""
    if not args.static_cache:
        return None
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=args.static_cache)


def _export_generation(
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
    import torch

    from hfexport.artifacts import load, save, update_manifest
    from hfexport.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener

    progress.step(f"exporting the generation components of {type(model).__name__} to {args.format}")
    try:
        with stage_listener(progress.stage):
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
        print(f"error: export failed: {exc}", file=sys.stderr)
        return int(ExitCode.EXPORT_FAILED)
    reports = exporter.reports
    for name, report in reports.items():
        progress.step(f"{name}: exported in {report.total_seconds:.1f}s; {len(report.fired)} rule(s) fired")
    # The programs generate() runs besides the documented components (a VLM's features and prefill) are saved too.
    names = [*programs, *getattr(programs, "runtime_components", {})]
    t0 = progress.step(f"saving {len(names)} components ({', '.join(names)}) to {args.output}/")
    save(
        programs,
        args.output,
        overwrite=args.overwrite,
        config=config,
        report=reports,
        model=args.model,
        hf_files=hf_files(args.model, model),
    )
    progress.step(f"saved in {time.perf_counter() - t0:.1f}s")
    status = 0
    validation: dict[str, Any] | None = None
    if args.validate:
        from hfexport.runtime.generation import generate

        progress.step("validating: each saved component loads and runs on its recorded inputs")
        loaded = load(args.output, trust=True)  # written by this process a moment ago
        ran = {}
        for name in loaded.components:
            outputs = loaded.run(programs.samples[name], name)
            ran[name] = all(bool(torch.isfinite(t).all()) for t in outputs.values() if t.is_floating_point())
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        n = args.new_tokens or 8
        progress.step(f"validating: {n} greedy tokens of the exported components against model.generate")
        reference = _generation_config(args) or copy.deepcopy(model.generation_config)
        reference.max_new_tokens = reference.min_new_tokens = n
        reference.do_sample = False
        with torch.no_grad():  # the same cache kind as the export
            want = model.generate(input_ids=ids, attention_mask=mask, generation_config=reference)
        got = generate(programs, ids, mask, max_new_tokens=n, min_new_tokens=n)
        prompt = ids.shape[1]
        same = got.shape == want.shape and torch.equal(got[:, prompt:], want[:, prompt:])
        agreement = float((got[:, prompt:] == want[:, prompt:]).float().mean()) if got.shape == want.shape else 0.0
        validation = {"ok": same and all(ran.values()), "components_run": ran, "new_tokens": n, "agreement": agreement}
        accuracy = quantized.measure(args, model, loaded, inputs, config)
        if accuracy is not None:  # a quantized export: the accuracy gates it, not token equality
            validation.update(ok=all(ran.values()) and accuracy.ok, accuracy=accuracy.to_dict())
            for report in reports.values():
                report.accuracy = accuracy
        update_manifest(args.output, validation=validation)
        print(f"components run from the saved artifact: {ran}")
        print(f"greedy tokens vs model.generate: {agreement:.0%} of {n} x {ids.shape[0]} agree")
        if accuracy is not None:
            quantized.print_accuracy(accuracy)
        if not validation["ok"]:
            print("validation failed: the generated tokens differ from model.generate", file=sys.stderr)
            status = int(ExitCode.DIFFERS)
    progress.close()
    for report in reports.values():
        print(report.table(all_rules=args.all))
    write_report_files(args, reports, validation)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {args.output}")
    return status
