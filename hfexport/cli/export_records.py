"""What `hfexport export` saves and writes beside the programs: the model's Hugging Face files, the sample the
manifest records, the config as the export used it, and the `--report-html` / `--report-markdown` files."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from hfexport.cli.models import inputs_source


def hf_files(spec: str, model: Any) -> dict[str, bytes]:
    """The Hugging Face files saved beside the export: a folder model's own (config, generation config, tokenizer,
    processor files, copied byte for byte), and what the model object adds (a built-in's config and generation
    config; a folder without generation_config.json gets the one transformers derived from its config)."""
    from hfexport.artifacts.hf_files import collect
    from hfexport.tiny import TINY_MODELS

    files = collect(model=model, files=None if spec in TINY_MODELS else Path(spec))
    return {**files, **_exported_architecture(files.get("config.json"), model)}


def _exported_architecture(config: bytes | None, model: Any) -> dict[str, bytes]:
    """A folder's `config.json` naming the class that was exported in `architectures` (after `--task`, a
    `BertModel` checkpoint exported as `BertForSequenceClassification`), as `save_pretrained` of that model would:
    `AutoExportedModel` and transformers' pipelines read it. {} when it already does (the file stays byte for
    byte) or is not a JSON object."""
    if config is None:
        return {}
    try:
        data = json.loads(config)
    except ValueError:
        return {}
    exported = [type(model).__name__]
    if not isinstance(data, dict) or data.get("architectures") == exported:
        return {}
    return {"config.json": (json.dumps({**data, "architectures": exported}, indent=2, sort_keys=True) + "\n").encode()}


def write_report_files(args: argparse.Namespace, reports: Any, validation: dict[str, Any] | None = None) -> None:
    """`--report-html` / `--report-markdown`: the report (or `{component: report}`) and validation as files."""
    targets = [("html", args.report_html), ("markdown", args.report_markdown)]
    if not any(path for _, path in targets):
        return
    from hfexport.apps.render import export_document, write_documents

    for path in write_documents(export_document(reports, validation, model=args.model), targets):
        print(f"report written to {path}", file=sys.stderr)


def sample_record(args: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `metadata.sample_inputs`: where the traced sample came from and its inputs' shapes."""
    shapes = {k: list(v.shape) for k, v in inputs.items() if hasattr(v, "shape")}
    return {"sample_inputs": {"source": inputs_source(args.model, args.task), "shapes": shapes}}


def as_used(config: Any, reports: list[Any]) -> Any:
    """The config the manifest records: where it left the ONNX opset open (None: the newest), the opset the
    export wrote (the report's `used["opset"]`), so the manifest never says null for something it knows."""
    opsets = {r.used.get("opset") for r in reports if r is not None and r.used.get("opset")}
    if getattr(config, "opset_version", 0) is not None or len(opsets) != 1:
        return config
    recorded = copy.copy(config)
    recorded.opset_version = opsets.pop()
    return recorded


def save_with_records(
    args: argparse.Namespace, programs: Any, output: Path, config: Any, report: Any, model: Any, inputs: dict
) -> None:
    """`hfexport.save` of the export with what the command records beside it: the config as used, the report(s),
    the model's Hugging Face files and the sample. `report` is one report or a dict of them, one per component."""
    from hfexport.artifacts import save

    reports = list(report.values()) if isinstance(report, dict) else [report]
    save(
        programs,
        output,
        overwrite=args.overwrite,
        config=as_used(config, reports),
        report=report,
        model=args.model,
        hf_files=hf_files(args.model, model),
        metadata=sample_record(args, inputs),
    )
