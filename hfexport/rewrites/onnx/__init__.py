"""ONNX IR post-fixes and ONNX Runtime fusions (stage `onnx`), in the order they run.

Fixes come first (they make the graph valid for ORT); fusions, which match the fixed graph, come after.
"""

RULES: list = []
