"""Dynamo: the `torch.export.ExportedProgram` itself, saved with `torch.export.save`, run by torch."""

from hfexport.backends.descriptor import Backend, Ref

BACKEND = Backend(
    name="dynamo",
    package=__name__,
    main_file="model.pt2",
    native_classes=("torch.export:ExportedProgram",),
    config=Ref(".config:DynamoConfig"),
    exporter=Ref(".exporter:DynamoExporter"),
    stages=("patch", "fx"),
    devices=("cpu", "cuda[:N]"),
    no_streaming="torch.export.save writes a .pt2 with its weights, which the capture on fake weights does not have",
)
