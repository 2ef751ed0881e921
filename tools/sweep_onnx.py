"""ONNX sweep: export every corpus entry with OnnxExporter, save it, and run it in ONNX Runtime against eager.

    python tools/sweep_onnx.py --family causal_lm --jobs 2 --out sweep_onnx.md

Each model runs in its own subprocess. For each: export with `OnnxConfig(dynamic=True)` to a temporary
`model.onnx` (+ external data), load it in a plain `onnxruntime.InferenceSession` (CPU), and compare the
model's main output with eager on the sample and on the grown input (tolerance 1e-3 x max(1, max|ref|)).
Lists the rules that fired per model, then a summary line.
"""

from __future__ import annotations

from sweep import child_script, run_sweep  # tools/ is on sys.path when this script runs

_CHILD = child_script(
    """
    import os
    import onnxruntime as ort
    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.lowerings.onnx import onnx_feed
    """,
    """
    path = os.path.join(tmp, "model.onnx")
    timed_export(OnnxExporter(), OnnxConfig(dynamic=True, output_path=path))
    row["status"] = "ort-load-error"
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    index = names.index(entry.output) if entry.output in names else 0
    input_names = [i.name for i in session.get_inputs()]

    def run(feed):
        return torch.from_numpy(session.run(None, onnx_feed(input_names, feed))[index])
    """,
    tolerance=1e-3,
)


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "onnx (ORT)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
