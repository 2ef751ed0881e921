"""Static scan of model sources for Python patterns that break `torch.export`: `scan` runs the pattern finder
(`hfexport.apps.scan_patterns`, where each pattern is described) over the modeling sources of the installed transformers
or given paths, and names the registered rules that target each site (`hfexport.apps.scan_rules`).

These are heuristics over syntax (no types): they point at code to read, and each site says whether a
registered rule targets its module, class or function.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst

from hfexport.apps.scan_patterns import KINDS, Site, scan_source
from hfexport.apps.scan_rules import RuleIndex

# Sources outside `models/` whose code runs inside every model's forward.
_SHARED_SOURCES = ("cache_utils.py",)


def transformers_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise RuntimeError("transformers is not installed")
    return Path(spec.origin).parent


def model_files(models: Sequence[str] | None = None) -> list[Path]:
    """The modeling sources of the installed transformers: all of them, or those of `models` (model types); then
    `cache_utils.py`, the cache layers every generative model runs (the sliding-window slice lives there)."""
    shared = [transformers_root() / name for name in _SHARED_SOURCES]
    root = transformers_root() / "models"
    if not models:
        return sorted(root.glob("*/modeling_*.py")) + shared
    files = []
    known = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_"))
    for name in models:
        folder = root / name.replace("-", "_")
        found = sorted(folder.glob("modeling_*.py")) if folder.is_dir() else []
        if not found:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ValueError(f"no modeling source for model type {name!r}{hint}")
        files += found
    return files + shared


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("*.py"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


@dataclass
class ScanResult:
    files: list[str]
    sites: list[Site]
    model_rules: dict[str, list[str]] = field(default_factory=dict)  # module -> rules written for its model
    errors: dict[str, str] = field(default_factory=dict)

    def by_module(self) -> dict[str, dict[str, list[Site]]]:
        grouped: dict[str, dict[str, list[Site]]] = {}
        for site in self.sites:
            grouped.setdefault(site.module, {}).setdefault(site.owner, []).append(site)
        return grouped

    def counts(self) -> dict[str, int]:
        return {kind: sum(1 for s in self.sites if s.kind == kind) for kind in KINDS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "counts": self.counts(),
            "sites": [s.to_dict() for s in self.sites],
            "model_rules": self.model_rules,
            "errors": self.errors,
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        lines = []
        for module, owners in self.by_module().items():
            model_rules = self.model_rules.get(module)
            lines.append(module + (f"  (rules for this model: {', '.join(model_rules)})" if model_rules else ""))
            for owner, sites in owners.items():
                lines.append(f"  {owner}")
                for s in sites:
                    function = s.scope.split(".", 1)[1] if "." in s.scope else s.scope
                    targeted = f"  [rule: {', '.join(s.rules)}]" if s.rules else ""
                    lines.append(f"    {s.line:5d}  {s.kind:19s} {function}: {s.code}{targeted}")
        for path, error in self.errors.items():
            lines.append(f"could not parse {path}: {error}")
        targeted = sum(1 for s in self.sites if s.rules)
        owners = sum(len(o) for o in self.by_module().values())
        counts = ", ".join(f"{k} {v}" for k, v in self.counts().items() if v)
        lines.append(
            f"{len(self.sites)} site(s) in {owners} class(es)/module(s) of {len(self.files)} file(s)"
            f" ({counts or 'none'}); {targeted} targeted by a registered rule"
        )
        return "\n".join(lines)


def source_module(path: Path, root: Path | None) -> str:
    """The dotted module name of `path` under `root`'s parent (`transformers.models.llama.modeling_llama`), or
    its file stem outside it."""
    if root is not None:
        try:
            parts = path.with_suffix("").relative_to(root.parent).parts
            return ".".join(parts)
        except ValueError:
            pass
    return path.stem


def _scan_file(path: Path, module: str, index: RuleIndex) -> list[Site] | str:
    """The sites of one file, or why it could not be parsed (a worker of `scan`)."""
    try:
        return scan_source(path.read_text(encoding="utf-8"), str(path), module, index)
    except (cst.ParserSyntaxError, UnicodeDecodeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def scan(
    models: Sequence[str] | None = None,
    paths: Sequence[str | Path] | None = None,
    rule_index: RuleIndex | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> ScanResult:
    """Scan the modeling sources of `models` (all installed ones when both are empty) and/or `paths`.

    `jobs` > 1 parses files in that many processes: LibCST parsing is CPU-bound, and every installed
    model (500+ files) takes minutes on one core.
    """
    root = transformers_root()
    files = (_expand(paths) if paths else []) + (model_files(models) if models or not paths else [])
    index = rule_index if rule_index is not None else RuleIndex.from_registry()
    result = ScanResult(files=[str(f) for f in files], sites=[])
    modules = [source_module(path.resolve(), root) for path in files]
    if jobs > 1 and len(files) > 1:
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=jobs)
        outcomes = pool.map(_scan_file, files, modules, [index] * len(files), chunksize=4)
    else:
        pool = None
        outcomes = map(_scan_file, files, modules, [index] * len(files))
    try:
        for i, (path, module, outcome) in enumerate(zip(files, modules, outcomes, strict=True), 1):
            if progress and (i % 25 == 0 or i == len(files)):
                progress(f"scanned {i}/{len(files)} file(s)")
            if isinstance(outcome, str):
                result.errors[str(path)] = outcome
                continue
            result.sites += outcome
            _add_model_rules(result, module, index)
    finally:
        if pool is not None:
            pool.shutdown()
    return result


def _add_model_rules(result: ScanResult, module: str, index: RuleIndex) -> None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["transformers", "models"]:
        rules = index.rules_for_model(parts[2])
        if rules:
            result.model_rules[module] = rules
