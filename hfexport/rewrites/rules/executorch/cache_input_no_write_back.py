"""A static cache on ExecuTorch without to_edge's write-back copies of the whole cache per step."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.executorch import ExecutorchEdgePassRule, bypass_nodes
from hfexport.rewrites.rule import RuleMeta

# ATen writes of a slice of a tensor: transformers' StaticLayer.update (`keys.index_copy_(2, positions, states)`,
# its fallback `keys[:, :, positions] = states`), functionalised by torch.export.
_WRITES = ("aten.index_copy.default", "aten.index_put.default")
_IN_PLACE_WRITES = ("aten.index_copy_.default", "aten.index_put_.default")


def count_cache_writes(program: torch.export.ExportedProgram) -> int:
    """How many inputs `program` mutates with an index write of themselves (a static cache's keys or values):
    in-place writes of a user input (the capture's graph keeps `index_copy_`), or functional writes returned as
    the input's mutation (a functionalised graph)."""
    from torch.export.graph_signature import InputKind, OutputKind

    user_inputs = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    written: set[str] = set()
    for node in program.graph.nodes:
        first = node.args[0] if node.op == "call_function" and node.args else None
        if str(node.target) in _IN_PLACE_WRITES and isinstance(first, fx.Node) and first.name in user_inputs:
            written.add(first.name)
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    for spec, value in zip(program.graph_signature.output_specs, outputs, strict=False):
        if spec.kind != OutputKind.USER_INPUT_MUTATION or not isinstance(value, fx.Node) or not value.args:
            continue
        first = value.args[0]
        if str(value.target) in _WRITES and isinstance(first, fx.Node) and first.name == spec.target:
            written.add(spec.target)
    return len(written)


def _is_copy(node: fx.Node) -> bool:
    # Edge-dialect ops wrap the ATen overload in `_op`.
    return node.op == "call_function" and getattr(node.target, "_op", node.target) is torch.ops.aten.copy.default


def _same_type(a: fx.Node, b: Any) -> bool:
    """Whether `a` and `b` hold tensors of one shape, dtype and strides (compared as symbolic expressions)."""
    va, vb = a.meta.get("val"), getattr(b, "meta", {}).get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dtype != vb.dtype:
        return False
    return [str(s) for s in va.shape] == [str(s) for s in vb.shape] and [str(s) for s in va.stride()] == [
        str(s) for s in vb.stride()
    ]


def drop_input_copies(gm: fx.GraphModule) -> Any:
    """Replace each `copy(input, src)` of a program input and a tensor of its shape, dtype and strides by `src`.

    `run_decompositions` (inside `to_edge`) writes a mutated user input back as `copy(input, new)`, and removes
    that copy only for buffers and parameters (torch `_remove_unnecessary_copy_op_pass`); `copy` of a tensor of
    the same type is its values, so the program returns `new` itself as the mutation, exactly."""

    def source_of(node: fx.Node) -> fx.Node | None:
        if not _is_copy(node) or len(node.args) < 2 or node.kwargs.get("non_blocking"):
            return None
        target, source = node.args[0], node.args[1]
        placeholder = isinstance(target, fx.Node) and target.op == "placeholder"
        return source if placeholder and _same_type(target, source) else None

    return bypass_nodes(gm, source_of)


def _edge_passes() -> list[Any]:
    return [drop_input_copies]


class _CacheWrite(torch.nn.Module):
    """A static cache layer's step: write the new states at `position`, then attend over the whole cache."""

    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, states: torch.Tensor, position: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            cache.index_copy_(2, position, states)
            updated = cache
        else:
            updated = cache.index_copy(2, position, states)
        # Reads every slot, so the outputs check the cache the program wrote.
        return torch.softmax(states @ updated.transpose(-1, -2), dim=-1) @ updated


def _inputs(heads: int = 3, slots: int = 8, tokens: int = 1, at: int = 5, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "states": torch.randn(1, heads, tokens, 4, generator=generator),
        "position": torch.arange(at, at + tokens),
        "cache": torch.randn(1, heads, slots, 4, generator=generator),
    }


def _built(in_place: bool = True, **kwargs: Any) -> Built:
    return _CacheWrite(in_place), _inputs(**kwargs)


cache_input_no_write_back = ExecutorchEdgePassRule(
    RuleMeta(
        id="executorch/cache-input-no-write-back",
        kind="optimization",
        why="A static cache is a user input the decode graph mutates (`index_copy_` in StaticLayer.update). "
        "`to_edge` re-traces it and writes the input back as `copy(input, new)` at each re-trace (two per cache "
        "tensor), which torch removes only for buffers, so each step copied every cache tensor three times "
        "(index_put's own copy and the two write-backs) before attention read it: at the SmolLM2-135M shape 60 "
        "tensors of 196 KB. The write-back copies become the new value itself (an exact identity: same shape, "
        "dtype and strides): `copy.out` 12 -> 0 on 2 layers, decode step 0.78-0.93x the time (A/B, load 7-8). "
        "executorch's reinplace pass "
        "(ExecutorchBackendConfig.run_reinplace_pass, which would also make index_put in place) is not used: "
        "with it the 2-layer SmolLM2 shape generated other tokens than eager from the second one"
        "; measured by tools/ab_rules.py (the executorch-static-decode form, 4 layers at "
        "SmolLM2-135M's width, batch 1, 128-token prompt, 64 new tokens, 2-core AVX2 EPYC): decode 1.03x (169.5 "
        "against 163.8 tok/s), tokens equal",
        upstream="torch==2.13.0 torch/export/exported_program.py _remove_unnecessary_copy_op_pass (buffers and "
        "parameters only)",
        backends=("executorch",),
        models=("llama",),
        examples=(
            Match(lambda: _built(), "one token written at slot 5 of an 8-slot cache, attention over every slot"),
            Match(lambda: _built(tokens=3, at=2, seed=1), "three tokens written at slots 2-4"),
            NoMatch(
                lambda: _built(in_place=False),
                "an out-of-place index_copy: the input is not mutated",
                reason="no user input is mutated by an index write",
            ),
        ),
    ),
    count=count_cache_writes,
    edge_passes=_edge_passes,
)
