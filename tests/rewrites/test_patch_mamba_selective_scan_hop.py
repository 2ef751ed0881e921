"""patch/mamba-selective-scan-hop, its ONNX and OpenVINO variants where they differ from the Dynamo one.

ONNX: without the rule its first example (zamba) is pinned to the sample length; with an older body (detach without
a copy) the scan cannot be traced on zamba's per-head views; with the rule the ONNX model runs a longer input in ONNX
Runtime. OpenVINO: why a `while_loop` and not the Dynamo variant's `scan`: with the scan in its place the conversion
fails (openvino 2026.4.1 has no translator for `scan`); this test fails once OpenVINO converts a scan, which is when
the two variants can become one. The rule's examples, run in tests/rewrites/test_examples.py, check each backend's
program against eager on both lengths, and (`-m slow`) that each fails without the rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import mamba_selective_scan_hop as rule
from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import scan_selective
from hfexport.testing.harness import check_match
from hfexport.testing.harness import export_program as _export


def test_the_first_example_is_pinned_to_the_sample_length_without_the_rule() -> None:
    example = rule.meta.examples[0]
    module, inputs = example.build()
    with torch.no_grad():
        program = _export(module.eval(), inputs, dynamic=True)
        with pytest.raises(Exception, match=r"Guard failed|[Ee]xpected input"):
            program.module()(**example.other_inputs())


def test_detaching_a_view_without_a_copy_fails_in_the_scan_trace() -> None:
    def detach_only(original, *args, **kwargs):
        def cut(value):
            return value.detach() if isinstance(value, torch.Tensor) else value

        return scan_selective(original, *map(cut, args), **{k: cut(v) for k, v in kwargs.items()})

    old = dataclasses.replace(rule, replacement=detach_only)
    with pytest.raises(Exception, match=r"vr must not be None"):
        check_match(old, rule.meta.examples[0], "onnx")


@pytest.mark.slow
def test_zamba_onnx_runs_a_longer_input_in_ort(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.naming import onnx_feed

    example = rule.meta.examples[0]
    module, inputs = example.build()
    path = tmp_path / "zamba.onnx"
    exporter = OnnxExporter()
    exporter.export(module, inputs, OnnxConfig(dynamic=True, output_path=str(path)))
    assert exporter.report.hits["patch"][rule.meta.id] == 2  # one scan per Mamba head
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for feed in (inputs, example.other_inputs()):
        with torch.no_grad():
            expected = module(**feed).last_hidden_state
        actual = torch.from_numpy(session.run(None, onnx_feed(names, feed))[0])
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_scan_op_does_not_convert_to_openvino() -> None:
    pytest.importorskip("openvino")
    with_scan = dataclasses.replace(rule, replacement=scan_selective)
    falcon_mamba = rule.meta.examples[1]
    assert "falcon_mamba" in falcon_mamba.description
    with pytest.raises(Exception, match=r"Conversion is failed for: .*scan"):
        check_match(with_scan, falcon_mamba, "openvino")


def test_the_dynamo_scan_takes_the_symbols_of_its_output_sizes() -> None:
    """Inductor (AOTInductor's compile) rewrites the scan into a while_loop and sizes its stacked outputs from the
    symbols among the scan's operands only: the batch must be one, or the compile fails with `KeyError: s..`."""
    from hfexport import DynamoConfig, DynamoExporter

    module, inputs = rule.meta.examples[1].build()  # falcon_mamba, batch 2: a dynamic batch
    program = DynamoExporter().export(module.eval(), inputs, DynamoConfig(dynamic=True))
    scans = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.scan]
    assert scans
    for node in scans:
        _, init, xs, additional = node.args
        bound = {xs[0].meta["val"].shape[0].node.expr}  # the scan's length
        bound |= {a.meta["val"].node.expr for a in additional if isinstance(a.meta["val"], torch.SymInt)}
        stacked = node.meta["val"][len(init) :]
        needed = set().union(
            *(s.node.expr.free_symbols for y in stacked for s in y.shape if isinstance(s, torch.SymInt))
        )
        assert needed and needed <= bound, (needed, bound)
