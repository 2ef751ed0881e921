"""Survey how plain ``torch.export`` fares on the corpus, before any hfexport rewrite is applied.

Why: the rewrites in hfexport must fix *causes* shared by many architectures, not single models. This
tool exports every entry of a family with ``strict=False`` and ``Dim.AUTO`` on every input dim,
compares the exported module with eager on the sample and on the grown input, and records the failure
(exception type, last meaningful message line, innermost transformers frame) so failures can be grouped.

Each model runs in its own subprocess with a timeout, so a hang or a crash costs one row, not the sweep.
``use_cache=False`` is passed to the model: ``DynamicCache`` is not a pytree node, and letting it break
every export would hide the causes behind it (``--use-cache`` runs with the cache to observe that one).

    python tools/survey_torch_export.py --family causal_lm --jobs 2 --out /tmp/survey
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _last_line(exc: BaseException) -> str:
    """The headline of the message (first non-boilerplate line); torch appends hints and URLs after it."""
    skip = (
        "For more information",
        "For C++ stack trace",
        "https://",
        "(Refer to",
        "User Stack",
    )
    lines = [ln.strip() for ln in str(exc).splitlines()]
    meaningful = [ln for ln in lines if ln and not ln.startswith(skip)]
    return (meaningful[0] if meaningful else type(exc).__name__)[:300]


def _where(exc: BaseException, text: str) -> str:
    """Innermost transformers frame: from the user stack in torch's message, else from the traceback."""
    hits = re.findall(r"(transformers/[\w/]+\.py)\", line (\d+)", text)
    hits += re.findall(r"(transformers/[\w/]+\.py):(\d+)", text)
    tb = [f for f in traceback.extract_tb(exc.__traceback__) if "/transformers/" in f.filename]
    if hits:
        path, line = hits[-1]
        return f"{path}:{line}"
    if tb:
        return f"transformers/{tb[-1].filename.split('/transformers/')[-1]}:{tb[-1].lineno}"
    return ""


def _compare(ref: Any, got: Any) -> tuple[bool, float, float]:
    """Max abs diff against the corpus tolerance 1e-3 * max(1, max|ref|)."""
    ref, got = ref.detach().float(), got.detach().float()
    if ref.shape != got.shape:
        return False, float("inf"), 0.0
    diff = (ref - got).abs().max().item() if ref.numel() else 0.0
    tol = 1e-3 * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    return diff <= tol, diff, tol


def _first(out: Any, name: str) -> Any:
    return out[name] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def _static_dims(ep: Any) -> dict[str, list[int]]:
    """Input dims that Dim.AUTO left static: the usual reason a grown input is refused."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    names = set(ep.graph_signature.user_inputs)
    shapes = {n.name: n.meta["val"].shape for n in ep.graph.nodes if n.op == "placeholder" and n.name in names}
    return {
        name: [i for i, d in enumerate(shape) if is_concrete_int(d)]
        for name, shape in shapes.items()
        if any(is_concrete_int(d) for d in shape)
    }


class _GuardLog(logging.Handler):
    """Collect shape guards added from transformers code: their source line is the cause to fix.

    A guard like ``Eq(s53, 8)`` or ``s53 <= 11`` silently turns a Dim.AUTO dim static or bounded; the
    exported program then refuses the grown input with a bare "Guard failed" that names no source line.
    """

    pattern = re.compile(r"eval (.+?) \[guard added\].*?\((?:.*?)(transformers/[\w/]+\.py:\d+ in \w+)\)")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = self.pattern.search(record.getMessage())
        # Only guards that pin a symbol to a number matter here; symbol-symbol equalities are benign.
        if match and re.search(r"\bs\d+\b.*?[=<>,] ?-?\d+\)?$", match.group(1)):
            hit = f"{match.group(1)} @ {match.group(2)}"
            if hit not in self.hits:
                self.hits.append(hit)


_NOTABLE_ATEN = ("nonzero", "histc", "_local_scalar_dense", "item", "bincount", "index_put", "unique")


def _ops_of_note(ep: Any) -> list[str]:
    """Ops that export accepts but a portable runtime may not: custom ops, higher-order ops, data-dependent.

    ``ep.module()`` runs them eagerly, so "ok" here does not mean ONNX/ExecuTorch/OpenVINO can lower them.
    """
    found = set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name.startswith("aten."):
            if name.split(".")[1] in _NOTABLE_ATEN:
                found.add(name)
        elif not name.startswith(("<built-in", "prims.", "_operator.")) and "sym_" not in name:
            found.add(name)
    return sorted(found)


def run_one(path: Path, use_cache: bool, log_dir: Path) -> dict[str, Any]:
    """Eager, export, compare on sample, compare on grown input. Runs inside the subprocess."""
    import warnings

    import torch
    from torch.export import Dim

    from hfexport.testing.corpus import load_entry

    warnings.filterwarnings("ignore")
    entry = load_entry(path)
    row: dict[str, Any] = {
        "model": entry.model_type,
        "class": entry.model_class,
        "status": "ok",
    }
    stage = "eager"
    try:
        model = entry.build_model()
        sample, grown = entry.sample_inputs(), entry.grown_inputs()
        # Through the config, not a kwarg: a forward(**kwargs) signature would make a ``use_cache``
        # key in dynamic_shapes invalid (its top-level keys must be the signature's arg names).
        model.config.use_cache = use_cache
        with torch.no_grad():
            ref = _first(model(**sample), entry.output)
            ref_grown = _first(model(**grown), entry.output)
        stage = "export"
        dyn = {k: {i: Dim.AUTO for i in range(v.dim())} for k, v in sample.items()}
        guards = _GuardLog()
        torch._logging.set_logs(dynamic=logging.INFO)
        logging.getLogger("torch.fx.experimental.symbolic_shapes").addHandler(guards)
        t0 = time.perf_counter()
        with torch.no_grad():  # as an exporter would: no set_grad_enabled wrappers left in the graph
            ep = torch.export.export(model, (), kwargs=sample, dynamic_shapes=dyn, strict=False)
        row["export_s"] = round(time.perf_counter() - t0, 2)
        row["static_dims"] = _static_dims(ep)
        row["guards"] = guards.hits[:8]
        row["ops_of_note"] = _ops_of_note(ep)
        row["ranges"] = {str(k): str(v) for k, v in ep.range_constraints.items()}
        stage = "run"
        mod = ep.module()
        ok, row["diff"], row["tol"] = _compare(ref, _first(mod(**sample), entry.output))
        if not ok:
            row["status"] = "mismatch"
            return row
        stage = "grown"
        ok, row["grown_diff"], _ = _compare(ref_grown, _first(mod(**grown), entry.output))
        if not ok:
            row["status"] = "grown-mismatch"
    except Exception as exc:  # the survey records every failure
        text = "".join(traceback.format_exception(exc))
        (log_dir / f"{entry.model_type}.txt").write_text(text)
        statuses = {
            "eager": "eager-error",
            "export": "export-error",
            "run": "run-error",
        }
        row.update(
            status=statuses.get(stage, "grown-error"),
            error=type(exc).__name__,
            message=_last_line(exc),
            where=_where(exc, text),
        )
        if stage == "grown" and row.get("guards"):
            row["where"] = row["guards"][0].split(" @ ")[1]
    return row


def _spawn(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one entry in a fresh interpreter so a hang, segfault or leaked patch stays contained."""
    out = args.out / "rows" / f"{path.stem}.json"
    cmd = [sys.executable, __file__, "--one", str(path), "--out", str(args.out)]
    cmd += ["--use-cache"] if args.use_cache else []
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout)
        if out.exists():
            row = json.loads(out.read_text())
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            row = {
                "model": path.stem,
                "status": "crash",
                "error": f"rc={proc.returncode}",
                "message": tail[0],
            }
    except subprocess.TimeoutExpired:
        row = {
            "model": path.stem,
            "status": "timeout",
            "error": "Timeout",
            "message": f">{args.timeout}s",
        }
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    print(
        f"{row['model']:<24} {row['status']:<15} {row.get('error', '')} {row.get('where', '')}",
        flush=True,
    )
    return row


def _short(op: str) -> str:
    """``aten.histc.default`` -> ``histc``; names without an overload stay as they are."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 2 else op


def _table(rows: list[dict[str, Any]]) -> str:
    """Markdown table, one row per model."""
    head = "| model | status | export s | error | where | message | ops of note |\n"
    head += "|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['model']} | {r['status']} | {r.get('export_s', '')} | {r.get('error', '')} | "
        f"{r.get('where', '')} | {r.get('message', '').replace('|', '/')[:160]} | "
        f"{', '.join(_short(o) for o in r.get('ops_of_note', []))} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    """Parse arguments; either run one entry (worker) or sweep a family (driver)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="causal_lm")
    ap.add_argument("--only", nargs="*", help="model types to run (default: all of the family)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument(
        "--use-cache",
        action="store_true",
        help="leave use_cache on (DynamicCache output)",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/survey"))
    ap.add_argument("--table", action="store_true", help="only rebuild table.md from OUT/survey.json")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    (args.out / "rows").mkdir(parents=True, exist_ok=True)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    if args.table:
        (args.out / "table.md").write_text(_table(json.loads((args.out / "survey.json").read_text())))
        return
    if args.one:
        row = run_one(args.one, args.use_cache, args.out / "logs")
        (args.out / "rows" / f"{args.one.stem}.json").write_text(json.dumps(row, indent=1))
        return
    from hfexport.testing.corpus import default_root

    paths = sorted((default_root() / args.family).glob("*.json"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda p: _spawn(p, args), paths))
    summary = args.out / "survey.json"
    if args.only and summary.exists():  # a partial rerun updates the rows it ran, keeps the others
        merged = {r["model"]: r for r in json.loads(summary.read_text())}
        merged.update({r["model"]: r for r in rows})
        rows = [merged[k] for k in sorted(merged)]
    summary.write_text(json.dumps(rows, indent=1))
    (args.out / "table.md").write_text(_table(rows))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
