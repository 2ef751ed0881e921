"""AOTInductor: the Dynamo program compiled ahead of time to C++ kernels (`torch._inductor.aoti_compile_and_package`),
a `.pt2` package loaded by `torch._inductor.aoti_load_package` from Python, or by torch's C++ runtime without Python.
"""

from hfexport.backends.descriptor import Backend, Ref

BACKEND = Backend(
    name="aoti",
    package=__name__,
    main_file="model.pt2",
    native_classes=("hfexport.backends.aoti.lowering:AOTInductorPackage",),
    config=Ref(".config:AOTInductorConfig"),
    exporter=Ref(".exporter:AOTInductorExporter"),
    # It compiles the Dynamo program: the Dynamo rules, at the stages they run at.
    rules="dynamo",
    stages=("patch", "fx"),
    devices=("cpu",),
    no_streaming="AOTInductor compiles the program's weights into its package, which needs them in memory",
    slow_export="AOTInductor compiles C++ kernels: about 35 s for a tiny model on 2 cores",
    try_last=True,
)
