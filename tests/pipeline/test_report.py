"""The report: explain() agrees with the backend, and the switches that show it."""
import logging
import re

import pytest
import torch
import torch.nn as nn

import qbackend
from qbackend.patterns.examples import residual_block

from tests.helpers import compile_and_run, onednn_only, quantize


@pytest.fixture(scope="module")
def converted():
    module, inputs = residual_block()
    return quantize(module, inputs), inputs


def test_explain_gives_the_backends_own_decisions(converted):
    model, inputs = converted
    _, _, captured = compile_and_run(model, inputs)
    torch._dynamo.reset()
    explained = qbackend.explain(model, *inputs)
    assert [d.line() for d in explained.decisions] == [d.line() for d in captured.report.decisions]


def test_report_lines_name_the_rule_op_and_source(converted, monkeypatch):
    onednn_only(monkeypatch)  # (the lines name oneDNN's ops)
    model, inputs = converted
    torch._dynamo.reset()
    lines = str(qbackend.explain(model, *inputs)).splitlines()
    assert lines[0] == "qbackend [cpu]: 3 of 3 conv / linear / pool / attention ops lowered in 1 graph(s), 0 kept"
    assert lines[1].startswith("LOWERED  conv   conv2d (0): qconv -> onednn::qconv_pointwise + relu, quantize(torch.uint8)")
    assert lines[3].startswith("LOWERED  conv   conv2d_2 (2.conv2): qconv_add -> onednn::qconv2d_pointwise.binary + add, relu")


def test_kept_line_gives_first_reason_and_rule_location():
    from qbackend.patterns.examples import conv_per_tensor_weight

    converted, inputs = conv_per_tensor_weight()
    torch._dynamo.reset()
    decision = qbackend.explain(converted, *inputs).decisions[0]  # (the conv whose weight is per tensor)
    assert re.match(r"KEPT     conv   conv2d \(0\): weight is quantized per tensor.*  \(patterns/qconv\.py:\d+\)$", decision.line()), \
        decision.line()


def test_a_float_layer_says_it_is_float_and_names_no_rule():
    module = nn.Sequential(nn.ConvTranspose2d(4, 8, 3)).eval()
    inputs = (torch.randn(1, 4, 8, 8),)
    converted = quantize(module, inputs)
    torch._dynamo.reset()
    (decision,) = qbackend.explain(converted, *inputs).decisions
    assert decision.line() == ("KEPT     conv   conv_transpose2d (0): a float conv: neither its input nor its weight is dequantized "
                               "(left float when the model was quantized: by the quantizer's recipe or keep_float)"), decision.line()


def test_report_option_prints_to_stderr(converted, capsys):
    model, inputs = converted
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="qbackend", options={"report": True})(*inputs)
    assert "qbackend [cpu]: 3 of 3" in capsys.readouterr().err


def test_report_env_switch_prints_to_stderr(converted, capsys, monkeypatch):
    model, inputs = converted
    monkeypatch.setenv("QBACKEND_REPORT", "1")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="qbackend")(*inputs)
    assert "LOWERED  conv   conv2d_2" in capsys.readouterr().err


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_report_goes_to_the_qbackend_logger(converted):
    model, inputs = converted
    logger, handler = logging.getLogger("qbackend"), _Collect()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="qbackend")(*inputs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert any("3 of 3 conv / linear / pool / attention ops lowered" in m for m in handler.messages), handler.messages



@pytest.mark.parametrize("build,kind,line", [
    ("conv_flatten_linear", "view", "int8 flow: 2 view chains run on int8"),
    ("two_branch_cat", "cat", "int8 flow: 1 cat run on int8"),
])
def test_int8_data_movement_is_one_line_with_its_decisions_in_moves(build, kind, line):
    from qbackend.patterns import examples

    module, inputs = getattr(examples, build)()
    torch._dynamo.reset()
    report = qbackend.explain(quantize(module, inputs), *inputs)
    assert line in str(report).splitlines(), str(report)
    assert all(d.kind in ("conv", "linear") for d in report.decisions)
    assert {d.kind for d in report.moves if d.lowered} == {kind}
