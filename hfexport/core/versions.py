"""Package checks for exporters: required, minimum and tested versions.

A missing or too-old package is an error naming the pip command that fixes it. A version that differs
from the tested one only warns, once per process per package and version, since exports usually still
work but the rules target a specific API surface. Local suffixes (`+cpu`, `+cu126`) are ignored.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

from packaging.version import InvalidVersion, Version

from hfexport.core.errors import MissingPackageError

logger = logging.getLogger("hfexport")

# Which extra of hfexport brings each optional package, for the install hint.
_EXTRA_FOR = {
    "onnx": "onnx",
    "onnxscript": "onnx",
    "onnx-ir": "onnx",
    "onnxruntime": "onnx",
    "executorch": "executorch",
    "openvino": "openvino",
    "nncf": "quantization",
    "torchao": "quantization",
}


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _public(version: str) -> Version | None:
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def install_hint(package: str, version: str | None = None) -> str:
    extra = _EXTRA_FOR.get(package)
    pinned = f"{package}=={version}" if version else package
    if extra:
        return f'pip install "hfexport[{extra}]" -c constraints.txt  (or: pip install "{pinned}")'
    return f'pip install "{pinned}"'


@functools.cache
def _warn_drift(who: str, package: str, installed: str, tested: str) -> None:
    # functools.cache makes this fire once per process for each (class, package, installed, tested): every
    # exporter and quantizer that was tested against another version says so itself, even after another did.
    logger.warning(
        "%s: %s %s is installed, it was tested with %s; exports usually work, but rewrite rules target "
        "the tested API. Pin it for production (%s).",
        who,
        package,
        installed,
        tested,
        install_hint(package, tested),
    )


def check_packages(
    required: tuple[str, ...] | list[str],
    min_versions: dict[str, str],
    tested_versions: dict[str, str],
    *,
    who: str = "hfexport",
) -> dict[str, str]:
    """Raise for missing/too-old packages, warn once on drift; return the installed versions."""
    found: dict[str, str] = {}
    for package in required:
        version = installed_version(package)
        if version is None:
            raise MissingPackageError(
                f"{who} needs {package}, which is not installed: {install_hint(package, tested_versions.get(package))}"
            )
        found[package] = version
        minimum = min_versions.get(package)
        if minimum is not None and (_public(version) or Version("0")) < Version(minimum):
            raise MissingPackageError(
                f"{who} needs {package}>={minimum}, but {version} is installed: "
                f"{install_hint(package, tested_versions.get(package, minimum))}"
            )
        tested = tested_versions.get(package)
        if tested is not None and _public(version) != _public(tested):
            _warn_drift(who, package, version, tested)
    return found
