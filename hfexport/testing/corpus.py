"""Load the tiny-model corpus (``tests/fixtures/corpus``) and materialise its models and inputs.

Each entry is a JSON file holding a small, valid config of a real transformers architecture plus a
declarative description of its sample inputs. Building models and inputs from seeds (instead of
storing weights or tensors) keeps the fixtures small and diff-able, and makes every run reproducible.
The format is described in the corpus README; the fixtures are copies so that the project never reads
outside its own tree when it runs or tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CorpusEntry", "default_root", "entry_from_dict", "load_corpus", "load_entry"]

_DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


# The grow steps of the shape checks: one step is the classic grown input; 13 and 26 steps take an 8-token
# sample with 5-token steps to 73 and 138 tokens, past windows and chunks of 16, 32 and 64 and not a multiple
# of any of them.
SHAPE_STEPS: dict[str, int] = {"grown": 1, "long": 13, "longer": 26}
# Config keys that bound a sequence's length (learned position tables).
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")


def _dtype(name: str) -> torch.dtype:
    """Map a spec dtype name to torch; unknown names fail loudly rather than silently defaulting."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} in corpus tensor spec")
    return _DTYPES[name]


# The last name of a module that scores the experts of a mixture-of-experts block.
_ROUTER_NAMES = frozenset({"gate", "router"})


def _draw_zero_routers(model: torch.nn.Module, seed: int, std: float) -> None:
    """Give a router whose weight the model's `_init_weights` leaves at zero (afmoe: `init.zeros_(module.gate.weight)`)
    a seeded normal draw.

    With a zero router every expert scores the same, and `topk` over the ties is free to keep any set: eager CPU
    torch and ONNX TopK (lowest index first, by the spec) then route the tokens to other experts, and the outputs
    differ for a reason no trained checkpoint has. Only all-zero router weights are drawn; every other weight
    keeps the model's own initialisation.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if name.rsplit(".", 1)[-1] not in _ROUTER_NAMES or not isinstance(weight, torch.nn.Parameter):
                continue
            if weight.ndim == 2 and weight.is_floating_point() and not weight.any():
                weight.copy_(torch.randn(weight.shape, generator=gen, dtype=torch.float32).mul_(std))


@dataclass
class CorpusEntry:
    """One architecture of the corpus: how to build the model and how to feed it."""

    model_type: str
    family: str
    auto_class: str
    model_class: str
    config: dict[str, Any]
    sample: dict[str, Any]
    output: str
    raw: dict[str, Any] = field(repr=False)

    @property
    def variant(self) -> str:
        """The variant's name (``hfexport.testing.corpus_variants``: another config of the type), or ""."""
        return str(self.raw.get("variant") or "")

    @property
    def name(self) -> str:
        """A stable id (``family/model_type``, ``family/model_type@variant``), handy for test ids and reports."""
        return f"{self.family}/{self.model_type}" + (f"@{self.variant}" if self.variant else "")

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        """Build the model with random weights; the seed makes the weights, hence the outputs, reproducible."""
        import transformers
        from transformers import CONFIG_MAPPING

        cfg = CONFIG_MAPPING[self.model_type].from_dict(self.config)
        torch.manual_seed(seed)
        model = getattr(transformers, self.auto_class).from_config(cfg)
        _draw_zero_routers(model, seed, float(getattr(cfg, "initializer_range", 0.02) or 0.02))
        return model.eval()

    def _text_ids(self, shape: list[int], gen: torch.Generator) -> torch.Tensor:
        """Draw token ids from ``text_range`` minus ``avoid_ids``, so no special/image token sneaks in."""
        lo, hi = self.sample["text_range"]
        avoid = set(self.sample.get("avoid_ids", []))
        allowed = torch.tensor([i for i in range(lo, hi) if i not in avoid], dtype=torch.int64)
        return allowed[torch.randint(len(allowed), tuple(shape), generator=gen)]

    def _make(self, spec: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
        """Materialise one tensor spec."""
        dtype = _dtype(spec["dtype"])
        if "values" in spec:
            return torch.tensor(spec["values"], dtype=dtype)
        shape, init = tuple(spec["shape"]), spec["init"]
        if init == "randint":
            return torch.randint(spec["low"], spec["high"], shape, generator=gen).to(dtype)
        if init == "text":
            return self._text_ids(list(shape), gen).to(dtype)
        if init == "rand":
            return torch.rand(shape, generator=gen).to(dtype)
        if init == "randn":
            return torch.randn(shape, generator=gen).to(dtype)
        if init == "full":
            return torch.full(shape, spec["value"], dtype=dtype)
        raise ValueError(f"unknown tensor spec init {init!r} in {self.name}")

    @property
    def batch(self) -> int:
        return int(self.sample.get("batch", 2))

    def _rebatch(self, spec: dict[str, Any], batch: int) -> dict[str, Any]:
        """The spec with `batch` rows instead of the sample's: literal rows are cycled, shapes changed; an input
        whose first axis is not the batch (flattened image patches) is left alone."""
        spec = dict(spec)
        if "values" in spec:
            rows = spec["values"]
            if isinstance(rows, list) and len(rows) == self.batch:
                spec["values"] = [rows[i % len(rows)] for i in range(batch)]
        elif spec.get("shape") and spec["shape"][0] == self.batch:
            spec["shape"] = [batch, *spec["shape"][1:]]
        return spec

    def sample_inputs(self, seed: int = 0, batch: int | None = None) -> dict[str, torch.Tensor]:
        """The reference inputs, in spec order (order matters for positional export signatures); `batch`
        draws the same kind of inputs for another batch size."""
        gen = torch.Generator().manual_seed(seed)
        specs = self.sample["inputs"]
        if batch is not None and batch != self.batch:
            specs = {name: self._rebatch(spec, batch) for name, spec in specs.items()}
        return {name: self._make(spec, gen) for name, spec in specs.items()}

    @property
    def max_length(self) -> int | None:
        """The longest sequence the model accepts: the entry's ``max_length``, else the config's position
        tables (top level or text config); None when the config names no bound."""
        if self.sample.get("max_length"):
            return int(self.sample["max_length"])
        bounds = []
        for cfg in (self.config, self.config.get("text_config") or {}, self.config.get("decoder") or {}):
            for key in _POSITION_KEYS:
                value = cfg.get(key) if isinstance(cfg, dict) else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    bounds.append(value)
        return min(bounds) if bounds else None

    def _grow(self, tensor: torch.Tensor, spec: dict[str, Any], gen: torch.Generator) -> torch.Tensor:
        """Append ``by`` elements along ``axis``; the new block shares every other dim with ``tensor``."""
        axis, fill = spec["axis"], spec["fill"]
        shape = list(tensor.shape)
        shape[axis] = spec["by"]
        if fill == "text":
            extra = self._text_ids(shape, gen).to(tensor.dtype)
        elif fill == "rand":
            extra = torch.rand(shape, generator=gen).to(tensor.dtype)
        elif fill == "randn":
            extra = torch.randn(shape, generator=gen).to(tensor.dtype)
        elif isinstance(fill, (int, float, bool)):
            extra = torch.full(shape, fill, dtype=tensor.dtype)
        else:
            raise ValueError(f"unknown grow fill {fill!r} in {self.name}")
        return torch.cat([tensor, extra], dim=axis)

    def main_output(self, outputs: Any) -> torch.Tensor:
        """The output the corpus compares (`self.output` of a model output or dict, else the first one)."""
        if isinstance(outputs, dict) or hasattr(outputs, "keys"):
            return outputs[self.output]
        return outputs[0]

    def grown_inputs(self, seed: int = 1, times: int = 1) -> dict[str, torch.Tensor]:
        """A longer input for the dynamic-shape check; inputs without a grow spec stay as sampled.

        The base is the seed-0 sample, so the grown input extends the reference one; ``seed`` only
        drives the appended elements. ``times`` multiplies every grow step (8 tokens +5 x 13 = 73).
        """
        gen = torch.Generator().manual_seed(seed)
        grow = self.sample.get("grow") or {}
        grow = {name: {**spec, "by": spec["by"] * times} for name, spec in grow.items()}
        return {name: self._grow(t, grow[name], gen) if name in grow else t for name, t in self.sample_inputs().items()}

    def _text_length(self, inputs: dict[str, torch.Tensor]) -> int:
        """The longest grown token axis of `inputs` (text-filled grow specs), the length positions tables must
        hold; an audio attention mask grows with the samples, which no position table bounds."""
        grow = self.sample.get("grow") or {}
        lengths = [inputs[name].shape[spec["axis"]] for name, spec in grow.items() if spec.get("fill") == "text"]
        return max(lengths, default=0)

    def shape_inputs(self, seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
        """Inputs of other shapes than the sample, by name, for the checks that find baked lengths and batches:
        ``grown`` (one grow step: 8 -> 13 tokens), ``long`` and ``longer`` (13 and 26 steps: 73 and 138 tokens,
        across sliding windows, attention chunks and SSM chunks) and ``batch+1``. A long one that would pass
        the model's ``max_length`` is left out; without a grow spec only ``batch+1`` remains."""
        feeds: dict[str, dict[str, torch.Tensor]] = {}
        if self.sample.get("grow"):
            bound = self.max_length
            for name, times in SHAPE_STEPS.items():
                feed = self.grown_inputs(seed, times)
                if bound is None or self._text_length(feed) <= bound:
                    feeds[name] = feed
        feeds["batch+1"] = self.sample_inputs(seed=0, batch=self.batch + 1)
        return feeds


def load_entry(path: Path | str) -> CorpusEntry:
    """Read one JSON entry; the whole dict is kept in ``raw`` for fields the dataclass does not name."""
    return entry_from_dict(json.loads(Path(path).read_text()))


def entry_from_dict(raw: dict[str, Any]) -> CorpusEntry:
    """An entry from its JSON dict (a file's, or one the corpus generator is still checking)."""
    return CorpusEntry(
        model_type=raw["model_type"],
        family=raw["family"],
        auto_class=raw["auto_class"],
        model_class=raw.get("model_class", ""),
        config=raw["config"],
        sample=raw["sample"],
        output=raw.get("output", "logits"),
        raw=raw,
    )


def default_root() -> Path:
    """The repo's ``tests/fixtures/corpus``, found from this file so it works from any cwd."""
    return Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "corpus"


def load_corpus(root: Path | None = None, family: str | None = None) -> list[CorpusEntry]:
    """All entries under ``root`` (optionally one family), sorted by family then model type."""
    root = Path(root) if root is not None else default_root()
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus fixtures not found at {root}; pass root= or copy entries to tests/fixtures/corpus"
        )
    pattern = f"{family}/*.json" if family else "*/*.json"
    # `_skipped.json` and other `_` files beside the entries are the generator's records, not entries.
    entries = [load_entry(p) for p in sorted(root.glob(pattern)) if not p.name.startswith("_")]
    if family and not entries:
        raise FileNotFoundError(f"no corpus entries for family {family!r} under {root}")
    return entries


def corpus_params(
    entries: list[CorpusEntry],
    fast: set[str],
    known_failures: dict[str, str],
    strict: bool = True,
    flaky: dict[str, str] | None = None,
) -> list[Any]:
    """pytest params of `entries`: the `fast` model types run by default, the rest are marked `slow`; known
    failures are expected to fail (`strict`: a fix shows up as a failure to remove the entry), flaky ones
    non-strictly."""
    import pytest

    params = []
    for entry in entries:
        marks = [] if entry.model_type in fast else [pytest.mark.slow]
        if entry.model_type in known_failures:
            marks.append(pytest.mark.xfail(reason=known_failures[entry.model_type], strict=strict))
        elif flaky and entry.model_type in flaky:
            marks.append(pytest.mark.xfail(reason=flaky[entry.model_type], strict=False))
        params.append(pytest.param(entry, id=entry.name, marks=marks))
    return params
