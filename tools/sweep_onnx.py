"""ONNX sweep: export every corpus entry with OnnxExporter, save it, and run it in ONNX Runtime against eager.

    python tools/sweep_onnx.py --family causal_lm --jobs 2 --out sweep_onnx.md

Each model runs in its own subprocess. For each: export with `OnnxConfig(dynamic=True)` to a temporary
`model.onnx` (+ external data), load it in a plain `onnxruntime.InferenceSession` (CPU), and compare the
model's main output with eager on the sample and on the grown input (tolerance 1e-3 x max(1, max|ref|)).
Lists the rules that fired per model, then a summary line.
"""

from __future__ import annotations

from sweep import run_sweep  # tools/ is on sys.path when this script runs

_CHILD = r"""
import json, os, sys, tempfile, time, warnings
warnings.filterwarnings("ignore")
import logging
logging.disable(logging.WARNING)
import torch
import onnxruntime as ort
from hfexport import OnnxConfig, OnnxExporter
from hfexport.lowerings.onnx import onnx_feed
from hfexport.testing.corpus import load_entry

entry = load_entry(sys.argv[1])
row = {"model": entry.model_type, "status": "eager-error"}
try:
    model = entry.build_model()
    inputs, grown = entry.sample_inputs(), entry.grown_inputs()
    def first(out):
        return out[entry.output] if hasattr(out, "keys") else out[0]
    with torch.no_grad():
        expected = [first(model(**inputs)), first(model(**grown))]
    row["status"] = "export-error"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        config = OnnxConfig(dynamic=True, output_path=path)
        exporter = OnnxExporter()
        start = time.perf_counter()
        exporter.export(model, inputs, config=config)
        row["export_s"] = round(time.perf_counter() - start, 2)
        row["rules"] = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
        row["status"] = "ort-load-error"
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        index = names.index(entry.output) if entry.output in names else 0
        input_names = [i.name for i in session.get_inputs()]
        for what, feed, ref in (("sample", inputs, expected[0]), ("grown", grown, expected[1])):
            row["status"] = f"{what}-error"
            actual = torch.from_numpy(session.run(None, onnx_feed(input_names, feed))[index])
            if actual.shape != ref.shape:
                row["status"] = f"{what}-shape"
                row["error"] = f"{list(actual.shape)} != {list(ref.shape)}"
                raise SystemExit(0)
            diff = (ref.float() - actual.float()).abs().max().item()
            row[f"{what}_diff"] = diff
            if not diff <= 1e-3 * max(1.0, ref.abs().max().item()):
                row["status"] = f"{what}-mismatch"
                raise SystemExit(0)
    row["status"] = "ok"
except SystemExit:
    pass
except BaseException as exc:
    text = str(exc).strip()
    row["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
    cause = exc.__cause__
    if cause is not None:
        row["error"] += f" <- {type(cause).__name__}: {str(cause).strip()[:300]}"
finally:
    print("ROW " + json.dumps(row))
"""


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "onnx (ORT)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
