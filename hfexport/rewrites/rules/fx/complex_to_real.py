"""Complex-valued tensors -> real pairs, for ONNX (no complex type), OpenVINO (no `aten.polar` conversion) and
ExecuTorch (`to_edge` has no lowering for `view_as_complex_copy`).

DeepSeek-V2 (and Llama 4) apply rotary embeddings with complex arithmetic: `torch.polar(ones, freqs)`,
`view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`, `view_as_real(...)`. torch.onnx has no complex
translation for most ops (deepseek_v2 stops at "No ONNX function found for aten.unsqueeze ... No
decompositions registered for the complex-valued input"), and `custom_translation_table` registers
functions as real-only, so the translation stage cannot help.

The rule rewrites the graph so that every complex tensor `z` of shape S is held as a real tensor of shape
S + [2] (`view_as_real(z)`): `view_as_complex` and `view_as_real` become no-ops, `polar(r, t)` is
`stack(r cos t, r sin t)`, a complex product is `(ac - bd, ad + bc)`, a product with a real tensor
multiplies both parts, `unsqueeze` shifts negative axes past the pair axis and `slice` (Llama 4's
`freqs_cis[:, ...]`) keeps its axis, counted from the front. All or nothing: if any node touching a
complex value is outside that set, the graph is left unchanged (the export then fails as
before, with torch.onnx's message).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import FxGraphRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._coverage_gaps import XNNPACK_RESHAPE

aten = torch.ops.aten

# Complex-touching ops the rule can lower; a graph with any other complex op is left alone.
_PASS_THROUGH = {aten.view_as_complex.default, aten.to.dtype_layout, aten._to_copy.default, aten.to.dtype}
_SUPPORTED = {
    aten.polar.default,
    aten.view_as_real.default,
    aten.mul.Tensor,
    aten.unsqueeze.default,
    aten.slice.Tensor,
    aten._assert_tensor_metadata.default,
    *_PASS_THROUGH,
}


def _is_complex(value: Any) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_complex()


def _touches_complex(node: fx.Node) -> bool:
    return _is_complex(node) or any(_is_complex(arg) for arg in node.all_input_nodes)


def _lower_complex(gm: fx.GraphModule) -> int:
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and _touches_complex(n)]
    if not nodes or any(n.target not in _SUPPORTED for n in nodes):
        return 0
    if any(n.op != "call_function" and _is_complex(n) for n in graph.nodes):
        return 0  # a complex graph input or output: the signature would change

    real: dict[fx.Node, fx.Node] = {}
    call = graph.call_function

    def parts(value: fx.Node) -> tuple[fx.Node, fx.Node]:
        pair = real[value]
        return call(aten.select.int, (pair, -1, 0)), call(aten.select.int, (pair, -1, 1))

    def pair(re: fx.Node, im: fx.Node) -> fx.Node:
        return call(aten.stack.default, ([re, im], -1))

    for node in nodes:
        target, args = node.target, node.args
        with graph.inserting_before(node):
            if target is aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                continue
            if target is aten.view_as_real.default:
                node.replace_all_uses_with(real[args[0]])
                graph.erase_node(node)
                continue
            if target is aten.view_as_complex.default:
                real[node] = args[0]
            elif target in _PASS_THROUGH:
                real[node] = real[args[0]]  # a device/layout move of a complex value on the same device
            elif target is aten.polar.default:
                magnitude, angle = args
                re = call(aten.mul.Tensor, (magnitude, call(aten.cos.default, (angle,))))
                im = call(aten.mul.Tensor, (magnitude, call(aten.sin.default, (angle,))))
                real[node] = pair(re, im)
            elif target is aten.unsqueeze.default:
                value, dim = args
                rank = value.meta["val"].dim()
                # A negative axis counts from the end of the complex shape, i.e. before the pair axis.
                real[node] = call(aten.unsqueeze.default, (real[value], dim if dim >= 0 else dim + rank + 1))
            elif target is aten.slice.Tensor:
                value, *rest = args
                dim = rest[0] if rest else node.kwargs.get("dim", 0)
                rank = value.meta["val"].dim()
                # The same axis of the complex shape, counted from the front (the pair axis is last).
                real[node] = call(aten.slice.Tensor, (real[value], dim % rank, *rest[1:]), dict(node.kwargs))
            else:  # aten.mul.Tensor
                a, b = args
                if _is_complex(a) and _is_complex(b):
                    (ar, ai), (br, bi) = parts(a), parts(b)
                    re = call(aten.sub.Tensor, (call(aten.mul.Tensor, (ar, br)), call(aten.mul.Tensor, (ai, bi))))
                    im = call(aten.add.Tensor, (call(aten.mul.Tensor, (ar, bi)), call(aten.mul.Tensor, (ai, br))))
                    real[node] = pair(re, im)
                else:
                    z, r = (a, b) if _is_complex(a) else (b, a)
                    if isinstance(r, fx.Node):
                        r = call(aten.unsqueeze.default, (r, -1))  # the same factor for both parts
                    real[node] = call(aten.mul.Tensor, (real[z], r))
    for node in reversed(nodes):
        if node.graph is graph and node in real:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return len(nodes)


# -- examples --------------------------------------------------------------------------------------


class _ComplexRotary(torch.nn.Module):
    """DeepSeek-V2's rotary: polar frequencies (scaled), complex product, back to real."""

    def __init__(self, dim: int = 8, scaling: float = 0.5) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.scaling = scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * self.scaling
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(x_ * freqs_cis.unsqueeze(1)).flatten(3)
        return out.type_as(x)


class _SlicedRotary(_ComplexRotary):
    """Llama 4's rotary: complex frequencies sliced (`freqs_cis[:, 1:]`) before the product."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)[:, 1:]
        x_ = torch.view_as_complex(x[:, :, 1:].float().reshape(*x.shape[:2], -1, x.shape[-1] // 2, 2))
        out = torch.view_as_real(x_ * freqs_cis.unsqueeze(1)).flatten(3)
        return out.type_as(x)


class _ComplexExp(torch.nn.Module):
    """`exp` of a complex tensor: not an op the rule lowers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(torch.exp(z)).flatten(-2)


class _Real(torch.nn.Module):
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return x * position_ids[:, None, :, None].float()


def _rotary_inputs(batch: int = 2, seq: int = 5) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(batch, 3, seq, 8, generator=generator),
        "position_ids": torch.arange(40, 40 + seq).repeat(batch, 1),
    }


def _rotary() -> Any:
    return _ComplexRotary(), _rotary_inputs()


def _rotary_other() -> dict[str, Any]:
    return _rotary_inputs(batch=3, seq=9)


def _exp() -> Any:
    return _ComplexExp(), {"x": torch.randn(2, 6, generator=torch.Generator().manual_seed(0))}


def _real() -> Any:
    return _Real(), _rotary_inputs()


complex_to_real = FxGraphRule(
    meta=RuleMeta(
        id="fx/complex-to-real",
        why="ONNX has no complex type and OpenVINO no aten.polar: complex rotary embeddings (polar, "
        "view_as_complex, complex mul) fail to translate ('No decompositions registered for the complex-valued "
        "input'; OpenVINO: no translator for aten.polar; to_edge: view_as_complex_copy)",
        upstream="https://github.com/pytorch/pytorch/issues/86746 (torch.onnx cannot trace complex types; also "
        "pytorch/pytorch#126972); OpenVINO has no aten.polar translator, to_edge no view_as_complex_copy",
        backends=("onnx", "openvino", "executorch"),
        models=("deepseek_v2", "llama4", "llama4_text"),
        examples=(
            Match(
                _rotary,
                "polar * scale, complex product, [2, 3, 5, 8], and [3, 3, 9, 8]",
                other_inputs=_rotary_other,
                known_failure={"executorch": XNNPACK_RESHAPE},
            ),
            Match(
                lambda: (_SlicedRotary(), _rotary_inputs()),
                "complex frequencies sliced [:, 1:]; then other sizes",
                other_inputs=_rotary_other,
                known_failure={"executorch": XNNPACK_RESHAPE},
            ),
            NoMatch(_exp, "complex exp: not lowered, the graph is left as it was"),
            NoMatch(_real, "no complex values"),
        ),
    ),
    transform=_lower_complex,
)
