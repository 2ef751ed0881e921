"""Generated documents: the rule catalogue (`rules`) and the coverage table (`coverage`) as package functions that
return the text; tools/gen_rule_docs.py and tools/coverage_report.py write them into docs/, and the tests compare
them with the committed files."""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(path: Path, text: str, check: bool, how: str) -> int:
    """Write `text` to `path`, or with `check` only compare: 1 (and a line saying to run `how`) when they differ."""
    if check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run `{how}`", file=sys.stderr)
            return 1
        print(f"{path} is current")
        return 0
    path.write_text(text)
    print(f"wrote {path} ({text.count(chr(10))} lines)")
    return 0
