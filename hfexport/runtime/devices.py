"""The device a saved artifact runs on, in each runtime's own terms, and whether this machine has it.

One name per device for every format (`cpu`, `cuda[:N]`, `gpu[.N]`), translated by each backend's runtime
(`Runtime.resolve_device`, in its folder) to what the runtime takes: a torch device (dynamo), ONNX Runtime execution
providers (onnx), an OpenVINO device name (openvino), an ExecuTorch backend (executorch, chosen at export time: the
`.pte` holds the delegate). `resolve_device` refuses a device the format has no notion of, or this machine does not
have, with a `ConfigError` whose text is one line; `use_device` makes the runtimes opened inside it (`hfexport.load`,
`validate`) use the device. The names each format takes are its descriptor's `devices`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from hfexport.core.errors import ConfigError

_NAME = re.compile(r"^(cpu|cuda|gpu)(?:[:.](\d+))?$")


@dataclass(frozen=True)
class RuntimeDevice:
    """A device for one format: `name` as the user wrote it, `kind` (`cpu`, `cuda`, `gpu`), `index`, and the
    runtime's spelling: `torch_device`, ONNX Runtime `providers`, the OpenVINO device, the ExecuTorch backend."""

    export_format: str
    name: str
    kind: str
    index: int | None = None
    torch_device: str = "cpu"
    providers: tuple[object, ...] = field(default=("CPUExecutionProvider",))
    openvino_device: str = "CPU"
    executorch_backend: str = "xnnpack"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def refuse(device: str, export_format: str, why: str) -> ConfigError:
    """The refusal of `--device device` for a format: why, and what the format runs on."""
    from hfexport.backends.registry import backend

    choices = ", ".join(backend(export_format).devices)
    return ConfigError(f"--device {device}: {why} (--format {export_format} runs on {choices})")


def check_cuda(device: str, export_format: str, index: int | None) -> None:
    """Refuse a CUDA device (`index`, or the current one) that torch does not see on this machine."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
        raise refuse(device, export_format, f"no CUDA device on this machine ({build}); use --device cpu")
    if index is not None and index >= torch.cuda.device_count():
        raise refuse(device, export_format, f"this machine has {torch.cuda.device_count()} CUDA device(s)")


def torch_cuda_device(device: str, export_format: str, kind: str, index: int | None) -> RuntimeDevice:
    """A CUDA device torch runs the format on (`cuda`, `cuda:N`); OpenVINO's `gpu` refused."""
    if kind == "gpu":
        raise refuse(device, export_format, "`gpu` names OpenVINO's GPU; a CUDA device is --device cuda")
    check_cuda(device, export_format, index)
    torch_device = "cuda" if index is None else f"cuda:{index}"
    return RuntimeDevice(export_format, device, "cuda", index, torch_device=torch_device)


def resolve_device(export_format: str, device: str) -> RuntimeDevice:
    """The device `device` (`cpu`, `cuda`, `cuda:1`, `gpu`, `gpu.0`) for `export_format`, checked to exist here.

    The CPU is every format's; any other device is the backend's to resolve (`Runtime.resolve_device`)."""
    from hfexport.backends.registry import find

    known = find(export_format)
    if known is None:
        raise ConfigError(f"--device: unknown format {export_format!r}")
    match = _NAME.match(device.strip().lower())
    if match is None:
        raise refuse(device, export_format, "not a device name")
    kind, index = match.group(1), int(match.group(2)) if match.group(2) is not None else None
    if kind == "cpu":
        if index not in (None, 0):
            raise refuse(device, export_format, "there is one CPU device")
        return RuntimeDevice(export_format, device, "cpu")
    resolved: RuntimeDevice = known.runtime.load().resolve_device(device, kind, index)
    return resolved


# The device the runtimes opened in this context use (None: each runtime's CPU default).
_CURRENT: ContextVar[RuntimeDevice | None] = ContextVar("hfexport_runtime_device", default=None)


@contextmanager
def use_device(device: RuntimeDevice | None) -> Iterator[None]:
    """Open and run the artifacts loaded inside this block on `device` (None: the CPU defaults)."""
    token = _CURRENT.set(device)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_device() -> RuntimeDevice | None:
    return _CURRENT.get()
