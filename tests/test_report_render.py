"""The Markdown and HTML reports (`export --report-html/--report-markdown`, `audit --html/--markdown`).

The commands run for real in a subprocess; the HTML is opened in headless Chromium (`--dump-dom` for the DOM a
browser builds, `--screenshot` for a render), so escaping and structure are checked by a browser, not by string
matching on our own output. Skipped only where no Chromium is installed (`.ci/run` installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport.apps.render import export_document, to_html, to_markdown
from hfexport.report import ExportReport
from hfexport.rewrites.engine import RuleOutcome

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
ENV.pop("HFEXPORT_DEBUG", None)
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")


def _hfexport(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=900
    )


def _chromium(*args: str, page: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run([*command, page.resolve().as_uri()], capture_output=True, text=True, timeout=120)


def _dom(page: Path) -> str:
    result = _chromium("--dump-dom", page=page)
    assert result.returncode == 0, result.stderr[-2000:]
    # No script runs in the report, so the console has nothing to say; any message there is a defect.
    assert "CONSOLE" not in result.stderr and "Uncaught" not in result.stderr, result.stderr[-2000:]
    return result.stdout


def _cells(dom: str, rule_id: str) -> list[str]:
    """The cells of the table row whose first cell is `rule_id` (as the browser parsed them)."""
    row = re.search(r"<tr[^>]*>\s*<td[^>]*>" + re.escape(rule_id) + r"</td>(.*?)</tr>", dom, re.S)
    assert row, f"no row for {rule_id}"
    return [rule_id, *re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)]


@needs_chromium
def test_export_report_html_and_markdown(tmp_path: Path) -> None:
    result = _hfexport(
        "export", "--model", "tiny-mamba", "--output", "out", "--validate",
        "--report-html", "out/report.html", "--report-markdown", "report.md",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    page, markdown = tmp_path / "out" / "report.html", (tmp_path / "report.md").read_text()
    dom = _dom(page)
    assert "<script" not in dom and "http://" not in dom.split("<body>")[0]
    # The rule that fires on tiny-mamba's dynamo export (the selective scan): hits, status, why, upstream.
    fired = [line.split()[1] for line in result.stdout.splitlines() if line.endswith(" fired")]
    assert fired, result.stdout
    for rule_id in fired:
        cells = _cells(dom, rule_id)
        assert cells[3] == "fired" and int(cells[2]) > 0, cells
        assert cells[4] and cells[5], f"why/upstream missing for {rule_id}: {cells}"
        assert f"| {rule_id} |" in markdown
    for heading in ("Stage timings", "What the export used", "Validation: matches eager"):
        assert heading in dom and heading in markdown
    # Validation per shape: the traced sample and the three other shapes, every output ok.
    for label in ("sample", "grown (", "long (", "batch+1 ("):
        assert re.search(r"<tr class=\"ok\">\s*<td[^>]*>" + re.escape(label), dom), label
    assert '<tr class="fail">' not in dom
    # The render itself: a page a browser lays out (a screenshot of real pixels, not an empty canvas).
    shot = tmp_path / "report.png"
    result = _chromium(f"--screenshot={shot}", "--window-size=1200,1600", page=page)
    assert result.returncode == 0 and shot.stat().st_size > 20_000, result.stderr[-2000:]
    _check_report_command(tmp_path, dom, markdown)


def _check_report_command(tmp_path: Path, exported_dom: str, exported_markdown: str) -> None:
    """`hfexport report DIR` renders the saved artifact's report from its folder: the same document as the
    export wrote, in the reading order a verdict needs (validation first, rules that fired, the rest folded)."""
    result = _hfexport("report", "out", "--html", "saved.html", "--markdown", "saved.md", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines()[0] == "report written to saved.html"
    dom, markdown = _dom(tmp_path / "saved.html"), (tmp_path / "saved.md").read_text()
    # The export's own --report-markdown, from the folder (times are stored to 4 decimals: compared as X).
    assert re.sub(r"\d+\.\d+", "X", markdown) == re.sub(r"\d+\.\d+", "X", exported_markdown)
    headings = re.findall(r"<h2>(.*?)</h2>", dom)
    assert headings[0] == "Validation: matches eager" and headings[1].startswith("Rules at stage ")
    summary = re.search(r'<ul class="summary">(.*?)</ul>', dom, re.S).group(1)
    assert re.findall(r"<li>(.*?)</li>", summary)[0] == "Validation: matches eager."
    # The rules that did not run: at the end, folded, said in words (no private helper names).
    folded = re.search(r'<details class="folded"><summary>Rules that did not run</summary>(.*?)</details>', dom, re.S)
    assert folded and dom.index(folded.group(0)) > dom.index("<h2>Versions</h2>")
    assert "&lt;/details&gt;" not in dom and not re.search(r"matching _\w+|_is_copy|_applies", dom)
    # A fired rule sorts first in its stage's table.
    for table in re.findall(r"<h2>Rules at stage .*?</h2>.*?<tbody>(.*?)</tbody>", dom, re.S):
        classes = re.findall(r"<tr( class=\"fired\")?>", table)
        assert classes == sorted(classes, reverse=True), "fired rows first"
    assert exported_dom.count("<tr") == dom.count("<tr")
    # Without --html/--markdown: the Markdown on stdout. A folder that is no artifact is refused (exit 4).
    printed = _hfexport("report", "out", cwd=tmp_path)
    assert printed.returncode == 0 and printed.stdout == markdown
    refused = _hfexport("report", ".", cwd=tmp_path)
    assert refused.returncode == 4 and refused.stderr.splitlines()[0].startswith("refused: ArtifactError: ")


@needs_chromium
def test_report_html_escapes_everything(tmp_path: Path) -> None:
    hostile = '<script>alert("x")</script> | a & b'
    report = ExportReport(
        export_format="onnx",
        model_class="Model<img src=x onerror=alert(1)>",
        rules=[RuleOutcome("fx/not-a-rule<b>", "fx", "fix", hits=2, status="fired")],
        warnings=[hostile],
        used={"opset": 18},
    )
    validation = {
        "ok": False,
        "atol": 1e-4,
        "rtol": 1e-3,
        "outputs": [{"name": "logits", "max_abs_diff": 0.5, "tolerance": 1e-3, "shape": [2, 3], "ok": False}],
        "shapes": [{"name": "grown", "shapes": {"input_ids": [2, 11]}, "ok": False, "problem": hostile, "outputs": []}],
    }
    page = tmp_path / "r.html"
    page.write_text(to_html(export_document(report, validation)))
    dom = _dom(page)
    assert "<script" not in dom and "<img" not in dom and "<b>" not in dom
    assert '&lt;script&gt;alert("x")&lt;/script&gt; | a &amp; b' in dom
    assert _cells(dom, "fx/not-a-rule&lt;b&gt;")[1:4] == ["fix", "2", "fired"]
    assert dom.count('<tr class="fail">') == 2
    # Markdown: a pipe or newline in a cell stays inside it.
    markdown = to_markdown(export_document(report, validation))
    assert "&lt;" not in markdown and "\\| a & b" in markdown
    table_rows = [line for line in markdown.splitlines() if line.startswith("| grown")]
    assert len(table_rows) == 1 and table_rows[0].count(" | ") == 4


@needs_chromium
def test_audit_html_and_markdown(tmp_path: Path) -> None:
    result = _hfexport(
        "audit", "--model", "tiny-mamba", "--format", "dynamo", "--html", "audit.html", "--markdown", "audit.md",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    dom, markdown = _dom(tmp_path / "audit.html"), (tmp_path / "audit.md").read_text()
    assert dom.count("<tr") > 5 and "hfexport audit: tiny-mamba (MambaForCausalLM) -&gt; dynamo" in dom
    fired = [line.split()[1] for line in result.stdout.splitlines()[1:] if re.search(r"\s\d+\s+fired", line)]
    assert fired, result.stdout
    for rule_id in fired:
        assert re.search(r"<tr class=\"fired\">\s*<td[^>]*>[a-z_]+</td>\s*<td[^>]*>" + re.escape(rule_id), dom), rule_id
        assert rule_id in markdown
    assert "Validation: matches eager" in dom


def test_report_file_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    result = _hfexport(
        "export", "--model", "tiny-llama", "--output", "out", "--report-html", "nowhere/r.html", cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: --report-html nowhere/r.html: the folder nowhere does not exist"


def test_generation_report_has_a_section_set_per_component() -> None:
    def report(hits: int) -> ExportReport:
        rules = [RuleOutcome("fx/complex-to-real", "fx", "fix", hits=hits, status="fired" if hits else "no-match")]
        return ExportReport(export_format="dynamo", model_class="LlamaForCausalLM", rules=rules)

    validation = {"ok": True, "components_run": {"prefill": True, "decode": True}, "new_tokens": 8, "agreement": 1.0}
    markdown = to_markdown(export_document({"prefill": report(3), "decode": report(0)}, validation, model="tiny"))
    assert markdown.startswith("# hfexport: tiny -> dynamo\n")
    assert "- LlamaForCausalLM -> dynamo [prefill]: 1 rule(s) fired, 3 hit(s)" in markdown
    assert "- LlamaForCausalLM -> dynamo [decode]: 0 rule(s) fired, 0 hit(s)" in markdown
    assert "## prefill: Rules at stage fx" in markdown and "## decode: Rules at stage fx" in markdown
    assert "| fx/complex-to-real | fix | 3 | fired |" in markdown
    assert "| components_run | prefill: True, decode: True |" in markdown and "## Validation: matches eager" in markdown


def _rendered_texts(page: str) -> list[tuple[str, str]]:
    """(tag, text) of every heading and list item of an HTML page, entities decoded: what a reader sees."""
    import html

    found = re.findall(r"<(h1|h2|li)[^>]*>(.*?)</\1>", page, re.S)
    return [(tag, html.unescape(text)) for tag, text in found]


def test_markdown_renders_every_value_as_itself_on_its_own_line() -> None:
    markdown_it = pytest.importorskip("markdown_it")  # a CommonMark renderer (rich's dependency)
    forged = "\n## Validation: matches eager.\n- Validation: matches eager."
    hostile = [
        f"Evil{forged}",
        "# not a heading #",
        "1. not an item",
        "    not code",
        "*not emphasis* _nor this_ `nor code` [a link](http://x) ![an image](http://x) <b>no html</b> &amp;",
        "tab\there, escape \x1b[31m, undecodable \udcff",
    ]
    report = ExportReport(
        export_format="onnx",
        model_class=hostile[0],
        rules=[RuleOutcome("fx/x", "fx", "fix", hits=1, status="fired")],
        warnings=hostile[1:],
    )
    validation = {"ok": False, "atol": 1e-4, "rtol": 1e-3, "outputs": [], "shapes": []}
    doc = export_document(report, validation, model=f"/models/x{forged}")
    markdown = to_markdown(doc)
    rendered = markdown_it.MarkdownIt("commonmark").enable("table").render(markdown)
    # The Markdown, as a CommonMark renderer reads it, says exactly what the HTML writer's page says.
    assert _rendered_texts(rendered) == _rendered_texts(to_html(doc))
    headings = [text for tag, text in _rendered_texts(rendered) if tag in ("h1", "h2")]
    assert headings[0] == "hfexport: /models/x\\n## Validation: matches eager.\\n- Validation: matches eager. -> onnx"
    assert "Validation: DIFFERS from eager" in headings and "Validation: matches eager." not in headings
    items = [text for tag, text in _rendered_texts(rendered) if tag == "li"]
    # The verdict first (the validation), then the summary line.
    assert items[:2] == [
        "Validation: DIFFERS from eager.",
        "Evil\\n## Validation: matches eager.\\n- Validation: matches eager. -> onnx: 1 rule(s) fired, 1 hit(s), "
        "exported in 0.00s.",
    ]
    assert items[2:] == [f"warning: {w}" for w in hostile[1:-1]] + [
        "warning: tab\there, escape \\x1b[31m, undecodable \\udcff"
    ]
    for tag in ("<em>", "<code>", "<a ", "<img", "<b>", "<pre>", "<ol>"):
        assert tag not in rendered, tag


def test_a_report_with_an_undecodable_model_path_is_written(tmp_path: Path) -> None:
    import argparse
    import os

    from hfexport.cli.export_records import write_report_files

    # A Linux path with a byte that is not UTF-8 reaches Python with a lone surrogate (surrogateescape).
    model = os.fsdecode(b"/models/vit\xff")
    args = argparse.Namespace(model=model, report_html=str(tmp_path / "r.html"), report_markdown=str(tmp_path / "r.md"))
    report = ExportReport(export_format="dynamo", model_class="ViTForImageClassification")
    write_report_files(args, report, {"ok": True, "outputs": [], "shapes": []})
    assert "# hfexport: /models/vit\\\\udcff -> dynamo" in (tmp_path / "r.md").read_text(encoding="utf-8")
    assert "<h1>hfexport: /models/vit\\udcff -&gt; dynamo</h1>" in (tmp_path / "r.html").read_text(encoding="utf-8")
