"""`math.ceil` of a size ratio becomes integer ceiling division, so the Dynamo program can be saved.

NLLB-MoE sizes its expert capacity as `math.ceil(fraction * nb_tokens)` (eval) or `2 * math.ceil(nb_tokens /
num_experts)`; with a dynamic length torch.export keeps a `math.ceil` node on a `SymFloat`. torch.export's
serializer writes only the symbolic operators of its `_SYM_OPS` table (add, sub, mul, floordiv, mod, neg,
sym_float, truediv, trunc, ...), not `math.ceil`, so `torch.export.save` fails ("Failed serializing node ceil").

The ceiling is rewritten in integers, `-((-n * p) // q)`, with the operands and exactness bounds of
`openvino/sym-ceil-to-int` (shared code: `openvino/_symbolic`): equal to Python's float ceiling for every size
below 2**53 / p; a fraction with a numerator above 2**21 is declined (the node stays and the save still fails).
Only the Dynamo backend: torch.onnx translates `math.ceil` (and its `operator.floordiv` truncates a negative
dividend, onnxscript torch_lib `operator_floordiv`), ExecuTorch has a `ceil.Scalar` prim op, and OpenVINO has
its own rule.
"""

from __future__ import annotations

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._symbolic import (
    CAPACITY_EXAMPLES,
    BlocksOfLength,
    ceil_to_int,
    ceil_to_rewrite,
    torch,
)

sym_ceil_to_int = NodeRule(
    RuleMeta(
        id="fx/sym-ceil-to-int",
        why="torch.export.save refuses a math.ceil node on a symbolic size ('Failed serializing node ceil in "
        "graph: %ceil ...', AssertionError 'op <built-in function ceil> is not in _SYM_OPS'): a dynamic Dynamo "
        "export of NLLB-MoE (expert capacity ceil(fraction * tokens), seq2seq/nllb-moe) cannot be saved. The "
        "ceiling is rewritten in integers, -((-n * p) // q), equal to Python's float ceiling for every size below "
        "2**53 / p; a fraction with a numerator above 2**21 is declined",
        upstream="torch==2.13.0 _export/serde/serialize.py _SYM_OPS (math.trunc, operator.floordiv, "
        "torch.sym_float... but no math.ceil; serialize_sym_op_inputs asserts the op is in it)",
        backends=("dynamo",),
        needed="the need is saving: tests/rewrites/test_fx_sym_ceil_to_int.py shows torch.export.save refusing "
        "each Match example without the rule (the harness runs a Dynamo program in memory, unsaved)",
        models=("nllb-moe",),
        examples=(
            *CAPACITY_EXAMPLES,
            Match(
                lambda: (BlocksOfLength(), {"x": torch.randn(2, 7, 3)}),
                "ceil(L / 4) blocks for a length of 7; then 12 (a multiple) and batch 3",
                other_inputs=lambda: {"x": torch.randn(3, 12, 3)},
            ),
            NoMatch(dense_decoder, "a Llama forward (no ceiling of sizes)"),
        ),
    ),
    predicate=ceil_to_rewrite,
    rewrite=ceil_to_int,
)
