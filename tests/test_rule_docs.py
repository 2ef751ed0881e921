"""docs/rules.md is the catalogue generated from the registry: CI fails when it is stale."""

from __future__ import annotations

from pathlib import Path

from hfexport.apps.docgen import write_or_check
from hfexport.apps.docgen.rules import render

ROOT = Path(__file__).resolve().parents[1]


def test_catalogue_is_current() -> None:
    generated = render()
    current = (ROOT / "docs" / "rules.md").read_text()
    assert current == generated, "docs/rules.md is stale: run `python tools/gen_rule_docs.py` and commit it"


def test_catalogue_documents_every_rule_with_its_metadata() -> None:
    from hfexport.rewrites.engine import default_registry

    text = render()
    for rule in default_registry().rules():
        section = text.split(f"### `{rule.id}`", 1)[1].split("\n### ", 1)[0]
        assert rule.meta.kind in section and ", ".join(rule.meta.backends) in section
        for example in rule.meta.examples:
            assert f"{type(example).__name__}: " in section
    assert (ROOT / "docs" / "authoring-rules.md").is_file() and "(authoring-rules.md)" in text


def test_catalogue_links_each_rule_to_its_file_and_its_upstream_issue() -> None:
    import re

    from hfexport.rewrites.engine import default_registry

    text = render()
    docs = ROOT / "docs"
    for rule in default_registry().rules():
        section = text.split(f"### `{rule.id}`", 1)[1].split("\n### ", 1)[0]
        defined = re.search(r"- \*\*defined in\*\*: \[`([^`]+)`\]\(([^)]+)\)", section)
        assert defined, rule.id
        path, link = defined.groups()
        name = rule.id.split("/", 1)[1].replace("-", "_")
        assert path == f"hfexport/rewrites/rules/{rule.stage}/{name}.py"
        # The link is relative to docs/ and reaches the file in this checkout.
        assert (docs / link).resolve() == (ROOT / path).resolve() and (ROOT / path).is_file()
        upstream = section.split("- **upstream**: ", 1)[1].split("\n", 1)[0]
        ref = rule.meta.upstream_ref
        assert ref is not None
        if ref.kind == "url":
            assert upstream.startswith(f"[{ref.url}]({ref.url})"), (rule.id, upstream)
        else:
            assert upstream.startswith(f"`{ref.package}=={ref.version}` `{ref.path}`"), (rule.id, upstream)
        # Every URL in a note is a link too.
        for url in re.findall(r"(?<![(\[])https://[^\s)\]]+", upstream):
            raise AssertionError(f"{rule.id}: bare URL {url} in {upstream}")


def test_check_mode_fails_on_a_stale_catalogue(tmp_path: Path) -> None:
    stale = tmp_path / "rules.md"
    stale.write_text("# old\n")
    text = render()
    assert write_or_check(stale, text, check=True, how="regenerate") == 1 and stale.read_text() == "# old\n"
    assert write_or_check(stale, text, check=False, how="regenerate") == 0
    assert write_or_check(stale, text, check=True, how="regenerate") == 0 and stale.read_text() == text
