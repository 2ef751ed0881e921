"""Saved exports: write an export result to a folder in its backend's own format, with a manifest, and run it back.

Per format:

| format | files | written by | run by |
|---|---|---|---|
| dynamo | `model.pt2` | `torch.export.save` | `hfexport.load_program(...).module()` |
| onnx | `model.onnx` (+ `model.onnx.data`) | `ONNXProgram.save` | ONNX Runtime, fed by `onnx_feed` |
| executorch | `model.pte` | `ExecutorchProgramManager.save` | `hfexport.runtime.executorch.ExecutorchProgram` |
| openvino | `model.xml` + `model.bin` | `openvino.save_model` | `hfexport.runtime.openvino.OpenVINORunner` |

`manifest.json` beside them records the format, the files, the input and output names, package versions, the
export config and the rule report, so an artifact can be audited (and run) without the code that made it.
Outputs are compared by name: the flattened model-output names (`logits`, `cache.layers_0_keys`) that the
lowerings give graph outputs, with the `output.` prefix of in-place cache pairs removed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
REPORT = "report.json"

# The file each format's artifact is run from; side files (weights) sit beside it.
MAIN_FILE: dict[str, str] = {
    "dynamo": "model.pt2",
    "onnx": "model.onnx",
    "executorch": "model.pte",
    "openvino": "model.xml",
}
_IN_PLACE_PREFIXES = ("input.", "output.")


@dataclass
class SavedArtifact:
    """What `save_artifact` wrote: the folder, the files (the first is the one to load) and the signature."""

    export_format: str
    directory: Path
    files: list[str]
    input_names: list[str]
    output_names: list[str]

    @property
    def path(self) -> Path:
        return self.directory / self.files[0]


@dataclass
class OutputDiff:
    """One output of an artifact against eager: the max abs diff and the tolerance it was held to."""

    name: str
    max_abs_diff: float
    tolerance: float
    shape: tuple[int, ...] = ()
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.max_abs_diff <= self.tolerance


@dataclass
class Validation:
    """The artifact run in its own runtime against the eager model on the same inputs."""

    export_format: str
    outputs: list[OutputDiff] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.ok for o in self.outputs)

    @property
    def max_abs_diff(self) -> dict[str, float]:
        return {o.name: o.max_abs_diff for o in self.outputs}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "atol": self.atol,
            "rtol": self.rtol,
            "outputs": [{**asdict(o), "shape": list(o.shape), "ok": o.ok} for o in self.outputs],
        }

    def __str__(self) -> str:
        lines = [f"validation ({self.export_format} runtime vs eager, |diff| <= atol + rtol * max|eager|):"]
        for o in self.outputs:
            verdict = "ok" if o.ok else "FAIL"
            detail = o.problem or f"max abs diff {o.max_abs_diff:.3g} (tolerance {o.tolerance:.3g})"
            lines.append(f"  {verdict:4s} {o.name} {list(o.shape)}: {detail}")
        if not self.outputs:
            lines.append("  FAIL no outputs to compare")
        return "\n".join(lines)


def plain_name(name: str) -> str:
    """An output name without the `input.`/`output.` prefix the lowerings give in-place cache pairs."""
    for prefix in _IN_PLACE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _signature(program: Any, export_format: str) -> tuple[list[str], list[str]]:
    if export_format == "onnx":
        graph = program.model.graph
        return [v.name for v in graph.inputs], [v.name for v in graph.outputs]
    if export_format == "openvino":
        return [p.get_any_name() for p in program.inputs], [p.get_any_name() for p in program.outputs]
    from hfexport.lowerings.openvino import signature_names

    exported = program.exported_program("forward") if export_format == "executorch" else program
    names = signature_names(exported)
    if export_format == "executorch":
        from hfexport.runtime.executorch import manager_input_names

        # A .pte runs on forward kwargs in the program's order: record the kwarg names, not the flat leaves.
        kwargs = manager_input_names(program)
        return kwargs or (names[0] if names else []), names[1] if names else []
    return names if names is not None else ([], [])


def save_artifact(program: Any, export_format: str, directory: str | Path, config: Any = None) -> SavedArtifact:
    """Save `program` (the native object `export()` returned for `export_format`) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if export_format not in MAIN_FILE:
        raise ValueError(f"cannot save format {export_format!r}; known: {sorted(MAIN_FILE)}")
    main = directory / MAIN_FILE[export_format]
    if export_format == "dynamo":
        import torch

        torch.export.save(program, str(main))
    elif export_format == "onnx":
        program.save(str(main), external_data=getattr(config, "external_data", True))
    elif export_format == "executorch":
        program.save(str(main))
    else:
        import openvino

        openvino.save_model(program, str(main), compress_to_fp16=getattr(config, "compress_to_fp16", True))
    side = sorted(p.name for p in directory.iterdir() if p.name.startswith("model.") and p != main)
    inputs, outputs = _signature(program, export_format)
    return SavedArtifact(export_format, directory, [main.name, *side], inputs, outputs)


def write_manifest(
    artifact: SavedArtifact,
    *,
    config: Any = None,
    report: Any = None,
    model: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write `manifest.json` (and `report.json` when there is a report) beside the artifact."""
    import hfexport

    versions = dict(getattr(report, "versions", {}) or {})
    versions.setdefault("hfexport", hfexport.__version__)
    files = list(artifact.files)
    if report is not None:
        report.save(artifact.directory / REPORT)
        files.append(REPORT)
    manifest = {
        "format": artifact.export_format,
        "model": model,
        "model_class": getattr(report, "model_class", None),
        "model_type": getattr(report, "model_type", None),
        "files": files,
        "inputs": artifact.input_names,
        "outputs": artifact.output_names,
        "versions": versions,
        "config": config.to_dict() if config is not None else None,
        "report": report.to_dict() if report is not None else None,
        **dict(extra or {}),
    }
    path = artifact.directory / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, default=str))
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / MANIFEST).read_text())


# -- running an artifact in its own runtime ------------------------------------------------------------------


def named_outputs(outputs: Any) -> dict[str, Any]:
    """Tensor leaves of a model output tree by flat name (`logits`, `cache.layers_0_keys`)."""
    import torch

    from hfexport.frontends.cache_pytree import register_cache_pytrees
    from hfexport.lowerings.onnx import leaf_names

    register_cache_pytrees()
    return {name: leaf.detach() for name, leaf in leaf_names(outputs) if isinstance(leaf, torch.Tensor)}


def eager_outputs(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        return named_outputs(model(**inputs))


def run_artifact(directory: str | Path, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Load the artifact in `directory` (by its manifest) in its runtime; run it on forward kwargs `inputs`."""
    import torch

    manifest = read_manifest(directory)
    export_format = manifest["format"]
    path = Path(directory) / manifest["files"][0]
    if export_format == "dynamo":
        from hfexport.runtime.dynamo import load_program

        with torch.no_grad():
            return named_outputs(load_program(path).module()(**inputs))
    if export_format == "onnx":
        import onnxruntime

        from hfexport.lowerings.onnx import onnx_feed

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feed = onnx_feed([i.name for i in session.get_inputs()], inputs)
        names = [plain_name(o.name) for o in session.get_outputs()]
        return {n: torch.from_numpy(v) for n, v in zip(names, session.run(None, feed), strict=True)}
    if export_format == "executorch":
        from hfexport.runtime.executorch import ExecutorchProgram

        flat = ExecutorchProgram(path, input_names=manifest.get("inputs") or None).run(inputs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        names = manifest.get("outputs") or []
        if len(names) != len(tensors):
            names = [f"output_{i}" for i in range(len(tensors))]
        return {plain_name(n): t for n, t in zip(names, tensors, strict=True)}
    if export_format == "openvino":
        from hfexport.runtime.openvino import OpenVINORunner

        return {plain_name(n): t for n, t in OpenVINORunner(path)(**inputs).items()}
    raise ValueError(f"no runtime for format {export_format!r}")


def compare(expected: Mapping[str, Any], actual: Mapping[str, Any], atol: float, rtol: float) -> list[OutputDiff]:
    """Each eager output against the artifact's output of the same name (by position when names differ)."""
    import torch

    if set(expected) != set(actual) and len(expected) == len(actual):
        # A runtime that lost the names (an unnamed OpenVINO result) still keeps the order.
        actual = dict(zip(expected, actual.values(), strict=True))
    diffs = []
    for name, want in expected.items():
        got = actual.get(name)
        scale = want.abs().max().item() if want.is_floating_point() and want.numel() else 0.0
        tolerance = atol + rtol * scale
        shape = tuple(want.shape)
        if got is None:
            diffs.append(OutputDiff(name, math.inf, tolerance, shape, "missing from the artifact's outputs"))
            continue
        got = torch.as_tensor(got)
        if tuple(got.shape) != shape:
            diffs.append(OutputDiff(name, math.inf, tolerance, shape, f"shape {list(got.shape)}, eager {list(shape)}"))
            continue
        if want.numel() == 0:
            diffs.append(OutputDiff(name, 0.0, tolerance, shape))
            continue
        diff = (got.double() - want.double()).abs().nan_to_num(math.inf).max().item()
        diffs.append(OutputDiff(name, diff, tolerance, shape))
    return diffs


def validate(
    directory: str | Path, model: Any, inputs: Mapping[str, Any], atol: float = 1e-4, rtol: float = 1e-3
) -> Validation:
    """Run the saved artifact in its own runtime and compare every output with eager `model(**inputs)`."""
    manifest = read_manifest(directory)
    expected = eager_outputs(model, inputs)
    actual = run_artifact(directory, inputs)
    return Validation(manifest["format"], compare(expected, actual, atol, rtol), atol, rtol)
