"""bf16 models: float outputs come out of the int8 kernels in bf16 when the graph computes in
bf16, whether the model was converted in bf16 (dequantize out_dtype=bfloat16) or runs under
CPU autocast; numerics against the reference run the same way.

Only the outputs are compared: the bf16 reference rounds every float result to 8 significant
bits, itself up to a step of a uint8 scale, so its intermediate int8 tensors differ from the
int8 kernels' (which accumulate exactly in int32) by 2 steps in up to 0.7% of elements, and a
one-step tie in an average pool moves the next conv by several (measured on these examples).
The outputs stay within the float tolerance (cosine >= 0.9999)."""
import contextlib

import pytest
import torch

from qbackend.patterns import examples

from tests.helpers import compile_and_run, quantize
from tests.tolerances import assert_float_close

EXAMPLES = ["conv_relu", "linear_relu", "residual_block", "linear_residual", "conv_avgpool_head", "two_branch_cat",
            "conv_flatten_linear"]


def _bf16_model(build):
    module, inputs = getattr(examples, build)()
    inputs = tuple(t.to(torch.bfloat16) for t in inputs)
    return quantize(module.to(torch.bfloat16), inputs), inputs, contextlib.nullcontext()


def _autocast(build):
    module, inputs = getattr(examples, build)()
    return quantize(module, inputs), inputs, torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("route", [_bf16_model, _autocast], ids=["bf16_model", "autocast"])
@pytest.mark.parametrize("build", EXAMPLES)
def test_bf16_float_outputs_match_the_reference(build, route):
    torch.manual_seed(0)
    converted, inputs, context = route(build)
    with context:
        actual, expected, captured = compile_and_run(converted, inputs)
    assert actual.dtype == expected.dtype
    assert_float_close(actual, expected, build)
    report = captured.report
    assert not report.kept, str(report)
    # Each float output has the dtype the graph computes in: bf16 throughout a bf16 model; under
    # autocast bf16 for conv / linear, float32 where autocast adds a float32 residual.
    graph_dtypes = {n.name: n.meta["example_value"].dtype for n in captured.graphs[0][0].graph.nodes
                    if isinstance(n.meta.get("example_value"), torch.Tensor)}
    float_outs = [d for d in report.decisions if d.post_ops and d.post_ops[-1].endswith(" out")]
    assert float_outs, str(report)
    for d in float_outs:
        assert d.post_ops[-1] == f"{graph_dtypes[d.node] if 'add' not in d.post_ops else actual.dtype} out", str(report)
