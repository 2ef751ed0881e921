"""ExecuTorch: `ExecutorchProgramManager` (a `.pte`, XNNPACK or CUDA delegate), run by the ExecuTorch runtime."""

from hfexport.backends.descriptor import Backend, Ref

BACKEND = Backend(
    name="executorch",
    package=__name__,
    main_file="model.pte",
    native_classes=("executorch.exir:ExecutorchProgramManager",),
    config=Ref(".config:ExecutorchConfig"),
    exporter=Ref(".exporter:ExecutorchExporter"),
    stages=("patch", "fx", "executorch"),
    devices=("cpu", "cuda"),
    device_at_export=True,
    # to_edge, XNNPACK's partitioner and the flatbuffer: the slowest lowering after AOTInductor's compile.
    try_last=True,
    slow_lowering=(
        "to_edge and XNNPACK's partitioner re-trace the graph once per partition: 60-170 s per tiny model's "
        "export and validation on 2 cores"
    ),
    no_streaming=(
        "ExecuTorch serialises a .pte (one flatbuffer, weights or an XNNPACK blob of packed weights inside) in "
        "memory, so its weights cannot stream"
    ),
)
