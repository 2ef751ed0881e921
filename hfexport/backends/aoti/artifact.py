"""How an AOTInductor component is saved: its `.pt2` package, copied as it is."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hfexport.artifacts.formats import ArtifactFormat, Signature, check_zip_archive


def _write(package: Any, main: Path, config: Any) -> None:
    shutil.copyfile(package.path, main)


def _signature(package: Any) -> Signature:
    return list(package.input_names), list(package.output_names)


ARTIFACT = ArtifactFormat(
    "aoti",
    _write,
    _signature,
    trust="holds an AOTInductor package (.pt2) of compiled native code: loading one runs that code",
    check_saved=check_zip_archive,
)
