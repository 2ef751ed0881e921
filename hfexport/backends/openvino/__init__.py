"""OpenVINO: `openvino.Model` (converted from the Dynamo program), saved as IR, run by the OpenVINO runtime."""

from hfexport.backends.descriptor import Backend, Ref

BACKEND = Backend(
    name="openvino",
    package=__name__,
    main_file="model.xml",
    native_classes=("openvino:Model", "openvino:CompiledModel"),
    side_suffixes=(".bin",),
    config=Ref(".config:OpenVINOConfig"),
    exporter=Ref(".exporter:OpenVINOExporter"),
    stages=("patch", "fx", "openvino"),
    devices=("cpu", "gpu[.N]"),
    # The sweep compares in float32: fp16 weight storage (OpenVINO's save default) is not what a rule changes.
    compare_config={"compress_to_fp16": False},
    streams_weights=True,
)
