"""Fuzz the inside of a saved `.pte`'s flatbuffer and count what the ExecuTorch runtime does with each edit.

    PYTHONPATH=$PWD python tools/fuzz_pte.py ARTIFACT --edits 300 --seed 1 [--baseline /work/main]

Each edit overwrites 1-3 random bytes of `model.pte` between byte 64 and the end of the program flatbuffer
(the extended header's program size), re-hashes the manifest so the integrity check passes, and is loaded
with `hfexport.load` and run once on ones in a child process (`tests/loading_child.py`), so a SIGABRT or
SIGSEGV is counted rather than ending the run. `--baseline DIR` runs the children on the code in DIR (e.g. a
checkout without the structural check) to count crashes before. Each edit is also classified, in this
process, by the reason `hfexport/artifacts/pte.py` gives for refusing it (the check is pure Python, so it
runs safely here): the table says, per class, how many edits there were and what the runtime did.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.formats import _check_pte
from tests.loading_child import Job, flatbuffer_flips, load_in_child, write_edited

# Refusal messages of hfexport/artifacts/pte.py (and the header check), by class.
CLASSES = [
    ("header", r"extended header|program table at|not an ExecuTorch program|truncated"),
    ("flatbuffer bounds", r"lies outside the program|past the end of its table|field table|NUL-terminated"),
    ("not UTF-8", r"not UTF-8"),
    ("input/output index or type", r"^method '.*': (input|output) \d+"),
    ("unknown value type", r"unknown type|without contents|without items|without text"),
    ("list item index or type", r"\((int|Tensor|Tensor\?)\[\]\) names value"),
    ("tensor scalar type", r"scalar type"),
    ("tensor sizes / dim order / dynamism", r"dim order|negative size|shape dynamism|storage offset|holds \d+ bytes"),
    ("tensor storage (planned, constant, none)", r"planned|constant|no storage|mutable data|named data|\.ptd"),
    ("segments", r"segment"),
    ("operator name / unknown operator", r"operator \d+ (is|has)"),
    ("kernel argument count", r"passes \d+ arguments to"),
    ("kernel argument type / result type", r"argument \d+ of|writes .* into"),
    (
        "instruction indices (value/operator/delegate/jump)",
        r"is value -?\d+|calls (operator|delegate)|jumps|of unknown kind",
    ),
    ("move/free type", r"moves a|frees a"),
    ("delegate payload", r"delegate|XNNPACK"),
    ("tables shared past the read budget", r"reads per byte"),
    ("other", r"."),
]


def classify(folder: Path) -> str:
    try:
        _check_pte(folder, {"main": "model.pte"})
    except ArtifactError as exc:
        message = str(exc).split("program: ", 1)[-1]
        return next(name for name, pattern in CLASSES if re.search(pattern, message))
    return "passes the check"


def make_edits(source: Path, work: Path, edits: int, seed: int) -> list[tuple[Path, list[tuple[int, int]]]]:
    data = (source / "model.pte").read_bytes()
    rng = random.Random(seed)
    made = []
    for i in range(edits):
        edited = bytearray(data)
        flips = flatbuffer_flips(data, rng)
        for position, byte in flips:
            edited[position] = byte
        made.append((write_edited(source, work / str(i) / "artifact", bytes(edited)), flips))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="a saved ExecuTorch artifact (hfexport.save) with model.pte")
    parser.add_argument("--edits", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inputs", default='{"x": [[2, 4], "float32"]}', help="JSON: name -> [shape, dtype]")
    parser.add_argument("--baseline", type=Path, help="run the children on the code in this folder")
    parser.add_argument("--json", type=Path, help="write every edit's outcome here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        made = make_edits(args.artifact, work, args.edits, args.seed)
        jobs = [Job(str(i), folder, inputs=json.loads(args.inputs)) for i, (folder, _) in enumerate(made)]
        if args.baseline:  # the child runs `python -c` here, so its first import path is the working folder
            os.environ["PYTHONPATH"] = str(args.baseline.resolve())
            os.chdir(args.baseline)
        outcomes = load_in_child(jobs, watch=work, timeout=300)
        classes = [classify(folder) for folder, _ in made]
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    records = []
    for i, (_, flips) in enumerate(made):
        outcome = outcomes[str(i)]
        kind = outcome.kind
        if kind == "died":
            kind = "died " + (outcome.detail.split(":")[0].removeprefix("exit "))
        table[classes[i]][kind] += 1
        records.append(
            {"edit": i, "flips": flips, "class": classes[i], "outcome": kind, "detail": outcome.detail[-400:]}
        )
    total = collections.Counter(r["outcome"] for r in records)
    print(f"{args.edits} edits of {args.artifact} (seed {args.seed}): {dict(total)}")
    for name, counts in sorted(table.items(), key=lambda item: -sum(item[1].values())):
        print(f"  {name:45s} {sum(counts.values()):4d}  {dict(counts)}")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
