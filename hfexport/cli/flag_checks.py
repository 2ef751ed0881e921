"""The command line's flag combinations, checked after parsing and before any work: flags that would do nothing
together, and a model, output or report file that would be refused later anyway (exit 2 before tracing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hfexport.backends.registry import backend, backends
from hfexport.cli.bench import bench_choices
from hfexport.cli.exits import UsageError
from hfexport.cli.export_config import LOW_MEMORY_RECIPES, config_json
from hfexport.cli.export_output import check_file_target, check_writable
from hfexport.cli.models import GENERATION_TASKS, check_model_spec


def check_combinations(args: argparse.Namespace) -> None:
    """Refuse flags that would do nothing in this combination, and a model or output refused later anyway."""
    if args.command in ("export", "audit", "sweep"):
        config_json(args.config)  # a JSON mistake is refused before any import of torch
    if args.command == "bench":
        check_model_spec(args.model, "causal-lm", args.trust_remote_code)
        bench_choices(args)
    if args.command in ("export", "audit"):
        check_model_spec(args.model, args.task, args.trust_remote_code)
        for flag, value in (("--batch-size", args.batch_size), ("--sequence-length", args.sequence_length)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be at least 1, not {value}")
    if args.command == "export":
        check_writable(Path(args.output))
        if args.task in GENERATION_TASKS:
            args.generation = True  # optimum's `-with-past`: the components generate runs
    for flag in ("report_html", "report_markdown", "html", "markdown"):
        if args.command in ("export", "audit", "report") and getattr(args, flag, None):
            output = Path(args.output) if args.command == "export" else None
            check_file_target(f"--{flag.replace('_', '-')}", Path(getattr(args, flag)), output)
    if args.command == "export" and args.device is not None:
        from hfexport.runtime.devices import resolve_device

        device = resolve_device(args.format, args.device)  # a device this machine lacks: exit 2 now
        if args.generation and not device.is_cpu and not backend(args.format).device_at_export:
            raise UsageError(
                f"--device {args.device} with --generation: the generation runtime runs {args.format} on the CPU; "
                "drop --device"
            )
    if args.command == "export" and not args.generation:
        given = [
            flag
            for flag, value in (
                ("--new-tokens", args.new_tokens),
                ("--static-cache", args.static_cache),
                ("--multi-token-decode", args.multi_token_decode or None),
            )
            if value is not None
        ]
        if given:
            raise UsageError(f"{', '.join(given)}: used only with --generation; add --generation or drop them")
    if args.command == "export" and args.low_memory:
        if not backend(args.format).streams_weights:
            streaming = " or ".join(b.name for b in backends() if b.streams_weights)
            raise UsageError(
                f"--low-memory: --format {streaming} (not {args.format}): {backend(args.format).no_streaming}"
            )
        if args.generation:
            raise UsageError("--low-memory exports one graph: drop --generation")
        if args.quantize and args.quantize not in LOW_MEMORY_RECIPES:
            raise UsageError(
                f"--low-memory --quantize {args.quantize}: only {', '.join(LOW_MEMORY_RECIPES)} (data-free weight "
                "compression, computed weight by weight as the weights stream); ort-* quantizes the whole ONNX "
                "model in memory, nncf-int8 and pt2e-x86 calibrate activations on the model's real weights"
            )
    if args.command in ("export", "audit") and not args.quantize:
        given = [flag for flag, value in (("--keep-float", args.keep_float), ("--eval-text", args.eval_text)) if value]
        if args.command == "audit" and args.quant:
            given.append("--quant")
        if args.command == "export" and args.max_perplexity_increase is not None:
            given.append("--max-perplexity-increase")
        if given:
            raise UsageError(f"{', '.join(given)}: used only with --quantize; add --quantize RECIPE or drop them")
    if args.command == "export" and args.max_perplexity_increase is not None and not args.validate:
        raise UsageError(
            "--max-perplexity-increase is the budget --validate holds a quantized export to: add --validate"
        )
    if args.command == "export" and args.low_memory and args.keep_float:
        raise UsageError("--low-memory compresses every weight as it streams: drop --keep-float")
    if args.command == "export":
        tolerances = [flag for flag in ("atol", "rtol") if getattr(args, flag) is not None]
        if tolerances and (not args.validate or args.generation):
            flags = " and ".join(f"--{flag}" for flag in tolerances)
            why = (
                "--generation --validate compares greedy tokens, not values"
                if args.validate
                else "they set the tolerance of --validate"
            )
            raise UsageError(f"{flags}: {why}; " + ("drop them" if args.validate else "add --validate or drop them"))
    if args.command in ("export", "audit") and args.dynamic:
        for flag, value in (("--batch-size", args.batch_size), ("--sequence-length", args.sequence_length)):
            if value == 1:
                raise UsageError(
                    f"{flag} 1 with dynamic shapes: torch.export makes an axis whose sample size is 1 static, so the "
                    f"artifact would take only 1 there; trace at {flag} 2 (the artifact still takes any size) or add "
                    "--no-dynamic for a static export"
                )
    if args.command == "export" and args.check_layers is not None and not (args.low_memory and args.validate):
        raise UsageError("--check-layers sets the reduced depth --low-memory --validate checks: add both or drop it")
    if args.command == "export" and args.generation and args.new_tokens is not None and not args.validate:
        raise UsageError("--new-tokens sets how many tokens --validate compares: add --validate or drop it")
