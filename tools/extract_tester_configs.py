"""Extract the tiny configs of transformers' own model tests into hfexport/testing/tester_configs.json
(`hfexport.testing.tester_extract`: values read with `ast`, no test code run).

    python tools/extract_tester_configs.py --tests /path/to/transformers/tests --commit <sha>
    python tools/extract_tester_configs.py --tests DIR --merge        # add to / replace in the existing data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hfexport.testing.tester_extract import extract

OUT = Path(__file__).resolve().parents[1] / "hfexport" / "testing" / "tester_configs.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=Path, required=True, help="transformers' tests/ folder")
    parser.add_argument("--commit", default="", help="the transformers commit the files are at (recorded)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--merge", action="store_true", help="keep the types of the existing file not found here")
    args = parser.parse_args(argv)
    found = extract(args.tests, args.commit)
    data: dict[str, Any] = {}
    if args.merge and args.out.exists():
        data = json.loads(args.out.read_text())
    import transformers

    data.setdefault("_about", {})["transformers"] = transformers.__version__
    types = data.setdefault("types", {})
    types.update(found)
    data["types"] = dict(sorted(types.items()))
    args.out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{len(found)} model types from {args.tests}; {len(data['types'])} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
