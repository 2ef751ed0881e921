"""Rules from outside hfexport: a package that declares an `hfexport.rules` entry point, `register_rules`,
`--rules`/HFEXPORT_RULES, `hfexport rules test`, and the checks a refused module fails.

The example package is tests/fixtures/rules_package (docs/authoring-rules.md shows its files): a toy architecture,
`countdown_model`, whose dynamic export bakes the sequence length in, and `countdown_rules`, the rule that fixes it.
It is installed with pip into a folder of its own, so its entry point is found as an installed one is.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hfexport
from hfexport import DynamoConfig, DynamoExporter, ExportReport, RuleSelection
from hfexport.cli.parser import main
from hfexport.rewrites import external, registry
from hfexport.rewrites.rule import RuleDefinitionError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tests" / "fixtures" / "rules_package"
RULE_ID = "patch/countdown-distance-arange"
ORIGIN = "countdown_rules (hfexport-example-rules 0.1.0)"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the example package is installed into (`pip install --target`), with its entry point metadata."""
    source = tmp_path_factory.mktemp("source") / "rules_package"
    shutil.copytree(PACKAGE, source)  # pip builds in the source folder: a copy keeps the checkout clean
    target = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, site: Path) -> registry.RuleRegistry:
    """hfexport's own rules in a registry that stands in for the process-wide one in this test (what a test
    registers does not leak into the others), the example package importable, HFEXPORT_RULES unset."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(external.ENVIRONMENT_VARIABLE, "")  # restored (unset) after the test; `--rules` sets it
    rules = registry.build_registry()
    with registry.using_registry(rules):
        yield rules


def _run(*args: str, path: list[Path], rules: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m hfexport ARGS` with this checkout and the folders `path` importable, HFEXPORT_RULES=`rules`."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [ROOT, *path])), "PYTHONWARNINGS": "ignore"}
    environment.pop(external.ENVIRONMENT_VARIABLE, None)
    if rules is not None:
        environment[external.ENVIRONMENT_VARIABLE] = rules
    command = [sys.executable, "-m", "hfexport", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)


def _first_error(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.splitlines()[0] if result.stderr else ""


_MARKED_BLOCK = re.compile(r"^<!-- doctest: skip \((.+?)\) -->\n```(\w+)\n(.*?)^```", re.S | re.M)


def _guide_blocks() -> list[tuple[str, str, str]]:
    """(marker reason, language, text) of each block of docs/authoring-rules.md that test_docs_snippets.py skips."""
    return _MARKED_BLOCK.findall((ROOT / "docs" / "authoring-rules.md").read_text())


# -- an installed rule package ------------------------------------------------------------------------------------
def test_an_installed_package_is_listed_but_not_imported_until_named(
    fresh: registry.RuleRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["rules", "list", "--stage", "patch"]) == 0
    out = capsys.readouterr().out
    assert RULE_ID not in out
    assert (
        "not enabled: countdown (countdown_rules, hfexport-example-rules 0.1.0); use it with --rules countdown" in out
    )
    assert "countdown_rules" not in sys.modules  # listing reads the metadata: no code of the package ran

    assert main(["rules", "list", "--stage", "patch", "--rules", "countdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["rule", "kind", "backends", "origin"]
    row = next(line for line in lines if line.startswith(RULE_ID))
    assert row.split()[1:3] == ["fix", "dynamo,onnx,executorch,openvino"]
    assert row.split()[3] == "countdown_rules"
    assert "1 from outside hfexport" in lines[-1]
    assert os.environ[external.ENVIRONMENT_VARIABLE] == "countdown"  # for the processes the command starts

    assert main(["rules", "show", RULE_ID]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[1] == f"origin:    {ORIGIN}"
    assert shown[2].endswith("countdown_rules/countdown_distance_arange.py:32")


def test_the_rule_fixes_the_export_and_is_in_its_report(fresh: registry.RuleRegistry) -> None:
    rules = hfexport.register_rules("countdown")
    assert [rule.id for rule in rules] == [RULE_ID]
    assert hfexport.register_rules("countdown_rules") == rules  # the module again: the same rules, once
    assert fresh.rules("patch")[-1] is rules[0]  # after hfexport's own patches

    from countdown_model.modeling import CountdownModel

    model = CountdownModel().eval()
    sample, longer = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (3, 9))
    # Without the rule the dynamic export keeps the sample's length: the program refuses 9 tokens.
    without = RuleSelection(disable=(RULE_ID,))
    baked = DynamoExporter().export(model, {"input_ids": sample}, DynamoConfig(dynamic=True, rules=without))
    with pytest.raises(AssertionError, match=r"Guard failed: input_ids.size\(\)\[1\] == 5"):
        baked.module()(input_ids=longer)

    exporter = DynamoExporter()
    program = exporter.export(model, {"input_ids": sample}, DynamoConfig(dynamic=True))
    torch.testing.assert_close(program.module()(input_ids=longer), model(longer), rtol=0, atol=0)
    outcome = next(o for o in exporter.report.rules if o.id == RULE_ID)
    assert (outcome.status, outcome.hits, outcome.origin) == ("fired", 1, ORIGIN)
    assert exporter.report.to_dict()["rules"][[o.id for o in exporter.report.rules].index(RULE_ID)]["origin"] == ORIGIN
    assert all("origin" not in o for o in exporter.report.to_dict()["rules"] if o["id"] != RULE_ID)
    # A saved report (report.json, the manifest) read back keeps it.
    saved = ExportReport.from_dict(exporter.report.to_dict())
    assert next(o for o in saved.rules if o.id == RULE_ID).origin == ORIGIN


def test_the_guide_shows_the_example_package_as_it_is() -> None:
    """Every file of the package that docs/authoring-rules.md shows is that file, which these tests install and run."""
    shown = {}
    for reason, _, text in _guide_blocks():
        found = re.match(r"the file (tests/fixtures/rules_package/\S+), which", reason)
        if found:
            shown[found.group(1)] = text
    files = {str(f.relative_to(ROOT)) for f in PACKAGE.rglob("*") if f.suffix in (".py", ".toml")}
    assert set(shown) == files - {"tests/fixtures/rules_package/countdown_model/__init__.py"}
    for path, text in shown.items():
        assert text == (ROOT / path).read_text(), f"docs/authoring-rules.md shows {path} otherwise"


def test_the_guides_commands_work_and_rules_test_prints_what_it_shows(site: Path) -> None:
    """The commands of the guide's "Use it" block run with the package installed (exit 0), and `rules test` prints
    the guide's sample output: its checks pass through the real exporters and runtimes."""
    block = next(text for reason, _, text in _guide_blocks() if "runs these commands" in reason)
    commands = [
        words[1:] for line in block.splitlines() if (words := shlex.split(line, comments=True))[:1] == ["hfexport"]
    ]
    assert [c[:2] for c in commands] == [["rules", "list"], ["rules", "list"], ["rules", "show"], ["rules", "test"]]
    guide = (ROOT / "docs" / "authoring-rules.md").read_text()
    sample = guide[guide.index("**Test it.**") :].split("```text\n", 1)[1].split("```", 1)[0]
    for args in commands:
        result = _run(*args, path=[site])
        assert result.returncode == 0, f"hfexport {' '.join(args)}: {result.stderr[-2000:]}"
        if args[1] == "test":
            assert result.stdout == sample
        elif args[1] == "show":
            assert f"origin:    {ORIGIN}" in result.stdout.splitlines()
        elif "--rules" in args:
            row = next(line for line in result.stdout.splitlines() if line.startswith(RULE_ID))
            assert row.split()[3] == "countdown_rules"
        else:
            assert result.stdout.splitlines()[-1].startswith("not enabled: countdown (countdown_rules,")


# -- refused modules ------------------------------------------------------------------------------------------------
_RULE = """
    import torch

    from hfexport.rewrites.examples import Match, NoMatch
    from hfexport.rewrites.kinds.fx import NodeRule
    from hfexport.rewrites.rule import RuleMeta


    def _square():
        return torch.nn.Identity(), {{"input": torch.randn(2, 3)}}


    {name} = NodeRule(
        RuleMeta(
            id={rule_id!r},
            why={why!r},
            upstream={upstream!r},
            examples=({examples}),
        ),
        predicate=lambda node: False,
        rewrite=lambda gm, node: None,
    )
"""
_BOTH = 'Match(_square, "m"), NoMatch(_square, "n")'
_GOOD = {
    "rule_id": "fx/toy-noop",
    "name": "toy_noop",
    "why": "a toy",
    "upstream": "torch==2.13.0 torch/fx/graph.py",
    "examples": _BOTH,
}


def _module(folder: Path, name: str, changes: dict[str, str] | None = None, listed: str = "[toy_noop]") -> str:
    """Write the module `name` (a rule, `_GOOD` with `changes`, and `RULES = listed`) into `folder`."""
    body = textwrap.dedent(_RULE.format(**{**_GOOD, **(changes or {})}))
    (folder / f"{name}.py").write_text(f"{body}\nRULES = {listed}\n")
    return name


@pytest.mark.parametrize(
    ("name", "changes", "listed", "error"),
    [
        ("empty_why", {"why": " "}, None, "empty_why: rule fx/toy-noop: `why` must say what it fixes or buys"),
        (
            "source_link",
            {"upstream": "https://github.com/pytorch/pytorch/blob/main/torch/fx/graph.py"},
            None,
            "source_link: rule fx/toy-noop: `upstream` URL 'https://github.com/pytorch/pytorch/blob/main/torch/fx/"
            "graph.py' is not an issue or pull request",
        ),
        (
            "taken_id",
            {"rule_id": "fx/complex-to-real", "name": "complex_to_real"},
            "[complex_to_real]",
            "taken_id: duplicate rule id 'fx/complex-to-real': hfexport has a rule of this id; pick another name",
        ),
        (
            "one_example",
            {"examples": 'Match(_square, "m"),'},
            None,
            "one_example: rule fx/toy-noop needs at least one Match and one NoMatch example",
        ),
        (
            "misnamed",
            {"name": "noop"},
            "[noop]",
            "misnamed: rule 'fx/toy-noop' must be the object `toy_noop` in misnamed or in misnamed.toy_noop",
        ),
        ("unlisted", {}, "[]", "unlisted: defines ['fx/toy-noop'] but does not list them in RULES"),
        ("no_list", {}, "toy_noop", "no_list: a module of rules lists them, in the order they run, as `RULES`"),
        ("missing_module_xyz", None, None, "no module or hfexport.rules entry point named 'missing_module_xyz'"),
    ],
)
def test_a_bad_module_is_refused_with_what_is_wrong_and_registers_nothing(
    fresh: registry.RuleRegistry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    changes: dict[str, str] | None,
    listed: str | None,
    error: str,
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    if changes is not None:
        _module(tmp_path, name, changes, listed or "[toy_noop]")
    before = fresh.ids()
    with pytest.raises(RuleDefinitionError) as info:
        hfexport.register_rules(name)
    assert error in str(info.value)
    assert fresh.ids() == before and not fresh.modules()


def test_a_second_module_cannot_take_an_id_and_requirements_must_be_registered(
    fresh: registry.RuleRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    first = hfexport.register_rules(_module(tmp_path, "first_rules"))
    assert [rule.origin_name for rule in first] == ["first_rules"]
    with pytest.raises(RuleDefinitionError, match="duplicate rule id 'fx/toy-noop': first_rules has a rule of this id"):
        hfexport.register_rules(_module(tmp_path, "second_rules"))
    body = _RULE.replace("upstream=", "requires=('fx/not-there',), upstream=")
    (tmp_path / "needs_rules.py").write_text(
        textwrap.dedent(body.format(**{**_GOOD, "rule_id": "fx/toy-other", "name": "toy_other"}))
        + "\nRULES = [toy_other]\n"
    )
    with pytest.raises(RuleDefinitionError, match="rule fx/toy-other requires 'fx/not-there', which is not registered"):
        hfexport.register_rules("needs_rules")
    assert [r.id for r in fresh.rules("fx")][-1] == "fx/toy-noop" and list(fresh.modules()) == ["first_rules"]


def test_a_refused_module_is_a_usage_error_on_the_command_line(site: Path, tmp_path: Path) -> None:
    _module(tmp_path, "why_less_rules", {"why": ""})
    result = _run("rules", "test", "why_less_rules", path=[site, tmp_path])
    assert result.returncode == 2, result.stderr[-2000:]
    assert _first_error(result) == "error: why_less_rules: rule fx/toy-noop: `why` must say what it fixes or buys"
    # `--rules` on an export: refused before any work, nothing written.
    output = tmp_path / "out"
    result = _run("export", "--model", "tiny-llama", "--output", str(output), "--rules", "no_such_rules", path=[site])
    assert result.returncode == 2 and not output.exists(), result.stderr[-2000:]
    first = _first_error(result)
    assert first.startswith(
        "error: --rules no_such_rules: no module or hfexport.rules entry point named 'no_such_rules'"
    )
    assert first.endswith("installed hfexport.rules entry points: countdown (hfexport-example-rules)")
    # The same name in HFEXPORT_RULES: refused the same way, naming the variable.
    result = _run(
        "export", "--model", "tiny-llama", "--output", str(output), path=[site], rules="countdown,no_such_rules"
    )
    assert result.returncode == 2 and not output.exists(), result.stderr[-2000:]
    assert _first_error(result).startswith(
        "error: HFEXPORT_RULES names 'no_such_rules': no module or hfexport.rules entry point named 'no_such_rules'"
    )


def test_hfexport_rules_names_are_loaded_with_the_default_registry(
    site: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_DEFAULT", None)  # built afresh here, restored after the test
    monkeypatch.setenv(external.ENVIRONMENT_VARIABLE, "countdown, no_such_rules")
    assert main(["rules", "list", "--stage", "patch"]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[0]
        .startswith(
            "error: HFEXPORT_RULES names 'no_such_rules': no module or hfexport.rules entry point named 'no_such_rules'"
        )
    )
    assert registry._DEFAULT is None  # nothing half-built is kept
    monkeypatch.setenv(external.ENVIRONMENT_VARIABLE, "countdown")
    assert registry.default_registry().get(RULE_ID).origin_name == ORIGIN
