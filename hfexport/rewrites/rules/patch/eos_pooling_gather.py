"""BART-style sequence classification: the last EOS token's hidden state, pooled by boolean-mask indexing.

`BartForSequenceClassification.forward` (and its copies in mbart, plbart, mvp, bigbird_pegasus, t5, mt5, umt5)
pools with

    torch_compilable_check(torch.unique_consecutive(eos_mask.sum(1)).numel() == 1, "... same number of <eos> ...")
    selected = hidden_states[eos_mask, :]
    torch_compilable_check(selected.shape[0] // hidden_states.shape[0] >= 1, "... at least one <eos> token.")
    sentence_representation = selected.view(hidden_states.size(0), -1, hidden_states.size(-1))[:, -1, :]

Both `unique_consecutive(...)` and the mask selection have data-dependent sizes (unbacked symbols): the export
succeeds, but `torch.export.load` refuses the saved program ("expected no unbacked symbols, got 1: {u0}").

The rule rewrites exactly these two expressions in the class's own `forward` source (LibCST; everything else in
the forward, its decorators and its loss code included, is the original code compiled again in the original
module's namespace): the count check becomes "every row's count equals the first row's" (the same condition
as a single consecutive unique for a non-empty 1-D tensor), and the selection becomes one row per example, the
hidden state at its last EOS position, which `.view(B, -1, H)[:, -1, :]` then passes through unchanged.
Whenever the head's own checks hold (every row has the same number k >= 1 of EOS tokens), row b of the original
selection's view is row b's k EOS states in order, and its `[:, -1, :]` is the last one: the same values. The
selection is rewritten only where its result is used by that view-and-last-row and by size checks alone.
"""

from __future__ import annotations

import re
import types
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._source_rewrite import ForwardRewrite, rewrite_function

# The name the rewritten forward reaches this module's helpers by (added to a copy of the module's globals).
_HELPERS = "__hfexport_eos_pooling"
_AT_LEAST_ONE = "Each example must contain at least one <eos> token."


def same_count(counts: torch.Tensor) -> torch.Tensor:
    """`torch.unique_consecutive(counts).numel() == 1` as a boolean tensor without a data-dependent size:
    one consecutive unique value means a non-empty tensor whose elements all equal the first."""
    flat = counts.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=counts.device)
    return (flat == flat[:1]).all()


def last_true_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """For `x` [B, L, H] and a boolean `mask` [B, L]: `x[b, last True of mask[b]]` for every b, as [B, H].

    With the same number k >= 1 of True in every row, `x[mask, :].view(B, -1, H)[:, -1, :]` is this; the
    rewritten forward feeds it to the same `.view(B, -1, H)[:, -1, :]`, which leaves it as it is. A row without
    EOS fails here with the head's own message (the original's `selected.shape[0] // B >= 1` check, which now
    always passes, fails for such a batch too). Any other indexing keeps the original expression.
    """
    if x.dim() != 3 or mask.dtype != torch.bool or mask.dim() != 2 or mask.shape != x.shape[:2]:
        return x[mask, :]
    from transformers.utils.import_utils import torch_compilable_check

    torch_compilable_check(mask.any(dim=-1), _AT_LEAST_ONE)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # The last True position of each row; -1 (clamped to 0) only for a row without one, which the check refuses
    # eagerly and in the Dynamo program (ONNX keeps no assertion: such a row then reads position 0).
    last = torch.where(mask, positions, -1).amax(dim=-1).clamp_min(0)
    index = last.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
    # select, not squeeze: OpenVINO's CPU plugin refused the dynamic squeeze of this gather (shape {1} vs {2}).
    return torch.gather(x, 1, index).select(1, 0)


# -- the source rewrite --------------------------------------------------------------------------------------


def _matchers() -> dict[str, Any]:
    import libcst.matchers as m

    full = m.SubscriptElement(slice=m.Slice(lower=None, upper=None, step=None))
    minus_one = m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))
    # `X[mask, :]`: a selection of rows by a mask name.
    selection = m.Subscript(slice=[m.SubscriptElement(slice=m.Index(value=m.Name())), full])
    return {
        "selection": selection,
        # `torch.unique_consecutive(counts).numel() == 1`
        "count_check": m.Comparison(
            left=m.Call(
                func=m.Attribute(
                    value=m.Call(
                        func=m.Attribute(value=m.Name("torch"), attr=m.Name("unique_consecutive")), args=[m.Arg()]
                    ),
                    attr=m.Name("numel"),
                ),
                args=[],
            ),
            comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Integer("1"))],
        ),
        # `<sel>.view(a, -1, b)[:, -1, :]` for a given `<sel>` matcher
        "pool": lambda sel: m.Subscript(
            value=m.Call(func=m.Attribute(value=sel, attr=m.Name("view")), args=[m.Arg(), m.Arg(minus_one), m.Arg()]),
            slice=[full, m.SubscriptElement(slice=m.Index(value=minus_one)), full],
        ),
        # `<sel>.shape[...]` / `<sel>.size(...)`: a size, allowed beside the pooling
        "size": lambda sel: m.OneOf(
            m.Subscript(value=m.Attribute(value=sel, attr=m.Name("shape"))),
            m.Call(func=m.Attribute(value=sel, attr=m.Name("size"))),
        ),
    }


# The text the `pool` matcher needs: a subscript `[:, -1, :]` (spaces and comments aside).
_POOL_TEXT = re.compile(r"\[\s*:\s*,\s*-\s*1\s*,\s*:\s*\]")


def pooled_selections(function: Any) -> list[Any]:
    """The `X[mask, :]` nodes of a LibCST `FunctionDef` whose every use is the last-row pooling
    `.view(a, -1, b)[:, -1, :]` (inline, or through one local name that is otherwise only asked for its size)."""
    import libcst as cst
    import libcst.matchers as m

    match = _matchers()
    found = []
    inline = m.findall(function, match["pool"](match["selection"]))
    found += [node.value.func.value for node in inline]  # type: ignore[attr-defined]
    for assign in m.findall(function, m.Assign(targets=[m.AssignTarget(target=m.Name())], value=match["selection"])):
        name = assign.targets[0].target.value  # type: ignore[attr-defined]
        uses = len(m.findall(function, m.Name(name)))
        pooled = len(m.findall(function, match["pool"](m.Name(name))))
        sized = len(m.findall(function, match["size"](m.Name(name))))
        assigned = len(m.findall(function, m.AssignTarget(target=m.Name(name))))
        if assigned == 1 and pooled >= 1 and uses == 1 + pooled + sized:
            found.append(assign.value)
    return [node for node in found if isinstance(node, cst.Subscript)]


def _replacements(function: Any) -> dict[Any, Any]:
    import libcst as cst
    import libcst.matchers as m

    selections = pooled_selections(function)
    if not selections:
        return {}

    def helper(name: str, *args: cst.BaseExpression) -> cst.Call:
        func = cst.Attribute(value=cst.Name(_HELPERS), attr=cst.Name(name))
        return cst.Call(func=func, args=[cst.Arg(a) for a in args])

    replacements: dict[cst.CSTNode, cst.CSTNode] = {}
    for node in selections:
        replacements[node] = helper("last_true_rows", node.value, node.slice[0].slice.value)
    for node in m.findall(function, _matchers()["count_check"]):
        replacements[node] = helper("same_count", node.left.func.value.args[0].value)  # type: ignore[attr-defined]
    return replacements


def rewrite_source(source: str) -> str | None:
    """`source` (one function definition, decorators included) with the EOS pooling rewritten, or None where it
    has none (or where the rewritten function could not be compiled as a plain function: a zero-argument
    `super()` or a closure would need the class body)."""
    return rewrite_function(source, _replacements)


_FORWARD = ForwardRewrite(
    "patch/eos-pooling-gather",
    rewrite_source,
    # Cheap necessary condition of the pooling pattern (`.view(...)[:, -1, :]`) before parsing with LibCST (about
    # 0.2 s a forward, and most forwards have a `.view` and a subscript).
    accept=lambda source: ".view(" in source and _POOL_TEXT.search(source) is not None,
    helpers=(_HELPERS, types.SimpleNamespace(same_count=same_count, last_true_rows=last_true_rows)),
)


def pools_eos_rows(module: torch.nn.Module) -> bool:
    """A module whose class defines a `forward` that pools `X[mask, :].view(B, -1, H)[:, -1, :]`."""
    return _FORWARD.of(module) is not None


# What `hfexport scan` (hfexport.apps.scan_rules.RuleIndex) reads off the predicate: the site kind it fixes, and
# `covers`.
pools_eos_rows.scan_kind = "mask-row-pooling"  # type: ignore[attr-defined]
pools_eos_rows.covers = _FORWARD.covers  # type: ignore[attr-defined]


# -- examples --------------------------------------------------------------------------------------------------


def _bart_like(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    small = {"vocab_size": 64, "eos_token_id": 2, "pad_token_id": 1, "bos_token_id": 0}
    if kind == "t5":
        t5 = {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "decoder_start_token_id": 0}
        config = transformers.T5Config(**t5, **small)
        return transformers.T5ForSequenceClassification(config).eval()
    config_class, model_class = {
        "bart": (transformers.BartConfig, transformers.BartForSequenceClassification),
        "mbart": (transformers.MBartConfig, transformers.MBartForSequenceClassification),
    }[kind]
    layers = {"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2}
    config = config_class(d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, **layers, **small)
    return model_class(config).eval()


def _ids(rows: list[list[int]]) -> dict[str, Any]:
    ids = torch.tensor(rows)
    # No cache: the classifier's logits are the point (and eager's cache object is not a tree of tensors).
    return {"input_ids": ids, "attention_mask": (ids != 1).long(), "use_cache": False}


def _classifier(kind: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    # Two EOS (2) per row at different positions, and a left-padded row (pad 1, masked).
    return _bart_like(kind), _ids([[5, 6, 2, 7, 2, 9], [1, 1, 8, 2, 2, 3]])


def _other_inputs() -> dict[str, Any]:
    # Another batch and length, one EOS per row (a different count than the sample's).
    return _ids([[5, 2, 7, 8, 9, 10, 11, 3], [9, 9, 9, 9, 9, 9, 9, 2], [2, 4, 4, 4, 4, 4, 4, 4]])


class _EncoderOnly(torch.nn.Module):
    """A model that holds a BART sequence classifier but runs only its encoder (e.g. to embed the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = _bart_like("bart")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool) -> torch.Tensor:
        encoder = self.classifier.model.get_encoder()
        return encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


eos_pooling_gather = MethodPatch(
    RuleMeta(
        id="patch/eos-pooling-gather",
        why="BART-style *ForSequenceClassification heads pool `hidden_states[eos_mask, :].view(B, -1, H)[:, -1, :]` "
        "after checking `torch.unique_consecutive(eos_mask.sum(1)).numel() == 1`: both sizes are data-dependent, "
        "so the saved Dynamo program does not load ('expected no unbacked symbols, got 1: {u0}') and ExecuTorch's "
        "to_edge refuses aten.unique_consecutive (not core ATen); the rewritten forward gathers each row's last "
        "EOS position and checks the counts without a data-dependent size",
        upstream="transformers==5.24.0 models/bart/modeling_bart.py BartForSequenceClassification.forward (copied "
        "to mbart, plbart, mvp, bigbird_pegasus, t5, mt5, umt5: the classes `hfexport scan` lists as "
        "eos-mask-pooling sites)",
        # ONNX and OpenVINO run the data-dependent selection (NonZero) and the unique count as they are: the
        # rule's first example matches eager there without the rule (measured 2026-12-02), so it is not enabled.
        backends=("dynamo", "executorch"),
        scan=(
            ScanCause(
                "eos-mask-pooling",
                "mask-row-pooling",
                ".*",
                "BART-style classifiers pool `hidden[eos_mask, :].view(B, -1, H)[:, -1, :]`: a data-dependent row "
                "count",
            ),
        ),
        models=("bart", "mbart", "plbart", "mvp", "bigbird_pegasus", "t5", "mt5", "umt5"),
        examples=(
            Match(
                lambda: _classifier("bart"),
                "BART classifier, two EOS per row and a left-padded row; then batch 3, length 8, one EOS per row",
                other_inputs=_other_inputs,
                needs=("executorch/is-all-true-as-any",),
            ),
            Match(
                lambda: _classifier("t5"),
                "T5 classifier (the pooling through a local `selected`), two EOS per row",
                other_inputs=_other_inputs,
                needs=("executorch/is-all-true-as-any",),
            ),
            NoMatch(
                lambda: (_EncoderOnly().eval(), _ids([[5, 6, 2, 7, 2, 9], [1, 1, 8, 2, 2, 3]])),
                "a model holding a BART classifier that runs only its encoder",
                reason="the patch is installed on the classifier, but its forward (the pooling) is never called",
            ),
        ),
    ),
    target=pools_eos_rows,
    method="forward",
    replacement=_FORWARD.replacement,
)
