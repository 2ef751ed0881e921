"""Peak resident memory of each stage of one generation export as `hfexport bench` builds it, and of its save.

    python tools/export_stage_memory.py --model path/to/folder --backend onnx --precision int4
    python tools/export_stage_memory.py --model path/to/folder --backend onnx --precision int4 --rules

The model folder is loaded with `from_pretrained`; the export is `hfexport.apps.bench.generation_export`'s (the
bench's config and quantizer for the backend and precision) and the artifact is saved to `--out` (a temporary
folder by default). The kernel's high-water mark of this process (VmHWM) is read and reset
(`/proc/self/clear_refs`, Linux) every time the export enters a stage (`--rules`: also every time a rule starts),
so each line is the peak RSS while that stage ran, not a sample ("ready": from the end of the load to the first
stage). Every parameter is read after the load, so that a memory-mapped checkpoint is resident before the export
starts; the first line gives the float parameters' bytes, the RSS then ("ready") and the export's peak over it in
units of the weights.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def _status(field: str) -> float:
    """A /proc/self/status memory field in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class StagePeaks:
    """Per-label peak RSS: `enter(label)` closes the current label with the high-water mark since it began."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, float]] = []  # label, peak MB, RSS MB at its end, seconds
        self.label, self.start = "load", time.perf_counter()

    def enter(self, label: str) -> None:
        self.rows.append((self.label, _status("VmHWM"), _status("VmRSS"), time.perf_counter() - self.start))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.label, self.start = label, time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder (causal LM)")
    parser.add_argument("--backend", default="onnx")
    parser.add_argument("--precision", default="int4")
    parser.add_argument("--out", help="where the artifact is saved (default: a temporary folder)")
    parser.add_argument("--rules", action="store_true", help="a line per rule as well as per stage")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from hfexport.apps.bench import generation_cache, generation_export
    from hfexport.artifacts import save
    from hfexport.auto import AutoHfExporter
    from hfexport.rewrites import engine

    peaks = StagePeaks()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    with torch.no_grad():  # a memory-mapped checkpoint's pages are resident once read: read them all now
        for parameter in model.parameters():
            parameter.sum()
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config, configs, call_sample, multi_token = generation_export(args.backend, args.precision, sample)
    peaks.enter("ready")
    ready = _status("VmRSS")
    start = time.perf_counter()
    hook = engine.fault_injection(lambda stage, rule: peaks.enter(stage if rule is None else f"{stage}: {rule}"))
    with tempfile.TemporaryDirectory() as tmp, hook if args.rules else engine.stage_listener(peaks.enter):
        components = AutoHfExporter.from_config(config).export_for_generation(
            model,
            call_sample,
            configs,
            generation_config=generation_cache(args.backend, 256),
            multi_token_decode=multi_token,
        )
        peaks.enter("save")
        save(components, Path(args.out or tmp), config=config, model=model)
        seconds = time.perf_counter() - start
        peaks.enter("end")
    top = max(peak for label, peak, _, _ in peaks.rows if label not in ("load", "ready"))
    print(
        f"weights {weights:.0f} MB; RSS ready {ready:.0f} MB; export + save {seconds:.1f} s; peak {top:.0f} MB, "
        f"{(top - ready) / weights:.2f}x the weights over ready"
    )
    for label, peak, rss, secs in peaks.rows:
        print(f"  {label[:60]:60s} peak {peak:7.0f} MB  end {rss:7.0f} MB  {secs:7.1f} s")


if __name__ == "__main__":
    main()
