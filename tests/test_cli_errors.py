"""User mistakes on the command line: each is one line on stderr and a documented exit code, before any work.

Every test runs the real command in a subprocess and checks its exit code and the first line of its stderr
(docs/cli.md, "Exit codes"). Most are refused before torch is imported, so they cost well under a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
ENV.pop("HFEXPORT_DEBUG", None)


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=env or ENV, timeout=600
    )
    return result.returncode, (result.stderr.splitlines() or [""])[0], result.stderr


def _model_folder(tmp_path: Path, weights: bool) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        pytest.param(
            ["--format", "onxx"],
            "error: argument --format: invalid choice: 'onxx' (choose from 'dynamo', 'onnx', 'executorch', "
            "'openvino', 'aoti'); did you mean 'onnx'?",
            id="format-typo",
        ),
        pytest.param(
            ["--config", "{bad"], "error: --config is not valid JSON (Expecting property name", id="config-json"
        ),
        pytest.param(["--config", "[1]"], "error: --config takes a JSON object", id="config-not-object"),
        pytest.param(["--config", "@/no/such.json"], "error: --config @/no/such.json: cannot read", id="config-file"),
        pytest.param(
            ["--task", "text-classification"],
            "error: --task sequence-classification does not apply to the built-in tiny-llama",
            id="task-on-builtin",
        ),
        pytest.param(["--task", "txt-generation"], "error: argument --task: invalid choice", id="task-typo"),
        pytest.param(["--new-tokens", "4"], "error: --new-tokens: used only with --generation", id="new-tokens-alone"),
        pytest.param(
            ["--static-cache", "32", "--multi-token-decode"],
            "error: --static-cache, --multi-token-decode: used only with --generation",
            id="generation-flags-alone",
        ),
        pytest.param(["--batch-size", "0"], "error: --batch-size must be at least 1, not 0", id="batch-size"),
        pytest.param(["--dtype", "float8"], "error: argument --dtype: invalid choice: 'float8'", id="dtype"),
        pytest.param(
            ["--atol", "1e-3"],
            "error: --atol: they set the tolerance of --validate; add --validate or drop them",
            id="atol-without-validate",
        ),
        pytest.param(
            ["--generation", "--validate", "--rtol", "1e-2"],
            "error: --rtol: --generation --validate compares greedy tokens, not values; drop them",
            id="rtol-with-generation",
        ),
        pytest.param(
            ["--batch-size", "1", "--validate"],
            "error: --batch-size 1 with dynamic shapes: torch.export makes an axis whose sample size is 1 static",
            id="batch-size-1-dynamic",
        ),
        # optimum-cli's spellings (`--format ONNX`, `--dtype fp16`) are accepted: the refusal is the opset's.
        pytest.param(
            ["--format", "ONNX", "--dtype", "fp16", "--opset", "17"],
            "error: --opset 17: opset_version must be an int >= 18",
            id="opset-17-optimum-spellings",
        ),
    ],
)
def test_a_mistake_is_one_line_and_exit_2_before_any_work(tmp_path: Path, args: list[str], first_line: str) -> None:
    out = tmp_path / "out"
    code, line, stderr = _run("export", "--model", "tiny-llama", "--output", str(out), *args)
    assert code == 2 and line.startswith(first_line), stderr
    assert "Traceback" not in stderr and "•" not in stderr  # nothing was built
    assert not out.exists()


def test_rule_ids_and_opset_are_checked_before_tracing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, line, stderr = _run("export", "--model", "tiny-llama", "--disable", "fx/no-such", "--output", str(out))
    assert code == 2 and line.startswith("error: rule selection names no registered rule: ['fx/no-such']"), stderr
    code, line, stderr = _run("export", "--model", "tiny-llama", "--opset", "18", "--output", str(out))
    assert code == 2 and line == "error: --opset applies to --format onnx, not dynamo", stderr
    assert "› stage" not in stderr and not out.exists()


def test_rules_show_of_an_unknown_id_names_the_closest_ones() -> None:
    code, line, _ = _run("rules", "show", "onnx/rms-norm-fuson")
    assert code == 2 and line.endswith(
        "; did you mean 'onnx/rms-norm-fusion' or 'onnx/skip-rms-norm-fusion' or 'onnx/rms-norm-core-fusion'?"
    )
    code, line, _ = _run("rules", "show", "rms-norm-fusion")  # the stage left out
    assert code == 2 and "did you mean 'onnx/rms-norm-fusion'" in line


def test_model_folders_without_config_or_weights_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, line, _ = _run("export", "--model", str(empty), "--output", str(tmp_path / "a"))
    assert (
        code == 2
        and line == f"error: --model {empty}: the folder has no config.json (is it a Hugging Face model folder?)"
    )
    folder = _model_folder(tmp_path, weights=False)
    code, line, _ = _run("export", "--model", str(folder), "--output", str(tmp_path / "b"))
    assert code == 2 and line.startswith(f"error: --model {folder}: the folder has no weights")
    code, line, _ = _run("export", "--model", "tiny-lama", "--output", str(tmp_path / "c"))
    assert code == 2 and line.startswith("error: --model 'tiny-lama' is neither a built-in")


def test_an_output_that_cannot_be_created_is_refused_before_the_export(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, line, stderr = _run("export", "--model", "tiny-llama", "--output", str(blocker / "out"))
    assert code == 2 and line == f"error: --output {blocker / 'out'}: {blocker} is a file, not a folder", stderr
    if os.geteuid() != 0:  # root writes through the mode bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code, line, _ = _run("export", "--model", "tiny-llama", "--output", str(locked / "out"))
        assert code == 2 and line.startswith(f"error: --output {locked / 'out'}: cannot create a folder")


def test_debug_shows_the_traceback_and_keeps_the_exit_code_and_version_prints() -> None:
    code, line, _ = _run("export", "--model", "tiny-lama", "--output", "x")
    assert code == 2 and line.startswith("error: --model 'tiny-lama' is neither a built-in")
    code, first, stderr = _run("export", "--model", "tiny-lama", "--output", "x", "--debug")
    # The traceback first, then the same one line; the exit code says what happened, not what is displayed.
    assert code == 2 and first.startswith("Traceback") and "UsageError" in stderr
    assert stderr.splitlines()[-1] == line
    code, _, stderr = _run("export", "--model", "tiny-lama", "--output", "x", env={**ENV, "HFEXPORT_DEBUG": "1"})
    assert code == 2 and "Traceback" in stderr
    result = subprocess.run([sys.executable, "-m", "hfexport", "--version"], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0 and result.stdout.startswith("hfexport ")


@contextlib.contextmanager
def _sigint_at_its_default() -> Iterator[None]:
    """A child started in the block gets SIGINT at its default, as a terminal's foreground command does.

    A signal ignored in a process stays ignored in the programs it runs, and Python keeps an ignored SIGINT
    ignored. A shell without job control starts `cmd &` with SIGINT ignored (POSIX, "Signals and Error
    Handling"), e.g. `bash run_tests.sh &` in a non-interactive shell: a pytest under it ran this test's export
    with SIGINT ignored, which finished and exited 0 (session 19's failure, reproduced that way). A handler (not
    SIG_IGN) is reset to the default by exec, so setting one here gives the child the default SIGINT.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _full_pipe() -> tuple[int, int]:
    """A pipe already full: a process writing to it blocks until the reader drains it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"." * 4096)
    os.set_blocking(write_end, True)  # the child shares this flag: it must block, not fail
    return read_end, write_end


def _lines_into(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


@pytest.mark.parametrize(
    "after",
    [
        pytest.param("• exporting", id="during-the-export"),
        # The whole export runs first: 9-13 s on the shared 2 cores.
        pytest.param("• validating", id="after-the-save-during-validation", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_exits_130_with_one_line(tmp_path: Path, after: str) -> None:
    # ONNX with validation: seconds of work after "• exporting"; after "• validating" the artifact is saved,
    # and an interrupted command must remove it. The export's stdout is a full pipe and the command is
    # unbuffered: its first stdout line (the validation's result, after "• validating") blocks until the
    # test drains the pipe, so the signal always arrives before the command can finish, whatever the load.
    out = tmp_path / "out"
    command = ["export", "--model", "tiny-llama", "--format", "onnx", "--validate", "--output", str(out)]
    stdout_read, stdout_write = _full_pipe()
    with _sigint_at_its_default():
        process = subprocess.Popen(
            [sys.executable, "-m", "hfexport", *command],
            stderr=subprocess.PIPE,
            stdout=stdout_write,
            text=True,
            env={**ENV, "PYTHONUNBUFFERED": "1"},
        )
    os.close(stdout_write)
    assert process.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_lines_into, args=(process.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        while not seen or not seen[-1].startswith(after):
            try:
                line = lines.get(timeout=300)
            except queue.Empty:  # e.g. blocked writing to its stdout: a line there before the validation's
                pytest.fail(f"no {after!r} line in 300 s; stderr so far: {''.join(seen)[-3000:]}")
            assert line is not None, "".join(seen)[-3000:]  # the command ended before the line
            seen.append(line)
        process.send_signal(signal.SIGINT)
    except BaseException:
        process.kill()
        raise
    finally:
        with open(stdout_read, "rb") as stdout:  # drained in full: the command can go on, and exit
            stdout.read()
    code = process.wait(timeout=120)
    rest = "".join(iter(lambda: lines.get(timeout=60), None))
    # The stderr after the signal says what happened if the exit is not 130.
    assert code == 130, rest[-3000:]
    assert rest.strip().splitlines()[-1] == "interrupted" and "Traceback" not in rest, rest[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


# Loaded into the command's own interpreter (`sitecustomize` on its PYTHONPATH): real SIGINTs at exact points,
# chosen by audit events. The first when the validation opens the published manifest (the artifact is
# complete and the command is working on it); the second as the clean-up is about to remove its second file
# (a KeyboardInterrupt raised in the hook stops that removal: one file is gone, the others are not).
_TWO_CTRL_C = """
import os, signal, sys

_OUT = os.path.realpath(os.environ["HFEXPORT_TEST_OUTPUT"])
_MANIFEST = os.path.join(_OUT, "manifest.json")
_sent = []
_removals = []


def _hook(event, args):
    if event == "open" and not _sent and isinstance(args[0], str) and os.path.realpath(args[0]) == _MANIFEST:
        if os.path.exists(_MANIFEST):
            _sent.append("published")
            os.kill(os.getpid(), signal.SIGINT)
    elif event == "os.remove" and _sent == ["published"]:
        if os.path.realpath(os.fsdecode(args[0])).startswith(_OUT + os.sep):
            _removals.append(args[0])
            if len(_removals) == 2:
                _sent.append("removing")
                os.kill(os.getpid(), signal.SIGINT)


sys.addaudithook(_hook)
"""


def test_a_second_ctrl_c_during_the_clean_up_leaves_no_half_artifact(tmp_path: Path) -> None:
    # Before: the second Ctrl-C stopped the removal after its first file, leaving manifest.json with some of the
    # files it lists (so `hfexport check` saw an incomplete artifact, not none). Now the manifest goes first and
    # the second Ctrl-C waits until the removal is done.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_TWO_CTRL_C)
    out = tmp_path / "out"
    env = {**ENV, "HFEXPORT_TEST_OUTPUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), ENV.get("PYTHONPATH", "")) if p)
    command = ["export", "--model", "tiny-llama", "--no-dynamic", "--validate", "--output", str(out)]
    with _sigint_at_its_default():
        result = subprocess.run(
            [sys.executable, "-m", "hfexport", *command], capture_output=True, text=True, env=env, timeout=600
        )
    assert result.returncode == 130, result.stderr[-3000:]
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    lines = result.stderr.strip().splitlines()
    assert f"removed the unfinished artifact in {out}/" in lines and lines[-1] == "interrupted", result.stderr[-3000:]


def test_an_interrupt_removes_only_the_artifact_this_command_published(tmp_path: Path) -> None:
    from hfexport.cli.export_output import nothing_left_on_interrupt

    def publish(folder: Path, files: dict[str, str]) -> None:  # what `save` leaves: the files, then the manifest
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        (folder / "manifest.json").write_text(json.dumps({"files": sorted(files)}))

    new, report = tmp_path / "new", tmp_path / "new" / "report.html"
    with pytest.raises(KeyboardInterrupt), nothing_left_on_interrupt(new, [report]):
        new.mkdir()
        publish(new, {"model.onnx": "m", "decoder/model.onnx": "d"})
        report.write_text("r")
        raise KeyboardInterrupt
    assert not new.exists()
    # --overwrite interrupted before its publish: the previous artifact stays, untouched.
    old = tmp_path / "old"
    old.mkdir()
    publish(old, {"model.onnx": "previous"})
    with pytest.raises(KeyboardInterrupt), nothing_left_on_interrupt(old, []):
        raise KeyboardInterrupt
    assert (old / "model.onnx").read_text() == "previous" and (old / "manifest.json").exists()
    # Published over it: the new artifact goes; the folder the user made stays, and a file no manifest lists.
    (old / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt), nothing_left_on_interrupt(old, []):
        (old / "model.onnx").unlink()
        publish(old, {"model.onnx.data": "new", "model.onnx": "new"})
        raise KeyboardInterrupt
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]
    # Any other exception is the export's failure, reported as such: the folder is not touched.
    with pytest.raises(ValueError), nothing_left_on_interrupt(new, []):
        new.mkdir()
        publish(new, {"model.onnx": "m"})
        raise ValueError
    assert (new / "model.onnx").exists()


def test_a_refused_artifact_exits_4(tmp_path: Path) -> None:
    code, line, _ = _run("check", str(tmp_path / "missing"))
    assert code == 4 and line.startswith("refused: ArtifactError:")


def test_portable_opset_and_sample_shape_flags_reach_the_export(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    out = tmp_path / "out"
    args = ["--format", "onnx", "--portable", "--opset", "20", "--batch-size", "3", "--sequence-length", "5"]
    code, _, stderr = _run("export", "--model", "tiny-llama", *args, "--validate", "--output", str(out))
    assert code == 0, stderr[-3000:]
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}.get("", 0) == 20
    assert not [n.op_type for n in model.graph.node if n.domain == "com.microsoft"]  # standard ops only
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["validation"]["ok"] is True
    assert [3, 5, 128] in [o["shape"] for o in manifest["validation"]["outputs"]], manifest["validation"]


# Small enough that a probe which let the folder through would load it quickly, never a 7B default Llama.
SMALL_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "vocab_size": 64,
}


def _folder_with_weights(tmp_path: Path, config: dict | bytes) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("config", "preprocessor", "task", "error"),
    [
        pytest.param(
            {"model_type": "vit", "architectures": ["ViTForImageClassification"], "num_hidden_layers": 1},
            {"crop_size": 2**31},
            "image-classification",
            "error: preprocessor_config.json crop_size gives image side 2147483648: a sample needs a whole number "
            "from 1 to 16384",
            id="crop-size-2^31",
        ),
        pytest.param(
            {"model_type": "vit", "architectures": ["ViTForImageClassification"], "num_hidden_layers": 1},
            {"crop_size": 16384},
            "image-classification",
            "error: the folder's config files make pixel_values of shape [2, 3, 16384, 16384] (1610612736 elements",
            id="pixels-over-the-cap",
        ),
        pytest.param(
            b"\xbd{not json",
            None,
            "auto",
            "error: --model {folder}: config.json could not be read (",
            id="config-not-utf8",
        ),
        pytest.param(
            {**SMALL_LLAMA, "vocab_size": -5},
            None,
            "auto",
            "error: config vocab_size gives vocabulary -5: a sample needs a whole number from 1 to 2147483648",
            id="vocab-size-negative",
        ),
    ],
)
def test_a_malformed_model_folder_is_one_usage_error(
    tmp_path: Path, config: dict | bytes, preprocessor: dict | None, task: str, error: str
) -> None:
    """The folder probe reads config files that anyone can write: a wrong type or an absurd size is exit 2 with one
    error line before any weight is loaded, never transformers' or torch's own exception (exit 3) or the
    allocation the size claims."""
    folder = _folder_with_weights(tmp_path, config)
    if preprocessor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    output = tmp_path / "out"
    code, _, stderr = _run("export", "--model", str(folder), "--task", task, "--output", str(output))
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(error.format(folder=folder)), stderr[-2000:]
    assert "Traceback" not in stderr and not output.exists()


def test_an_output_path_that_is_not_utf8_saves_and_loads(tmp_path: Path) -> None:
    """A folder name of bytes that are not UTF-8 (as file systems allow) is written and read back: torch's .pt2
    writer aborted the process on such a path (exit 134) before it was given a file object."""
    output = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/out-\xff\xfe"))
    export = ["export", "--model", "tiny-llama", "--output", str(output), "--validate"]
    for args in (export, ["check", str(output), "--trust"]):
        # Bytes, not text: the command prints the path as the file system spells it.
        result = subprocess.run([sys.executable, "-m", "hfexport", *args], capture_output=True, env=ENV, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
    assert (output / "model.pt2").is_file()
