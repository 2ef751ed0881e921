"""Computations on baked layout literals folded into constants, so a re-trace keeps them static.

A multimodal component exported with its image layout baked in (`LayoutSpecialised`: `grid_thw`,
`image_sizes` as literal tensors) traces exactly because the literals stay constants while tracing
(rule `patch/fake-constant-layouts`): `grid_thw.tolist()`, `repeat_interleave(..., grid)` and the index
grids built from them get static sizes. But the graph still holds those ops, applied to a lifted
constant. torch.onnx re-traces the program (`run_decompositions`), where lifted constants are
registered as buffers and become plain fake tensors: the same ops now have data-dependent sizes and the
translation fails ("Could not guard on data-dependent expression Eq(u12, 0)", GLM-4V, VideoLLaMA3).

The rule evaluates, with torch's own kernels on the real literal values, every node that depends only on
integer lifted constants (and on literals), and replaces the nodes the rest of the graph reads with
new lifted constants (tensors) or Python numbers. This is constant folding: the values are those eager
computes for the baked layout, so outputs are unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from hfexport.generation_spec import LAYOUT_MAX_NUMEL, LayoutSpecialised
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import FxGraphRule
from hfexport.rewrites.rule import RuleMeta

# Largest folded tensor kept as a constant (elements): layout-derived index grids are small; a larger
# result means the fold reached data-sized work, and the graph is left as it was.
_MAX_FOLDED_NUMEL = 1 << 22


def _foldable_target(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded not in target.tags
    return target in vars(operator).values()


def _written_in_place(node: fx.Node) -> bool:
    """Whether an op writes `node`'s value in place (`add_`: a cache's `torch.tensor(0)` offset that the forward
    advances, xLSTM's `seqlen_offset`), directly or through an alias of it (a view, `detach_`). Such a value is
    state, not a layout: folded, it would be a constant the program mutates, which the lowering refuses ('Constant
    _folded_layout_0 is mutated in the forward method'). `detach_` (after every `torch.tensor` literal) changes no
    value."""
    for user in node.users:
        target = user.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        for index, argument in enumerate(target._schema.arguments):
            value = user.args[index] if index < len(user.args) else user.kwargs.get(argument.name)
            if value is not node or argument.alias_info is None:
                continue
            if argument.alias_info.is_write and target is not torch.ops.aten.detach_.default:
                return True
            if _written_in_place(user):  # the user's result aliases `node`: a write to it writes `node`
                return True
    return False


def _value(arg: Any, env: dict[fx.Node, Any]) -> Any:
    return fx.node.map_arg(arg, lambda n: env[n])


def fold_layout_constants(program: torch.export.ExportedProgram) -> int:
    """Fold what depends only on integer lifted constants; return the nodes folded (0: graph unchanged)."""
    graph = program.graph
    signature = program.graph_signature
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    env: dict[fx.Node, Any] = {}
    for spec in signature.input_specs:
        if spec.kind != InputKind.CONSTANT_TENSOR or not isinstance(spec.arg, TensorArgument):
            continue
        value = program.constants.get(spec.target)
        integral = isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())
        if integral and value.numel() <= LAYOUT_MAX_NUMEL:  # a layout literal, not a table of data
            env[placeholders[spec.arg.name]] = value
    if not env:
        return 0
    roots = set(env)
    rooted = set(roots)  # nodes computed from a layout constant (a literal-only `arange(3)` is not)
    folded: list[fx.Node] = []
    for node in graph.nodes:
        if node.op != "call_function" or not _foldable_target(node):
            continue
        inputs = node.all_input_nodes
        if not all(n in env for n in inputs) or _written_in_place(node):
            continue
        try:
            env[node] = node.target(*_value(node.args, env), **_value(node.kwargs, env))
        except Exception:  # an op that cannot run eagerly here: leave it (and what depends on it) in the graph
            continue
        if any(n in rooted for n in inputs):
            rooted.add(node)
            folded.append(node)
    if not folded:
        return 0
    # The frontier: folded values that an unfolded node (or the output) reads.
    done = set(folded)
    frontier = [n for n in folded if any(user not in done for user in n.users)]
    for node in frontier:
        value = env[node]
        tensor_ok = isinstance(value, torch.Tensor) and value.numel() <= _MAX_FOLDED_NUMEL
        if not (tensor_ok or isinstance(value, (int, float, bool))):
            return 0  # a list or an oversized tensor crosses into the graph: leave everything as it was
    first_user_input = next(
        (placeholders[s.arg.name] for s in signature.input_specs if s.kind == InputKind.USER_INPUT), None
    )
    for index, node in enumerate(frontier):
        value = env[node]
        if isinstance(value, torch.Tensor):
            name = f"_folded_layout_{index}"
            while name in program.constants or name in placeholders:
                name = "_" + name
            anchor = first_user_input or next(iter(graph.find_nodes(op="output")))
            with graph.inserting_before(anchor):
                replacement = graph.placeholder(name)
            replacement.meta["val"] = node.meta.get("val", value)
            program.constants[name] = value.clone()
            position = next(
                (i for i, s in enumerate(signature.input_specs) if s.kind == InputKind.USER_INPUT),
                len(signature.input_specs),
            )
            signature.input_specs.insert(
                position, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=name), target=name)
            )
            node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user not in done)
            # A folded value the program returns: its output spec names the node it replaced, and the verifier
            # (torch.export.save) refuses the program unless the spec follows ("User output ... is not in the
            # correct order"; gemma2/exaone4 sequence classifiers, whose sliding-window caches are outputs).
            for out_spec in signature.output_specs:
                if isinstance(out_spec.arg, TensorArgument) and out_spec.arg.name == node.name:
                    out_spec.arg = TensorArgument(name=replacement.name)
        else:
            # A Python number cannot be a graph output: a returned scalar keeps its node (and its inputs).
            for user in [u for u in node.users if u not in done and u.op != "output"]:
                user.args = fx.node.map_arg(user.args, lambda n, node=node, value=value: value if n is node else n)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda n, node=node, value=value: value if n is node else n)
    for node in reversed(list(graph.nodes)):
        if node in env and node not in roots and not node.users:
            graph.erase_node(node)
    for root in roots:
        if not root.users:
            spec = next(s for s in signature.input_specs if getattr(s.arg, "name", None) == root.name)
            signature.input_specs.remove(spec)
            program.constants.pop(spec.target, None)
            graph.erase_node(root)
    graph.lint()
    program.graph_module.recompile()
    return len(folded)


# -- examples --------------------------------------------------------------------------------------


class _GridTower(torch.nn.Module):
    """Qwen2-VL-style attention windows: per-frame patch counts from `grid_thw`, a softmax per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        bounds = torch.nn.functional.pad(frames.cumsum(0), (1, 0))
        lengths = bounds[1:] - bounds[:-1]
        hidden = self.proj(pixel_values)
        return torch.cat([chunk.softmax(0) for chunk in hidden.split(lengths.tolist())])


def _grid_tower() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    # A two-frame video and two images of odd, unequal grids.
    module = LayoutSpecialised(_GridTower().eval(), {"grid_thw": ([[2, 2, 3], [1, 3, 3], [1, 1, 5]], torch.int64)})
    return module, {"pixel_values": torch.randn(26, 6)}


class _FloatConstant(torch.nn.Module):
    """A float literal scaled by an input: nothing integer to fold."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([0.5, 2.0, 1.5])


def _float_constant() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _FloatConstant(), {"x": torch.randn(2, 3)}


fold_layout_constants = FxGraphRule(
    RuleMeta(
        id="fx/fold-layout-constants",
        why="a layout literal baked into a vision component (grid_thw, image_sizes) is a lifted constant; "
        "torch.onnx's re-trace (run_decompositions) turns lifted constants into plain fake buffers, so "
        "the grid computations traced statically become data-dependent again and translation fails "
        "('Could not guard on data-dependent expression Eq(u12, 0)', GLM-4V, VideoLLaMA3). On Dynamo, the "
        "`aten.item` nodes of `grid.tolist()` stay in the graph with specialised outputs, which torch.export.save "
        "writes and torch.export.load refuses ('Failed deserializing node ... aten.item.default': 'bool' object "
        "has no attribute 'as_name'; Qwen2-VL's forward). Folding them into constants with eager kernels is exact",
        upstream="torch==2.13.0 export/exported_program.py _decompose_and_get_gm_with_new_signature_constants "
        "(_register_constants_as_buffers); _export/serde/serialize.py deserialize_sym_int (item outputs)",
        # The lowerings that re-trace the program (torch.onnx, to_edge, OpenVINO's decompositions); and Dynamo,
        # whose .pt2 cannot hold the `aten.item` of a baked literal (see `why`).
        backends=("dynamo", "onnx", "executorch", "openvino"),
        models=("glm4v_moe", "glm46v", "video_llama_3", "qwen3_5_moe"),
        examples=(
            # The baked layout traces only with patch/fake-constant-layouts, as in every export of such a component.
            Match(
                _grid_tower,
                "per-frame windows of a baked video + 2-image grid",
                needs=("patch/fake-constant-layouts",),
            ),
            NoMatch(_float_constant, "a float literal (not a layout)"),
        ),
    ),
    program_transform=fold_layout_constants,
)
