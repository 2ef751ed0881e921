"""`hfexport scan`: LibCST matchers find export-breaking patterns, and say which rules target them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hfexport.cli import main
from hfexport.scan import KINDS, RuleIndex, scan, scan_source

FIXTURES = Path(__file__).parent / "fixtures" / "scan"


def _expected(path: Path) -> set[tuple[str, int]]:
    """The fixture marks each site with a trailing `# <kind>` comment."""
    marked = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = re.search(r"#\s*([a-z-]+)\s*$", line)
        if found and found[1] in KINDS:
            marked.add((found[1], number))
    return marked


def test_every_pattern_is_found_where_the_fixture_marks_it() -> None:
    path = FIXTURES / "dirty_model.py"
    expected = _expected(path)
    assert {kind for kind, _ in expected} == set(KINDS)  # the fixture covers every pattern
    sites = scan_source(path.read_text(), str(path), "dirty_model", RuleIndex())
    assert {(s.kind, s.line) for s in sites} == expected
    by_line = {s.line: s for s in sites}
    assert by_line[9].scope == "DirtyAttention.forward" and by_line[9].owner == "DirtyAttention"
    assert by_line[28].owner == "<module>" and by_line[28].code == "mask.sum(-1).tolist()"


def test_export_friendly_code_has_no_sites() -> None:
    path = FIXTURES / "clean_model.py"
    assert scan_source(path.read_text(), str(path), "clean_model", RuleIndex()) == []


def test_parallel_scan_finds_the_same_sites_in_the_same_order() -> None:
    serial = scan(paths=[FIXTURES], rule_index=RuleIndex())
    parallel = scan(paths=[FIXTURES], rule_index=RuleIndex(), jobs=2)
    assert parallel.sites == serial.sites and len(serial.sites) == 8


def test_sites_name_the_rules_that_target_their_class_or_function() -> None:
    index = RuleIndex(targets={"dirty_model.DirtyModel.forward": ["patch/example"]})
    path = FIXTURES / "dirty_model.py"
    sites = scan_source(path.read_text(), str(path), "dirty_model", index)
    targeted = {s.line for s in sites if s.rules == ("patch/example",)}
    assert targeted == {line for kind, line in _expected(path) if 16 <= line <= 24}
    assert all(not s.rules for s in sites if s.owner != "DirtyModel")


def test_installed_transformers_sites_are_matched_to_registered_rules() -> None:
    result = scan(models=["cpmant", "mamba", "llama"])
    cpmant = [s for s in result.sites if s.module == "transformers.models.cpmant.modeling_cpmant"]
    assert any(s.kind == "list-from-shape" and s.owner == "CpmAntModel" for s in cpmant)
    assert all("patch/cpmant-mask-arange" in s.rules for s in cpmant if s.owner == "CpmAntModel")
    mamba = [s for s in result.sites if s.scope == "mamba_selective_scan"]
    assert [s.kind for s in mamba] == ["loop-over-shape"] and "patch/mamba-selective-scan-hop" in mamba[0].rules
    assert "patch/mamba-selective-scan-hop" in result.model_rules["transformers.models.mamba.modeling_mamba"]
    assert not [s for s in result.sites if ".llama." in s.module]  # Llama exports cleanly
    assert len(result.files) == 3


def test_scan_command_prints_sites_per_class_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scan.json"
    assert main(["scan", "--path", str(FIXTURES), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "  DirtyModel\n" in printed and "loop-over-shape" in printed
    assert "8 site(s) in 3 class(es)/module(s) of 2 file(s)" in printed
    data = json.loads(out.read_text())
    assert data["counts"]["item-tolist"] == 2 and len(data["sites"]) == 8
    assert main(["scan", "--models", "lama"]) == 2
    assert "did you mean" in capsys.readouterr().err
