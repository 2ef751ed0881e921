"""Every ```python and ```bash block of README.md and docs/*.md runs as a test, so the docs cannot go stale.

- **bash**: each `hfexport ...` command of the block (comments dropped, `\\` continuations joined, `&&` chains
  split) runs as `python -m hfexport ...` in a fresh temporary folder and must exit 0. Other commands of a block
  (`pip install`, `pytest`, `python tools/...`) are not run: they install or run the suite itself.
- **python**: the block is executed in a fresh temporary folder (the current directory), with these names
  already defined, as the docs' prose assumes: `model` and `inputs` (the built-in `tiny-llama` and its sample
  inputs), `tokenizer` (a word-level tokenizer of the tiny folder below), `texts` and `calibration_dataset`
  (tokenized `texts`, one dict per text).
- **Substitutions**: `path/to/local/model` is a folder saved in the test (tiny-llama's weights and config plus that
  tokenizer); `my_model/modeling_my_model.py` is transformers' own `modeling_llama.py`; `tests/fixtures/code_lm`
  (the trained code model) is that folder of this repository.
- **Markers**: an HTML comment on the line before a block's fence: `<!-- doctest: skip (reason) -->` (a signature
  or an illustration with `...`; the reason is required), `<!-- doctest: slow -->` (minutes: ablations, sweeps,
  generation exports; run with `-m slow`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENV.pop("HFEXPORT_DEBUG", None)
_FENCE = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"^<!-- doctest: (skip|slow)(?: \((.+)\))? -->$")
PLACEHOLDER_MODEL = "path/to/local/model"
PLACEHOLDER_MODELING = "my_model/modeling_my_model.py"
# The trained code model fixture, named by its path in the repository (blocks run in a temporary folder).
CODE_LM = "tests/fixtures/code_lm"
TEXTS = ["Hello, world!", "Hi", "Export me to ONNX", "The train leaves at noon", "Hello again, world"]


@dataclass
class Block:
    path: Path
    line: int
    language: str
    code: str
    marker: str | None = None
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            line = text[: match.start()].count("\n") + 1
            before = [ln.strip() for ln in text[: match.start()].splitlines() if ln.strip()]
            marker = _MARKER.match(before[-1]) if before else None
            block = Block(path, line, match.group(1), match.group(2))
            if marker:
                block.marker, block.reason = marker.group(1), marker.group(2) or ""
            blocks.append(block)
    return blocks


def hfexport_commands(code: str) -> list[list[str]]:
    """The `hfexport` commands of a bash block, as argument lists."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0] == "hfexport":
                commands.append(words[1:])
    return commands


def _params() -> list[Any]:
    params = []
    for block in doc_blocks():
        marks = []
        if block.marker == "skip":
            marks.append(pytest.mark.skip(reason=f"doctest: skip ({block.reason})"))
        elif block.marker == "slow":
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`path/to/local/model`: tiny-llama's config and weights plus a word-level tokenizer of its vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from hfexport.tiny import get_tiny_model

    folder = tmp_path_factory.mktemp("local") / "model"
    get_tiny_model("tiny-llama").build().save_pretrained(folder)
    words = sorted({w for text in TEXTS for w in re.findall(r"\w+|[^\w\s]", text)})
    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.save_pretrained(folder)
    return folder


def _substitute(code: str, folder: Path) -> str:
    import transformers.models.llama.modeling_llama as llama

    code = code.replace(PLACEHOLDER_MODEL, str(folder)).replace(PLACEHOLDER_MODELING, llama.__file__)
    return code.replace(CODE_LM, str(ROOT / CODE_LM))


def _namespace(folder: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from hfexport.tiny import get_tiny_model

    tiny = get_tiny_model("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return {
        "__name__": "__doc_snippet__",
        "model": tiny.build(),
        "inputs": tiny.sample_inputs(),
        "tokenizer": tokenizer,
        "texts": list(TEXTS),
        "calibration_dataset": [dict(tokenizer(text, return_tensors="pt")) for text in TEXTS],
    }


def test_markers_are_reasoned() -> None:
    """A skip says why; a marker that is not exactly the documented form is a typo that would run the block."""
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("<!-- doctest"):
                marker = _MARKER.match(line.strip())
                assert marker, f"{path.name}:{number}: malformed doctest marker {line!r}"
                assert marker.group(1) != "skip" or marker.group(2), f"{path.name}:{number}: a skip needs a reason"
    assert len(doc_blocks()) > 20  # the extraction found the blocks (a broken regex would skip them all)


@pytest.mark.parametrize("block", _params())
def test_doc_block(block: Block, model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _substitute(block.code, model_folder)
    monkeypatch.chdir(tmp_path)
    if block.language == "python":
        exec(compile(code, block.id, "exec"), _namespace(model_folder))  # the docs are ours: running them is the test
        return
    commands = hfexport_commands(code)
    if not commands:
        pytest.skip("no hfexport command in this block (pip, pytest and tools/ are not run)")
    for args in commands:
        result = subprocess.run(
            [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV, timeout=1800
        )
        assert result.returncode == 0, f"hfexport {shlex.join(args)} -> {result.returncode}\n{result.stderr[-3000:]}"
