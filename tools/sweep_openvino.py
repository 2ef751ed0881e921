"""OpenVINO sweep: export every corpus entry with OpenVINOExporter and run it on the OpenVINO CPU plugin.

    python tools/sweep_openvino.py --family causal_lm --jobs 2 --out sweep_openvino.md

Each model runs in its own subprocess. For each: export with `OpenVINOConfig(dynamic=True)` (an in-memory
`openvino.Model`), compile it on CPU with the f32 inference-precision hint, and compare the model's main
output with eager on the sample and on the grown input (tolerance 1e-4 x max(1, max|ref|)); the model must
also report its sequence axis as dynamic. Lists the rules that fired per model, then a summary line.
"""

from __future__ import annotations

from sweep import run_sweep  # tools/ is on sys.path when this script runs

_CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import logging
logging.disable(logging.WARNING)
import torch
from hfexport import OpenVINOConfig, OpenVINOExporter
from hfexport.runtime.openvino import OpenVINORunner
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
    exporter = OpenVINOExporter()
    start = time.perf_counter()
    ov_model = exporter.export(model, inputs, config=OpenVINOConfig(dynamic=True))
    row["export_s"] = round(time.perf_counter() - start, 2)
    row["rules"] = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    row["status"] = "compile-error"
    runner = OpenVINORunner(ov_model)
    static = [p.get_any_name() for p in ov_model.inputs if p.get_partial_shape().is_static]
    for what, feed, ref in (("sample", inputs, expected[0]), ("grown", grown, expected[1])):
        row["status"] = f"{what}-error"
        outputs = runner(**feed)
        actual = outputs[entry.output] if entry.output in outputs else next(iter(outputs.values()))
        if actual.shape != ref.shape:
            row["status"] = f"{what}-shape"
            row["error"] = f"{list(actual.shape)} != {list(ref.shape)}"
            raise SystemExit(0)
        diff = (ref.float() - actual.float()).abs().max().item()
        row[f"{what}_diff"] = diff
        if not diff <= 1e-4 * max(1.0, ref.abs().max().item()):
            row["status"] = f"{what}-mismatch"
            raise SystemExit(0)
    row["status"] = "ok"
    if static:
        row["error"] = f"static inputs: {static}"
except SystemExit:
    pass
except BaseException as exc:
    text = str(exc).strip()
    row["error"] = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
    if "Summary:" in text:
        row["error"] += " " + " ".join(text[text.find("Summary:"):].split())[:300]
    cause = exc.__cause__
    if cause is not None and "Summary:" not in text:
        row["error"] += f" <- {type(cause).__name__}: {str(cause).strip()[:300]}"
finally:
    print("ROW " + json.dumps(row))
"""


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "openvino (CPU, f32 hint)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
