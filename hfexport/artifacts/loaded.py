"""Load a saved export back, runnable, without trusting what is in the folder.

    loaded = hfexport.load("out/")                 # trust=True for a .pt2
    outputs = loaded.run(inputs)                   # {output name: tensor}, in the artifact's own runtime

Loading picks the runtime from a fixed table keyed by the manifest's `format` (`hfexport.runtime.drivers`);
it never imports or calls anything the manifest names. Before it opens any model file it checks the manifest
(`hfexport.artifacts.manifest.read_manifest`), every listed file (`check_files`: inside the folder, sizes,
sha256) and each format's files (`ARTIFACT_FORMATS[...].check_saved`: the `.pte` header, the ONNX protobuf and
every external-data location it names, the OpenVINO IR's XML and constants, the `.pt2` zip), so a damaged file is
a refusal and never reaches a runtime that would abort on it. A config, tokenizer or processor file in the
folder whose `auto_map` names Python code the manifest does not list is refused too
(`hf_files.check_listed_code`). A `.pt2` is a zip with pickled parts: it loads only
with `trust=True`, and its cache pytree contexts resolve only transformers cache classes.

A `LoadedExport` is also what `hfexport.runtime.generate` takes for a saved `export_for_generation` artifact:
it offers `export_format`, `generation` and `components` (each with `path` and `open()`), which the runtime
reads by duck typing.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.artifacts.errors import ArtifactError, FailedValidationWarning, UntrustedArtifactError
from hfexport.artifacts.formats import ARTIFACT_FORMATS
from hfexport.artifacts.hf_files import check_listed_code
from hfexport.artifacts.manifest import SINGLE, check_files, read_manifest, validation_verdict
from hfexport.core.errors import InputError
from hfexport.generation_spec import image_count_mismatch
from hfexport.runtime.drivers import backend


@dataclass
class LoadedComponent:
    """One component of a loaded export, opened in its runtime. `run(inputs)` -> {output name: tensor}."""

    name: str
    export_format: str
    directory: Path
    main: str
    files: list[str]
    inputs: list[str]
    outputs: list[str]
    config: dict[str, Any] | None = field(default=None, repr=False)
    report: dict[str, Any] | None = field(default=None, repr=False)
    runtime: Any = field(default=None, repr=False)
    # The method of the main file this component runs, where the file holds one per component (an ExecuTorch
    # program: `prefill`, `decode`); None: the file's only program.
    method: str | None = None
    # The component whose model file (and method) this one shares (a prefill served by the decode graph): its
    # runtime, opened once, is this one's too.
    same_as: LoadedComponent | None = field(default=None, repr=False)
    # The first component of another method of the same file: the program it loaded serves this one's method too,
    # so the file is loaded once.
    program_of: LoadedComponent | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.directory / self.main

    def open(self) -> Any:
        """Open the runtime once: an ExportedProgram, an ONNX Runtime session, an ExecuTorch program, or a
        compiled OpenVINO model (f32 inference hint)."""
        if self.runtime is not None:
            return self.runtime
        if self.same_as is not None:
            self.runtime = self.same_as.open()
            return self.runtime
        runtime_of = backend(self.export_format)
        try:
            if self.method is None:
                runtime = runtime_of.open(self.path, self.inputs)
            elif runtime_of.open_method is None:
                raise ArtifactError(f"the {self.export_format} runtime runs no method by name")
            else:
                source = self.program_of.open() if self.program_of is not None else self.path
                runtime = runtime_of.open_method(source, self.method, self.inputs)
        except ImportError:
            raise
        except Exception as exc:
            raise ArtifactError(
                f"component {self.name!r} ({self.main}) does not load in the {self.export_format} runtime: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc
        for names in backend(self.export_format).graph_inputs(runtime):
            if not names & set(self.inputs):
                raise ArtifactError(
                    f"component {self.name!r} ({self.main}) takes an input named {sorted(names)}, which its manifest "
                    f"does not list ({self.inputs[:20]}): the model file and the manifest do not belong together"
                )
        self.runtime = runtime
        return self.runtime

    @property
    def image_count(self) -> dict[str, int]:
        """The pixel inputs whose image count the export kept static (`{input name: count}`, from the report's
        `used["image_count"]`); {} when none. Manifest data: anything but names and positive ints is ignored."""
        used = (self.report or {}).get("used") if isinstance(self.report, Mapping) else None
        counts = used.get("image_count") if isinstance(used, Mapping) else None
        if not isinstance(counts, Mapping):
            return {}
        return {k: v for k, v in counts.items() if isinstance(k, str) and type(v) is int and v > 0}

    def check_image_count(self, inputs: Mapping[str, Any]) -> None:
        """Refuse a feed whose pixel input has another image count than the export kept static (every format:
        torch.export's input guard would refuse it on a .pt2, the other runtimes with their own shape errors)."""
        for name, expected in self.image_count.items():
            given = inputs.get(name)
            shape = getattr(given, "shape", None)
            if shape is not None and len(shape) >= 1 and int(shape[0]) != expected:
                raise InputError(image_count_mismatch(f"component {self.name!r}", name, expected, int(shape[0])))

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run on the source model's forward kwargs; outputs by flat name (`logits`, `cache.layers_0_keys`)."""
        self.check_image_count(inputs)
        return backend(self.export_format).run(self.open(), inputs, self.outputs)

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        return self.run(inputs)


@dataclass
class LoadedExport:
    """A loaded artifact: its components (`"model"` for a single export) and the manifest (plain data)."""

    directory: Path
    export_format: str
    components: dict[str, LoadedComponent]
    manifest: dict[str, Any] = field(repr=False)

    @property
    def config(self) -> dict[str, Any] | None:
        """The export config as recorded (plain data; `AutoExportConfig.from_dict` rebuilds it if you trust it)."""
        return self.manifest.get("config")

    @property
    def report(self) -> dict[str, Any] | None:
        return self.manifest.get("report")

    @property
    def versions(self) -> dict[str, str]:
        return dict(self.manifest.get("versions") or {})

    @property
    def generation(self) -> Any:
        """The `GenerationSpec` of an `export_for_generation` artifact (rebuilt from checked plain data), or None."""
        data = self.manifest.get("generation")
        if data is None:
            return None
        from hfexport.generation_spec import GenerationSpec

        return GenerationSpec.from_dict(data)

    def __getitem__(self, name: str) -> LoadedComponent:
        try:
            return self.components[name]
        except KeyError:
            raise KeyError(f"no component {name!r}; components: {list(self.components)}") from None

    def run(self, inputs: Mapping[str, Any], component: str | None = None) -> dict[str, Any]:
        """Run one component (the only one by default) on forward kwargs `inputs`."""
        if component is None:
            if len(self.components) != 1:
                raise ValueError(f"this export has components {list(self.components)}: name one")
            component = next(iter(self.components))
        return self[component].run(inputs)


def load(
    directory: str | Path, *, trust: bool = False, verify: bool = True, open_runtimes: bool = True
) -> LoadedExport:
    """Load an artifact written by `save` (or `hfexport export`), checking it before opening anything.

    Raises `ManifestError` (schema, code names), `UnsafePathError` (paths leaving the folder),
    `ArtifactError` (missing, truncated or corrupt files; a file its runtime cannot load) and
    `UntrustedArtifactError` (a `.pt2` without `trust=True`). `verify=False` skips the sha256 check
    (sizes are always checked); `open_runtimes=False` defers opening each runtime to its first `run`.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    verdict, detail = validation_verdict(manifest)
    if verdict == "failed":
        warnings.warn(
            f"{directory}: its validation failed when it was exported ({detail}); `hfexport check` shows it, "
            "export again to replace it",
            FailedValidationWarning,
            stacklevel=2,
        )
    export_format = manifest["format"]
    kind = ARTIFACT_FORMATS[export_format]
    if kind.trust and not trust:
        raise UntrustedArtifactError(
            f"{directory} {kind.trust}. Load it with trust=True only if you trust who wrote it"
        )
    check_files(directory, manifest, verify)
    check_listed_code(directory, set(manifest["files"]))
    single = set(manifest["components"]) == {SINGLE}
    components: dict[str, LoadedComponent] = {}
    by_main: dict[str, LoadedComponent] = {}
    by_method: dict[tuple[str, str | None], LoadedComponent] = {}
    for name, comp in manifest["components"].items():
        kind.check_saved(directory, comp)
        component = LoadedComponent(
            name=name,
            export_format=export_format,
            directory=directory,
            main=comp["main"],
            files=list(comp["files"]),
            inputs=list(comp["inputs"]),
            outputs=list(comp["outputs"]),
            config=comp.get("config") if comp.get("config") is not None else manifest.get("config"),
            report=comp.get("report") if not single else manifest.get("report"),
            method=comp.get("method"),
        )
        first = by_method.setdefault((component.main, component.method), component)
        component.same_as = first if first is not component else None
        program = by_main.setdefault(component.main, component)
        if component.method is not None and component.same_as is None and program is not component:
            component.program_of = program
        components[name] = component
    loaded = LoadedExport(directory, export_format, components, manifest)
    if open_runtimes:
        for component in components.values():
            component.open()
    return loaded
