"""An experts forward that loops over `nonzero()` of the experts hit: the same body, over every expert.

transformers' eager experts loop

    expert_mask = one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]                # or `.item()`, `int(x.item())`
        ...                                       # this expert's rows: torch.where(expert_mask[expert_idx])

iterates a tensor whose length is the number of experts that received a token: data-dependent, so the trace
fails ("Could not guard on data-dependent expression Eq(u0, 0)" in unbind). Classes with transformers'
`use_experts_implementation` dispatch run a batched function under export instead, but a class without it
(DbrxExperts, Step3p7Experts in transformers 5.24.0) runs this loop; with the corpus's 4 experts and 16 routed
tokens every expert happened to be hit in eager, with 48 experts (`dbrx@many-experts`) most are not.

The rule rewrites the class's own forward source (LibCST; everything else is the original code, compiled again
in its module): the loop runs over `range(self.num_experts)` (unrolled by the trace) with the per-row
conversion dropped, the `expert_hit` assignment becomes None, and a `if <rows>.numel() == 0: continue` skip at the
top of the loop body goes (an expert without rows adds nothing). An expert that received no token then selects
no rows and adds an empty block; the others run in the same ascending order with the same operations as eager,
so the sums are bit-identical. The sentinel row `num_experts` (`num_classes=self.num_experts + 1`) is never
visited, as eager skips it.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules._moe_batched import dispatches_experts
from hfexport.rewrites.rules.patch._source_rewrite import ForwardRewrite, rewrite_function


def _matchers() -> dict[str, Any]:
    import libcst.matchers as m

    nonzero = m.Call(func=m.Attribute(attr=m.Name("nonzero")))
    # `x.nonzero()`, optionally followed by `.squeeze(-1)` / `.view(-1)` / `.reshape(-1)`.
    flat = m.Call(func=m.Attribute(value=nonzero, attr=m.Name("squeeze") | m.Name("view") | m.Name("reshape")))
    return {"hit": nonzero | flat}


def _row_index(statement: Any, loop_var: str) -> str | None:
    """`X = v[0]` / `X = v.item()` / `X = int(v.item())` over the loop variable `v`: the name X, else None."""
    import libcst as cst
    import libcst.matchers as m

    if not m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])):
        return None
    assign = statement.body[0]
    value = assign.value
    var = m.Name(loop_var)
    first = m.Subscript(value=var, slice=[m.SubscriptElement(slice=m.Index(value=m.Integer("0")))])
    item = m.Call(func=m.Attribute(value=var, attr=m.Name("item")), args=[])
    if m.matches(value, first | item | m.Call(func=m.Name("int"), args=[m.Arg(value=item)])):
        target = assign.targets[0].target
        return target.value if isinstance(target, cst.Name) else None
    return None


def _empty_skip(statement: Any) -> bool:
    """`if <rows>.numel() == 0: continue` (no else): the data-dependent skip of an expert without rows."""
    import libcst.matchers as m

    numel = m.Call(func=m.Attribute(attr=m.Name("numel")), args=[])
    test = m.Comparison(left=numel, comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("0"))])
    body = m.IndentedBlock(body=[m.SimpleStatementLine(body=[m.Continue()])])
    return m.matches(statement, m.If(test=test, body=body, orelse=None))


def _replacements(function: Any) -> dict[Any, Any]:
    import libcst as cst
    import libcst.matchers as m

    if not m.findall(function, m.Attribute(value=m.Name("self"), attr=m.Name("num_experts"))):
        return {}
    hits = {
        assign.targets[0].target.value: assign
        for assign in m.findall(function, m.Assign(targets=[m.AssignTarget(target=m.Name())]))
        if m.matches(assign.value, _matchers()["hit"])
    }
    bound = cst.Call(
        func=cst.Name("range"), args=[cst.Arg(cst.Attribute(value=cst.Name("self"), attr=cst.Name("num_experts")))]
    )
    replacements: dict[cst.CSTNode, cst.CSTNode] = {}
    for loop in m.findall(function, m.For(target=m.Name(), iter=m.Name())):
        name = loop.iter.value
        # The hit tensor is used by this loop only (its assignment and the iteration).
        if name not in hits or len(m.findall(function, m.Name(name))) != 2 or not loop.body.body:
            continue
        index = _row_index(loop.body.body[0], loop.target.value)
        if index is None:
            continue
        body = loop.body.with_changes(body=[s for s in loop.body.body[1:] if not _empty_skip(s)])
        replacements[loop] = loop.with_changes(target=cst.Name(index), iter=bound, body=body)
        replacements[hits[name]] = hits[name].with_changes(value=cst.Name("None"))
    return replacements


def rewrite_source(source: str) -> str | None:
    """`source` (one method, decorators included) with its loops over `nonzero()` of the experts hit running over
    `range(self.num_experts)`, or None where it has no such loop."""
    return rewrite_function(source, _replacements)


_FORWARD = ForwardRewrite(
    "patch/experts-hit-loop-every-expert",
    rewrite_source,
    accept=lambda source: "nonzero(" in source and "self.num_experts" in source,
)


def loops_over_experts_hit(module: torch.nn.Module) -> bool:
    """An experts module without transformers' experts dispatch whose class's forward loops over `nonzero()` of
    the experts hit (see the module docstring), with an integer `num_experts`."""
    if not isinstance(getattr(module, "num_experts", None), int) or dispatches_experts(module):
        return False
    return _FORWARD.of(module) is not None


# What `hfexport scan` reads off the predicate: the site kind it fixes, and `covers`.
loops_over_experts_hit.scan_kind = "loop-over-nonzero"  # type: ignore[attr-defined]
loops_over_experts_hit.covers = _FORWARD.covers  # type: ignore[attr-defined]


# -- examples --------------------------------------------------------------------------------------------------


def _dbrx(experts: int, top_k: int, tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from hfexport.rewrites.example_models import tiny_model

    ffn = {"ffn_hidden_size": 16, "moe_num_experts": experts, "moe_top_k": top_k}
    return tiny_model(
        "DbrxConfig",
        "DbrxForCausalLM",
        tokens=tokens,
        vocab_size=64,
        d_model=16,  # DbrxConfig's own names (hidden_size & co. are read-only aliases of them)
        n_layers=1,
        n_heads=2,
        max_seq_len=256,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000, "clip_qkv": 8},
        ffn_config=ffn,
    )


def _tokens(tokens: int, batch: int) -> dict[str, Any]:
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    return {"input_ids": ids, "use_cache": False}


class _EmbeddingsOnly(torch.nn.Module):
    """A model that holds a DBRX causal LM but runs only its token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _dbrx(16, 2, 4)[0]

    def forward(self, input_ids: torch.Tensor, use_cache: bool) -> torch.Tensor:
        return self.lm.transformer.wte(input_ids)


experts_hit_loop_every_expert = MethodPatch(
    RuleMeta(
        id="patch/experts-hit-loop-every-expert",
        why="An experts forward without transformers' experts dispatch (DbrxExperts, Step3p7Experts) loops over "
        "`nonzero()` of the experts that received a token: a data-dependent count the trace cannot iterate ('Could "
        "not guard on data-dependent expression Eq(u0, 0)'), met as soon as an expert gets no token (48 experts "
        "for 16 tokens x top-4: dbrx@many-experts); the rewritten forward runs the same body over every expert "
        "(an expert without tokens adds an empty block): bit-identical to eager",
        upstream="transformers==5.24.0 models/dbrx/modeling_dbrx.py DbrxExperts.forward (`for expert_idx in "
        "expert_hit`, the eager experts loop; the classes `hfexport scan` lists as loop-over-nonzero sites)",
        # ExecuTorch runs the rewritten loop's `torch.where` columns with another dim order (slice_copy 0x12) and
        # OpenVINO does not convert its `index_add`: DBRX there needs a batched-experts rule of its own.
        backends=("dynamo", "onnx"),
        scan=(
            ScanCause(
                "experts-hit-loop",
                "loop-over-nonzero",
                "forward",
                "an experts forward without the experts dispatch loops over `nonzero()` of the experts hit: a "
                "data-dependent count (Eq(u0, 0)) as soon as an expert gets no token",
            ),
        ),
        models=("dbrx", "step3p7"),
        examples=(
            Match(
                lambda: _dbrx(48, 4, 4),
                "DBRX, 48 experts, top-4 of 2 x 4 tokens: most experts get no token; then 11 tokens, a batch of 3",
                other_inputs=lambda: _tokens(11, 3),
            ),
            Match(lambda: _dbrx(4, 2, 8), "DBRX, 4 experts, top-2 of 2 x 8 tokens (the corpus's config)"),
            NoMatch(
                lambda: (_EmbeddingsOnly().eval(), _tokens(4, 2)),
                "a model holding a DBRX causal LM that runs only its token embeddings",
                reason="the patch is installed on the DBRX experts, but their forward is never called",
            ),
        ),
    ),
    target=loops_over_experts_hit,
    method="forward",
    replacement=_FORWARD.replacement,
)
