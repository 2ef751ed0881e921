"""Generate a corpus entry for every model type of transformers' auto mappings (issue #17).

    OMP_NUM_THREADS=1 python tools/gen_corpus.py                      # all families -> tests/fixtures/corpus_all
    python tools/gen_corpus.py --families causal_lm --types llama,gpt2 --out /tmp/c
    python tools/gen_corpus.py --resume                               # only types without a result yet
    python tools/gen_corpus.py --report-only                          # rewrite READMEs and docs/coverage.md

Each model type is built in a worker process (``--worker``) that reports one JSON line per type; the parent
kills a worker that spends more than ``--timeout`` seconds on one type, records the timeout and starts a new
worker on the remaining types, so one hanging or crashing architecture costs one entry, not the run.
Entries go to ``<out>/<family>/<model_type>.json``; every type that could not be built is listed with its
reason in ``<out>/<family>/_skipped.json`` and the family's README.md; the per-family table goes into
docs/coverage.md between generated markers.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfexport.testing.corpus_gen import FAMILIES, Family, family_types, generate_entry  # noqa: E402
from hfexport.testing.corpus_readmes import write_family_readme  # noqa: E402

PREFIX = "@@GEN "
COVERAGE = ROOT / "docs" / "coverage.md"
START, END = "<!-- gen_corpus:start -->", "<!-- gen_corpus:end -->"


def _reusable() -> dict[str, dict[str, Any]]:
    """Hand-made entries (transformers' own tester configs) by model type, preferred where they verify."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "tests" / "fixtures" / "corpus").glob("*/*.json")):
        raw = json.loads(path.read_text())
        found.setdefault(raw["model_type"], raw)
    return found


def worker(family_name: str, types: list[str]) -> None:
    """Build each type in turn and print one result line per type (the parent parses only PREFIX lines)."""
    family = next(f for f in FAMILIES if f.name == family_name)
    auto = family_types(family)
    reuse = _reusable()
    for model_type in types:
        print(PREFIX + json.dumps({"start": model_type}), flush=True)
        result = generate_entry(model_type, family, auto[model_type], reuse.get(model_type))
        line = {"type": model_type, "entry": result.entry, "reason": result.reason}
        print(PREFIX + json.dumps(line), flush=True)


class Run:
    """The results of one family, kept on disk after every type so an interrupted run can resume."""

    def __init__(self, out: Path, family: Family) -> None:
        self.dir = out / family.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.skipped_path = self.dir / "_skipped.json"
        self.skipped: dict[str, str] = json.loads(self.skipped_path.read_text()) if self.skipped_path.exists() else {}

    def done(self) -> set[str]:
        return {p.stem for p in self.dir.glob("*.json") if not p.name.startswith("_")} | set(self.skipped)

    def record(self, model_type: str, entry: dict[str, Any] | None, reason: str) -> None:
        path = self.dir / f"{model_type}.json"
        if entry is not None:
            path.write_text(json.dumps(entry, indent=1) + "\n")
            self.skipped.pop(model_type, None)
        else:
            path.unlink(missing_ok=True)
            self.skipped[model_type] = reason
        self.skipped_path.write_text(json.dumps(dict(sorted(self.skipped.items())), indent=1) + "\n")


def _reader(stream: Any, lines: queue.Queue) -> None:
    for raw in stream:
        if raw.startswith(PREFIX):
            lines.put(json.loads(raw[len(PREFIX) :]))
    lines.put(None)


def run_family(family: Family, types: list[str], run: Run, timeout: float, log: Path) -> None:
    """Drive workers over ``types``; a type that times out or kills its worker is recorded and skipped."""

    def command(pending: list[str]) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--worker", family.name, "--types", ",".join(pending)]

    def done(msg: dict[str, Any]) -> None:
        run.record(msg["type"], msg["entry"], msg["reason"])
        status = "ok" if msg["entry"] else "skip: " + msg["reason"][:150]
        print(f"  {family.name}/{msg['type']}: {status}", flush=True)

    def failed(model_type: str, reason: str) -> None:
        run.record(model_type, None, reason)
        print(f"  {family.name}/{model_type}: {reason[:80]}", flush=True)

    drive_workers(types, command, done, failed, timeout, log)


def drive_workers(
    types: list[str],
    command: Callable[[list[str]], list[str]],
    done: Callable[[dict[str, Any]], None],
    failed: Callable[[str, str], None],
    timeout: float,
    log: Path,
) -> None:
    """Run ``command(pending)`` (a worker printing ``PREFIX`` JSON lines: ``{"start": type}`` then a result with
    ``"type"``) until every type has a result; ``done(result)`` for each, ``failed(type, reason)`` for a type that
    outlives ``timeout`` or kills its worker, after which a new worker takes the remaining types."""
    pending = list(types)
    while pending:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT))
        env["HF_HUB_OFFLINE"] = "1"  # nothing may come from a model hub: a config that wants weights fails
        with log.open("a") as err:
            proc = subprocess.Popen(
                command(pending), stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
            )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        current, started = None, time.monotonic()
        while True:
            try:
                msg = lines.get(timeout=max(1.0, timeout - (time.monotonic() - started)) if current else 600)
            except queue.Empty:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                failed(current, f"timeout: no result within {timeout:.0f}s")
                pending.remove(current)
                break
            if msg is None:  # the worker exited: finished, or crashed on `current`
                rc = proc.wait()
                if current is not None:
                    failed(current, f"worker process died (exit code {rc})")
                    pending.remove(current)
                else:
                    pending = []
                break
            if "start" in msg:
                current, started = msg["start"], time.monotonic()
                continue
            done(msg)
            pending.remove(msg["type"])
            current = None


# --- report -------------------------------------------------------------------------------------------------------


def write_coverage(out: Path, families: list[Family]) -> str:
    """The per-family table, written into docs/coverage.md between the generated markers."""
    rows = [
        START,
        "## Corpus of every architecture (generated)",
        "",
        textwrap.fill(
            "`python tools/gen_corpus.py` derives a tiny entry for every `model_type` in transformers' auto "
            f"mappings (output: `{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}`). Built = the "
            "entry's config builds, runs a forward pass and, for generative families, `generate`s 3 tokens "
            "(transformers 5.24.0, torch 2.13.0 CPU). Reused = the hand-made entry of tests/fixtures/corpus "
            "(transformers' tester config) verified the same way. Every skipped type is listed with its error in "
            "the family's `_skipped.json` and README.md; the cause column classes the error of the most-shrunk "
            "config.",
            116,
        ),
        "",
        "| family | types in mapping | built | reused hand-made | skipped | top skip causes |",
        "|---|---|---|---|---|---|",
    ]
    totals = [0, 0, 0, 0]
    for family in families:
        if not (out / family.name).is_dir():
            continue
        total, built, reused, skipped, causes = write_family_readme(family, out)
        top = ", ".join(f"{c} {n}" for c, n in sorted(causes.items(), key=lambda kv: -kv[1])[:3])
        rows.append(f"| {family.name} | {total} | {built} | {reused} | {skipped} | {top} |")
        for i, v in enumerate((total, built, reused, skipped)):
            totals[i] += v
    rows += [f"| **all** | {totals[0]} | {totals[1]} | {totals[2]} | {totals[3]} | |", END]
    block = "\n".join(rows)
    text = COVERAGE.read_text() if COVERAGE.exists() else "# Coverage\n"
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    COVERAGE.write_text(text)
    return block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "corpus_all")
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--types", default="", help="comma-separated model types (default: the whole mapping)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type")
    parser.add_argument("--resume", action="store_true", help="skip types that already have a result")
    parser.add_argument("--retry-skipped", action="store_true", help="with --resume: try skipped types again")
    parser.add_argument("--report-only", action="store_true", help="only rewrite READMEs and docs/coverage.md")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.types.split(","))
        return 0
    wanted = set(filter(None, args.families.split(",")))
    families = [f for f in FAMILIES if not wanted or f.name in wanted]
    out = args.out.resolve()
    if not args.report_only:
        log = out / "_gen.log"
        out.mkdir(parents=True, exist_ok=True)
        for family in families:
            run = Run(out, family)
            types = list(family_types(family))
            if args.types:
                types = [t for t in types if t in set(args.types.split(","))]
            if args.resume:
                done = run.done() - (set(run.skipped) if args.retry_skipped else set())
                types = [t for t in types if t not in done]
            print(f"{family.name}: {len(types)} types", flush=True)
            run_family(family, types, run, args.timeout, log)
    if not args.types and out == (ROOT / "tests" / "fixtures" / "corpus_all").resolve():
        print(write_coverage(out, list(FAMILIES)))
    else:
        for family in families:
            print(family.name, write_family_readme(family, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
