"""How an OpenVINO component is saved (IR: `.xml` graph, `.bin` weights) and checked before the runtime sees it.

The IRs of a generation artifact are saved together (`write_components`): `<component>.xml` side by side at the
top of the artifact, all reading one `weights.bin` beside them, each constant's bytes stored once however many
IRs hold it. An IR reads its own `<stem>.bin`, or where it has none that shared file (`runtime.openvino.ir_weights`).
"""

from __future__ import annotations

import tempfile
import xml.parsers.expat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.artifacts.formats import ArtifactFormat, Signature
from hfexport.runtime.openvino import SHARED_IR_WEIGHTS


def _write_openvino(program: Any, main: Path, config: Any) -> None:
    import openvino

    if not isinstance(program, openvino.Model):
        raise TypeError(f"cannot save a {type(program).__name__}: save the openvino.Model, not a compiled one")
    from hfexport.lowerings.openvino_weights import save_ir

    save_ir(program, main, compress_to_fp16=getattr(config, "compress_to_fp16", True))


def _write_openvino_components(
    programs: Mapping[str, Any], folder: Path, configs: Mapping[str, Any]
) -> dict[str, list[Path]]:
    """Write each model as `<name>.xml` in `folder`, every constant once in `weights.bin`; return each one's files."""
    from hfexport.lowerings.openvino_weights import share_weights

    drafts = {}
    with tempfile.TemporaryDirectory(prefix=".hfexport-ir-", dir=folder) as tmp:
        for name, program in programs.items():
            drafts[name] = Path(tmp) / name / "model.xml"
            drafts[name].parent.mkdir()
            _write_openvino(program, drafts[name], configs[name])
        paths = share_weights(drafts, folder, SHARED_IR_WEIGHTS)
    return {name: [path, folder / SHARED_IR_WEIGHTS] for name, path in paths.items()}


def _ir_weights(directory: Path, comp: dict[str, Any]) -> str:
    """The weights file the runtime will read for this component (`runtime.openvino.ir_weights`), which it lists:
    the IR's own `<stem>.bin`, or the shared `weights.bin` beside it when it has no `.bin` of its own."""
    main = PurePosixPath(comp["main"])
    own = main.with_suffix(".bin").as_posix()
    if own in comp["files"]:
        return own
    shared = (main.parent / SHARED_IR_WEIGHTS).as_posix()
    if shared not in comp["files"]:
        raise ArtifactError(f"{comp['main']!r} lists neither {own!r} nor {shared!r}: an IR without its weights")
    if (directory / own).exists() or (directory / own).is_symlink():
        raise UnsafePathError(f"{comp['main']!r} would read {own!r}, which the manifest does not list")
    return shared


def _check_openvino_ir(directory: Path, comp: dict[str, Any]) -> None:
    """An OpenVINO IR: XML without a DTD or entities, a `<net>` root, and every constant's bytes inside the `.bin`."""
    main = comp["main"]
    weights = _ir_weights(directory, comp)
    bin_size = (directory / weights).stat().st_size
    parser = xml.parsers.expat.ParserCreate()
    seen: list[str] = []
    layer = [""]  # the type of the <layer> being read

    def refuse_dtd(*_args: Any) -> None:
        raise ArtifactError(f"{main!r} declares a DTD or entities, which an OpenVINO IR never has")

    def element(name: str, attrs: dict[str, str]) -> None:
        if not seen and name != "net":
            raise ArtifactError(f"{main!r} is not an OpenVINO IR: its root element is <{name}>, not <net>")
        seen.append(name)
        if name == "layer":
            layer[0] = attrs.get("type", "")
        elif name == "data" and layer[0] == "Const" and "offset" in attrs and "size" in attrs:
            try:
                offset, length = int(attrs["offset"]), int(attrs["size"])
            except ValueError:
                raise ArtifactError(f"{main!r}: a constant's offset/size are not integers") from None
            if offset < 0 or length < 0 or offset + length > bin_size:
                raise ArtifactError(
                    f"{main!r} reads a constant at bytes {offset}..{offset + length} of {weights!r}, which has "
                    f"{bin_size}: a truncated or mismatched weight file"
                )

    parser.StartDoctypeDeclHandler = refuse_dtd
    parser.EntityDeclHandler = refuse_dtd
    parser.StartElementHandler = element
    try:
        with open(directory / main, "rb") as f:
            parser.ParseFile(f)
    except xml.parsers.expat.ExpatError as exc:
        raise ArtifactError(f"{main!r} is not readable XML: {exc}") from None
    if not seen:
        raise ArtifactError(f"{main!r} is empty, not an OpenVINO IR")


def _openvino_signature(program: Any) -> Signature:
    return [p.get_any_name() for p in program.inputs], [p.get_any_name() for p in program.outputs]


def _check_streamed(main: Path, checkpoint: Any, quantized: bool) -> Any:
    from hfexport.artifacts.low_memory import check_streamed_ir

    return check_streamed_ir(main, checkpoint)


ARTIFACT = ArtifactFormat(
    "openvino",
    _write_openvino,
    _openvino_signature,
    required_siblings={".bin": "the IR's weights"},
    shared_siblings={".bin": SHARED_IR_WEIGHTS},
    check_saved=_check_openvino_ir,
    check_streamed=_check_streamed,
    write_components=_write_openvino_components,
)
