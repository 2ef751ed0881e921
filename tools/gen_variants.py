"""Generate the variants of corpus entries and measure the config branches they cover (issue #43).

    OMP_NUM_THREADS=1 python tools/gen_variants.py --families causal_lm            # -> tests/fixtures/corpus_variants
    python tools/gen_variants.py --families causal_lm --types deepseek_v3,gpt_oss --timeout 300
    python tools/gen_variants.py --report-only                                      # rewrite the READMEs only

For each built entry of `tests/fixtures/corpus_all/<family>` (and its `@tester` config, where
`hfexport/testing/tester_configs.json` has one that differs from the entry's), `hfexport.testing.corpus_variants`
proposes variants (one config attribute the modeling code branches on, set to other values); each is checked
like a corpus entry (build, forward, grown input, `generate` for generative families) and written as
`<out>/<family>/<type>@<variant>.json`. The checks run under a line tracer on the type's modeling files
(`hfexport.testing.config_branches`), so `<out>/<family>/_coverage.json` records, per type, how many sides of
the `if`s that read the config the entry alone takes and how many the entry and its variants take, and every
variant that did not build with its error. Types run in worker processes with a per-type timeout, as in
tools/gen_corpus.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from gen_corpus import PREFIX, drive_workers  # noqa: E402

from hfexport.testing.corpus_gen import FAMILIES  # noqa: E402
from hfexport.testing.corpus_readmes import write_variants_readme  # noqa: E402

CORPUS = ROOT / "tests" / "fixtures" / "corpus_all"
OUT = ROOT / "tests" / "fixtures" / "corpus_variants"
_SHARED_LIMIT = 30  # uncovered sides listed per type


def _tester_variant(model_type: str, entry: dict[str, Any], family: Any) -> tuple[dict[str, Any] | None, str]:
    """The entry rebuilt from transformers' tester config (`@tester`), when there is one other than the entry's."""
    from transformers.models.auto import modeling_auto  # noqa: F401  (the auto classes resolve through it)

    from hfexport.testing.corpus_gen import tester_config, tester_configs, try_config

    records = tester_configs().get(model_type, [])
    if not records or str(entry.get("source", "")).startswith(("tester:", "reused:")):
        return None, ""
    try:
        config = tester_config(model_type, records[0])
        built, reason = try_config(model_type, family, entry["auto_class"], config, f"tester:{records[0]['tester']}")
    except Exception as exc:  # the tester config itself is refused by this transformers
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if built is None:
        return None, reason
    built["variant"] = "tester"
    return built, ""


def worker(family_name: str, types: list[str], out: Path) -> None:
    """Variants and coverage of each type in turn; one PREFIX line per type."""
    from hfexport.testing.config_branches import LineCounts, branch_sites, count_lines, taken_sides
    from hfexport.testing.corpus_gen import error_line, verify_entry
    from hfexport.testing.corpus_variants import apply_variant, propose_variants

    family = next(f for f in FAMILIES if f.name == family_name)
    for model_type in types:
        print(PREFIX + json.dumps({"start": model_type}), flush=True)
        start = time.perf_counter()
        base = json.loads((CORPUS / family_name / f"{model_type}.json").read_text())
        files = list(branch_sites(model_type))
        total = LineCounts()
        total.merge(count_lines(files, lambda base=base: verify_entry(base, family.generative)))
        base_counts = LineCounts(counts={k: Counter(v) for k, v in total.counts.items()})
        built: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        tester, why = _tester_variant(model_type, base, family)
        if tester is not None:
            built["tester"] = tester
        elif why:
            skipped["tester"] = why
        for variant in propose_variants(model_type, base["config"]):
            entry = apply_variant(base, variant)
            try:
                record: dict[str, Any] = {}
                counts = count_lines(files, lambda e=entry, r=record: r.update(verify_entry(e, family.generative)))
            except Exception as exc:
                skipped[variant.name] = error_line(exc)
                continue
            entry.update(record)
            built[variant.name] = entry
            total.merge(counts)
        coverage = _coverage(model_type, base_counts, total, taken_sides)
        coverage.update(variants=sorted(built), skipped=skipped, seconds=round(time.perf_counter() - start, 1))
        folder = out / family_name
        folder.mkdir(parents=True, exist_ok=True)
        for name, entry in built.items():
            (folder / f"{model_type}@{name}.json").write_text(json.dumps(entry, indent=1) + "\n")
        print(PREFIX + json.dumps({"type": model_type, "coverage": coverage}), flush=True)


def _coverage(model_type: str, base: Any, total: Any, taken_sides: Any) -> dict[str, Any]:
    """Sides of the config `if`s reached: taken by the entry alone, and by the entry with its variants."""
    sites = reached = base_sides = sides = 0
    uncovered: list[str] = []
    base_by_site = {(p, s.line): t for p, s, t in taken_sides(model_type, base)}
    for path, site, taken in taken_sides(model_type, total):
        sites += 1
        if taken is None:
            continue
        reached += 1
        sides += sum(taken)
        base_sides += sum(base_by_site.get((path, site.line)) or (False, False))
        if not all(taken):
            side = "else" if taken[0] else "then"
            uncovered.append(f"{Path(path).name}:{site.line} {side} of `{site.code}`")
    return {
        "if_sites": sites,
        "reached": reached,
        "sides": 2 * reached,
        "covered_by_entry": base_sides,
        "covered": sides,
        "uncovered": uncovered[:_SHARED_LIMIT],
    }


def run_family(family: str, types: list[str], out: Path, timeout: float) -> None:
    """Variants of `types` of one family, each type's coverage saved as soon as its worker reports it."""
    folder = out / family
    folder.mkdir(parents=True, exist_ok=True)
    coverage_file = folder / "_coverage.json"
    coverage = json.loads(coverage_file.read_text()) if coverage_file.exists() else {}

    def command(pending: list[str]) -> list[str]:
        script = str(Path(__file__).resolve())
        return [sys.executable, script, "--worker", family, "--types", ",".join(pending), "--out", str(out)]

    def save(model_type: str, record: dict[str, Any]) -> None:
        coverage[model_type] = record
        coverage_file.write_text(json.dumps(dict(sorted(coverage.items())), indent=1) + "\n")

    def done(msg: dict[str, Any]) -> None:
        save(msg["type"], msg["coverage"])
        c = msg["coverage"]
        sides = f"sides {c['covered_by_entry']} -> {c['covered']}/{c['sides']}"
        print(f"  {family}/{msg['type']}: {len(c['variants'])} variants, {sides} ({c['seconds']}s)", flush=True)

    def failed(model_type: str, reason: str) -> None:
        save(model_type, {"error": reason})
        print(f"  {family}/{model_type}: {reason}", flush=True)

    drive_workers(types, command, done, failed, timeout, folder / "_gen.log")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--families", default="causal_lm")
    parser.add_argument("--types", default="", help="comma-separated model types (default: every built entry)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per type (all its variants)")
    parser.add_argument("--resume", action="store_true", help="skip types already in _coverage.json")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.types.split(","), args.out)
        return 0
    for family in filter(None, args.families.split(",")):
        if not args.report_only:
            types = sorted(p.stem for p in (CORPUS / family).glob("*.json") if not p.name.startswith("_"))
            if args.types:
                types = [t for t in types if t in set(args.types.split(","))]
            if args.resume:
                known = args.out / family / "_coverage.json"
                done = json.loads(known.read_text()) if known.exists() else {}
                types = [t for t in types if t not in done]
            run_family(family, types, args.out, args.timeout)
        print(family, write_variants_readme(args.out, family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
