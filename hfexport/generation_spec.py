"""The generation artifact's schema: how the components of one `export_for_generation` call are run.

Plain data (JSON-ready), written by the frontend, saved in the manifest, read by the runtime; plus the wrapper
that bakes an image layout into a modality component, which rules must recognise without importing the
frontend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.core.positions import MultimodalPositions
from hfexport.naming import canonical_output


class LayoutSpecialised(torch.nn.Module):
    """A modality component with its layout inputs (image_grid_thw, image_sizes...) as constants of the graph.

    Vision towers turn these small integer tensors into Python ints (`grid_thw.tolist()`) to split patches per
    image, which torch.export can only trace as data-dependent values it cannot branch on. Built as literals
    inside the forward, they stay known while tracing (rule `patch/fake-constant-layouts` lets torch's fake
    tensors keep tensors of that size as constants), so the graph is exact for that image layout; the runtime
    refuses other layouts (see `ComponentSpec.layout`).
    """

    def __init__(self, inner: torch.nn.Module, layout: Mapping[str, tuple[list[Any], torch.dtype]]) -> None:
        super().__init__()
        self.inner = inner
        self.layout = dict(layout)

    def forward(self, **kwargs: Any) -> Any:
        literals = {k: torch.tensor(values, dtype=dtype) for k, (values, dtype) in self.layout.items()}
        return canonical_output(self.inner(**kwargs, **literals))


# Largest layout tensor baked into a modality component (a few images' grid_thw / sizes, not data).
LAYOUT_MAX_NUMEL = 64

# Where `export()` of a pixel-input forward records the layout it baked in (`{input name: values}`): on the
# captured program's `graph_module.meta`, read by the lowerings that keep the check outside the graph
# (ONNX metadata, since torch.onnx drops in-graph assertions).
LAYOUT_META = "hfexport_baked_layout"
# The ONNX model metadata key holding that layout as JSON; hfexport's ONNX runner checks a feed against it.
LAYOUT_METADATA_KEY = "hfexport.baked_layout"


# Where `export()` of a pixel-input forward records the pixel inputs whose image axis (axis 0) the trace kept at the
# sample's size although it was asked dynamic (`{input name: count}`): the program holds for that image count
# only, since the forward makes one Python value per image (a per-image list of features it returns or walks).
# Not with a layout input (image_grid_thw, image_sizes...): the baked layout fixes the images already.
# `capture` puts it on `graph_module.meta`; the export report keeps it as `used["image_count"]`, which
# `hfexport.load(...).run` checks a feed against on every format.
IMAGE_COUNT_META = "hfexport_baked_image_count"
# Where `capture` records the other axes asked dynamic that the trace fixed at the sample's size
# (`{input name: {axis as str: size}}`): the model's code made them Python values (a loop over the sequence, a
# branch on a length). The export report keeps it as `used["static_axes"]`; the CLI's `--validate` skips the
# other shapes that change them, saying why.
STATIC_AXES_META = "hfexport_specialised_axes"


def image_count_mismatch(what: str, name: str, expected: int, given: int) -> str:
    """The error for a pixel input of another image count than the one the export kept static."""
    return (
        f"{what} was exported for {name}.shape[0] == {expected} (the image axis: the model makes one Python value "
        f"per image or row of images, e.g. a list of per-image features, so the graph holds for this count only); "
        f"got {given}: export again with inputs of this image count"
    )


def layout_mismatch(what: str, name: str, expected: Any, given: Any) -> str:
    """The error for an input of another image layout than the one baked into a graph, naming the expected one."""
    return (
        f"{what} was exported for {name}={expected} (an image layout baked into the graph); got {given}: "
        "export again with inputs of this layout"
    )


@dataclass
class CacheLeaf:
    """One tensor of a component's initial cache: its flat name, sample shape and dtype."""

    name: str
    shape: list[int]
    dtype: str


@dataclass
class ComponentSpec:
    """What a runtime needs to feed one component: its tensor inputs, in graph order, and its initial cache."""

    inputs: list[str]
    # Python-valued program inputs the runtime had to feed back: always empty now (every graph takes tensors and
    # the cache only, its Python arguments fixed inside); kept so older manifests load and are refused by name.
    constants: dict[str, Any]
    mask_rank: int | None
    cache_leaves: list[CacheLeaf]
    # Layout inputs baked into the graph (`LayoutSpecialised`): the only values the component accepts.
    layout: dict[str, list[Any]] = field(default_factory=dict)
    # The flat names of the tensors each nested input other than the cache flattens to, in pytree order (a VLM
    # prefill's `mm_encoder_outputs.image.last_hidden_state`, ...): a runtime that takes its inputs by position
    # (a loaded ExecuTorch program) places them by these names.
    leaves: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class GenerationSpec:
    """How to run the components of one `export_for_generation` call; plain data (JSON-ready).

    `static_cache`: the cache has a fixed length (`max_cache_len` in the sample) written in place; the
    runtime allocates it once. Otherwise prefill starts from an empty cache and each step returns the grown one.
    """

    components: dict[str, ComponentSpec]
    cache_key: str | None
    static_cache: bool
    max_cache_len: int | None
    multi_token_decode: bool
    sample_batch: int
    is_encoder_decoder: bool = False
    # State-space caches (Mamba): a 2-D mask covers the current tokens only, not past + current.
    mask_current_only: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    # Logits processors of the model's generation config that the runtime applies (greedy parity needs them):
    # the first new token forced, the last one forced to end the sequence, token ids never produced, and
    # ids not produced as the first new token (Whisper's `begin_suppress_tokens`).
    forced_bos_token_id: int | None = None
    forced_eos_token_id: list[int] = field(default_factory=list)
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    # The fields of the `encoder_outputs` ModelOutput the decoder steps take ([] for a tuple): a runtime without
    # the samples (a loaded artifact) feeds the encoder output under the same names.
    encoder_output_fields: list[str] = field(default_factory=list)
    # The decode step takes every token so far, not only the new one (CPM-Ant re-embeds the whole sequence and
    # slices off the cached part itself); the runtime then feeds the whole sequence at each step.
    decode_full_sequence: bool = False
    # Multimodal rotary positions the runtime rebuilds for the prefill and the decode steps (Qwen2-VL style).
    positions: MultimodalPositions | None = None
    # The components `hfexport.runtime.generate` runs beyond the documented ones (a multimodal model's
    # `<modality>_features` and `prefill`), which `export_for_generation` keeps outside its dict. Listed even
    # when exported with `runtime_components=False`, so that generate can say what is missing.
    runtime_components: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationSpec:
        components = {
            name: ComponentSpec(
                inputs=list(c["inputs"]),
                constants=dict(c.get("constants", {})),
                mask_rank=c["mask_rank"],
                cache_leaves=[CacheLeaf(**leaf) for leaf in c["cache_leaves"]],
                layout=dict(c.get("layout", {})),
                leaves={k: list(v) for k, v in c.get("leaves", {}).items()},
            )
            for name, c in data["components"].items()
        }
        positions = data.get("positions")
        if positions is not None:
            positions = MultimodalPositions.from_dict(positions)
        return cls(**{**data, "components": components, "positions": positions})
