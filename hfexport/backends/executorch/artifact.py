"""How an ExecuTorch component is saved (a `.pte` flatbuffer) and checked before the runtime sees it.

The distinct programs of a generation artifact are saved together (`write_components`): one `model.pte` at the top
of the artifact with one method per component, named by it (`prefill`, `decode`), each weight stored once for all
of them (`hfexport.lowerings.executorch.one_program`). The manifest names each component's method (`method`); a
component without one runs the program's `forward`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.formats import ArtifactFormat, Signature
from hfexport.artifacts.pte import check_program
from hfexport.formats import MAIN_FILE
from hfexport.naming import manager_input_names, signature_names


def _write_executorch(program: Any, main: Path, config: Any) -> None:
    program.save(str(main))


def _write_executorch_components(
    programs: Mapping[str, Any], folder: Path, configs: Mapping[str, Any]
) -> dict[str, list[Path]] | None:
    """Write `programs` as one `model.pte` in `folder`, a method per component; return each one's files (all the
    one program). None when they cannot share one program (`one_program`)."""
    from hfexport.lowerings.executorch import one_program

    joint = one_program(programs, configs)
    if joint is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    main = folder / MAIN_FILE["executorch"]
    with open(main, "wb") as f:
        joint.write_to_file(f)
    return {name: [main] for name in programs}


@functools.cache
def _pte_identifier() -> bytes:
    """The flatbuffer file identifier of an ExecuTorch program, as the installed schema declares it."""
    spec = importlib.util.find_spec("executorch")  # finds the package without running it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        schema = Path(root) / "schema" / "program.fbs"
        if schema.is_file():
            found = re.search(r'^file_identifier\s+"(\w{4})"', schema.read_text(), re.MULTILINE)
            if found:
                return found.group(1).encode()
    return b"ET12"  # executorch/schema/program.fbs of executorch 0.4 to 1.x


def check_pte(directory: Path, comp: dict[str, Any]) -> None:
    """The header of a `.pte`: the program identifier at bytes 4-8, and an extended header ("eh00") whose sizes
    fit the file. The ExecuTorch runtime aborts the process on some files that fail its own header check (it
    cannot decode its error text), so this is checked before the runtime sees the file."""
    main = comp["main"]
    path = directory / main
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    identifier = _pte_identifier()
    if len(head) < 8 or head[4:8] != identifier:
        raise ArtifactError(
            f"{main!r} is not an ExecuTorch program: bytes 4-8 are {head[4:8]!r}, a program has {identifier!r}"
        )
    root = int.from_bytes(head[0:4], "little")
    program_size, segment_base = size, 0
    if head[8:12] == b"eh00":
        if len(head) < 32:
            raise ArtifactError(f"{main!r} is cut short inside its extended header")
        length = int.from_bytes(head[12:16], "little")
        program_size = int.from_bytes(head[16:24], "little")
        segment_base = int.from_bytes(head[24:32], "little")
        segment_size = int.from_bytes(head[32:40], "little") if length > 24 and len(head) >= 40 else 0
        if length < 24 or not 0 < program_size <= size or (segment_base and segment_base < program_size):
            raise ArtifactError(f"{main!r} has an inconsistent extended header (a damaged or foreign file)")
        if segment_base + segment_size > size:
            raise ArtifactError(
                f"{main!r} is {size} bytes, its header says {segment_base + segment_size}: a truncated program"
            )
    if not 8 <= root < program_size:
        raise ArtifactError(f"{main!r} has its program table at {root}, outside the program ({program_size} bytes)")
    # Inside the flatbuffer: every index, type and size the runtime trusts (hfexport/artifacts/pte.py).
    methods = check_program(path.read_bytes(), program_size, segment_base, main)
    method = comp.get("method") or "forward"
    if method not in methods:
        raise ArtifactError(f"{main!r} has no method {method!r} (its methods: {sorted(methods)})")


def _executorch_signature(program: Any) -> Signature:
    names = signature_names(program.exported_program("forward"))
    # A .pte runs on forward kwargs in the program's order: record the kwarg names, not the flat leaves.
    kwargs = manager_input_names(program)
    return kwargs or (names[0] if names else []), names[1] if names else []


ARTIFACT = ArtifactFormat(
    "executorch",
    _write_executorch,
    _executorch_signature,
    check_saved=check_pte,
    write_components=_write_executorch_components,
    methods=True,
)
