"""`scalar - integer_tensor` (aten.rsub.Scalar that promotes) becomes a subtraction of two tensors.

ProphetNet builds its additive mask as `(1.0 - attention_mask[:, None, None, :]) * finfo.min` with an int64
`attention_mask`: torch.export records `aten.rsub.Scalar(mask, 1.0)` with a float output. torch.onnx's
decomposition (step 2/3) turns it into `aten.sub.Tensor(1.0, convert_element_type(mask))` (torch._refs.rsub:
the scalar first) and then fails re-running that node, whose first argument must be a tensor ("Expected a
value of type 'complex' for argument 'b' but instead found type 'FakeTensor'").

The rule writes `s - x` as `aten.sub.Tensor(scalar_tensor(s, dtype=out), x)` with `out` the node's own result
dtype: a 0-d tensor of the result dtype promotes with `x` to that same dtype (a 0-d operand never wins over a
dimensioned one of its category, and an integer `x` against a float 0-d tensor gives that float), and the scalar
is rounded to that dtype as eager's kernel does, so the values are exactly eager's. Only `alpha == 1` and an
`x` whose dtype differs from the result (the promoting case that breaks) are matched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten


def _val(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, fx.Node) else None


def _promoting_rsub(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.rsub.Scalar or len(node.args) < 2:
        return False
    alpha = node.args[2] if len(node.args) > 2 else node.kwargs.get("alpha", 1)
    source, out = _val(node.args[0]), _val(node)
    if not (isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return alpha == 1 and isinstance(node.args[1], (int, float, bool)) and source.dtype != out.dtype


def _as_tensor_sub(gm: fx.GraphModule, node: fx.Node) -> None:
    source, scalar = node.args[0], node.args[1]
    out = _val(node)
    with gm.graph.inserting_before(node):
        constant = gm.graph.call_function(
            aten.scalar_tensor.default, (scalar,), {"dtype": out.dtype, "device": out.device}
        )
        constant.meta["val"] = torch.empty((), dtype=out.dtype, device=out.device)
        replacement = gm.graph.call_function(aten.sub.Tensor, (constant, source))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


class _PaddingMask(torch.nn.Module):
    """ProphetNet-style: an additive mask from an int64 attention mask, `(1.0 - mask) * finfo.min`."""

    def forward(self, scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        additive = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(scores.dtype).min
        return torch.softmax(scores + additive, dim=-1)


class _FloatMask(torch.nn.Module):
    """The same with a float mask: rsub keeps the dtype and torch.onnx translates it as it is."""

    def forward(self, scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        additive = (1.0 - attention_mask[:, None, None, :]) * torch.finfo(scores.dtype).min
        return torch.softmax(scores + additive, dim=-1)


class _IntScalar(torch.nn.Module):
    """`0.5 - mask` on an int64 mask (a fractional scalar: the result is not an integer), scaling the scores."""

    def forward(self, scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (0.5 - attention_mask)[:, None, None, :] * scores


def _mask(batch: int = 2, length: int = 5, seed: int = 0, dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=dtype)
    mask[-1, :2] = 0  # a left-padded sequence
    return {"scores": torch.randn(batch, 2, length, length, generator=generator), "attention_mask": mask}


rsub_promoted_scalar = NodeRule(
    RuleMeta(
        id="fx/rsub-promoted-scalar",
        why="ProphetNet's `(1.0 - attention_mask) * finfo.min` on an int64 mask is aten.rsub.Scalar with a float "
        "result; torch.onnx's decomposition (step 2/3) rewrites it to aten.sub.Tensor(1.0, convert_element_type"
        "(mask)) and fails re-running it ('Expected a value of type 'complex' for argument 'b' but instead found "
        "type 'FakeTensor'', causal_lm/prophetnet)",
        upstream="torch==2.13.0 _refs/__init__.py rsub (decomposes to sub(scalar, tensor)), run by "
        "torch/onnx/_internal/exporter/_decomp.py's decomposition table",
        backends=("onnx",),
        models=("prophetnet",),
        examples=(
            Match(
                lambda: (_PaddingMask(), _mask()),
                "int64 padding mask, odd length, one padded row; then other sizes",
                other_inputs=lambda: _mask(batch=3, length=9, seed=1),
            ),
            Match(lambda: (_IntScalar(), _mask(length=7, seed=2)), "0.5 - int64 mask times scores"),
            NoMatch(lambda: (_FloatMask(), _mask(dtype=torch.float32)), "a float mask: rsub keeps its dtype"),
        ),
    ),
    predicate=_promoting_rsub,
    rewrite=_as_tensor_sub,
)
