"""OpenVINO sweep: export every corpus entry with OpenVINOExporter and run it on the OpenVINO CPU plugin.

    python tools/sweep_openvino.py --family causal_lm --jobs 2 --out sweep_openvino.md

Each model runs in its own subprocess. For each: export with `OpenVINOConfig(dynamic=True)` (an in-memory
`openvino.Model`), compile it on CPU with the f32 inference-precision hint, and compare the model's main
output with eager on the sample and on the grown input (tolerance 1e-4 x max(1, max|ref|)); the model must
also report its sequence axis as dynamic. Lists the rules that fired per model, then a summary line.
"""

from __future__ import annotations

from sweep import child_script, run_sweep  # tools/ is on sys.path when this script runs

_CHILD = child_script(
    """
    from hfexport import OpenVINOConfig, OpenVINOExporter
    from hfexport.runtime.openvino import OpenVINORunner
    """,
    """
    ov_model = timed_export(OpenVINOExporter(), OpenVINOConfig(dynamic=True))
    row["status"] = "compile-error"
    runner = OpenVINORunner(ov_model)
    static = [p.get_any_name() for p in ov_model.inputs if p.get_partial_shape().is_static]

    def run(feed):
        outputs = runner(**feed)
        return outputs[entry.output] if entry.output in outputs else next(iter(outputs.values()))
    """,
    tolerance=1e-4,
    after="""
    if static:
        row["error"] = f"static inputs: {static}"
    """,
)


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "openvino (CPU, f32 hint)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
