"""Load artifacts in a child process, so that a runtime that aborts or crashes is an outcome, not the end of the run.

    outcomes = load_in_child([Job("a", folder, inputs={"input_ids": ([2, 5], "int64")})], watch=tmp_path)

One child loads the jobs one after another (imports are paid once); when a job kills it (SIGABRT, SIGSEGV) or
hangs, that job's outcome says so and a new child takes the remaining jobs. In the child, an audit hook records
the files Python opens under `watch` but outside the job's folder, and the modules imported while loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, os, sys, threading, traceback
watch, jobs_file = sys.argv[1], sys.argv[2]
state = {"folder": None, "outside": [], "imported": []}
main_thread = threading.get_ident()

def hook(event, args):
    if state["folder"] is None or threading.get_ident() != main_thread:
        return
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(watch + os.sep) and not path.startswith(state["folder"] + os.sep):
            state["outside"].append(path)
    elif event == "import" and args:
        state["imported"].append(str(args[0]))

sys.addaudithook(hook)
import torch
import hfexport
from hfexport.artifacts import ArtifactError

for line in open(jobs_file):
    job = json.loads(line)
    print(json.dumps({"start": job["id"]}), flush=True)
    state.update(folder=os.path.realpath(job["folder"]), outside=[], imported=[])
    kind, detail = "loaded", ""
    try:
        loaded = hfexport.load(job["folder"], trust=job["trust"])
        if job["inputs"]:
            inputs = {k: torch.ones(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in job["inputs"].items()}
            try:
                outputs = loaded.run(inputs)
                detail = ",".join(sorted(outputs))
            except Exception as exc:  # a program that loads but does not run: reported, not an abort
                kind, detail = "run-failed", f"{type(exc).__name__}: {exc}"
    except ArtifactError as exc:
        kind, detail = "refused", f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        kind, detail = "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    state["folder"] = None
    result = {"id": job["id"], "kind": kind, "detail": detail[:2000], "outside": state["outside"],
              "imported": sorted(set(state["imported"]))}
    print(json.dumps(result), flush=True)
"""


@dataclass
class Job:
    id: str
    folder: Path
    trust: bool = False
    # name -> (shape, torch dtype name): run the loaded program once on ones of these shapes
    inputs: dict[str, tuple[list[int], str]] = field(default_factory=dict)


@dataclass
class Outcome:
    id: str
    # loaded | run-failed | refused (an ArtifactError) | error (any other exception) | died | hung
    kind: str
    detail: str = ""
    outside: list[str] = field(default_factory=list)
    imported: list[str] = field(default_factory=list)


def load_in_child(jobs: list[Job], watch: Path, timeout: float = 180.0) -> dict[str, Outcome]:
    """Each job's outcome, by id. `timeout`: the most seconds one job (the first one's imports included) may take."""
    outcomes: dict[str, Outcome] = {}
    pending = list(jobs)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
    while pending:
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for job in pending:
                record: dict[str, Any] = {"id": job.id, "folder": str(job.folder), "trust": job.trust}
                f.write(json.dumps({**record, "inputs": job.inputs}) + "\n")
        with tempfile.TemporaryFile() as stderr:
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, os.path.realpath(watch), f.name],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                errors="replace",
                env=env,
            )
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
            started, hung = _collect(lines, outcomes, timeout)
            if hung:
                child.kill()
            child.wait()
            os.unlink(f.name)
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-1500:]
        if started is not None:
            kind = "hung" if hung else "died"
            outcomes[started] = Outcome(started, kind, f"exit {child.returncode}: {tail}")
        elif not any(job.id in outcomes for job in pending):
            raise RuntimeError(f"the loading child failed before any job (exit {child.returncode}): {tail}")
        pending = [job for job in pending if job.id not in outcomes]
    return outcomes


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _collect(lines: queue.Queue[str | None], outcomes: dict[str, Outcome], timeout: float) -> tuple[str | None, bool]:
    """Read the child's answers until it ends or one job takes longer than `timeout`: the unfinished job's id, and
    whether it hung (else the child ended)."""
    started: str | None = None
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            return started, True
        if line is None:
            return started, False
        if not line.startswith("{"):
            continue
        message = json.loads(line)
        if "start" in message:
            started = message["start"]
        else:
            outcomes[message["id"]] = Outcome(**message)
            started = None


def write_edited(source: Path, folder: Path, data: bytes, main: str = "model.pte") -> Path:
    """A copy of the artifact `source` in `folder` with `main` replaced by `data` and its checksum re-computed,
    as someone who can rewrite the manifest would."""
    shutil.copytree(source, folder)
    (folder / main).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["checksums"][main] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def flatbuffer_flips(data: bytes, rng: random.Random) -> list[tuple[int, int]]:
    """1-3 random (position, byte) edits of a `.pte` inside its program flatbuffer: past the 64-byte head, before
    the end the extended header gives the program (the segments after it hold weights and delegate payloads)."""
    end = int.from_bytes(data[16:24], "little") if data[8:12] == b"eh00" else len(data)
    return [(rng.randrange(64, end), rng.randrange(256)) for _ in range(rng.choice([1, 1, 2, 3]))]
