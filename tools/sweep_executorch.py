"""ExecuTorch sweep: export every corpus entry with ExecutorchExporter (XNNPACK), run the program in the
ExecuTorch runtime, and compare with eager.

    python tools/sweep_executorch.py --family causal_lm --jobs 1 --out sweep_executorch.md
    python tools/sweep_executorch.py --family encoder --only bert,convbert --json rows.json

Each model runs in its own subprocess. For each: export with `ExecutorchConfig(dynamic=True)` and the
bounded dynamic shapes ExecuTorch needs (`bounded_dynamic_shapes`: batch <= 8, sequence <= the model's
max_position_embeddings, image height and width <= its image_size, raw audio <= 160 000 samples),
save `model.pte`, load it with `executorch.runtime`, and compare the model's
main output with eager on the sample and on the grown input (tolerance 1e-4 x max(1, max|ref|)).
Lists the rules that fired per model, then a summary line. A model takes minutes (XNNPACK preprocesses every
partition): on a shared 2-core machine run a family in chunks with `--only`. Results: docs/coverage.md.
"""

from __future__ import annotations

from sweep import child_script, run_sweep  # tools/ is on sys.path when this script runs

_CHILD = child_script(
    """
    import os
    from hfexport import ExecutorchConfig, ExecutorchExporter
    from hfexport.runtime.executorch import ExecutorchProgram
    """,
    """
    # dynamic=True: the exporter caps unbounded axes for memory planning (one warning).
    manager = timed_export(ExecutorchExporter(), ExecutorchConfig(dynamic=True))
    path = os.path.join(tmp, "model.pte")
    manager.save(path)
    row["status"] = "load-error"
    program = ExecutorchProgram(path)

    def run(feed):
        return program.run(feed)[0]
    """,
    tolerance=1e-4,
)


def main(argv: list[str] | None = None) -> int:
    return run_sweep(argv, _CHILD, "executorch (XNNPACK)", with_format=False)


if __name__ == "__main__":
    raise SystemExit(main())
