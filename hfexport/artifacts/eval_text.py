"""Held-out text that ships with every Python: the standard library's source, split by a hash of each file's name.

`tools/train_code_lm.py` trains the code model fixture (`tests/fixtures/code_lm/`) on the training side of this
split; `heldout_python()` is the default text `quantization_accuracy` (and `export --validate` on a quantized
export) measures on. The standard library differs between Python versions, so the text does too: records name
the version it came from.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders whose .py files are not the library's own source (installed packages, test suites).
SKIPPED_FOLDERS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def is_heldout(relative: str) -> bool:
    """Whether the file at `relative` (a path under the stdlib, with `/`) is held out: about 5 % of the files.

    A hash of the name, not of the content, so a file stays on its side when it changes between versions.
    """
    return hashlib.sha256(relative.encode()).digest()[0] < 13


@dataclass
class StdlibCorpus:
    """The stdlib's .py files, sorted by path, on each side of the split, and their texts (UTF-8 files only)."""

    root: Path
    train: list[str]
    heldout: list[str]
    texts: dict[str, str]
    skipped_not_utf8: list[str]


def stdlib_files(root: Path | None = None) -> list[str]:
    """Every .py file under the running interpreter's stdlib (`root`), sorted, minus `SKIPPED_FOLDERS`."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not SKIPPED_FOLDERS.intersection(path.relative_to(root).parts[:-1])
    )


def read_stdlib(heldout_only: bool = False, root: Path | None = None) -> StdlibCorpus:
    """The split stdlib corpus; `heldout_only` reads the held-out files only."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    names = [name for name in stdlib_files(root) if not heldout_only or is_heldout(name)]
    texts: dict[str, str] = {}
    skipped = []
    for name in names:
        try:
            texts[name] = (root / name).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
    kept = [name for name in names if name in texts]
    return StdlibCorpus(
        root=root,
        train=[name for name in kept if not is_heldout(name)],
        heldout=[name for name in kept if is_heldout(name)],
        texts=texts,
        skipped_not_utf8=skipped,
    )


def heldout_sample(corpus: StdlibCorpus, budget: int = 64_000) -> str:
    """Whole held-out files of 1-24 KB, in path order, joined by newlines, up to `budget` characters."""
    chosen, size = [], 0
    for name in corpus.heldout:
        text = corpus.texts[name]
        if 1_000 <= len(text) <= 24_000 and size + len(text) <= budget:
            chosen.append(text)
            size += len(text)
    return "\n".join(chosen)


def heldout_python(budget: int = 64_000) -> tuple[str, str]:
    """(text, description): held-out stdlib source of this interpreter (`heldout_sample`), and where it came from."""
    text = heldout_sample(read_stdlib(heldout_only=True), budget)
    return text, f"held-out Python {platform.python_version()} stdlib source ({len(text) // 1000} KB)"
