"""The AOTInductor lowering: compile a captured program into a `.pt2` package (`AOTInductorPackage`).

A package holds the program's kernels as a shared library, its weights and its pytree specs. hfexport runs it on
flat tensors (`loader.boxed_run`): the names of its tensor inputs and outputs, in order, are recorded in the
package's own metadata at compile time, so a saved package needs nothing else to be fed by name, and its specs (which
name transformers classes) are never unflattened. A constant output of the program (a None, as CLIP's tower returns
for the hidden states that `output_hidden_states=-1` does not keep) is dropped from the results, as every other
lowering drops it. A program that writes into its inputs (a static cache) is compiled
with the writes kept: the package updates the caller's tensors in place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfexport.core.errors import ConfigError, InputError

# The package metadata keys hfexport writes (`AOTICompiledModel.get_metadata()`).
INPUTS_KEY = "hfexport.inputs"
OUTPUTS_KEY = "hfexport.outputs"


class AOTInductorPackage:
    """A program compiled by AOTInductor: a `.pt2` package of C++ kernels and weights, and what running it takes.

    `package(**forward_kwargs)` runs it: `{output name: tensor}`, a static cache written in place into the tensors
    given. `run(tensors)` runs it on its flat tensor inputs (`input_names`, in order); `load()` is torch's runner
    (`AOTICompiledModel`, loaded once); `save(path)` copies the package. `path` is the package file: a temporary
    one, removed with this object, unless the config named `output_path`.
    """

    def __init__(
        self,
        path: str | Path,
        input_names: list[str] | None = None,
        output_names: list[str | None] | None = None,
        op_counts: Mapping[str, int] | None = None,
        graph_code: str = "",
        owned: str | None = None,
    ) -> None:
        self.path = Path(path)
        self._runner: Any = None
        if input_names is None or output_names is None:
            metadata = self.load().get_metadata()
            if INPUTS_KEY not in metadata or OUTPUTS_KEY not in metadata:
                raise InputError(f"{self.path} is an AOTInductor package that hfexport did not compile (no names)")
            input_names, output_names = json.loads(metadata[INPUTS_KEY]), json.loads(metadata[OUTPUTS_KEY])
        self.input_names = list(input_names)
        # One entry per value the package returns (`boxed_run` returns one per leaf of the output spec): the output's
        # name, or None for a constant leaf, which `run` drops.
        self._leaves: list[str | None] = list(output_names)
        self.output_names: list[str] = [name for name in self._leaves if name is not None]
        # What the compiled program held, recorded before compiling (the package keeps no graph).
        self.op_counts = Counter(op_counts or {})
        self.graph_code = graph_code
        if owned is not None:
            weakref.finalize(self, shutil.rmtree, owned, ignore_errors=True)

    def load(self) -> Any:
        """torch's runner of the package (`torch._inductor.aoti_load_package`), loaded on first use."""
        if self._runner is None:
            import torch

            self._runner = torch._inductor.aoti_load_package(str(self.path))
        return self._runner

    def run(self, tensors: list[Any]) -> list[Any]:
        """The outputs (`output_names`, in order) for the flat tensor inputs (`input_names`, in order)."""
        import torch

        if len(tensors) != len(self.input_names):
            raise InputError(
                f"the package takes {len(self.input_names)} tensors ({self.input_names}), got {len(tensors)}"
            )
        # The kernels index their inputs with the strides of the traced sample (contiguous): a view with other
        # strides (an expanded position_ids, a sliced mask) would be read as if it were contiguous, so it is copied.
        # A contiguous tensor is passed as it is, so a static cache is still written in place.
        given = [t.contiguous() if isinstance(t, torch.Tensor) else t for t in tensors]
        outputs = self.load().loader.boxed_run(given)  # boxed: the list passed is consumed
        if len(outputs) != len(self._leaves):
            raise InputError(f"the package returned {len(outputs)} outputs, its names are {self._leaves}")
        return [value for value, name in zip(outputs, self._leaves, strict=True) if name is not None]

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        from hfexport.naming import tensor_leaves

        given = tensor_leaves(inputs)
        missing = [name for name in self.input_names if name not in given]
        if missing:
            raise InputError(f"the package takes {missing}, which the inputs ({sorted(given)}) do not have")
        return dict(zip(self.output_names, self.run([given[name] for name in self.input_names]), strict=True))

    def save(self, path: str | Path) -> None:
        shutil.copyfile(self.path, path)

    def __repr__(self) -> str:
        return (
            f"AOTInductorPackage({str(self.path)!r}, inputs={len(self.input_names)}, outputs={len(self.output_names)})"
        )


def check_compiler() -> None:
    """Refuse, before tracing, a machine without the C++ compiler AOTInductor builds its kernels with (`g++`, or
    `CXX`: what `torch._inductor.config.cpp.cxx` searches)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # torch's InvalidCxxCompiler: none of the searched compilers runs
        raise ConfigError(
            f"AOTInductor compiles C++ and finds no compiler here ({type(exc).__name__}); install g++ or set CXX"
        ) from None


def compile_package(program: Any, inductor_configs: Mapping[str, Any] | None, context: Any) -> AOTInductorPackage:
    """Compile `program` (functionalised) into a package in a temporary folder the returned package owns."""
    import torch
    from torch.export.graph_signature import ConstantArgument, OutputKind

    from hfexport.backends.dynamo.ops import fx_op_counts
    from hfexport.naming import spec_names, user_input_names

    inputs = user_input_names(program, tensors_only=True)
    if inputs is None:
        raise InputError("the program's inputs cannot be named (a user input the pytree spec does not match)")
    # Every leaf the package returns (constants too): `boxed_run` gives one value per leaf of the output spec. A
    # constant leaf (None, an int) is recorded as None: the package's results leave it out.
    leaves = spec_names(program.call_spec.out_spec, drop_first=False)
    specs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if len(specs) != len(leaves):
        raise InputError("the program's outputs cannot be named (a user output the pytree spec does not match)")
    outputs = [None if isinstance(s.arg, ConstantArgument) else n for n, s in zip(leaves, specs, strict=True)]
    metadata = {INPUTS_KEY: json.dumps(inputs), OUTPUTS_KEY: json.dumps(outputs)}
    options = {**(inductor_configs or {}), "aot_inductor.metadata": metadata}
    owned = tempfile.mkdtemp(prefix="hfexport-aoti-")
    try:
        with context.stage("compile"), torch.no_grad():
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=str(Path(owned) / "model.pt2"), inductor_configs=options
            )
    except BaseException:
        shutil.rmtree(owned, ignore_errors=True)
        raise
    return AOTInductorPackage(path, inputs, outputs, fx_op_counts(program), program.graph_module.code, owned=owned)
