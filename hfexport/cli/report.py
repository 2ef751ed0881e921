"""`hfexport report DIR`: a saved artifact's report, rendered from its folder (Markdown or static HTML)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hfexport.cli.exits import ExitCode


def cmd_report(args: argparse.Namespace) -> int:
    """Render the report the manifest holds (one per component of a generation export) with its validation:
    to `--html` / `--markdown` files, or as Markdown on stdout when neither is given. Reads the manifest only
    (checked like `load` checks it); no model file is opened."""
    from hfexport.apps.render import export_document, to_markdown, write_documents
    from hfexport.artifacts import ArtifactError, read_manifest
    from hfexport.report import ExportReport

    try:
        manifest = read_manifest(Path(args.directory))
    except ArtifactError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(ExitCode.REFUSED)
    components = manifest["components"]
    if manifest.get("report") is not None:
        reports: object = ExportReport.from_dict(manifest["report"])
    else:
        reports = {name: ExportReport.from_dict(c["report"]) for name, c in components.items() if c.get("report")}
    if not reports:
        print(f"refused: {args.directory}: its manifest holds no report (saved without one)", file=sys.stderr)
        return int(ExitCode.REFUSED)
    doc = export_document(reports, manifest.get("validation"), model=manifest.get("model"))  # type: ignore[arg-type]
    targets = [("html", args.html), ("markdown", args.markdown)]
    if not any(path for _, path in targets):
        print(to_markdown(doc), end="")
        return int(ExitCode.OK)
    for path in write_documents(doc, targets):
        print(f"report written to {path}", file=sys.stderr)
    return int(ExitCode.OK)
