"""`hfexport check DIR`: verify a saved artifact (manifest, paths, checksums) and open it in its runtime."""

from __future__ import annotations

import argparse
import sys

from hfexport.cli.exits import ExitCode


def cmd_check(args: argparse.Namespace) -> int:
    from hfexport.artifacts import ArtifactError, load

    try:
        loaded = load(args.directory, trust=args.trust)
    except ArtifactError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(ExitCode.REFUSED)
    manifest = loaded.manifest
    print(f"{loaded.directory}: {loaded.export_format} artifact of {manifest.get('model_class') or '?'}, ok")
    for name, component in loaded.components.items():
        print(f"  {name}: {component.main}  inputs {component.inputs}  outputs {len(component.outputs)}")
    print(f"  files {len(manifest['files'])} (sizes and sha256 verified), versions {loaded.versions}")
    return 0
