"""Rule kinds: the bodies a rule can have, each with its applier (`engine.py` holds the table of appliers by kind).

`patch` (model patches), `fx` (graph rules: `NodeRule` for every stage that edits the captured program, and
`FxGraphRule`), `onnx` (ATen overrides and ONNX IR rewrites), `executorch` (what `to_edge` is handed), `openvino`
(rules of the converted model).
"""
