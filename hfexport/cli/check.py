"""`hfexport check DIR`: verify a saved artifact (manifest, paths, checksums) and open it in its runtime."""

from __future__ import annotations

import argparse
import sys
import warnings

from hfexport.cli.exits import ExitCode


def cmd_check(args: argparse.Namespace) -> int:
    from hfexport.artifacts import ArtifactError, FailedValidationWarning, load, validation_verdict

    try:
        with warnings.catch_warnings():  # the verdict is said below, as part of the check
            warnings.simplefilter("ignore", FailedValidationWarning)
            loaded = load(args.directory, trust=args.trust)
    except ArtifactError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(ExitCode.REFUSED)
    manifest = loaded.manifest
    verdict, detail = validation_verdict(manifest)
    state = "ok" if verdict != "failed" else "files ok, validation FAILED"
    print(f"{loaded.directory}: {loaded.export_format} artifact of {manifest.get('model_class') or '?'}, {state}")
    for name, component in loaded.components.items():
        main = f"{component.main} (method {component.method})" if component.method else component.main
        print(f"  {name}: {main}  inputs {component.inputs}  outputs {len(component.outputs)}")
    print(f"  files {len(manifest['files'])} (sizes and sha256 verified), versions {loaded.versions}")
    print(f"  validation: {verdict}: {detail}")
    if verdict == "failed":
        print(f"error: {loaded.directory}: its validation failed when it was exported: {detail}", file=sys.stderr)
        return int(ExitCode.DIFFERS)
    return 0
