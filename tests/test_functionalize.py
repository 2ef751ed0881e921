"""`functionalize_input_writes`: a program's direct writes into its inputs as mutation outputs, without a re-trace,
equal to what `run_decompositions({})` makes of them; writes of another form are left to the re-trace."""

from __future__ import annotations

import copy

import torch
from torch.export.graph_signature import OutputKind

from hfexport.frontends.functionalize import functionalize_input_writes


class _CacheWrite(torch.nn.Module):
    """A static cache's update: index_copy_ into the cache input, add_ into its length, the cache read after."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor, length: torch.Tensor, position: torch.Tensor) -> tuple:
        cache.index_copy_(1, position, x * 2)
        cache.index_copy_(1, position + 1, x)  # a second write to the same input: chained
        length.add_(x.shape[1])
        return cache.sum(-1) + length, cache


class _ViewWrite(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[:, :2] = x  # a write through a view: not the simple form
        return cache.sum()


def _inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 4, generator=generator)
    return x, torch.randn(2, 6, 4, generator=generator), torch.tensor([3]), torch.tensor([2])


def test_cache_writes_become_the_retrace_s_mutation_outputs() -> None:
    program = torch.export.export(_CacheWrite(), _inputs())
    expected = copy.deepcopy(program).run_decompositions({})
    fast = functionalize_input_writes(program)
    assert fast is not None
    assert not any(getattr(n.target, "_schema", None) and n.target._schema.is_mutable for n in fast.graph.nodes)
    mutations = [(s.kind, s.target) for s in fast.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    assert mutations == [
        (s.kind, s.target) for s in expected.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT
    ]
    assert [s.target for s in fast.graph_signature.output_specs][:2] == ["cache", "length"]
    # Run both: the same outputs, and the same values written into the caller's inputs.
    ours, theirs = _inputs(), _inputs()
    ours_out, theirs_out = fast.module()(*ours), expected.module()(*theirs)
    for a, b in zip([*ours_out, *ours], [*theirs_out, *theirs], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # And eager's: the module writes its inputs the same way.
    eager_inputs = _inputs()
    eager_out = _CacheWrite()(*eager_inputs)
    for a, b in zip([*ours_out, *ours], [*eager_out, *eager_inputs], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_write_through_a_view_is_left_to_the_retrace() -> None:
    generator = torch.Generator().manual_seed(0)
    program = torch.export.export(_ViewWrite(), (torch.randn(2, 2, generator=generator), torch.zeros(2, 4)))
    before = str(program.graph)
    assert functionalize_input_writes(program) is None
    assert str(program.graph) == before
