"""The device a saved artifact runs on, in each runtime's own terms, and whether this machine has it.

One name per device for every format (`cpu`, `cuda[:N]`, `gpu[.N]`), translated to what the runtime takes: a
torch device (dynamo), ONNX Runtime execution providers (onnx), an OpenVINO device name (openvino), an
ExecuTorch backend (executorch, chosen at export time: the `.pte` holds the delegate). `resolve_device`
refuses a device the format has no notion of, or this machine does not have, with a `ConfigError` whose text is
one line; `use_device` makes the runtimes opened inside it (`hfexport.load`, `validate`) use the device.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from hfexport.errors import ConfigError

# What each format can run on (the names `--device` takes), for the messages.
FORMAT_DEVICES = {
    "dynamo": ("cpu", "cuda[:N]"),
    "onnx": ("cpu", "cuda[:N]"),
    "openvino": ("cpu", "gpu[.N]"),
    "executorch": ("cpu", "cuda"),
}
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


def _refuse(device: str, export_format: str, why: str) -> ConfigError:
    choices = ", ".join(FORMAT_DEVICES[export_format])
    return ConfigError(f"--device {device}: {why} (--format {export_format} runs on {choices})")


def _cuda_available(device: str, export_format: str, index: int | None) -> None:
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device visible"
        raise _refuse(device, export_format, f"no CUDA device on this machine ({build}); use --device cpu")
    if index is not None and index >= torch.cuda.device_count():
        raise _refuse(device, export_format, f"this machine has {torch.cuda.device_count()} CUDA device(s)")


def resolve_device(export_format: str, device: str) -> RuntimeDevice:
    """The device `device` (`cpu`, `cuda`, `cuda:1`, `gpu`, `gpu.0`) for `export_format`, checked to exist here."""
    match = _NAME.match(device.strip().lower())
    if export_format not in FORMAT_DEVICES:
        raise ConfigError(f"--device: unknown format {export_format!r}")
    if match is None:
        raise _refuse(device, export_format, "not a device name")
    kind, index = match.group(1), int(match.group(2)) if match.group(2) is not None else None
    if kind == "cpu":
        if index not in (None, 0):
            raise _refuse(device, export_format, "there is one CPU device")
        return RuntimeDevice(export_format, device, "cpu")
    if export_format == "openvino":
        if kind == "cuda":
            raise _refuse(device, export_format, "OpenVINO has no CUDA device; its (Intel) GPU is --device gpu")
        import openvino as ov

        available = ov.Core().available_devices
        want = "GPU" if index is None else f"GPU.{index}"
        if not any(d == want or (index is None and d.startswith("GPU")) for d in available):
            raise _refuse(device, export_format, f"OpenVINO sees no {want} here (devices: {', '.join(available)})")
        return RuntimeDevice(export_format, device, "gpu", index, openvino_device=want)
    if kind == "gpu":
        raise _refuse(device, export_format, "`gpu` names OpenVINO's GPU; a CUDA device is --device cuda")
    if export_format == "onnx":
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise _refuse(
                device,
                export_format,
                "this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu); use --device cpu",
            )
        provider = ("CUDAExecutionProvider", {"device_id": index or 0})
        return RuntimeDevice(export_format, device, "cuda", index, providers=(provider, "CPUExecutionProvider"))
    _cuda_available(device, export_format, index)
    if export_format == "executorch":
        if index not in (None, 0):
            raise _refuse(device, export_format, "the ExecuTorch CUDA backend runs on the current device only")
        return RuntimeDevice(export_format, device, "cuda", index, torch_device="cuda", executorch_backend="cuda")
    torch_device = "cuda" if index is None else f"cuda:{index}"
    return RuntimeDevice(export_format, device, "cuda", index, torch_device=torch_device)


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
