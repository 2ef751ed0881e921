"""A rule's `upstream`: where its cause lives upstream, as an issue or a pinned place in a package, parsed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# `upstream` starts with a reference a reader can follow, then an optional short note:
# - an issue or pull request: https://github.com/<owner>/<repo>/issues/<n> or /pull/<n> (an issue comment anchor
#   allowed), a GitLab issue or merge request, or a Chromium issue;
# - a package version and where in it: `<package>==<version> <path> [note]`, e.g.
#   `transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan`.
# A link into a source tree (github.com/.../blob/...) is a code location: cite it in the package form, which
# also says which release the rule was written against.
_TRACKER_URL_RE = re.compile(
    r"^https://(?:"
    r"github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+(?:#issuecomment-\d+)?"
    r"|gitlab\.com/[\w./-]+/-/(?:issues|merge_requests)/\d+"
    r"|issues\.chromium\.org/issues/\d+"
    r")$"
)
_PACKAGE_PIN_RE = re.compile(r"^(?P<package>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>\S+)$")
UPSTREAM_FORMS = (
    "an issue or PR URL (https://github.com/<owner>/<repo>/issues/<n> or /pull/<n>) or "
    "'<package>==<version> <path>' (e.g. 'transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan'), "
    "optionally followed by a short note"
)


@dataclass(frozen=True)
class UpstreamRef:
    """The parsed `upstream` of a rule: where the bug (or the fused-into op) lives upstream.

    `kind` "url": `url` is an issue or pull request. `kind` "package": `package`==`version`, at `path`
    (a file, a module or an op family). `note` is the free text after the reference (it may name more links).
    """

    kind: Literal["url", "package"]
    url: str = ""
    package: str = ""
    version: str = ""
    path: str = ""
    note: str = ""

    @property
    def reference(self) -> str:
        """The reference without the note: the URL, or `package==version path`."""
        return self.url if self.kind == "url" else f"{self.package}=={self.version} {self.path}"


def parse_upstream(text: str) -> UpstreamRef:
    """Parse an `upstream` string (see `UPSTREAM_FORMS`); raise ValueError saying what is wrong."""
    from packaging.version import InvalidVersion, Version

    words = text.split()
    if not words:
        raise ValueError(f"`upstream` is empty; it must be {UPSTREAM_FORMS}")
    first = words[0]
    if first.startswith(("http://", "https://")):
        if not _TRACKER_URL_RE.match(first):
            raise ValueError(
                f"`upstream` URL {first!r} is not an issue or pull request; cite a code location as "
                f"'<package>==<version> <path>'. It must be {UPSTREAM_FORMS}"
            )
        return UpstreamRef("url", url=first, note=" ".join(words[1:]))
    pin = _PACKAGE_PIN_RE.match(first)
    if pin is None:
        raise ValueError(f"`upstream` must start with a URL or '<package>==<version>', not {first!r}: {UPSTREAM_FORMS}")
    try:
        Version(pin["version"])
    except InvalidVersion:
        raise ValueError(f"`upstream` pins {first!r}, whose version is not a version number") from None
    if len(words) < 2:
        raise ValueError(f"`upstream` {first!r} needs the path it refers to: '{first} <path> [note]'")
    note = " ".join(words[2:])
    return UpstreamRef("package", package=pin["package"], version=pin["version"], path=words[1], note=note)
