"""Run an ExecuTorch program (`.pte`) with a model's forward kwargs, checking shapes before `execute`.

`executorch_feed(inputs)` flattens forward kwargs into the method's input list: the same pytree order
the capture used (caches flattened to their tensors), with Python constants (`use_cache=False`, None)
kept in place, since ExecuTorch keeps them as program inputs. `ExecutorchProgram` loads a program,
checks each tensor input against what the program was planned for (rank, dtype, and every axis against
its upper bound) and raises `InputError` naming the input and axis, instead of the runtime's opaque error
code (or a failure deep inside a kernel, when the total size still fits the planned buffer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.naming import executorch_named_feed, manager_input_names

__all__ = [
    "ExecutorchProgram",
    "contiguous",
    "executorch_feed",
    "executorch_named_feed",
    "manager_input_names",
    "run_program",
]


def executorch_feed(inputs: Mapping[str, Any]) -> list[Any]:
    """The input list of `Method.execute` for forward kwargs `inputs` (as the model's forward takes them)."""
    return [value for _, value in executorch_named_feed(inputs)]


@dataclass(frozen=True)
class InputSlot:
    """What the program was planned for at one tensor input: the upper bound of each axis, and the dtype."""

    index: int
    max_sizes: tuple[int, ...]
    dtype: torch.dtype | None


# ExecuTorch's ScalarType codes (c10's numbering) of the dtypes a method input can have.
_SCALAR_TYPES = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
}


def _slots(method: Any) -> dict[int, InputSlot]:
    meta = method.metadata
    slots = {}
    for index in range(meta.num_inputs()):
        try:
            info = meta.input_tensor_meta(index)
        except (IndexError, RuntimeError):  # a non-tensor input (bool, int, None)
            continue
        slots[index] = InputSlot(index, tuple(int(s) for s in info.sizes()), _SCALAR_TYPES.get(int(info.dtype())))
    return slots


def check_feed(slots: Mapping[int, InputSlot], named_feed: list[tuple[str, Any]]) -> None:
    """Raise `InputError` when a tensor input does not fit the program's planned shapes or dtypes."""
    if len(named_feed) != len(slots) and max(slots, default=-1) >= len(named_feed):
        raise InputError(f"the program takes more inputs than the {len(named_feed)} given")
    for index, (name, value) in enumerate(named_feed):
        slot = slots.get(index)
        if slot is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(f"input {index} ({name!r}) must be a tensor, got {type(value).__name__}")
        if value.ndim != len(slot.max_sizes):
            bound = list(slot.max_sizes)
            raise InputError(f"input {name!r} has {value.ndim} axes, the program takes {len(bound)} ({bound})")
        if slot.dtype is not None and value.dtype != slot.dtype:
            raise InputError(f"input {name!r} is {value.dtype}, the program takes {slot.dtype}")
        for axis, (size, bound) in enumerate(zip(value.shape, slot.max_sizes, strict=True)):
            if size > bound:
                raise InputError(
                    f"input {name!r} has size {size} on axis {axis}, but the program was planned for at most "
                    f"{bound} there (shape bound {list(slot.max_sizes)}); re-export with a larger bound, e.g. "
                    f"dynamic_shapes={{{name.split('.')[0]!r}: {{{axis}: Dim('d{axis}', min=1, max={size})}}}}"
                )


def contiguous(values: list[Any]) -> list[Any]:
    """The method's inputs with every strided view copied to a tensor of its own: the ExecuTorch runtime refuses a
    tensor whose strides are not those of its dim order ("Input 0 for method forward should be contiguous or
    channels-last"), e.g. LLaVA's projector input `hidden_states[-2][:, 1:]` as the model slices it, or a mask's
    last columns. A contiguous tensor is passed as it is (`Tensor.contiguous` returns it), so a static cache the
    program writes in place is still the caller's tensor."""
    return [value.contiguous() if isinstance(value, torch.Tensor) else value for value in values]


def load_kernel_libraries() -> None:
    """Register the kernels of ExecuTorch's optional operator libraries that exported programs may call with the
    runtime: `llama::custom_sdpa` (rule `executorch/unmasked-sdpa-as-custom-sdpa`). Without it a method that
    calls one fails to load ("Failed to load method forward, error: 0x14", an operator without a kernel). A
    plain `executorch.runtime` user imports `executorch.extension.llm.custom_ops.custom_ops` the same way."""
    # An executorch build without the LLM custom ops: programs that call them fail to load.
    with contextlib.suppress(ImportError):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401


class ExecutorchProgram:
    """A loaded ExecuTorch program whose method (`forward` unless named) runs on forward kwargs and checks them first.

    `source` is a `.pte` path, the program bytes, an `ExecutorchProgramManager`, or a program the ExecuTorch
    runtime loaded (`executorch.runtime.Program`: another `ExecutorchProgram`'s `program`, so that the methods of
    one file share one loaded program). `method` names the method to run. A `.pte` does not keep the forward
    argument names: kwargs are fed in the order given, which must be the sample inputs' order, unless
    `input_names` (known from a manager) puts them in order.
    """

    def __init__(
        self, source: str | Path | bytes | Any, method: str = "forward", input_names: list[str] | None = None
    ) -> None:
        from executorch.runtime import Program, Runtime

        load_kernel_libraries()
        loaded = source if isinstance(source, Program) else None
        if isinstance(source, (str, Path)):
            data: Any = Path(source)
        elif isinstance(source, (bytes, bytearray)):
            data = bytes(source)
        elif loaded is None:  # an ExecutorchProgramManager
            data = source.buffer
            input_names = input_names or manager_input_names(source, method)
        self.input_names = input_names
        self.program = loaded if loaded is not None else Runtime.get().load_program(data)
        if method not in self.program.method_names:
            raise InputError(f"the program has no method {method!r}; its methods: {sorted(self.program.method_names)}")
        with _without_cpuinfo_log():
            self.method = self.program.load_method(method)
        self.slots = _slots(self.method)

    def run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """Run on forward kwargs `inputs`; return the method's flat outputs."""
        if self.input_names is not None:
            missing = [n for n in self.input_names if n not in inputs]
            unknown = sorted(set(inputs) - set(self.input_names))
            if missing or unknown:
                raise InputError(f"the program takes {self.input_names}; missing {missing}, unknown {unknown}")
            inputs = {name: inputs[name] for name in self.input_names}
        named = executorch_named_feed(inputs)
        check_feed(self.slots, named)
        return list(self.method.execute(contiguous([value for _, value in named])))

    __call__ = run


_CPUINFO_LOG = b"[cpuinfo_utils.cpp:"
_cpuinfo_logged = False


@contextlib.contextmanager
def _without_cpuinfo_log() -> Any:
    """The first XNNPACK method loaded in a process sizes ExecuTorch's threadpool, whose CPU probe (the
    executorch 1.x wheel's `cpuinfo_utils.cpp`, logging at info level from C++) writes five lines to stderr
    about ARM `midr` files an x86 machine does not have. They go to a temporary file for that one call; every
    other line written to stderr meanwhile is written back after it."""
    global _cpuinfo_logged
    if _cpuinfo_logged:
        yield
        return
    _cpuinfo_logged = True
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not line.startswith(_CPUINFO_LOG)]
            if kept:
                os.write(2, b"".join(kept))


def run_program(source: str | Path | bytes | Any, inputs: Mapping[str, Any]) -> list[Any]:
    """Load `source` (a `.pte` path, bytes or manager) and run its `forward` on forward kwargs `inputs`."""
    return ExecutorchProgram(source).run(inputs)
