"""ExecuTorch sweep: export every corpus entry with ExecutorchExporter (XNNPACK), run the program in the
ExecuTorch runtime, and compare with eager.

    python tools/sweep_executorch.py --family causal_lm --jobs 2 --out sweep_executorch.md

Each model runs in its own subprocess. For each: export with `ExecutorchConfig(dynamic=True)` and the
bounded dynamic shapes ExecuTorch needs (`bounded_dynamic_shapes`: batch <= 8, sequence <= the model's
max_position_embeddings), save `model.pte`, load it with `executorch.runtime`, and compare the model's
main output with eager on the sample and on the grown input (tolerance 1e-4 x max(1, max|ref|)).
Lists the rules that fired per model, then a summary line.
"""

from __future__ import annotations

from sweep import run_sweep  # tools/ is on sys.path when this script runs

_CHILD = r"""
import dataclasses, json, os, sys, tempfile, time, warnings
warnings.filterwarnings("ignore")
import logging
logging.disable(logging.WARNING)
import torch
from hfexport import ExecutorchConfig, ExecutorchExporter
from hfexport.lowerings.executorch import bounded_dynamic_shapes
from hfexport.runtime.executorch import ExecutorchProgram
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
    config = ExecutorchConfig(dynamic=True)
    config = dataclasses.replace(config, dynamic_shapes=bounded_dynamic_shapes(model, inputs, config, []))
    exporter = ExecutorchExporter()
    start = time.perf_counter()
    manager = exporter.export(model, inputs, config=config)
    row["export_s"] = round(time.perf_counter() - start, 2)
    row["rules"] = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pte")
        manager.save(path)
        row["status"] = "load-error"
        program = ExecutorchProgram(path)
        for what, feed, ref in (("sample", inputs, expected[0]), ("grown", grown, expected[1])):
            row["status"] = f"{what}-error"
            actual = program.run(feed)[0]
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
    return run_sweep(argv, _CHILD, "executorch (XNNPACK)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
