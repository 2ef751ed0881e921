"""A parameter that several nodes read (tied embeddings) gets one placeholder per reader (stage `fx`; opt-in,
switched on by `NNCFTorchFXQuantizer` with `NNCFQuantizationConfig`).

A tied head (`lm_head.weight` is `embed_tokens.weight`: Llama-3.2, SmolLM2, Qwen3 small, Gemma) is one parameter
placeholder in the captured program, read by the embedding and by the head's `linear`; `program.module()` turns it
into one `get_attr` node with both as users. `nncf.quantize` on that graph (nncf 3.4, Torch FX) changes a weight
through `constant_update(node, value, port)`, which puts the new constant in place of the old one with
`old_const.replace_all_uses_with(new_const)`: every reader of the weight gets the value meant for one of them.
Each weight NNCF changes goes through it (SmoothQuant's rescaled weights, the int8 weights folded after
quantization by `compress_post_quantize_transformation`), so the head's int8 weight becomes the embedding's table
and the program no longer traces: "Tensor dtype mismatch! Expected: torch.float32, Got: torch.int8" at the
`_assert_tensor_metadata` after a Llama's embedding.

The rule gives every reader after the first a placeholder of its own for the same parameter (the same target in
the program's signature, so no tensor is copied and the values are those of the original): `program.module()` then
has one `get_attr` node per reader and NNCF's update of one reaches only that one. Opt-in, because a backend
that compiles the program itself gains nothing from it; a quantizer that changes one reader's weight needs it.
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import FxGraphRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._tied_head import TiedHead, UntiedHead, token_ids


def _untie(program: torch.export.ExportedProgram) -> int:
    """One placeholder per reader of each parameter that several nodes read; return the placeholders added."""
    graph = program.graph
    signature = program.graph_signature
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    added = 0
    for spec in list(signature.input_specs):
        if spec.kind != InputKind.PARAMETER or not isinstance(spec.arg, TensorArgument):
            continue
        node = placeholders[spec.arg.name]
        # A parameter the program returns keeps its placeholder there: the output spec names that node.
        readers = [user for user in node.users if user.op != "output"]
        for reader in readers[1:]:
            name = f"{node.name}_reader_{added}"
            while name in placeholders:
                name = "_" + name
            with graph.inserting_after(node):
                copy = graph.placeholder(name)
            copy.meta = dict(node.meta)
            placeholders[name] = copy
            reader.replace_input_with(node, copy)
            position = signature.input_specs.index(spec) + 1
            signature.input_specs.insert(
                position, InputSpec(InputKind.PARAMETER, TensorArgument(name=name), target=spec.target)
            )
            added += 1
    if added:
        graph.lint()
        program.graph_module.recompile()
    return added


# -- examples --------------------------------------------------------------------------------------------------------


untie_shared_weights = FxGraphRule(
    RuleMeta(
        id="fx/untie-shared-weights",
        why="NNCFTorchFXQuantizer int8 (nncf.quantize) failed on tied embeddings with 'Tensor dtype mismatch! "
        "Expected: torch.float32, Got: torch.int8': NNCF replaces a weight for all of its readers, so the "
        "head's int8 weight became the embedding's table",
        upstream="nncf==3.4.0 nncf/experimental/torch/fx/transformations.py constant_update "
        "(old_const.replace_all_uses_with(new_const) updates every reader of a shared get_attr); no NNCF issue "
        "found for 'constant_update shared weight' in openvinotoolkit/nncf",
        backends=("dynamo", "onnx", "openvino", "executorch"),
        needed="tests/rewrites/test_quant_rules.py shows it: without the rule nncf.quantize's graph of a tied head "
        "does not trace; without a quantizer nothing needs it",
        models=("llama", "qwen3", "nncf-torch-fx"),
        kind="fix",
        enabled_by_default=False,
        examples=(
            Match(
                lambda: (TiedHead(64), token_ids(64)),
                "a tied output projection (the embedding's weight, 64 x 16): a placeholder of its own",
            ),
            NoMatch(
                lambda: (UntiedHead(64), token_ids(64)),
                "a head with its own weight",
                reason="every parameter has one reader",
            ),
        ),
    ),
    program_transform=_untie,
)
