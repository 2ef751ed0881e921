"""The record of one backend (`Backend`): everything the package knows of an export format, in one place.

A descriptor is data plus references (`Ref`) to the backend's code, each imported on first use. The registry
(`hfexport.backends.registry`) sits low in the layer list so that every layer can read it; the code a reference
names sits in the backend's own folder, in a module whose name says its layer (`config`, `ops`, `exporter`,
`driver`, `artifact`, `tools`: see docs/design-notes.md), and is imported only by a caller at or above that
layer. Looking a backend up therefore imports nothing of it, and `import hfexport` imports no backend package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Ref:
    """An object named `module:attribute` (the module may start with "." for the backend's own package),
    imported on first use."""

    target: str

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2]

    def load(self) -> Any:
        value: Any = importlib.import_module(self.module)
        for part in self.attribute.split("."):
            value = getattr(value, part)
        return value


def _same(result: Any) -> Any:
    return result


def _replaced(result: Any, model: Any) -> Any:
    return model


@dataclass(frozen=True)
class Ops:
    """What a backend's result is made of: how its ops are counted (the one implementation the harness, the quantizer
    record and the audit share), and the backend model inside it that a quantizer of that model takes.

    `op_counts(result)`: every op of a native result by name, and `compressed_constant.<dtype>` for each
    low-precision weight (at least 2-D): what an optimization rule must change.
    `quantized_op_counts(result)`: the quantization ops and compressed weights among them (the quantizer record).
    `runtime_op_counts(folder)`: `(where, counts)` of what the runtime executes for a saved artifact, after its
    own optimizations (ONNX Runtime's optimized graph, OpenVINO's compiled model), or None where it cannot be read.
    `backend_model(result)`: what a quantizer of the backend's model (`quantizes_fx_graph=False`) takes;
    `with_backend_model(result, quantized)`: the result holding the quantized model.
    """

    op_counts: Callable[[Any], Mapping[str, int]]
    quantized_op_counts: Callable[[Any], dict[str, int]] = lambda result: {}
    runtime_op_counts: Callable[[Any], tuple[str, Mapping[str, int]] | None] = lambda folder: None
    backend_model: Callable[[Any], Any] = _same
    with_backend_model: Callable[[Any, Any], Any] = _replaced


@dataclass(frozen=True)
class Tools:
    """What the example harness and `hfexport bench` do differently per backend.

    `run(result, inputs)`: run a native result on forward kwargs in its runtime; its outputs (any tree of tensors
    and arrays). `structure(result)`: what the export produced, comparable with `==` (proves a rule changed
    nothing). `example_config(config, inputs)`: the config of a rule example's dynamic export (ExecuTorch bounds
    its axes). `bench_quantizer(precision)`: the backend's weight-only recipe for "int8"/"int4" in `hfexport bench`.
    `bench_variants`: extra `hfexport bench` rows, `{name: config dict}` (a config variant of this format).
    """

    run: Callable[[Any, Mapping[str, Any]], Any]
    structure: Callable[[Any], Any]
    example_config: Callable[[Any, Mapping[str, Any]], Any] = lambda config, inputs: config
    bench_quantizer: Callable[[str], Any] | None = None
    bench_variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _resolve(package: str, ref: Ref | None) -> Ref | None:
    if ref is None or not ref.module.startswith("."):
        return ref
    return Ref(package + ref.target)


@dataclass(frozen=True)
class Backend:
    """One export format: its names and files, where its code is, and the facts every layer asks about it.

    `Ref`s starting with "." are relative to `package`, the backend's folder.
    """

    name: str  # `export_format`, `--format`, the manifest's `format`
    package: str  # the backend's folder, `hfexport.backends.<name>`
    main_file: str  # the file a saved component is loaded from
    # "module:Class" of the native objects; `format_of` checks them only once their module is imported.
    native_classes: tuple[str, ...]
    config: Ref  # the config class (configs layer)
    exporter: Ref  # the exporter class (exporters layer)
    # The records of the other layers, by default in the modules named by their layer:
    # `hfexport.runtime.drivers.base.Runtime`: generation driver, open, run, devices (runtime layer);
    runtime: Ref = Ref(".driver:RUNTIME")
    # `hfexport.artifacts.formats.ArtifactFormat`: write, signature, checks (artifacts layer);
    artifact: Ref = Ref(".artifact:ARTIFACT")
    # `Ops` (lowerings layer); `Tools` (tools layer).
    ops: Ref = Ref(".ops:OPS")
    tools: Ref = Ref(".tools:TOOLS")
    # Files beside the main one that belong to it (ONNX external data, OpenVINO weights).
    side_suffixes: tuple[str, ...] = ()
    # Whose rewrite rules its exports run (`RuleMeta.backends` names): its own by default; a backend that compiles
    # the Dynamo program (AOTInductor) runs the Dynamo rules.
    rules: str = ""
    # The rewrite stages its exports pass through (a rule of another stage never runs for it).
    stages: tuple[str, ...] = ("patch", "fx")
    # The device names `--device` takes for it (`hfexport.runtime.devices`), for the messages.
    devices: tuple[str, ...] = ("cpu",)
    # The device is chosen when exporting (an ExecuTorch delegate): `--device` sets the config (`Runtime.device_config`)
    # and the generation runtime runs on it; else the generation runtime runs on the CPU.
    device_at_export: bool = False
    # Relative tolerance of `hfexport sweep`'s comparison with eager (over max(1, max|eager|)), and the config fields
    # its exports set (the sweep compares in float32).
    tolerance: float = 1e-4
    compare_config: Mapping[str, Any] = field(default_factory=dict)
    # `low_memory=True`: the weights stream from the checkpoint into the saved files (`exporters.low_memory`); else why
    # they cannot (for `--low-memory`'s refusal).
    streams_weights: bool = False
    no_streaming: str = ""
    # Why a bfloat16 model is exported computing in float32 for it (its runtime has no bf16 kernels), or "".
    no_bfloat16: str = ""
    # Why one export takes tens of seconds even for a tiny model (a native compile), or "": test matrices over every
    # format run such a backend's cells in the slow tier.
    slow_export: str = ""
    # Why its lowering takes about a minute even for a tiny model (no native compile, but passes that interpret the
    # graph many times over), or "": test matrices over every format run its cells on their first model in the
    # default tier and the others in the slow tier.
    slow_lowering: str = ""
    # Its lowering is among the slowest: a search that stops at the first backend showing something (a fix's need,
    # `testing.harness.check_fix_needed`) tries it last.
    try_last: bool = False

    def __post_init__(self) -> None:
        for name in ("config", "exporter", "runtime", "artifact", "ops", "tools"):
            object.__setattr__(self, name, _resolve(self.package, getattr(self, name)))
        if not self.rules:
            object.__setattr__(self, "rules", self.name)

    @property
    def native_type(self) -> str:
        """What its exporter returns, for messages (`torch.onnx.ONNXProgram`)."""
        return self.native_classes[0].replace(":", ".")

    @property
    def public_names(self) -> dict[str, str]:
        """The package-level names of its exporter and config class, by the module that defines each."""
        return {ref.attribute: ref.module for ref in (self.exporter, self.config)}
