"""The rule engine: metadata validation, registration, selection, exact hit counts, reversible patches."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from hfexport.rewrites import engine
from hfexport.rewrites.declines import Declined
from hfexport.rewrites.engine import RewriteContext, RuleRegistry
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.kinds.patch import (
    MethodPatch,
    ModuleFunctionPatch,
    PatchSession,
    installed_gates,
)
from hfexport.rewrites.rule import RuleDefinitionError, RuleMeta, RuleSelection
from tests.rewrites import toy_module
from tests.rewrites.toy_module import Doubler


def _examples() -> tuple:
    build = lambda: (Doubler(), {"x": torch.randn(2, 3)})  # noqa: E731
    return (Match(build), NoMatch(build))


def _meta(rule_id: str, **kwargs) -> RuleMeta:
    return RuleMeta(id=rule_id, why="test", upstream="hfexport==0 tests", examples=_examples(), **kwargs)


# -- metadata and registration --------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["Patch/x", "patch/Under_score", "nostage/x", "patch/", "patch/a--b", "fx"])
def test_rule_id_grammar_is_enforced(bad: str) -> None:
    with pytest.raises(RuleDefinitionError, match="rule id"):
        _meta(bad)


def test_fix_needs_upstream_and_backends_are_checked() -> None:
    with pytest.raises(RuleDefinitionError, match="upstream"):
        RuleMeta(id="fx/a", why="w", upstream="", examples=_examples())
    with pytest.raises(RuleDefinitionError, match="backends"):
        _meta("fx/a", backends=("tensorrt",))
    # an optimization may omit upstream: it is not a workaround
    assert RuleMeta(id="fx/a", why="w", upstream="", kind="optimization").kind == "optimization"


def test_registration_refuses_missing_examples_and_duplicates() -> None:
    registry = RuleRegistry()
    pred, rewrite = (lambda n: False), (lambda gm, n: None)
    only_match = RuleMeta(id="fx/a", why="w", upstream="hfexport==0 tests", examples=(_examples()[0],))
    with pytest.raises(RuleDefinitionError, match="Match and one NoMatch"):
        registry.register(NodeRule(only_match, predicate=pred, rewrite=rewrite))
    registry.register(NodeRule(_meta("fx/a"), predicate=pred, rewrite=rewrite))
    with pytest.raises(RuleDefinitionError, match="duplicate"):
        registry.register(NodeRule(_meta("fx/a"), predicate=pred, rewrite=rewrite))


def test_rule_kind_must_match_id_stage() -> None:
    with pytest.raises(RuleDefinitionError, match="a NodeRule is a rule of stage fx or executorch or openvino"):
        NodeRule(_meta("patch/a"), predicate=lambda n: False, rewrite=lambda gm, n: None)
    with pytest.raises(RuleDefinitionError, match="a MethodPatch is a rule of stage patch, not 'fx'"):
        MethodPatch(_meta("fx/a"), target="x.y.Z.forward", replacement=lambda original, self: None)


def test_every_kind_runs_in_a_phase_of_its_stage() -> None:
    from hfexport.rewrites.rule import PHASES

    for rule in engine.default_registry().rules():
        assert rule.phase in PHASES[rule.stage], rule.id
    node = NodeRule(_meta("openvino/a"), predicate=lambda n: False, rewrite=lambda gm, n: None)
    assert (node.stage, node.phase) == ("openvino", "program")
    phases = {r.id: r.phase for r in engine.default_registry().rules("onnx")}
    assert phases["onnx/keep-near-noop-constants"] == "fix" and phases["onnx/rms-norm-fusion"] == "fusion"
    assert phases["onnx/dequantized-gather-rows"] == "quantized"


def test_a_stage_of_several_phases_needs_the_phase_named() -> None:
    context = RewriteContext(backend="onnx")
    with pytest.raises(ValueError, match="name the one to run"):
        engine.apply("onnx", object(), context)
    with pytest.raises(ValueError, match="has no phase 'model'"):
        engine.apply("onnx", object(), context, phase="model")


# -- selection -------------------------------------------------------------------------------------
def test_selection_by_id_and_prefix() -> None:
    a, b, c = _meta("fx/drop-assert"), _meta("fx/drop-assert-async"), _meta("patch/sdpa-math")
    opt_in = _meta("fx/slow-thing", enabled_by_default=False)
    default = RuleSelection()
    assert default.is_enabled(a) and not default.is_enabled(opt_in)
    assert not RuleSelection(disable=("fx",)).is_enabled(a)
    assert RuleSelection(disable=("fx",)).is_enabled(c)
    # prefixes stop at id boundaries: "fx/drop-assert" also selects "fx/drop-assert-async"
    sel = RuleSelection(disable=("fx/drop-assert",))
    assert not sel.is_enabled(a) and not sel.is_enabled(b)
    assert RuleSelection(disable=("fx/dro",)).is_enabled(a)
    # the most specific pattern wins; a tie goes to disable
    assert RuleSelection(enable=("fx/drop-assert-async",), disable=("fx/",)).is_enabled(b)
    assert not RuleSelection(enable=("fx/",), disable=("fx/",)).is_enabled(a)
    assert RuleSelection(enable=("fx/slow-thing",)).is_enabled(opt_in)


def test_unknown_selection_patterns_are_reported() -> None:
    ids = ["fx/drop-assert", "patch/sdpa-math"]
    assert RuleSelection(enable=("fx/nope",), disable=("patch",)).unknown_patterns(ids) == ["fx/nope"]


# -- exact hit counts on a hand-made graph ----------------------------------------------------------
class ThreeRelus(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.relu(x) + 1) - torch.relu(x * 2) + torch.sigmoid(x)


def test_fx_hit_counts_are_exact() -> None:
    def relu_to_clamp(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        with gm.graph.inserting_after(node):
            clamp = gm.graph.call_function(torch.ops.aten.clamp_min.default, (node.args[0], 0.0))
        node.replace_all_uses_with(clamp)
        gm.graph.erase_node(node)

    rule = NodeRule(
        _meta("fx/relu-to-clamp"),
        predicate=lambda n: n.target is torch.ops.aten.relu.default,
        rewrite=relu_to_clamp,
    )
    registry = RuleRegistry()
    registry.register(rule)
    x = torch.randn(4, 5)
    program = torch.export.export(ThreeRelus(), (x,))
    context = RewriteContext(backend="dynamo")
    hits = engine.apply("fx", program, context, registry).hits
    assert hits == {"fx/relu-to-clamp": 3}
    assert context.outcomes["fx/relu-to-clamp"].status == "fired"
    torch.testing.assert_close(program.module()(x), ThreeRelus()(x))
    # disabled: zero hits and recorded as disabled
    context = RewriteContext(backend="dynamo", selection=RuleSelection(disable=("fx/relu-to-clamp",)))
    program = torch.export.export(ThreeRelus(), (x,))
    assert engine.apply("fx", program, context, registry).hits == {}
    assert context.outcomes["fx/relu-to-clamp"].status == "disabled"
    # other backend: skipped with the reason
    onnx_only = NodeRule(_meta("fx/onnx-only", backends=("onnx",)), predicate=lambda n: True, rewrite=None)
    registry.register(onnx_only)
    context = RewriteContext(backend="dynamo")
    engine.apply("fx", torch.export.export(ThreeRelus(), (x,)), context, registry)
    assert context.outcomes["fx/onnx-only"].status == "other-backend"


def test_a_node_predicate_may_say_why_it_declines_a_site() -> None:
    def relu_unless_nested(node: torch.fx.Node) -> bool | Declined:
        if node.target is not torch.ops.aten.relu.default:
            return False
        if any(user.target is torch.ops.aten.relu.default for user in node.users):
            return Declined("a relu under a relu")
        return True

    def to_clamp(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
        node.target, node.args = torch.ops.aten.clamp_min.default, (node.args[0], 0.0)

    class Nested(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(torch.relu(x)) + torch.relu(x * 2)

    registry = RuleRegistry()
    registry.register(NodeRule(_meta("fx/relu-once"), predicate=relu_unless_nested, rewrite=to_clamp))
    x = torch.randn(3)
    context = RewriteContext(backend="dynamo")
    program = torch.export.export(Nested(), (x,))
    assert engine.apply("fx", program, context, registry).hits == {"fx/relu-once": 2}
    assert context.outcomes["fx/relu-once"].declined == {"a relu under a relu": 1}


# -- reversible, scoped patches ----------------------------------------------------------------------
def _scale_by_three(original, x):
    return x * 3


def _patch_rules() -> RuleRegistry:
    registry = RuleRegistry()
    registry.register(
        MethodPatch(
            _meta("patch/doubler-forward"),
            target="tests.rewrites.toy_module.Doubler.forward",
            replacement=lambda original, self, x: x * 10,
        )
    )
    registry.register(
        ModuleFunctionPatch(
            _meta("patch/toy-scale"), target="tests.rewrites.toy_module.scale", replacement=_scale_by_three
        )
    )
    return registry


def test_patches_are_restored_when_the_trace_raises() -> None:
    model = Doubler()
    original_scale = toy_module.scale
    context = RewriteContext(backend="dynamo")
    with (
        pytest.raises(RuntimeError, match="boom"),
        engine.patched(model, context, _patch_rules()) as session,
        session.active(),
    ):
        assert "forward" in vars(model)
        assert toy_module.scale is not original_scale
        raise RuntimeError("boom")
    assert "forward" not in vars(model)
    assert toy_module.scale is original_scale
    assert installed_gates() == []
    x = torch.randn(3)
    torch.testing.assert_close(model(x), x * 2)


def test_patch_hits_count_accepted_calls_only() -> None:
    model = Doubler()
    context = RewriteContext(backend="dynamo")
    with engine.patched(model, context, _patch_rules()) as session, session.active():
        model(torch.randn(2))
        model(torch.randn(2))
        toy_module.scale(torch.randn(2))
    assert context.hits["patch/doubler-forward"] == 2
    assert context.hits["patch/toy-scale"] == 1


def test_method_patch_binds_on_instances_not_the_class() -> None:
    exported, bystander = Doubler(), Doubler()
    x = torch.randn(3)
    with engine.patched(exported, RewriteContext(backend="dynamo"), _patch_rules()):
        torch.testing.assert_close(exported(x), x * 10)
        torch.testing.assert_close(bystander(x), x * 2)
        assert Doubler.forward.__name__ == "forward"


def test_missing_target_is_not_applicable() -> None:
    registry = RuleRegistry()
    registry.register(
        MethodPatch(
            _meta("patch/ghost"), target="transformers.models.nope.modeling_nope.Nope.forward", replacement=None
        )
    )
    context = RewriteContext(backend="dynamo")
    with engine.patched(Doubler(), context, registry):
        pass
    assert context.outcomes["patch/ghost"].status == "not-applicable"
    assert "importable" in context.outcomes["patch/ghost"].reason or "exist" in context.outcomes["patch/ghost"].reason


def test_other_threads_never_see_module_patches() -> None:
    seen: dict[str, object] = {}
    ready, done = threading.Event(), threading.Event()

    def bystander() -> None:
        ready.wait()
        x = torch.full((2,), 2.0)
        seen["scale"] = toy_module.scale(x)
        done.set()

    thread = threading.Thread(target=bystander)
    thread.start()
    context = RewriteContext(backend="dynamo")
    with engine.patched(Doubler(), context, _patch_rules()) as session, session.active():
        torch.testing.assert_close(toy_module.scale(torch.full((2,), 2.0)), torch.full((2,), 6.0))
        ready.set()
        done.wait(10)
    thread.join()
    torch.testing.assert_close(seen["scale"], torch.full((2,), 2.0))
    assert context.hits["patch/toy-scale"] == 1


def test_patches_are_active_inside_torch_export() -> None:
    model = Doubler()
    x = torch.randn(2, 3)
    context = RewriteContext(backend="dynamo")
    with engine.patched(model, context, _patch_rules()) as session, session.active():
        program = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(program.module()(x), x * 10)
    assert "forward" not in vars(model)


def test_session_setattr_restores_previous_instance_values() -> None:
    model = Doubler()
    model.flag = 1
    with PatchSession(lambda rule_id: None) as session:
        session.setattr(model, "flag", 2)
        session.setattr(model, "new_attr", 3)
        session.setattr(F, "relu", None)
    assert model.flag == 1 and not hasattr(model, "new_attr")
    assert F.relu is not None


def test_module_function_patch_applies_only_to_models_using_that_module() -> None:
    context = RewriteContext(backend="dynamo")
    with engine.patched(ThreeRelus(), context, _patch_rules()):
        assert toy_module.scale.__name__ == "scale" and not installed_gates()
    assert context.outcomes["patch/toy-scale"].status == "not-applicable"
    assert "uses no module of tests.rewrites.toy_module" in context.outcomes["patch/toy-scale"].reason


# -- one rule per family: per-backend bodies, former ids -----------------------------------------------
def test_a_rule_may_give_each_backend_its_own_replacement() -> None:
    from hfexport.rewrites.rule import PerBackend

    def on_dynamo(original, self, x):
        return x * 10

    def on_onnx(original, self, x):
        return x * 20

    meta = _meta("patch/toy-per-backend", backends=("dynamo", "onnx"))
    rule = MethodPatch(
        meta, target="tests.rewrites.toy_module.Doubler.forward", replacement=PerBackend(dynamo=on_dynamo, onnx=on_onnx)
    )
    assert rule.variants() == (("dynamo",), ("onnx",))
    registry = RuleRegistry()
    registry.register(rule)
    x = torch.ones(2)
    for backend, factor in (("dynamo", 10), ("onnx", 20)):
        model = Doubler()
        context = RewriteContext(backend=backend)
        with engine.patched(model, context, registry):
            assert torch.equal(model(x), x * factor)
        assert context.hits["patch/toy-per-backend"] == 1
    with pytest.raises(RuleDefinitionError, match="is given for"):
        MethodPatch(
            _meta("patch/toy-partial", backends=("dynamo", "onnx")),
            target="x.Y.z",
            replacement=PerBackend(dynamo=on_dynamo),
        )
    same = MethodPatch(
        _meta("patch/toy-shared", backends=("dynamo", "onnx", "openvino")),
        target="x.Y.z",
        replacement=PerBackend(dynamo=on_dynamo, onnx=on_dynamo, openvino=on_onnx),
    )
    assert same.variants() == (("dynamo", "onnx"), ("openvino",))


def test_a_rule_may_name_every_registered_backend_and_one_that_runs_another_s_rules() -> None:
    # AOTInductor compiles the Dynamo program (`Backend.rules == "dynamo"`): an export to it runs the Dynamo rules,
    # with their Dynamo bodies, and the rules that name it; a rule that names it alone is not a Dynamo rule.
    from hfexport.rewrites.rule import PerBackend

    def on_dynamo(original, self, x):
        return x * 10

    def on_aoti(original, self, x):
        return x * 30

    target = "tests.rewrites.toy_module.Doubler.forward"
    inherited = MethodPatch(_meta("patch/toy-dynamo", backends=("dynamo",)), target=target, replacement=on_dynamo)
    own = MethodPatch(
        _meta("patch/toy-own", backends=("dynamo", "aoti")),
        target=target,
        replacement=PerBackend(dynamo=on_dynamo, aoti=on_aoti),
    )
    only = MethodPatch(_meta("patch/toy-only", backends=("aoti",)), target=target, replacement=on_aoti)
    assert [r.applies_to("aoti") for r in (inherited, own, only)] == [True, True, True]
    assert [r.applies_to("dynamo") for r in (inherited, own, only)] == [True, True, False]
    assert not inherited.applies_to("onnx") and not only.applies_to("onnx")
    x = torch.ones(2)
    for rule, backend, factor in ((inherited, "aoti", 10), (own, "aoti", 30), (own, "dynamo", 10), (only, "aoti", 30)):
        registry = RuleRegistry()
        registry.register(rule)
        model, context = Doubler(), RewriteContext(backend=backend)
        with engine.patched(model, context, registry):
            assert torch.equal(model(x), x * factor), (rule.id, backend)
        assert context.hits[rule.id] == 1
    model, context = Doubler(), RewriteContext(backend="dynamo")
    registry = RuleRegistry()
    registry.register(only)
    with engine.patched(model, context, registry):
        assert torch.equal(model(x), x * 2)
    assert context.outcomes["patch/toy-only"].status == "other-backend"
    with pytest.raises(RuleDefinitionError, match="aoti"):  # the message lists every registered backend
        PerBackend(tensorrt=on_aoti)


def test_a_merged_rule_answers_to_its_former_ids() -> None:
    registry = engine.default_registry()
    mamba = registry.get("patch/mamba-selective-scan-hop")
    for former in ("patch/mamba-selective-scan-onnx", "patch/mamba-selective-scan-openvino"):
        assert former in mamba.meta.aliases and registry.get(former) is mamba
        selection = RuleSelection(disable=(former,))
        registry.validate_selection(selection)  # a former id is no typo
        assert not selection.is_enabled(mamba.meta) and selection.disables(mamba.meta)
        assert registry.plan(selection)[mamba.id] == "disabled by the rule selection"
    assert registry.get("patch/openvino-moe-batched-experts").id == "patch/moe-batched-experts"
    assert registry.get("patch/executorch-jetmoe-rowwise-experts").id == "patch/jetmoe-rowwise-experts"
    # The longest pattern still decides: the family's own id re-enables it over a former id's prefix.
    assert RuleSelection(enable=("patch/mamba-selective-scan-hop",), disable=("patch/mamba",)).is_enabled(mamba.meta)
    with pytest.raises(
        RuleDefinitionError, match="is already taken: it is a former id of patch/mamba-selective-scan-hop"
    ):
        registry_copy = RuleRegistry()
        registry_copy.register(mamba)
        registry_copy.register(
            MethodPatch(
                _meta("patch/toy-thief", aliases=("patch/mamba-selective-scan-onnx",)),
                target="x.Y.z",
                replacement=lambda original, self: None,
            )
        )


def test_a_requirement_on_another_backend_does_not_drop_a_rule() -> None:
    registry = engine.default_registry()
    selection = RuleSelection(disable=("executorch/split-as-slices",))
    assert registry.plan(selection, "openvino")["patch/moe-batched-experts"] is None
    assert registry.plan(selection, "executorch")["patch/moe-batched-experts"].startswith("requires")
