"""Every built-in tiny model x every format x {plain, `--validate`, `--generation --validate`} from the command
line (`hfexport.testing.cli_matrix`): each cell works, or is refused before any work with exit 2 and a reason.

Each command runs once per test session, in a subprocess, and the tests of a cell share it: the plain export
is the `--validate` run's export and save (the same command without its last step), the manifest, files and
output of a run are read by every test that needs them. The table these runs give is in docs/cli.md
("Built-in models on every format"); `python tools/cli_matrix.py` prints it. A format whose exports compile
natively (`Backend.slow_export`: AOTInductor) runs its cells in the slow tier only (docs/aoti.md has its table).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hfexport.backends import backend
from hfexport.formats import FORMATS, MAIN_FILE
from hfexport.testing.cli_matrix import CliRun, cell, run_cell, skipped_checks
from hfexport.tiny import TINY_MODELS

# Cells refused before any work, with the start of their one line: none. A combination the command cannot do
# would be listed here with its reason (and the docs table says the same).
REFUSED: dict[tuple[str, str, str], str] = {}
# Checks of other shapes a validation skips by design, with the start of the reason: LLaVA's export keeps the
# image count of pixel_values (the vision tower makes one Python value per image), so another batch is refused.
SKIPPED = {
    ("tiny-llava", export_format, "validate"): ["batch+1: the export keeps it static (pixel_values holds 2 image(s)"]
    for export_format in FORMATS
}
# Mamba's scan is unrolled on ExecuTorch, so the sequence is the sample's (the export says so and records it in
# `used.static_axes`): the longer sequences are skipped with that reason.
SKIPPED[("tiny-mamba", "executorch", "validate")] = [
    "grown: the export keeps it static (",
    "long: the export keeps it static (",
]
# The Hugging Face files an export of a built-in model writes beside the artifact.
HF_FILES = ("config.json", "generation_config.json")
CELLS = [(model, export_format) for model in TINY_MODELS for export_format in FORMATS]
# A format whose every export is a native compile (`Backend.slow_export`: AOTInductor) runs its cells in the slow tier;
# one whose lowering takes about a minute (`Backend.slow_lowering`: ExecuTorch) runs the first model's
# `--generation --validate` cell in the default tier (two lowerings, the saved program loaded and generating) and
# the others in the slow tier.
FEW_MODELS = ("tiny-llama",)
DEFAULT_CELLS = [
    (model, export_format)
    for model, export_format in CELLS
    if not backend(export_format).slow_export and (model in FEW_MODELS or not backend(export_format).slow_lowering)
]
GENERATION_ONLY = {export_format for _, export_format in CELLS if backend(export_format).slow_lowering}
# Cells that fail today, with the start of their error (strict: a cell that starts working fails its test, and its
# entry goes).
FAILS: dict[tuple[str, str, str], str] = {}


def _params(mode: str) -> list:
    """The cells for the tests of `mode`: slow for a slow format, a strict expected failure for those in FAILS."""
    params = []
    for key in CELLS:
        default = key in DEFAULT_CELLS and (mode == "generation" or key[1] not in GENERATION_ONLY)
        marks = [] if default else [pytest.mark.slow]
        if (*key, mode) in FAILS:
            marks.append(pytest.mark.xfail(reason=FAILS[(*key, mode)], strict=True))
        params.append(pytest.param(*key, marks=marks, id="-".join(key)))
    return params


Runs = Callable[[str, str, str], CliRun]


def _jobs() -> int:
    """Commands run at once: one per core (the exports are mostly single-threaded Python), up to 4, also under
    pytest-xdist: the matrix is the longest file, and the other workers finish theirs first and leave their cores
    to it (`HFEXPORT_TEST_JOBS` overrides)."""
    if os.environ.get("HFEXPORT_TEST_JOBS"):
        return max(1, int(os.environ["HFEXPORT_TEST_JOBS"]))
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def cli_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """`runs(model, format, mode)`: the `hfexport export` run of that cell, run once per session.

    The cells the session's tests will ask for are started at once, `_jobs()` at a time, in the order the tests
    ask for them, so a test waits only for its own cell while the next ones run beside it.
    """
    root = tmp_path_factory.mktemp("cli-matrix")
    wanted = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module.__name__ == __name__ and callspec is not None and "model" in callspec.params:
            mode = "generation" if "generation" in item.originalname else "validate"
            wanted.append((callspec.params["model"], callspec.params["export_format"], mode))
    wanted = sorted(dict.fromkeys(wanted), key=lambda key: key[2] == "generation")  # the order tests run in
    with concurrent.futures.ThreadPoolExecutor(max_workers=_jobs()) as pool:
        futures = {key: pool.submit(run_cell, *key, root) for key in wanted}

        def runs(model: str, export_format: str, mode: str) -> CliRun:
            key = (model, export_format, mode)
            if key not in futures:
                futures[key] = pool.submit(run_cell, *key, root)
            return futures[key].result()

        yield runs
        for future in futures.values():
            future.cancel()


def _works(run: CliRun) -> dict:
    """The checks every working cell passes: exit 0, progress first on stderr, no traceback, a manifest."""
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.first_stderr_line == f"• building {run.model}", run.stderr[:2000]
    assert "Traceback" not in run.stderr and "Logging error" not in run.stderr, run.stderr[-4000:]
    manifest = run.manifest
    assert manifest is not None and manifest["format"] == run.export_format
    listed = manifest["files"]
    assert all((run.output / rel).is_file() for rel in listed), listed
    on_disk = sorted(p.relative_to(run.output).as_posix() for p in run.output.rglob("*") if p.is_file())
    assert on_disk == sorted([*listed, "manifest.json"]), "the artifact's files, nothing else, are left behind"
    return manifest


def _refused(run: CliRun, key: tuple[str, str, str]) -> None:
    assert run.returncode == 2 and run.first_stderr_line.startswith("error: " + REFUSED[key]), run.stderr[-2000:]
    assert "•" not in run.stderr and not run.output.exists(), "refused before any work"


@pytest.mark.parametrize(("model", "export_format"), _params("validate"))
def test_plain_export(cli_runs: Runs, model: str, export_format: str) -> None:
    run = cli_runs(model, export_format, "validate")
    if (model, export_format, "validate") in REFUSED:
        return _refused(run, (model, export_format, "validate"))
    assert cell(run, "plain").verdict == "works", run.stderr[-4000:]
    manifest = _works(run)
    assert set(manifest["components"]) == {"model"}
    main = MAIN_FILE[export_format]
    assert manifest["files"][0] == main and {"report.json", *HF_FILES} <= set(manifest["files"])
    assert manifest["inputs"] == list(TINY_MODELS[model].sample_inputs())
    assert manifest["model"] == model and manifest["report"]["export_format"] == export_format


@pytest.mark.parametrize(("model", "export_format"), _params("validate"))
def test_export_validate(cli_runs: Runs, model: str, export_format: str) -> None:
    key = (model, export_format, "validate")
    run = cli_runs(*key)
    if key in REFUSED:
        return _refused(run, key)
    manifest = _works(run)
    validation = manifest["validation"]
    assert validation["ok"] is True and validation["tolerance_source"].startswith("the default for float32")
    assert f"ok   {manifest['outputs'][0]} " in run.stdout and "FAIL" not in run.stdout
    # The sample and the three other shapes, each compared or skipped with its reason; never a crash.
    assert sorted(s["name"] for s in validation["shapes"]) == ["batch+1", "grown", "long"]
    skipped = skipped_checks(manifest)
    expected = SKIPPED.get(key, [])
    assert len(skipped) == len(expected) and all(s.startswith(e) for s, e in zip(skipped, expected, strict=True))
    assert cell(run, "--validate").verdict == "works"


@pytest.mark.parametrize(("model", "export_format"), _params("generation"))
def test_export_generation_validate(cli_runs: Runs, model: str, export_format: str) -> None:
    key = (model, export_format, "generation")
    run = cli_runs(*key)
    if key in REFUSED:
        return _refused(run, key)
    manifest = _works(run)
    validation = manifest["validation"]
    assert validation["ok"] is True and validation["agreement"] == 1.0, validation
    assert all(validation["components_run"].values()) and set(validation["components_run"]) == set(
        manifest["components"]
    )
    assert manifest["generation"] is not None and len(manifest["components"]) >= 2
    assert "greedy tokens vs model.generate: 100% of 8 x 2 agree" in run.stdout
    assert cell(run, "--generation --validate").verdict == "works"


def test_a_whisper_generation_artifact_generates_whisper_s_tokens(cli_runs: Runs) -> None:
    # transformers' Whisper generate returns the new tokens without the decoder start token; so does the export.
    import hfexport

    run = cli_runs("tiny-whisper", "onnx", "generation")
    _works(run)
    tiny = TINY_MODELS["tiny-whisper"]
    model, features = tiny.build(), tiny.sample_inputs(seed=3)["input_features"]
    exported = hfexport.AutoExportedModel.from_pretrained(run.output)
    with torch.no_grad():
        expected = model.generate(input_features=features, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    got = exported.generate(input_features=features, max_new_tokens=5, min_new_tokens=5)
    assert got.shape == expected.shape == (2, 5) and torch.equal(got, expected)


@pytest.mark.parametrize(
    "keys",
    [
        # The default tier's rows: every column of a format whose default tier holds its generation cell only is
        # read by the slow tier's table.
        pytest.param([key for key in DEFAULT_CELLS if key[1] not in GENERATION_ONLY], id="default"),
        pytest.param(CELLS, id="all", marks=pytest.mark.slow),
    ],
)
def test_the_matrix_table_reads_every_run(cli_runs: Runs, tmp_path: Path, keys: list[tuple[str, str]]) -> None:
    # The docs table is built from these runs: one row per model and format, a verdict in every column.
    from hfexport.testing.cli_matrix import COLUMNS, markdown_table

    cells = [
        cell(cli_runs(model, export_format, mode), column)
        for model, export_format in keys
        for column, mode in COLUMNS.items()
    ]
    table = markdown_table(cells)
    (tmp_path / "table.md").write_text(table)
    assert table.count("\n") == len(keys) + 1
    # docs/cli.md shows the same rows (a cell that fails today is read from its own words there).
    documented = set((Path(__file__).parents[1] / "docs" / "cli.md").read_text().splitlines())
    failing = {(f" `{model}` ", f" {export_format} ") for model, export_format, _ in FAILS}  # as a row spells them
    rows = [r for r in table.splitlines()[2:] if tuple(r.split("|")[1:3]) not in failing]
    assert [r for r in rows if r not in documented] == [], "docs/cli.md's matrix is stale: python tools/cli_matrix.py"
    ok = [c.verdict in ("works", "refused") or (c.model, c.export_format, COLUMNS[c.column]) in FAILS for c in cells]
    assert all(ok), json.dumps([vars(c) for c, fine in zip(cells, ok, strict=True) if not fine], default=str)


# -- the artifact describes itself truly (the runs above, read again) -----------------------------------------


def test_the_manifest_and_report_say_what_was_written(cli_runs: Runs) -> None:
    onnx = _works(cli_runs("tiny-llama", "onnx", "validate"))
    # The opset the export wrote, not null.
    assert onnx["config"]["opset_version"] == onnx["report"]["used"]["opset"] and onnx["config"]["opset_version"]
    # OpenVINO: how the saved weights were written (float16 by default), not "not saved".
    openvino = _works(cli_runs("tiny-llama", "openvino", "validate"))
    assert openvino["report"]["used"]["saved_weights"] == "float16"
    # The copied config names the exported class; a generation export names the model, not its first component.
    run = cli_runs("tiny-whisper", "onnx", "generation")
    whisper = _works(run)
    assert json.loads((run.output / "config.json").read_text())["architectures"] == ["WhisperForConditionalGeneration"]
    assert (whisper["model_class"], whisper["model_type"]) == ("WhisperForConditionalGeneration", "whisper")
    from hfexport.testing.cli_matrix import run_command

    check = run_command("check", str(run.output))
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.splitlines()[0] == f"{run.output}: onnx artifact of WhisperForConditionalGeneration, ok"
    assert "  validation: passed: 8 greedy tokens equal model.generate's" in check.stdout


def test_a_single_graph_export_says_which_export_generates(cli_runs: Runs) -> None:
    import hfexport
    from hfexport.artifacts import ArtifactError

    run = cli_runs("tiny-llama", "onnx", "validate")
    model = hfexport.AutoExportedModel.from_pretrained(run.output)
    with pytest.raises(ArtifactError, match=r"not a generation export, so it cannot generate: export it with "):
        model.generate(input_ids=torch.tensor([[5, 6]]))


def test_task_text_generation_exports_what_generate_runs(tmp_path: Path) -> None:
    import hfexport
    from hfexport.testing.cli_matrix import run_command

    out = tmp_path / "gen"
    result = run_command("export", "--model", "tiny-llama", "--task", "text-generation", "--format", "onnx",
                         "--output", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "• exporting the generation components of LlamaForCausalLM to onnx (--task text-generation: " in (
        result.stderr
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["components"]) == ["prefill", "decode"] and manifest["generation"] is not None
    tiny = TINY_MODELS["tiny-llama"]
    ids = tiny.sample_inputs(seed=2)["input_ids"]
    with torch.no_grad():
        expected = tiny.build().generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    got = hfexport.AutoExportedModel.from_pretrained(out).generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4)
    assert torch.equal(got, expected)
    # optimum's -with-past names imply --generation too: --new-tokens is then refused only for want of --validate.
    refused = run_command("export", "--model", "tiny-llama", "--task", "text-generation-with-past",
                          "--new-tokens", "4", "--output", str(tmp_path / "other"))  # fmt: skip
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[0].startswith("error: --new-tokens sets how many tokens --validate compares")
