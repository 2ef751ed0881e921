"""Write docs/coverage.md's release-wide table from the sweeps of the generated corpus
(`hfexport.apps.docgen.coverage`).

python tools/coverage_report.py                 # reads docs/sweeps/*.json, rewrites docs/coverage.md
python tools/coverage_report.py --check         # exit 1 if docs/coverage.md is stale
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hfexport.apps.docgen import write_or_check
from hfexport.apps.docgen.coverage import update

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweeps", type=Path, default=ROOT / "docs" / "sweeps")
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests" / "fixtures" / "corpus_all")
    parser.add_argument("--variants", type=Path, default=ROOT / "tests" / "fixtures" / "corpus_variants")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "coverage.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc differs from what it would write")
    args = parser.parse_args(argv)
    current = args.out.read_text() if args.out.exists() else "# Architecture coverage\n"
    text = update(current, args.sweeps, args.corpus, args.variants)
    return write_or_check(args.out, text, args.check, "python tools/coverage_report.py")


if __name__ == "__main__":
    raise SystemExit(main())
