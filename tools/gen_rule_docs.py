"""Write docs/rules.md, the rule catalogue, from the rule registry (`hfexport.apps.docgen.rules.render`).

python tools/gen_rule_docs.py          # rewrite docs/rules.md
python tools/gen_rule_docs.py --check  # exit 1 when docs/rules.md is not current (CI)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hfexport.apps.docgen import write_or_check
from hfexport.apps.docgen.rules import render

CATALOGUE = Path(__file__).resolve().parents[1] / "docs" / "rules.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/rules.md differs from the registry")
    args = parser.parse_args(argv)
    return write_or_check(CATALOGUE, render(), args.check, "python tools/gen_rule_docs.py")


if __name__ == "__main__":
    raise SystemExit(main())
