"""A model folder is untrusted input (a git clone, a download): nothing from outside it enters an artifact, and no
code of its own runs without an explicit yes.

Files: a config or tokenizer file that is a symlink out of the folder (`/proc/self/environ`, a secret elsewhere,
`../../outside`), a FIFO, a folder, or a 300 MB "tokenizer" is refused with the file named, by the command before
any work (exit 2) and by `hfexport.save(..., hf_files=folder)` before it writes anything; a symlink inside the
folder and a hub cache snapshot's links into its own `blobs/` are read through. Code: a folder whose config or
tokenizer needs its own Python (`auto_map`) is refused in one line unless `--trust-remote-code`, with stdin
answering "y" to any prompt; an artifact whose config names code its manifest does not list is refused by
`hfexport check` and `load`. Each case that runs code proves it did not by a marker file the code would write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from hfexport.artifacts import ArtifactError, load, save
from hfexport.artifacts.hf_files import collect, folder_files
from hfexport.core.errors import InputError

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
ENV.pop("HFEXPORT_DEBUG", None)
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def _hfexport(*args: str, env: dict[str, str] | None = None, stdin: str = "y\n" * 20) -> tuple[int, str, str]:
    """Run the command with stdin a pipe that answers "y" to any question (transformers' remote-code prompt)."""
    result = subprocess.run(
        [sys.executable, "-m", "hfexport", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=300,
    )
    return result.returncode, (result.stderr.splitlines() or [""])[0], result.stderr


def _folder(tmp_path: Path, config: dict[str, Any] | None = None) -> Path:
    """A model folder as the command checks it before loading: a config and a (here empty) weights file."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or LLAMA))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _secret(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret"
    secret.write_text("HF_TOKEN=hf_not_for_the_artifact")
    return secret


def _program() -> torch.export.ExportedProgram:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    return torch.export.export(Tiny(), (torch.ones(1, 2),))


# -- files: nothing from outside the folder -------------------------------------------------------------------


def _link_to_environ(folder: Path, tmp_path: Path) -> tuple[str, str]:
    (folder / "spiece.model").symlink_to("/proc/self/environ")
    return "spiece.model", "leads to /proc/"


def _link_to_secret(folder: Path, tmp_path: Path) -> tuple[str, str]:
    (folder / "sentencepiece.bpe.model").symlink_to(_secret(tmp_path))
    return "sentencepiece.bpe.model", f"leads to {_secret(tmp_path)}, outside the model folder"


def _relative_link_out(folder: Path, tmp_path: Path) -> tuple[str, str]:
    _secret(tmp_path)
    (folder / "vocab.txt").symlink_to("../outside/secret")
    return "vocab.txt", "outside the model folder"


def _fifo(folder: Path, tmp_path: Path) -> tuple[str, str]:
    os.mkfifo(folder / "tokenizer.json")  # opened for reading, it would block until someone writes
    return "tokenizer.json", "is a FIFO, not a regular file"


def _a_folder(folder: Path, tmp_path: Path) -> tuple[str, str]:
    (folder / "merges.txt").mkdir()
    return "merges.txt", "is a folder, not a regular file"


def _huge(folder: Path, tmp_path: Path) -> tuple[str, str]:
    with open(folder / "tokenizer.json", "wb") as f:
        f.truncate(300 * 1024 * 1024)  # sparse: 300 MB on paper, nothing on disk
    return "tokenizer.json", f"is {300 * 1024 * 1024} bytes, more than a config or tokenizer file can be"


HOSTILE_FILES = [
    pytest.param(_link_to_environ, id="symlink-to-proc-environ"),
    pytest.param(_link_to_secret, id="symlink-to-a-secret"),
    pytest.param(_relative_link_out, id="relative-symlink-out"),
    pytest.param(_fifo, id="fifo"),
    pytest.param(_a_folder, id="folder"),
    pytest.param(_huge, id="300MB-tokenizer"),
]


@pytest.mark.parametrize("make", HOSTILE_FILES)
def test_the_command_refuses_a_hostile_folder_file_before_any_work(tmp_path: Path, make: Any) -> None:
    folder = _folder(tmp_path)
    name, says = make(folder, tmp_path)
    out = tmp_path / "out"
    code, line, stderr = _hfexport("export", "--model", str(folder), "--output", str(out))
    assert code == 2, stderr[-3000:]
    assert line.startswith(f"error: {folder / name} ") and says in line, line
    assert "•" not in stderr and not out.exists()  # nothing was built, nothing written


@pytest.mark.parametrize("make", HOSTILE_FILES)
def test_save_refuses_a_hostile_folder_file_before_writing(tmp_path: Path, make: Any) -> None:
    folder = _folder(tmp_path)
    name, says = make(folder, tmp_path)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=re.escape(str(folder / name))) as caught:
        save(_program(), out, hf_files=folder)
    assert says in str(caught.value)
    assert not out.exists() and not list(tmp_path.glob(".out.hfexport-tmp-*"))


def test_symlinks_inside_the_folder_and_into_the_hub_cache_blobs_are_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "files").mkdir()
    (folder / "files" / "tok.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer.json").symlink_to("files/tok.json")
    assert folder_files(folder) == {"config.json": json.dumps(LLAMA).encode(), "tokenizer.json": b'{"version": "1.0"}'}
    # ~/.cache/huggingface/hub/models--org--tiny/snapshots/<rev>/config.json -> ../../blobs/<sha>
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0a1b").write_text('{"model_type": "llama"}')
    snapshot = repo / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/0a1b")
    assert folder_files(snapshot) == {"config.json": b'{"model_type": "llama"}'}
    # Another repository's blobs are outside: a snapshot reads only its own repository's.
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    (other / "ffff").write_text("someone else's")
    (snapshot / "vocab.txt").symlink_to("../../../models--someone--else/blobs/ffff")
    with pytest.raises(InputError, match=r"vocab\.txt leads to .*, outside the model folder"):
        folder_files(snapshot)
    # A link to nowhere is no file (as Path.is_file says); none is copied.
    (snapshot / "vocab.txt").unlink()
    (snapshot / "merges.txt").symlink_to("../../blobs/missing")
    assert folder_files(snapshot) == {"config.json": b'{"model_type": "llama"}'}


class _swap_at_open:
    """Swap the file named `real` for something else at the moment it is opened (an `open` audit event, before
    the system call), as another process racing the reader would."""

    _active: ClassVar[list[tuple[str, Any]]] = []
    _installed: ClassVar[bool] = False

    def __init__(self, real: Path, swap: Any) -> None:
        self.entry = (str(real), swap)
        if not _swap_at_open._installed:
            sys.addaudithook(_swap_at_open._hook)
            _swap_at_open._installed = True

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and _swap_at_open._active and isinstance(args[0], str):
            path, swap = _swap_at_open._active[-1]
            if args[0] == path:
                _swap_at_open._active.pop()
                swap(Path(path))

    def __enter__(self) -> None:
        _swap_at_open._active.append(self.entry)

    def __exit__(self, *exc: Any) -> None:
        if self.entry in _swap_at_open._active:
            _swap_at_open._active.remove(self.entry)


def _to_symlink(path: Path) -> None:
    path.unlink()
    path.symlink_to("/proc/self/environ")


def _to_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("swap", [_to_symlink, _to_fifo], ids=["symlink", "fifo"])
def test_a_file_swapped_between_the_check_and_the_read_is_refused(tmp_path: Path, swap: Any) -> None:
    from hfexport.core.model_files import check_folder_file, read_folder_file

    folder = _folder(tmp_path)
    (folder / "vocab.txt").write_text("a\nb\n")
    checked = check_folder_file(folder, "vocab.txt")
    assert checked is not None and checked.size == 4
    changed = re.escape("vocab.txt: changed while it was read")
    with _swap_at_open(checked.real, swap), pytest.raises(InputError, match=changed):
        read_folder_file(folder, "vocab.txt")


# -- code: none runs without an explicit yes --------------------------------------------------------------------


def _code_folder(tmp_path: Path, marker: Path, *, config: dict[str, Any] | None = None) -> Path:
    """A folder whose config names its own code: importing `configuration_evil.py` writes `marker`."""
    config = config or {
        "model_type": "evilmodel",
        "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"},
    }
    folder = _folder(tmp_path, config)
    (folder / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evilmodel'\n"
    )
    return folder


@pytest.fixture
def code_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    # transformers copies a folder's code into HF_MODULES_CACHE before importing it: keep that in tmp_path.
    yield {**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}


@pytest.mark.parametrize(
    "args", [["export"], ["export", "--task", "causal-lm"], ["audit"]], ids=["export", "export-task", "audit"]
)
def test_a_folder_that_needs_its_own_code_is_refused_in_one_line(
    tmp_path: Path, code_env: dict[str, str], args: list[str]
) -> None:
    marker = tmp_path / "code-ran"
    folder = _code_folder(tmp_path, marker)
    out = ["--output", str(tmp_path / "out")] if args[0] == "export" else []
    code, line, stderr = _hfexport(*args, "--model", str(folder), *out, env=code_env)
    assert code == 2, stderr[-3000:]
    assert line == (
        f"error: --model {folder}: config.json needs the folder's own Python code (model_type 'evilmodel' is not a "
        "transformers model; its auto_map names 'configuration_evil.EvilConfig'); hfexport runs none unless you "
        "pass --trust-remote-code"
    ), stderr[-3000:]
    assert "[y/N]" not in stderr and not marker.exists()  # never asked, never ran
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_needs_its_own_code_is_refused(tmp_path: Path, code_env: dict[str, str]) -> None:
    marker = tmp_path / "code-ran"
    folder = _code_folder(tmp_path, marker, config=LLAMA)
    auto_map = {"AutoTokenizer": ["configuration_evil.EvilTokenizer", None]}
    tokenizer = {"tokenizer_class": "EvilTokenizer", "auto_map": auto_map}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    code, line, _ = _hfexport("export", "--model", str(folder), "--output", str(tmp_path / "out"), env=code_env)
    assert code == 2 and line.startswith(f"error: --model {folder}: tokenizer_config.json needs the folder's own"), line
    assert line.endswith("hfexport runs none unless you pass --trust-remote-code") and not marker.exists()


def test_trust_remote_code_lets_transformers_run_the_folders_code(tmp_path: Path, code_env: dict[str, str]) -> None:
    marker = tmp_path / "code-ran"
    folder = _code_folder(tmp_path, marker)
    args = ["export", "--model", str(folder), "--output", str(tmp_path / "out"), "--trust-remote-code"]
    code, _, stderr = _hfexport(*args, env=code_env, stdin="n\n" * 20)
    # The code ran because it was asked to (the export then fails: the folder has no model code and no weights).
    assert marker.exists(), stderr[-3000:]
    assert code == 3 and "--trust-remote-code" not in stderr


def test_a_folder_config_with_auto_map_beside_a_known_model_type_runs_nothing(tmp_path: Path) -> None:
    # transformers loads a llama config with its own classes even when auto_map names code: nothing is refused.
    marker = tmp_path / "code-ran"
    config = {**LLAMA, "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}
    folder = _code_folder(tmp_path, marker, config=config)
    from hfexport.core.model_files import code_needed

    assert code_needed({"config.json": (folder / "config.json").read_bytes()}) is None
    # Saved beside an export, the code its auto_map names is copied and listed, so the artifact is complete.
    files = folder_files(folder)
    assert sorted(files) == ["config.json", "configuration_evil.py"] and not marker.exists()


def test_the_code_an_auto_map_names_is_saved_with_its_relative_imports(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    config = {
        "model_type": "evilmodel",
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"},
    }
    folder = _code_folder(tmp_path, marker, config=config)
    (folder / "modeling_evil.py").write_text("from .configuration_evil import EvilConfig\nfrom .utils_evil import x\n")
    (folder / "utils_evil.py").write_text("x = 1\n")
    (folder / "unrelated.py").write_text("y = 2\n")
    assert sorted(folder_files(folder)) == [
        "config.json",
        "configuration_evil.py",
        "modeling_evil.py",
        "utils_evil.py",
    ]
    (folder / "modeling_evil.py").unlink()
    missing = re.escape("auto_map names code in modeling_evil.py, which the folder does not have")
    with pytest.raises(InputError, match=missing):
        folder_files(folder)
    remote = {**config, "auto_map": {"AutoConfig": "org/repo--configuration_evil.EvilConfig"}}
    (folder / "config.json").write_text(json.dumps(remote))
    with pytest.raises(InputError, match="code that is no file of the folder"):
        folder_files(folder)
    unlisted = re.escape("code in configuration_evil.py, which is not among the files to save")
    with pytest.raises(InputError, match=unlisted):
        collect(files={"config.json": json.dumps(config).encode()})
    assert not marker.exists()


def _artifact(tmp_path: Path, **hf: Any) -> Path:
    return save(_program(), tmp_path / "artifact", hf_files=hf.get("files"))


def _rehash(folder: Path, rel: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / rel).read_bytes()
    manifest["checksums"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _plant_code(folder: Path, marker: Path, listed_config: bool) -> None:
    """What an attacker adds to an artifact: a config naming code, and the code (never listed)."""
    config = {"model_type": "evilmodel", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    if listed_config:
        _rehash(folder, "config.json")
    (folder.parent / "planted").mkdir()
    source = _code_folder(folder.parent / "planted", marker)
    (folder / "configuration_evil.py").write_bytes((source / "configuration_evil.py").read_bytes())


@pytest.mark.parametrize("listed_config", [True, False], ids=["listed-config", "unlisted-config"])
def test_check_refuses_an_artifact_whose_config_names_unlisted_code(tmp_path: Path, listed_config: bool) -> None:
    marker = tmp_path / "code-ran"
    files = {"config.json": json.dumps(LLAMA).encode()} if listed_config else None
    folder = _artifact(tmp_path, files=files)
    load(folder, trust=True)  # as saved, it loads
    _plant_code(folder, marker, listed_config)
    code, line, stderr = _hfexport("check", str(folder), "--trust")
    assert code == 4, stderr[-3000:]
    assert line == (
        f"refused: ArtifactError: {folder}: config.json's auto_map names 'configuration_evil.EvilConfig', code in "
        "configuration_evil.py, which its manifest does not list: from_pretrained(..., trust_remote_code=True) on "
        "this folder would run code no checksum covers"
    )
    assert not marker.exists()


def test_exported_model_never_asks_to_run_code(tmp_path: Path, code_env: dict[str, str]) -> None:
    marker = tmp_path / "code-ran"
    folder = _artifact(tmp_path, files={"config.json": json.dumps(LLAMA).encode()})
    _plant_code(folder, marker, listed_config=True)
    script = (
        "import sys\nimport hfexport\n"
        "try:\n    hfexport.ExportedModel.from_pretrained(sys.argv[1], trust=True)\n"
        "except hfexport.ArtifactError as exc:\n    print('refused:', exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)], input="y\n" * 20, capture_output=True, text=True, env=code_env
    )
    assert result.stdout.startswith(f"refused: {folder}: config.json's auto_map names"), result.stderr[-3000:]
    assert "[y/N]" not in result.stdout + result.stderr and not marker.exists()


def test_listed_code_loads_but_runs_only_with_trust_remote_code(tmp_path: Path) -> None:
    from hfexport import ExportedModel

    marker = tmp_path / "code-ran"
    folder = _artifact(tmp_path, files=folder_files(_code_folder(tmp_path, marker)))
    manifest = load(folder, trust=True).manifest
    assert "configuration_evil.py" in manifest["files"]  # listed and checksummed: `check` accepts it
    with pytest.raises(ArtifactError, match=r"config\.json needs the folder's own Python code.*trust_remote_code=True"):
        ExportedModel.from_pretrained(folder, trust=True)
    assert not marker.exists()
    from transformers import LlamaConfig

    model = ExportedModel.from_pretrained(folder, trust=True, config=LlamaConfig())
    assert isinstance(model.config, LlamaConfig) and not marker.exists()


def test_the_auto_map_check_reads_hostile_config_files_safely(tmp_path: Path) -> None:
    from hfexport.artifacts.hf_files import check_listed_code

    folder = tmp_path / "artifact"
    folder.mkdir()
    # Nested past Python's recursion limit: not JSON transformers could load, so no auto_map (no RecursionError).
    (folder / "config.json").write_text("[" * 100_000)
    check_listed_code(folder, {"config.json"})
    # The key spelled with a JSON escape is still the key.
    (folder / "config.json").write_text('{"\\u0061uto_map": {"AutoConfig": "evil.EvilConfig"}}')
    named = re.escape("config.json's auto_map names 'evil.EvilConfig', code in evil.py")
    with pytest.raises(ArtifactError, match=named):
        check_listed_code(folder, {"config.json"})
    # A config file larger than any real one is refused, not parsed.
    with open(folder / "config.json", "wb") as f:
        f.truncate(65 * 1024 * 1024)
    with pytest.raises(ArtifactError, match="more than a config or tokenizer file can be"):
        check_listed_code(folder, {"config.json"})


def _custom_llama_folder(tmp_path: Path) -> Path:
    """tiny-llama's weights and a tokenizer, under a model type of its own defined by the folder's code."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hfexport.tiny import TINY_MODELS

    folder = tmp_path / "custom"
    TINY_MODELS["tiny-llama"].build().save_pretrained(folder)
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "Hello": 4, ",": 5, "world": 6, "!": 7, "Export": 8}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tinycustom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyCustomConfig(LlamaConfig):\n"
        "    model_type = 'tinycustom'\n"
    )
    (folder / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyCustomConfig\n\n\n"
        "class TinyCustomForCausalLM(LlamaForCausalLM):\n    config_class = TinyCustomConfig\n"
    )
    return folder


@pytest.mark.slow  # three commands, one a folder export with validation: about 80 s on the 2-core test machine
def test_a_model_with_its_own_code_exports_with_trust_remote_code_and_its_code_is_listed(
    tmp_path: Path, code_env: dict[str, str]
) -> None:
    folder = _custom_llama_folder(tmp_path)
    out = tmp_path / "out"
    code, line, stderr = _hfexport("export", "--model", str(folder), "--output", str(out), env=code_env)
    assert code == 2 and "model_type 'tinycustom' is not a transformers model" in line, stderr[-3000:]
    args = ["--output", str(out), "--trust-remote-code", "--no-dynamic", "--validate"]
    code, _, stderr = _hfexport("export", "--model", str(folder), *args, env=code_env)
    assert code == 0, stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"config.json", "configuration_tiny.py", "modeling_tiny.py"} <= set(manifest["files"])
    assert manifest["validation"]["ok"] is True and manifest["model_class"] == "TinyCustomForCausalLM"
    code, _, stderr = _hfexport("check", str(out), "--trust")
    assert code == 0, stderr[-3000:]
