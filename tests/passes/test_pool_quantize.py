"""A squeeze-excitation block's pool reads the conv's float result in one pass
(qbackend/passes/pool_quantize.py): the graph after the rewrite, the reference's values, and a
quantize that another op reads too left as it is."""
from unittest import mock

import expecttest
import torch
import torch.nn as nn

from qbackend.pipeline import cleanup

from tests.helpers import assert_matches_reference, needs_own_kernels, quantize, short_graph
from tests.kernels.test_own_conv_kernels import SqueezeExcitationBlock

pytestmark = needs_own_kernels


class PooledTwice(SqueezeExcitationBlock):
    """The block's depthwise output also max-pooled: its quantize has a second reader."""

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        return self.project(y * self.squeeze(y)), nn.functional.max_pool2d(y, 2)


def _lowered(block_class):
    """(graph, report) of the block lowered as separate calls (the graph shows them), its int8
    tensors and outputs checked against the reference's."""
    torch.manual_seed(0)
    block, x = block_class(nn.SiLU).eval(), torch.randn(2, 8, 14, 14)
    model = quantize(block, (x,))
    with mock.patch.object(cleanup, "chain_own_kernels", lambda gm, **_: None):
        captured = assert_matches_reference(model, (x,))
    return short_graph(captured.lowered), captured.report


class TestPoolOfQuantizedFloats(expecttest.TestCase):
    def test_the_pool_reads_the_float_result_where_it_alone_reads_its_quantize(self):
        graph, report = _lowered(SqueezeExcitationBlock)
        pool = [line for line in graph.splitlines() if line.startswith("global_avg_pool")]
        self.assertExpectedInline("\n".join(pool), """global_avg_pool_quantize = pools.global_avg_pool_quantize(qconv_depthwise, 0.0125, 22, 0, 127, 0, 22, 0, 127)""")
        assert "quantize_per_tensor(qconv_depthwise" not in graph, graph
        assert "1 pool(s) of a quantized float tensor in one pass (no uint8 copy for them)" in report.notes

    def test_a_quantize_another_op_reads_too_stays(self):
        graph, report = _lowered(PooledTwice)
        assert "global_avg_pool_quantize" not in graph and "pools.global_avg_pool_u8(quantize_per_tensor" in graph, graph
        assert not any("pool(s) of a quantized float tensor" in note for note in report.notes)

