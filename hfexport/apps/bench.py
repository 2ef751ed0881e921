"""How fast a model's exported generation runs on this machine (`hfexport bench`, issue #19, goal 7).

For each backend x precision: `export_for_generation` with a static cache (one multi-token decode graph that
also takes the prompt), then `hfexport.runtime.generate` from a random prompt, against the model's own
`generate` (dynamic cache) in the same process. A row has the time to the first token (TTFT: a one-token
generate), decode tokens/s ((new - 1) / (time of `new` tokens - TTFT)), whether the tokens equal eager's, the
export's seconds and peak memory over the process's before it, and the share of the decode ceiling: this
machine's matrix-vector bandwidth (fp32 `torch.mv` over a matrix larger than the caches, measured in the same
run) over the bytes of weights one decode step reads (scaled by 32 / bits for a quantized row; scales and the
unquantized embedding are not counted). Timings are medians over `repeats`; a loaded machine inflates them, so
the load is recorded at the start and the end.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hfexport.backends.registry import backend as descriptor
from hfexport.backends.registry import backends, names

if TYPE_CHECKING:
    import torch

# Weight bits of each precision: a quantized row's ceiling is the fp32 one times 32 / bits.
PRECISION_BITS = {"fp32": 32, "int8": 8, "int4": 4}
STATIC_DECODE = "static_decode"  # a variant's key (not a config field): see `generation_export`
GROWING_CACHE = "growing_cache"  # a variant's key (not a config field): see `generation_cache`


def _variants() -> dict[str, dict[str, Any]]:
    """Rows that are a config variant of a format rather than its defaults (`Tools.bench_variants`), by name."""
    return {name: dict(v) for b in backends() for name, v in b.tools.load().bench_variants.items()}


VARIANTS: dict[str, dict[str, Any]] = _variants()
# Every format, each followed by its variants (`hfexport bench --backends`); without --backends, every format.
DEFAULT_BACKENDS: tuple[str, ...] = names()
BACKENDS: tuple[str, ...] = tuple(
    name for b in backends() for name in (b.name, *(v for v, c in VARIANTS.items() if c["export_format"] == b.name))
)


def quantizer_for(backend: str, precision: str) -> Any:
    """Each backend's weight-only (or dynamic) recipe for `precision` (`Tools.bench_quantizer`): int8 = dynamic
    activations with int8 weights where the backend has it (ONNX Runtime, XNNPACK), else NNCF int8 weights; int4 =
    on ExecuTorch, torchao's 8da4w (dynamic int8 activations, int4 weights in groups of 32), elsewhere NNCF int4
    weights, symmetric, groups of 32, every layer on ONNX Runtime and OpenVINO (the output projection and the
    embedding too). None for fp32."""
    if precision == "fp32":
        return None
    if precision not in PRECISION_BITS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISION_BITS)}")
    fmt = VARIANTS.get(backend, {}).get("export_format", backend)
    recipe = descriptor(fmt).tools.load().bench_quantizer
    if recipe is None:
        raise ValueError(f"{fmt} has no {precision} recipe in hfexport bench")
    return recipe(precision)


def token_agreement(got: Sequence[int], expected: Sequence[int]) -> tuple[int, int]:
    """(tokens equal to `expected` position by position, tokens equal before the first difference). Both, because on
    a model whose logits are nearly flat (random weights) a quantized run parts from the reference early and may
    then repeat a token the reference also repeats later: many equal positions, none before the first difference."""
    same = sum(a == b for a, b in zip(got, expected, strict=False))
    prefix = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    return same, min(len(got), len(expected)) if prefix is None else prefix


def rss_bytes() -> int:
    """This process's resident memory now (Linux `/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak resident memory while the block runs, over the process's at its start (polled every 20 ms)."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def megabytes(self) -> float:
        return (self.peak - self.start) / 1e6


def matvec_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second that `torch.mv` streams from an fp32 matrix of `megabytes` (the kernel decode is bound
    by), median of `repeats`."""
    import torch

    cols = 4096
    rows = max(1, megabytes * 1024 * 1024 // (4 * cols))
    matrix = torch.randn(rows, cols)
    vector = torch.randn(cols)
    torch.mv(matrix, vector)
    times = [_time(lambda: torch.mv(matrix, vector)) for _ in range(repeats)]
    return matrix.numel() * 4 / statistics.median(times)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied head shares the embedding's), less
    the input embedding when the head does not reuse it (a gather reads one row per token)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed(fn: Callable[[int], Any], new: int, repeats: int) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s) of `fn(max_new_tokens)`: medians over `repeats`, after one warm-up."""
    fn(2)  # sessions, allocations, first-call compilation
    first = statistics.median(_time(lambda: fn(1)) for _ in range(repeats))
    full = statistics.median(_time(lambda: fn(new)) for _ in range(repeats))
    # On a tiny model with few repeats the noise of the two medians can exceed the decode time itself: no
    # reading then, rather than a rate from a difference of about zero.
    return first, (new - 1) / (full - first) if full > first else float("nan")


@dataclass
class Alternated:
    """One setting's readings in `timed_alternately`: TTFT and decode tok/s medians, and its last `new`-token output."""

    ttft_s: float
    tokens_per_s: float
    output: Any


def timed_alternately(runs: Mapping[str, Callable[[int], Any]], new: int, rounds: int) -> dict[str, Alternated]:
    """`timed` for an A/B: each round runs every setting in turn (a 1-token call for TTFT, then a `new`-token one),
    so a change of machine load lands on every side; round 0 warms them up and is not counted."""
    ttft: dict[str, list[float]] = {name: [] for name in runs}
    rate: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, Any] = {}
    for round_ in range(rounds + 1):
        for name, fn in runs.items():
            first = _time(lambda fn=fn: fn(1))
            start = time.perf_counter()
            outputs[name] = fn(new)
            whole = time.perf_counter() - start
            if round_:
                ttft[name].append(first)
                rate[name].append((new - 1) / (whole - first))
    return {
        name: Alternated(statistics.median(ttft[name]), statistics.median(rate[name]), outputs[name]) for name in runs
    }


@dataclass
class BenchRow:
    """One line of the table: a run (eager, or a backend) at one precision."""

    run: str
    precision: str
    ttft_s: float = float("nan")
    tokens_per_s: float = float("nan")
    tokens: str = ""
    export_s: float = float("nan")
    peak_mb: float = float("nan")
    note: str = ""


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def cpu_description() -> str:
    """The CPU's model name and the vector extensions that select the runtimes' kernels (AVX-512, AMX, and VNNI for
    int8: without it, AVX2's 8-bit dot products can saturate their 16-bit intermediate sums, which OpenVINO's docs
    call the saturation issue), so that a run's speed and quantized tokens can be read against its CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        import platform

        return platform.processor() or "unknown"
    fields = dict(
        (key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in text.splitlines()[:40])
    )
    flags = set(fields.get("flags", "").split())
    isa = [flag for flag in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if flag in flags]
    return f"{fields.get('model name', 'unknown')} ({', '.join(isa) or 'no AVX2'})"


COLUMNS = ("run", "precision", "TTFT ms", "decode tok/s", "% of ceiling", "x eager", "tokens", "export s", "peak MB")


@dataclass
class BenchResult:
    """A benchmark run: its rows (the first is eager fp32, the x eager reference) and what the ceiling is from."""

    rows: list[BenchRow]
    bandwidth: float  # bytes/s that torch.mv streamed
    weight_bytes: int  # weights one decode step reads
    prompt: int
    new: int
    load: tuple[float, float] = (float("nan"), float("nan"))  # 1-minute load average at the start and the end
    threads: int = field(default_factory=_torch_threads)
    cpu: str = field(default_factory=cpu_description)

    @property
    def ceiling(self) -> float:
        """fp32 decode tokens/s if every step only streamed its weights at the measured bandwidth."""
        return self.bandwidth / self.weight_bytes

    def table(self) -> str:
        """The rows as a Markdown table (the note column last)."""
        eager = self.rows[0].tokens_per_s
        header = [*COLUMNS, "note"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in self.rows:
            share = 100 * r.tokens_per_s / (self.ceiling * 32 / PRECISION_BITS[r.precision])
            cells = (
                r.run,
                r.precision,
                f"{r.ttft_s * 1e3:.0f}",
                f"{r.tokens_per_s:.1f}",
                f"{share:.0f}%",
                f"{r.tokens_per_s / eager:.2f}",
                r.tokens,
                f"{r.export_s:.0f}",
                f"{r.peak_mb:.0f}",
                r.note,
            )
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the CPU, threads, load, bandwidth, weights per token and the fp32 ceiling."""
        return (
            f"{self.cpu}; torch threads {self.threads}; load {self.load[0]:.1f} -> {self.load[1]:.1f}; matvec "
            f"bandwidth {self.bandwidth / 1e9:.1f} GB/s; weights read per token {self.weight_bytes / 1e6:.1f} MB; "
            f"fp32 decode ceiling {self.ceiling:.1f} tok/s; prompt {self.prompt}, {self.new} new tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "bandwidth_bytes_per_s": self.bandwidth,
            "weight_bytes_per_token": self.weight_bytes,
            "ceiling_tokens_per_s": self.ceiling,
            "prompt": self.prompt,
            "new": self.new,
            "load": list(self.load),
            "threads": self.threads,
            "cpu": self.cpu,
        }


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160].replace("|", "/").replace("\n", " ")


def generation_export(backend: str, precision: str, sample: dict[str, Any]) -> tuple[Any, Any, Any, bool]:
    """`backend`'s config for `precision`, the config argument of `export_for_generation` (that config, or one per
    component), the sample to trace on and whether the decode graph takes several tokens.

    Every backend: one multi-token decode graph, dynamic, traced on the two-row `sample`. `STATIC_DECODE` variants:
    a dynamic prefill graph and a one-token decode graph exported static, both traced on the sample's first row
    (so the program runs batch 1 only, as on a device)."""
    from hfexport.auto import AutoExportConfig

    settings = dict(VARIANTS.get(backend, {"export_format": backend, "dynamic": True}))
    static_decode = settings.pop(STATIC_DECODE, False)
    settings.pop(GROWING_CACHE, None)
    config = AutoExportConfig.from_dict(settings)
    quantizer = quantizer_for(backend, precision)
    if quantizer is not None:
        config = dataclasses.replace(config, quantizer=quantizer)
    if not static_decode:
        return config, config, sample, True
    configs = {"prefill": config, "decode": dataclasses.replace(config, dynamic=False)}
    return config, configs, {name: value[:1] for name, value in sample.items()}, False


def generation_cache(backend: str, max_length: int) -> Any:
    """The `generation_config` of `backend`'s generation export: a static cache of `max_length` tokens, or None
    (transformers' dynamic cache, grown by concatenation) for a `GROWING_CACHE` variant, whose runtime fuses the
    growing cache into its attention (OpenVINO stateful: docs/openvino.md, "Speed beside optimum-intel")."""
    from transformers import GenerationConfig

    if VARIANTS.get(backend, {}).get(GROWING_CACHE):
        return None
    return GenerationConfig(cache_implementation="static", max_cache_len=max_length)


def bench_generation(
    model: Any,
    *,
    backends: Sequence[str] = ("onnx",),
    precisions: Sequence[str] = ("fp32",),
    prompt: int = 128,
    new: int = 128,
    repeats: int = 3,
    bandwidth_mb: int = 512,
    on_step: Callable[[str], Any] | None = None,
) -> BenchResult:
    """Time eager `generate` and every backend x precision's exported generation of `model` (a causal LM, in eval
    mode) on one random prompt of `prompt` tokens (batch 1), `new` greedy tokens each. A backend or precision
    that fails to export or run is a row with the error as its note, not the end of the run."""
    import torch

    from hfexport.auto import AutoHfExporter
    from hfexport.runtime.generation import generate

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"backend {unknown[0]!r}: one of {', '.join(BACKENDS)}")
    for precision in precisions:
        if precision not in PRECISION_BITS:
            raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISION_BITS)}")
    say = on_step or (lambda message: None)
    load_start = os.getloadavg()[0]
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    say("measuring this machine's matrix-vector bandwidth")
    bandwidth = matvec_bandwidth(bandwidth_mb, 10 if bandwidth_mb >= 256 else 3)
    pad = getattr(model.generation_config, "pad_token_id", None)

    def eager(n: int) -> Any:
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0 if pad is None else pad,
            )

    say(f"eager generate: {prompt}-token prompt, {new} new tokens, {repeats} repeat(s)")
    ttft, tps = timed(eager, new, repeats)
    rows = [BenchRow("eager generate (dynamic cache)", "fp32", ttft, tps, "reference")]
    expected = eager(new)
    # Traced on two rows, so that the batch axis stays dynamic (a sample axis of size 1 would be exported static).
    sample = {
        "input_ids": ids[:, : min(8, prompt)].repeat(2, 1),
        "attention_mask": mask[:, : min(8, prompt)].repeat(2, 1),
    }
    for backend in backends:
        for precision in precisions:
            cache = generation_cache(backend, prompt + new)
            row = BenchRow(f"hfexport {backend} ({'dynamic' if cache is None else 'static'} cache)", precision)
            rows.append(row)
            say(f"{backend} {precision}: export_for_generation")
            try:
                config, configs, call_sample, multi_token = generation_export(backend, precision, sample)
                start = time.perf_counter()
                with PeakRss() as memory:
                    components = AutoHfExporter.from_config(config).export_for_generation(
                        model, call_sample, configs, generation_config=cache, multi_token_decode=multi_token
                    )
                row.export_s, row.peak_mb = time.perf_counter() - start, memory.megabytes

                def run(n: int, components: Any = components) -> Any:
                    return generate(components, ids, mask, max_new_tokens=n, min_new_tokens=n)

                got = run(new)
                same, prefix = token_agreement(got[0, prompt:].tolist(), expected[0, prompt:].tolist())
                row.tokens = "equal" if torch.equal(got, expected) else f"{same}/{new} equal, first {prefix}"
                say(f"{backend} {precision}: timing generate")
                row.ttft_s, row.tokens_per_s = timed(run, new, repeats)
            except Exception as exc:  # a backend that cannot run is a row, not the end of the benchmark
                if os.environ.get("HFEXPORT_DEBUG"):
                    traceback.print_exc()
                row.note = _one_line(exc)
            # Each row as it ends: a long run (an hour at 30 layers) leaves its figures in the log if it stops early.
            say(
                f"{backend} {precision}: TTFT {row.ttft_s * 1e3:.0f} ms, {row.tokens_per_s:.1f} tok/s, tokens "
                f"{row.tokens or '-'}, export {row.export_s:.0f} s, peak {row.peak_mb:.0f} MB {row.note}".rstrip()
            )
    return BenchResult(rows, bandwidth, weight_bytes_per_token(model), prompt, new, (load_start, os.getloadavg()[0]))
