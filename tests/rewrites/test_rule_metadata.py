"""Rule metadata a reader can trust: `upstream` is an issue/PR URL or a pinned package path, `expires` is a
bounded requirement the audit evaluates, and every rule lives in the file its id names."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from hfexport.core import versions
from hfexport.rewrites.catalogue import expiry_status, rule_location, rule_module_name
from hfexport.rewrites.engine import default_registry
from hfexport.rewrites.rule import RuleDefinitionError, RuleMeta
from hfexport.rewrites.upstream import UpstreamRef, parse_upstream

ROOT = Path(__file__).resolve().parents[2]


# -- upstream --------------------------------------------------------------------------------------
def test_upstream_url_and_package_forms_parse_into_their_parts() -> None:
    issue = parse_upstream("https://github.com/pytorch/executorch/issues/11449 (static_reshape; one dynamic dim)")
    assert issue == UpstreamRef(
        "url", url="https://github.com/pytorch/executorch/issues/11449", note="(static_reshape; one dynamic dim)"
    )
    assert parse_upstream("https://github.com/google/XNNPACK/pull/9935").reference == (
        "https://github.com/google/XNNPACK/pull/9935"
    )
    pin = parse_upstream("transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan")
    assert (pin.kind, pin.package, pin.version, pin.path, pin.note) == (
        "package",
        "transformers",
        "5.24.0",
        "models/mamba/modeling_mamba.py",
        "mamba_selective_scan",
    )
    assert pin.reference == "transformers==5.24.0 models/mamba/modeling_mamba.py"


@pytest.mark.parametrize(
    ("upstream", "complaint"),
    [
        ("transformers models/cpmant/modeling_cpmant.py", "must start with a URL or '<package>==<version>'"),
        ("https://github.com/openvinotoolkit/openvino/blob/master/src/op_table.cpp", "not an issue or pull request"),
        ("https://example.com/some/page", "not an issue or pull request"),
        ("torch==2.13.0", "needs the path"),
        ("torch==two models/x.py", "not a version number"),
        ("torch>=2.13 torch/export.py", "must start with a URL"),
    ],
)
def test_malformed_upstream_is_a_rule_definition_error_that_says_what_is_wrong(upstream: str, complaint: str) -> None:
    with pytest.raises(RuleDefinitionError, match="rule fx/bad: ") as info:
        RuleMeta(id="fx/bad", why="w", upstream=upstream)
    assert complaint in str(info.value)


def test_every_registered_rule_cites_an_issue_or_a_pinned_package_path() -> None:
    for rule in default_registry().rules():
        ref = rule.meta.upstream_ref
        assert ref is not None, f"{rule.id} has no upstream"
        if ref.kind == "package":
            # A pin is a real release: a valid version of a package this project works with.
            Version(ref.version)
            assert ref.path, rule.id


# -- expires ---------------------------------------------------------------------------------------
def test_expires_needs_a_version_bound() -> None:
    with pytest.raises(RuleDefinitionError, match="needs a version bound"):
        RuleMeta(id="fx/bad", why="w", upstream="torch==2.13.0 export/x.py", expires="torch")
    with pytest.raises(RuleDefinitionError, match="is not a requirement"):
        RuleMeta(id="fx/bad", why="w", upstream="torch==2.13.0 export/x.py", expires="torch >> 2")


def test_a_rule_expires_once_the_installed_version_satisfies_its_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = default_registry().get("executorch/quant-slice-keeps-qparams")
    requirement = Requirement(rule.meta.expires or "")
    assert requirement.name == "executorch"
    # The installed release predates the fix; the first release with it (faked here) retires the rule.
    for installed, expired in (("1.4.1", False), ("1.5.0", True), ("1.5.1+cpu", True)):
        monkeypatch.setattr(versions, "installed_version", lambda package, v=installed: v)
        status = expiry_status(rule.meta)
        assert status[0] is expired, (installed, status)
        assert status[1].startswith(f"executorch {installed} ")


def test_expiring_rules_pin_a_release_that_predates_their_fix() -> None:
    # A rule cannot cite `pkg==V` as the buggy release and expire at a requirement V already meets.
    for rule in default_registry().rules():
        if not rule.meta.expires:
            continue
        requirement = Requirement(rule.meta.expires)
        ref = rule.meta.upstream_ref
        assert ref is not None
        if ref.kind == "package" and ref.package == requirement.name:
            assert not requirement.specifier.contains(ref.version), rule.id


# -- the id is the file and the name ---------------------------------------------------------------
def test_every_rule_is_defined_in_the_module_its_id_names() -> None:
    for rule in default_registry().rules():
        module_name, attribute = rule_module_name(rule.id)
        module = importlib.import_module(module_name)
        assert getattr(module, attribute, None) is rule, f"{rule.id} must be `{attribute}` in {module_name}"
        location = rule_location(rule)
        assert location is not None, rule.id
        assert location.path == f"hfexport/rewrites/rules/{rule.stage}/{attribute}.py"
        line = (ROOT / location.path).read_text().splitlines()[location.line - 1]
        assert line.startswith(f"{attribute} = "), (rule.id, line)


# -- what the test run knows of a rule is on the rule ----------------------------------------------
def _built() -> tuple[object, dict]:
    raise AssertionError("not built: a metadata check")


def test_an_example_is_checked_only_on_backends_of_its_rule() -> None:
    from hfexport.rewrites.examples import Match

    with pytest.raises(RuleDefinitionError, match=r"example 0 .* not all in \('onnx',\)"):
        RuleMeta(
            id="fx/bad",
            why="w",
            upstream="torch==2.13.0 fx/x.py",
            backends=("onnx",),
            examples=(Match(_built, "m", backends=("dynamo",)),),
        )
    with pytest.raises(RuleDefinitionError, match="known_failure names"):
        RuleMeta(
            id="fx/bad",
            why="w",
            upstream="torch==2.13.0 fx/x.py",
            backends=("onnx", "dynamo"),
            examples=(Match(_built, "m", backends=("onnx",), known_failure={"dynamo": "not lowered"}),),
        )
    with pytest.raises(ValueError, match="needs a reason"):
        Match(_built, "m", known_failure={"onnx": " "})


def test_known_failures_needs_and_baselines_are_declared_by_rules() -> None:
    from hfexport.rewrites.examples import known_failure
    from hfexport.testing.harness import baseline_rules

    registry = default_registry()
    assert baseline_rules("openvino") == ("openvino/drop-constant-inputs",)
    assert baseline_rules("executorch") == ("executorch/sym-size-functions-verifier",)
    assert baseline_rules("onnx") == ()
    complex_rule = registry.get("fx/complex-to-real")
    assert "XNNPACK reshape" in (known_failure(complex_rule.meta.examples[0], "executorch") or "")
    assert known_failure(complex_rule.meta.examples[0], "onnx") is None
    assert "torch.export.save" in registry.get("fx/sym-ceil-to-int").meta.needed
    with pytest.raises(RuleDefinitionError, match="`needed` is for a fix"):
        RuleMeta(id="onnx/bad", why="w", upstream="", kind="optimization", needed="elsewhere")


# -- one rule, one file: shared code in `_topic.py` modules ----------------------------------------
def _imported_rule_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for each `from hfexport.rewrites.rules... import ...` of a file; a rules package's submodules
    imported by name count as modules with no names."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hfexport.rewrites.rules"):
            names = [alias.name for alias in node.names]
            folder = ROOT.joinpath(*node.module.split("."))
            submodules = [n for n in names if (folder / f"{n}.py").is_file()]
            found += [(f"{node.module}.{n}", []) for n in submodules]
            found.append((node.module, [n for n in names if n not in submodules]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("hfexport.rewrites.rules.")]
    return found


def test_a_rule_imports_no_other_rule_and_no_private_name() -> None:
    """A rule's file is the whole rule: it imports no sibling rule's module (code that rules share is in a `_topic.py`
    module beside them, or in hfexport/rewrites/rules/ when stages share it), and no private name of any module
    there (a topic module's names for its rules are public)."""
    rules = ROOT / "hfexport" / "rewrites" / "rules"
    problems = []
    for path in sorted(rules.rglob("*.py")):
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for module, names in _imported_rule_modules(path):
            last = module.rsplit(".", 1)[-1]
            is_rule_module = module.count(".") == 4 and not last.startswith("_")
            if is_rule_module and module != own:
                problems.append(f"{path.relative_to(ROOT)} imports the rule module {module}")
            private = [n for n in names if n.startswith("_")]
            if private:
                problems.append(f"{path.relative_to(ROOT)} imports private {private} from {module}")
    assert not problems, "\n".join(problems)


# Test files of tests/rewrites/ not named after one rule: the engine and the kinds, and checks of what several rules
# do together.
_SHARED_TEST_FILES = {
    "test_engine.py": "the engine: registration, selection, phases, hit counts, patches",
    "test_examples.py": "every rule's examples (ids carry the rule id)",
    "test_rule_metadata.py": "every rule's metadata",
    "test_onnx_kinds.py": "the ONNX rule kinds",
    "test_executorch_rules.py": "the ExecuTorch rule kinds, and the MoE patch through ExecuTorch",
    "test_openvino_rules.py": "the OpenVINO rule kinds, and each OpenVINO rule's need",
    "test_quant_rules.py": "the rules of quantized programs, each with the quantizer that writes what it fixes",
    "test_aten_checks.py": "the ATen overrides of transformers' checks (is-all-true, squeeze-dim-noop)",
    "test_onnx_fusions_upstream.py": "the norm fusions against onnxscript's own ORT fusions",
    "test_executorch_cache_copies.py": "the two ExecuTorch rules that take cache copies out of a decode step",
    "test_openvino_cache_copies.py": "the two OpenVINO rules that take cache copies out of a decode step",
    "test_patch_chunk_length.py": "the BigBird and DeepSeek-V4 window-buffer patches' replacements against eager",
    "test_patch_seq2seq_rules.py": "the seq2seq patches (LongT5, NLLB-MoE, Moonshine) without their rule",
    "test_external_rules.py": "rules from outside hfexport: register_rules, the entry point, --rules, rules test",
}


def test_rule_tests_are_named_after_their_rule() -> None:
    """tests/rewrites/test_<stage>_<name>.py holds the tests of rule `<stage>/<name>` (beyond its examples)."""
    registry = default_registry()
    names = {f"test_{rule.stage}_{rule_module_name(rule.id)[1]}.py" for rule in registry.rules()}
    files = {path.name for path in (ROOT / "tests" / "rewrites").glob("test_*.py")}
    assert not files - names - set(_SHARED_TEST_FILES), sorted(files - names - set(_SHARED_TEST_FILES))
    assert set(_SHARED_TEST_FILES) <= files, sorted(set(_SHARED_TEST_FILES) - files)
