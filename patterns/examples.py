"""Example graphs for the rule rows: ones that match, and near misses that must not.

Each builder returns (module, example inputs). Builders of near misses return the
PT2E-converted module, edited where PT2E itself would never produce the near miss.
torchao is imported only when a builder runs (tests, docs), never by the backend.

Over 600 lines on purpose: a catalogue of ~50 small builders, each read alone from the rule row
that names it (``examples.conv_relu``); split by rule, one helper (``_convert``, the edits of a
converted graph) would be shared by every part.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from qbackend.models import SelfAttention
from qbackend.ops import graph_op
from qbackend.weight_only.weight_quant import quantize

from .post_ops import UNARY


def _convert(module: nn.Module, inputs: tuple):
    """torchao's PT2E flow as its docs spell it (X86InductorQuantizer's default config, with
    the reduced range that is exact on every CPU): the rows sit below qbackend's own flow
    (qbackend.pt2e_flow), which imports them through the lowering."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    exported = torch.export.export(module.eval(), inputs, strict=True).module()
    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config(reduce_range=True))
    prepared = prepare_pt2e(exported, quantizer)
    with torch.no_grad():
        prepared(*inputs)
    return convert_pt2e(prepared)


def _first(gm, op_name: str):
    op = graph_op(op_name)
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def conv_relu():
    """conv -> relu (int8 out, read by the next conv) -> conv (float out)."""
    module = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2))
    return module, (torch.randn(2, 4, 10, 10),)


def linear_relu():
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8)), (torch.randn(3, 5, 16),)


class ResidualBlock(nn.Module):
    """conv -> relu -> conv -> + x -> relu, one ReLU module reused (as torchvision does)."""

    def __init__(self, channels=8):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv2(self.relu(self.conv1(x))) + x)


def residual_block():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), ResidualBlock(8)), (torch.randn(2, 3, 12, 12),)


class InplaceResidualBlock(nn.Module):
    """torchvision's Bottleneck / BasicBlock ending: ``out += identity`` (an in-place add_ in
    the exported graph), then ReLU; ``into_residual`` adds into the identity instead."""

    def __init__(self, channels=8, into_residual=False):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu = nn.ReLU()
        self.into_residual = into_residual

    def forward(self, x):
        identity = self.relu(self.conv1(x))
        out = self.conv2(identity)
        if self.into_residual:
            identity += out
            out = identity
        else:
            out += identity
        return self.relu(out)


def inplace_residual_block():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), InplaceResidualBlock(8)), (torch.randn(2, 3, 12, 12),)


def conv_add_into_residual():
    """The in-place add writes into the residual (another conv's output), not into the conv's."""
    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), InplaceResidualBlock(8, into_residual=True))
    inputs = (torch.randn(2, 3, 12, 12),)
    return _convert(module, inputs), inputs


def conv_transpose():
    inputs = (torch.randn(2, 4, 10, 10),)
    return _convert(nn.Sequential(nn.ConvTranspose2d(4, 8, 3), nn.ReLU()), inputs), inputs


def _per_tensor_weight(gm):
    """Swap the first per-channel weight dequantize for a per-tensor one (same int8 data)."""
    dq = _first(gm, "dequantize_per_channel")
    scales = getattr(gm, dq.args[1].target)
    dq.target = graph_op("dequantize_per_tensor")
    dq.args = (dq.args[0], float(scales.max()), 0, -128, 127, torch.int8)
    gm.recompile()
    return gm


def _asymmetric_weight(gm):
    dq = _first(gm, "dequantize_per_channel")
    getattr(gm, dq.args[2].target)[0] = 3
    return gm


def conv_per_tensor_weight():
    module, inputs = conv_relu()
    return _per_tensor_weight(_convert(module, inputs)), inputs


def conv_asymmetric_weight():
    module, inputs = conv_relu()
    return _asymmetric_weight(_convert(module, inputs)), inputs


def linear_per_tensor_weight():
    module, inputs = linear_relu()
    return _per_tensor_weight(_convert(module, inputs)), inputs


def linear_asymmetric_weight():
    module, inputs = linear_relu()
    return _asymmetric_weight(_convert(module, inputs)), inputs


class ConvWithRuntimeWeight(nn.Module):
    def forward(self, x, weight):
        return torch.nn.functional.conv2d(x, weight, padding=1)


def conv_runtime_weight():
    inputs = (torch.randn(2, 4, 10, 10), torch.randn(8, 4, 3, 3))
    return _convert(ConvWithRuntimeWeight(), inputs), inputs


def float_conv():
    """A conv left in float (the quantizer was told to skip it)."""
    module, inputs = conv_relu()
    return torch.export.export(module.eval(), inputs, strict=True).module(), inputs


def float_linear():
    module, inputs = linear_relu()
    return torch.export.export(module.eval(), inputs, strict=True).module(), inputs


class Conv1dAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x) + x)


def conv1d_add():
    inputs = (torch.randn(2, 8, 16),)
    return _convert(Conv1dAdd(), inputs), inputs


class ConvAddBroadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x, bias_map):
        return torch.relu(self.conv(x) + bias_map)


def conv_add_broadcast():
    inputs = (torch.randn(2, 4, 10, 10), torch.randn(1, 8, 1, 1))
    return _convert(ConvAddBroadcast(), inputs), inputs


# Post-ops as they appear in ATen graphs: name -> (op, extra args, kwargs)
POST_OP_CALLS = {
    "relu": (torch.ops.aten.relu.default, (), {}),
    "relu6": (torch.ops.aten.hardtanh.default, (0.0, 6.0), {}),
    "hardtanh": (torch.ops.aten.hardtanh.default, (-0.5, 0.5), {}),
    "gelu": (torch.ops.aten.gelu.default, (), {}),
    "gelu_tanh": (torch.ops.aten.gelu.default, (), {"approximate": "tanh"}),
    "leaky_relu": (torch.ops.aten.leaky_relu.default, (0.1,), {}),
    "tanh": (torch.ops.aten.tanh.default, (), {}),
    "hardswish": (torch.ops.aten.hardswish.default, (), {}),
    "silu": (torch.ops.aten.silu.default, (), {}),
}


def post_op_of(name: str):
    """The PostOp the post-op table reads from POST_OP_CALLS[name]."""
    op, args, kwargs = POST_OP_CALLS[name]
    return UNARY[op](torch.fx.Graph().call_function(op, (None, *args), kwargs))


class HandQuantized(nn.Module):
    """A conv (rank 1-3) or linear (rank 0) written directly in PT2E's converted form, for
    shapes and post-ops the X86 quantizer does not annotate (conv3d, tanh, ...):
    dq(q(x)) -> conv / linear -> [post-op] -> [q -> dq]."""

    def __init__(self, rank, in_ch=8, out_ch=8, kernel=3, stride=1, padding=1, dilation=1, groups=1,
                 post_op="relu", quantize_output=True, bias=True):
        super().__init__()
        import torch.ao.quantization.fx._decomposed  # noqa: F401  registers quantized_decomposed ops

        torch.manual_seed(rank * 100 + groups)
        weight = torch.randn(out_ch, in_ch // groups, *([kernel] * rank)) * 0.2
        scales = weight.abs().amax(dim=tuple(range(1, rank + 2))) / 127
        self.register_buffer("w_int8", torch.clamp(torch.round(weight / scales.view(-1, *[1] * (rank + 1))), -128, 127).to(torch.int8))
        self.register_buffer("w_scale", scales)
        self.register_buffer("w_zp", torch.zeros(out_ch, dtype=torch.int64))
        self.bias = nn.Parameter(torch.randn(out_ch) * 0.1) if bias else None
        self.rank, self.args = rank, (stride, padding, dilation, groups)
        self.post_op, self.quantize_output = post_op, quantize_output

    def forward(self, x):
        aten, qd = torch.ops.aten, torch.ops.quantized_decomposed
        q, dq = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
        # 7-bit activations (reduce_range): exact on every x86 CPU, VNNI or not
        x = dq(q(x, 0.04, 64, 0, 127, torch.uint8), 0.04, 64, 0, 127, torch.uint8)
        w = qd.dequantize_per_channel.default(self.w_int8, self.w_scale, self.w_zp, 0, -128, 127, torch.int8)
        if self.rank == 0:
            y = aten.linear.default(x, w, self.bias)
        else:
            stride, padding, dilation, groups = self.args
            conv = getattr(aten, f"conv{self.rank}d").default
            y = conv(x, w, self.bias, [stride] * self.rank, [padding] * self.rank, [dilation] * self.rank, groups)
        if self.post_op is not None:
            op, args, kwargs = POST_OP_CALLS[self.post_op]
            y = op(y, *args, **kwargs)
        if self.quantize_output:
            y = dq(q(y, 0.06, 50, 0, 127, torch.uint8), 0.06, 50, 0, 127, torch.uint8)
        return y


def conv_maxpool_conv():
    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 3))
    return module, (torch.randn(2, 3, 16, 16),)


def _rescale(gm, quant, factor=2.0):
    """Give a quantize and the dequantizes reading it another scale (a consistent graph whose
    qparams PT2E would not have chosen)."""
    assert quant.target is graph_op("quantize_per_tensor"), quant
    for node in (quant, *quant.users):
        node.args = (node.args[0], node.args[1] * factor, *node.args[2:])
    gm.recompile()
    return gm


def _requantized_output(build, target):
    """The converted example of ``build`` with the quantize after the first ``target`` node
    rescaled: the op's output no longer shares its input's qparams."""
    module, inputs = build()
    gm = _convert(module, inputs)
    node = next(n for n in gm.graph.nodes if n.target is target)
    return _rescale(gm, next(iter(node.users))), inputs


def maxpool_requantize():
    """The quantize after max_pool2d uses other qparams than its input: a requantize."""
    return _requantized_output(conv_maxpool_conv, torch.ops.aten.max_pool2d.default)


class TwoBranchCat(nn.Module):
    """Two conv + relu branches concatenated along channels, then a conv (Inception-style)."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.relu_left, self.relu_right = nn.ReLU(), nn.ReLU()
        self.head = nn.Conv2d(16, 8, 3)

    def forward(self, x):
        return self.head(torch.cat([self.relu_left(self.left(x)), self.relu_right(self.right(x))], 1))


def two_branch_cat():
    return TwoBranchCat(), (torch.randn(2, 3, 12, 12),)


def cat_mixed_qparams():
    """The second cat input is quantized with another scale than the first."""
    module, inputs = two_branch_cat()
    gm = _convert(module, inputs)
    cat = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    return _rescale(gm, cat.args[0][1].args[0]), inputs


def cat_requantize():
    return _requantized_output(two_branch_cat, torch.ops.aten.cat.default)


class LinearResidual(nn.Module):
    """Transformer-style residual: x + linear(gelu(linear(x))), then layer norm."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def linear_residual():
    return LinearResidual(), (torch.randn(2, 5, 16),)


def static_linear_residual():
    module, inputs = linear_residual()
    return _convert(module, inputs), inputs


class LinearAddBroadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, row):
        return self.fc(x) + row


def linear_add_broadcast():
    inputs = (torch.randn(4, 16), torch.randn(1, 8))
    return _convert(LinearAddBroadcast(), inputs), inputs


class GroupDequantLinear(nn.Module):
    """A weight-only quantized linear written in graph form: the weight is dequantized by
    PT2E's ``dequantize_per_channel_group``, torchao's ``dequantize_affine`` or
    ``dequantize_per_channel``, then used by ``linear(x, w)`` or ``x @ w.T``. Run eagerly it is
    the float reference computed from the dequantized weight."""

    # the module whose import registers the form's dequantize op
    REGISTERS = {"affine": "torchao.quantization.quant_primitives"}

    def __init__(self, in_features, out_features, bits, group_size, form="per_channel_group", use="linear"):
        super().__init__()
        importlib.import_module(self.REGISTERS.get(form, "torch.ao.quantization.fx._decomposed"))
        torch.manual_seed(in_features * 7 + out_features + bits)
        q = quantize(torch.randn(out_features, in_features) * 0.1, bits, group_size)
        zero = q.zero_point if q.zero_point is not None else torch.zeros_like(q.scale, dtype=torch.int8)
        self.register_buffer("w_int", q.stored)
        per_channel = form == "per_channel"  # 1-D scales and int64 zero points, as PT2E writes them
        self.register_buffer("w_scale", q.scale[:, 0].clone() if per_channel else q.scale)
        self.register_buffer("w_zero", zero[:, 0].to(torch.int64) if per_channel else zero)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)
        self.bits, self.group_size, self.form, self.use = bits, q.group_size, form, use

    def weight(self, w_int):
        qmin, qmax = (-8, 7) if self.bits == 4 else (-128, 127)
        if self.form == "per_channel_group":
            return torch.ops.quantized_decomposed.dequantize_per_channel_group.default(
                w_int, self.w_scale, self.w_zero, qmin, qmax, torch.int8, self.group_size, torch.float32)
        if self.form == "affine":  # called through the packet, with a keyword, as torchao writes it
            return torch.ops.torchao.dequantize_affine(
                w_int, [1, self.group_size], self.w_scale, self.w_zero, torch.int8, qmin, qmax, output_dtype=torch.float32)
        return torch.ops.quantized_decomposed.dequantize_per_channel.default(
            w_int, self.w_scale, self.w_zero, 0, qmin, qmax, torch.int8)

    def forward(self, x, w_int=None):
        w = self.weight(self.w_int if w_int is None else w_int)
        return nn.functional.linear(x, w, self.bias) if self.use == "linear" else x @ w.T + self.bias


class _RuntimeWeight(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, w_int):
        return self.layer(x, w_int)


def int4_weight_mlp():
    """int4 group-wise: PT2E's group dequantize used by linear, torchao's by x @ w.T."""
    return nn.Sequential(GroupDequantLinear(64, 32, 4, 32), nn.ReLU(),
                         GroupDequantLinear(32, 16, 4, 32, form="affine", use="matmul")), (torch.randn(3, 5, 64),)


def int8_weight_mlp():
    """int8 per-channel: dequantize_per_channel used by linear, torchao's affine by x @ w.T."""
    return nn.Sequential(GroupDequantLinear(64, 32, 8, None, form="per_channel"), nn.GELU(),
                         GroupDequantLinear(32, 16, 8, None, form="affine", use="matmul")), (torch.randn(4, 64),)


def weight_only_runtime_weight():
    """The int4 weight is an input of the compiled graph, not a constant."""
    layer = GroupDequantLinear(64, 32, 4, 32)
    return _RuntimeWeight(layer), (torch.randn(4, 64), layer.w_int.clone())


def int8_asymmetric_weight():
    """An int8 weight with non-zero zero points: the int8 weight-only kernels take none."""
    layer = GroupDequantLinear(64, 32, 8, None, form="affine")
    layer.w_zero += 3
    return layer, (torch.randn(4, 64),)


class ConvFlattenLinear(nn.Module):
    """conv + relu -> flatten -> linear -> view / permute / reshape -> linear: a flatten between
    int8 tensors, and a float view chain in front of a quantize."""

    def __init__(self):
        super().__init__()
        self.conv, self.relu = nn.Conv2d(3, 4, 3, stride=2), nn.ReLU()
        self.fc1, self.fc2 = nn.Linear(4 * 5 * 5, 12), nn.Linear(12, 6)

    def forward(self, x):
        y = self.fc1(torch.flatten(self.relu(self.conv(x)), 1))
        return self.fc2(y.view(-1, 2, 6).permute(0, 2, 1).reshape(-1, 12))


def conv_flatten_linear():
    return ConvFlattenLinear(), (torch.randn(2, 3, 12, 12),)


def flatten_requantize():
    return _requantized_output(conv_flatten_linear, torch.ops.aten.flatten.using_ints)


class LinearViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        return self.fc(x).view(-1, 3, 4).transpose(1, 2)


def view_float_consumer():
    """The view chain ends in the graph output (float), not in a quantize."""
    inputs = (torch.randn(2, 12),)
    return _convert(LinearViewOut(), inputs), inputs


class ConvAvgPoolHead(nn.Module):
    """conv -> avg_pool2d (3x3, padded) -> conv -> adaptive_avg_pool2d(1) -> flatten -> linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.relu1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.pool = nn.AvgPool2d(3, stride=2, padding=1)
        self.conv2, self.relu2 = nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
        self.head, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        y = self.relu2(self.conv2(self.pool(self.relu1(self.conv1(x)))))
        return self.fc(torch.flatten(self.head(y), 1))


def conv_avgpool_head():
    return ConvAvgPoolHead(), (torch.randn(2, 3, 16, 16),)


def avgpool_requantize():
    return _requantized_output(conv_avgpool_head, torch.ops.aten.avg_pool2d.default)


def attention_block():
    """A small BERT-style self-attention (q / k / v / out projections around float attention)."""
    return SelfAttention(hidden=32, heads=4), (torch.randn(2, 8, 32),)


class AttentionReturningProbs(nn.Module):
    """Attention that also returns its probabilities: they must exist, so no fusion."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = (t.view(2, 8, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        probs = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / 8 ** 0.5, dim=-1)
        return torch.matmul(probs, v), probs


def attention_probs_returned():
    inputs = (torch.randn(2, 8, 32),)
    return _convert(AttentionReturningProbs(), inputs), inputs


class GroupedQueryAttention(nn.Module):
    """Llama-style attention: 4 query heads share 2 key / value heads (``enable_gqa``), head
    dim 16, through the fused call; ``causal`` asks for is_causal=True instead."""

    def __init__(self, causal=False):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.causal = causal

    def forward(self, x):
        b, length, _ = x.shape
        q = self.q(x).view(b, length, 4, 16).transpose(1, 2)
        k, v = (t.view(b, length, 2, 16).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return self.out(attended.transpose(1, 2).reshape(b, length, 64))


def grouped_query_attention():
    return GroupedQueryAttention(), (torch.randn(2, 8, 64),)


def causal_fused_attention():
    inputs = (torch.randn(2, 8, 64),)
    return _convert(GroupedQueryAttention(causal=True), inputs), inputs


class FlatHeadsAttention(nn.Module):
    """Attention over [batch * heads, length, head dim] queries, keys and values (3-D) through
    the fused call."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = (t.view(b, length, 4, 16).transpose(1, 2).reshape(b * 4, length, 16) for t in self.qkv(x).chunk(3, dim=-1))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(attended.view(b, 4, length, 16).transpose(1, 2).reshape(b, length, 64))


def flat_heads_fused_attention():
    inputs = (torch.randn(2, 8, 64),)
    return _convert(FlatHeadsAttention(), inputs), inputs


class SmoothedLinear(nn.Module):
    """LayerNorm -> x * (1/s) -> linear, as ``qbackend.smooth_quant`` leaves an explicit
    smoothing multiply; ``factors`` of shape [16] (per channel) or [1] (a near miss);
    ``also_return`` makes the scaled tensor a graph output too (a float consumer)."""

    def __init__(self, factors=16, also_return=False):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 8)
        self.register_buffer("inv_s", torch.linspace(0.25, 4.0, factors))
        self.also_return = also_return

    def forward(self, x):
        scaled = self.norm(x) * self.inv_s
        return (self.fc(scaled), scaled) if self.also_return else self.fc(scaled)


def smoothed_linear():
    return SmoothedLinear(), (torch.randn(2, 5, 16),)


def smoothing_by_one_factor():
    inputs = (torch.randn(2, 5, 16),)
    return _convert(SmoothedLinear(factors=1), inputs), inputs


def smoothed_value_returned():
    inputs = (torch.randn(2, 5, 16),)
    return _convert(SmoothedLinear(also_return=True), inputs), inputs


class NormedLinear(nn.Module):
    """linear -> LayerNorm -> linear (a BERT layer's output norm before the next one's linear);
    ``dims``: how many trailing dimensions the norm covers; ``affine``: the norm's weight and
    bias; ``also_return``: the normed rows are an output too (a float consumer)."""

    def __init__(self, dims=1, affine=True, also_return=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm([5, 16][-dims:], elementwise_affine=affine)
        self.also_return = also_return

    def forward(self, x):
        normed = self.norm(self.fc1(x))
        return (self.fc2(normed), normed) if self.also_return else self.fc2(normed)


def normed_linear(**flags):
    return NormedLinear(**flags), (torch.randn(2, 5, 16),)


def norm_over_two_dimensions():
    inputs = (torch.randn(2, 5, 16),)
    return _convert(NormedLinear(dims=2), inputs), inputs


def norm_without_affine():
    inputs = (torch.randn(2, 5, 16),)
    return _convert(NormedLinear(affine=False), inputs), inputs


class ResidualSum(nn.Module):
    """ConvNeXt's block end in small: a float branch (a conv scaled in float, as ConvNeXt's
    layer scale follows its linear) plus the float residual, the sum both returned and read by
    the next conv; ``broadcast``: the residual's per-channel means added instead (a near miss)."""

    def __init__(self, broadcast=False):
        super().__init__()
        self.branch, self.next = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.broadcast = broadcast

    def forward(self, x):
        other = x.mean(dim=(2, 3), keepdim=True) if self.broadcast else x
        total = self.branch(x) * 0.5 + other
        return self.next(total), total


def residual_sum_quantized():
    return ResidualSum(), (torch.randn(2, 8, 6, 6),)


def broadcast_sum_quantized():
    inputs = (torch.randn(2, 8, 6, 6),)
    return _convert(ResidualSum(broadcast=True), inputs), inputs


class SqueezeExcitation(nn.Module):
    """EfficientNet's block middle: features, their per-channel gate (pool, two 1x1 convs,
    sigmoid), the gated features into the next conv; ``spatial``: a per-pixel gate instead."""

    def __init__(self, channels=16, spatial=False):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.SiLU())
        self.squeeze = nn.Conv2d(channels, 8, 1)
        self.excite = nn.Conv2d(8, 1 if spatial else channels, 1)
        self.project = nn.Conv2d(channels, 8, 1)
        self.spatial = spatial

    def forward(self, x):
        x = self.features(x)
        pooled = x if self.spatial else torch.nn.functional.adaptive_avg_pool2d(x, 1)
        gate = torch.sigmoid(self.excite(torch.nn.functional.silu(self.squeeze(pooled))))
        return self.project(x * gate)


def squeeze_excitation():
    return SqueezeExcitation(), (torch.randn(2, 3, 10, 10),)


def spatial_gate():
    inputs = (torch.randn(2, 3, 10, 10),)
    return _convert(SqueezeExcitation(spatial=True), inputs), inputs
