"""`hfexport audit`: export and report what every rule did; optionally ablate the rules that fired."""

from __future__ import annotations

import argparse
from typing import Any

from hfexport.cli.exits import ExitCode
from hfexport.cli.export import model_options
from hfexport.cli.export_config import export_config
from hfexport.cli.models import load_model, split
from hfexport.cli.progress import Progress
from hfexport.cli.progress import step as _step
from hfexport.cli.validation import validation_tolerance


def cmd_audit(args: argparse.Namespace) -> int:
    from hfexport.apps.audit import run_audit
    from hfexport.rewrites.engine import stage_listener

    config = export_config(args)
    _step(f"building {args.model}")
    model, inputs = load_model(args.model, args.task, **model_options(args))
    if args.quant:
        return _quant_audit(args, model, inputs, config)
    ablate: bool | tuple[str, ...] = False
    if args.ablate is not None:
        ablate = split(args.ablate) or True
    tolerance = validation_tolerance(args, config, model)
    progress = Progress()
    try:
        # Each export of the audit (the base and every ablation) shows its stages as they start.
        with stage_listener(progress.stage):
            audit = run_audit(
                model,
                inputs,
                config,
                model_name=args.model,
                ablate=ablate,
                atol=tolerance.atol,
                rtol=tolerance.rtol,
                progress=progress.step,
            )
    finally:
        progress.close()
    print(audit.render(explain=args.explain, all_rules=args.all))
    if args.json:
        audit.save(args.json)
        _step(f"wrote {args.json}")
    if args.html or args.markdown:
        from hfexport.apps.render import audit_document, write_documents

        for path in write_documents(audit_document(audit), [("html", args.html), ("markdown", args.markdown)]):
            _step(f"wrote {path}")
    if not audit.exported:
        return int(ExitCode.EXPORT_FAILED)
    return int(ExitCode.OK if (audit.validation or {}).get("ok") else ExitCode.DIFFERS)


def _quant_audit(args: argparse.Namespace, model: Any, inputs: dict[str, Any], config: Any) -> int:
    """`audit --quant`: the recipe's error by linear group, worst first, and the gain of keeping the worst in float."""
    from hfexport.apps.quant_audit import audit_quantization
    from hfexport.cli.accuracy import text_and_tokenizer
    from hfexport.rewrites.engine import stage_listener

    text, name, tokenizer = text_and_tokenizer(args)
    progress = Progress()
    try:
        with stage_listener(progress.stage):
            audit = audit_quantization(
                model,
                inputs,
                config,
                tokenizer=tokenizer,
                text=text,
                text_name=name,
                keep_worst=args.keep_worst,
                progress=progress.step,
            )
    finally:
        progress.close()
    print(audit.render())
    if args.json:
        audit.save(args.json)
        _step(f"wrote {args.json}")
    return int(ExitCode.OK)
