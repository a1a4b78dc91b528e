"""Every rule row: its example lowers with reference numerics; its near misses are rejected
with the stated reason. Built from the rule table, so a new row brings its own tests."""
import pytest
import torch

from qbackend.archive_operators import graph_ops
from qbackend.archive.operator_allowlist import ALLOWED
from qbackend.patterns import RULES

from tests.helpers import assert_matches_reference, compile_and_run, quantize
from tests.tolerances import assert_outputs_close

EXAMPLES = [pytest.param(rule, id=rule.name) for rule in RULES]
NEAR_MISSES = [pytest.param(rule, miss, id=f"{rule.name}-{miss.build.__name__}") for rule in RULES for miss in rule.near_misses]


@pytest.mark.parametrize("rule", EXAMPLES)
def test_example_lowers_with_reference_numerics(rule):
    module, inputs = rule.example()
    converted = module if rule.example_is_quantized else quantize(module, inputs, **dict(rule.example_flags))
    assert graph_ops(converted, inputs) <= ALLOWED  # (a saved archive of it loads: operator_allowlist.py)
    captured = assert_matches_reference(converted, inputs)
    used = {d.rule for d in captured.report.decisions + captured.report.moves if d.lowered}
    assert rule.name in used, str(captured.report)
    assert not captured.report.kept, str(captured.report)


@pytest.mark.parametrize("rule,miss", NEAR_MISSES)
def test_near_miss_is_rejected_with_reason(rule, miss):
    converted, inputs = miss.build()
    assert graph_ops(converted, inputs) <= ALLOWED
    actual, expected, captured = compile_and_run(converted, inputs)
    assert_outputs_close(actual, expected, miss.build.__name__)  # runs as the reference does
    decisions = captured.report.decisions + captured.report.moves
    reasons = [attempt.reason for d in decisions for attempt in d.tried if attempt.rule == rule.name]
    assert any(miss.reason in r for r in reasons), f"expected {miss.reason!r} among {reasons}\n{captured.report}"
    rejected = {d.node for d in decisions if any(a.reason in reasons for a in d.tried)}
    assert not [d for d in decisions if d.lowered and d.rule == rule.name and d.node in rejected]


def _linear(bias, shape):
    return torch.nn.Sequential(torch.nn.Linear(16, 8, bias=bias)), (torch.randn(*shape),)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", [(4, 16), (2, 3, 16), (2, 2, 3, 16)], ids=["2d", "3d", "4d"])
def test_linear_input_ranks_and_bias(bias, shape):
    module, inputs = _linear(bias, shape)
    report = assert_matches_reference(quantize(module, inputs), inputs).report
    assert [d.rule for d in report.decisions] == ["qlinear"], str(report)
