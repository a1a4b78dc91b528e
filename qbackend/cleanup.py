"""After lowering: drop dead nodes, fold constant subgraphs, run the q/dq that remain on the
fast exact implementations, and keep views valid on channels-last kernel outputs. Before
lowering: drop inference-mode dropouts, which return their input and would hide a residual
add from the linear that feeds it."""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from qbackend.patterns.base import constant_value, fake_value

from . import fast_qdq, native
from .freeze import drop_unused_constants, set_constant
from .kernel_chain import chain_own_kernels
from .ops import graph_op, resolve

aten = torch.ops.aten


def drop_inference_dropout(gm: GraphModule) -> int:
    """``aten.dropout(x, p, train=False)`` returns ``x`` itself (ATen's early return): every
    reader reads ``x`` instead. Exported transformers keep these between a linear and its
    residual add (HF BERT: dense -> dropout -> + input -> LayerNorm)."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.dropout.default and not node.kwargs \
                and len(node.args) == 3 and node.args[2] is False:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def _foldable(gm: GraphModule, node: Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(constant_value(gm, n) is not None for n in inputs)


def fold_constants(gm: GraphModule) -> int:
    """Evaluate ops whose inputs are all constants (e.g. the float weight of a conv that was
    not lowered: dequantize_per_channel of a frozen int8 weight) once, at compile time."""
    folded = 0
    for node in list(gm.graph.nodes):
        if not _foldable(gm, node):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: getattr(gm, n.target))
        value = node.target(*args, **kwargs)
        if not isinstance(value, torch.Tensor):
            continue
        name = f"_folded_{node.name}"
        set_constant(gm, name, value)
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        gm.graph.erase_node(node)
        folded += 1
    return folded


def _channels_last_readers() -> set:
    """The ops that read their first argument (a conv input) channels-last: oneDNN's 2-D int8
    convs and qbackend's conv kernels."""
    readers = {r.op for r in (resolve(name, "cpu") for name in ("qconv", "qconv_tensor", "qconv_binary", "qconv_binary_tensor")) if r}
    if native.available() is None:
        readers.update(form for name in ("qconv", "qconv_dw3x3", "qconv_stem") for form in native.own_kernel_forms(name))
    return readers


def _feeds_convs_only(node: Node, readers: set) -> bool:
    """A 4-D float quantize whose every reader is a conv reading it as its input."""
    value = fake_value(node.args[0])
    return (value is not None and value.dim() == 4 and bool(node.users)
            and all(u.target in readers and u.args[0] is node and node not in u.args[1:] for u in node.users))


def fast_boundary_qdq(gm: GraphModule, device: str = "cpu") -> None:
    """Replace the reference q/dq that stay in the graph by ``fast_qdq``; a quantize read only
    by identical dequantizes becomes one fused quantize-dequantize; on CPU, one read only by
    convs writes channels-last (the model's input before its first conv)."""
    q_op, dq_op = graph_op("quantize_per_tensor"), graph_op("dequantize_per_tensor")
    if q_op is None:
        return
    readers = _channels_last_readers() if device == "cpu" else set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not q_op or node.kwargs:
            continue
        users = list(node.users)
        if users and all(u.target is dq_op and u.args[1:] == node.args[1:] for u in users):
            out_dtype = {u.kwargs.get("out_dtype") for u in users}
            if len(out_dtype) == 1:
                with gm.graph.inserting_before(node):
                    fused = gm.graph.call_function(fast_qdq.quantize_dequantize_per_tensor, node.args, {"out_dtype": out_dtype.pop()})
                fused.meta = dict(users[0].meta)
                for user in users:
                    user.replace_all_uses_with(fused)
                    gm.graph.erase_node(user)
                gm.graph.erase_node(node)
                continue
        node.target = fast_qdq.quantize_per_tensor_channels_last if _feeds_convs_only(node, readers) else fast_qdq.quantize_per_tensor
    replacements = {dq_op: fast_qdq.dequantize_per_tensor,
                    graph_op("quantize_per_tensor_tensor"): fast_qdq.quantize_per_tensor_tensor,
                    graph_op("dequantize_per_tensor_tensor"): fast_qdq.dequantize_per_tensor_tensor}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in replacements:
            node.target = replacements[node.target]


def _mutated(node: Node) -> bool:
    return any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users)


def views_accept_any_layout(gm: GraphModule) -> None:
    """oneDNN conv outputs are channels-last; ``view`` on them raises where eager's contiguous
    output would not. ``reshape`` gives the same values (a view when strides allow)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            if not _mutated(node) and not _mutated(node.args[0]):
                node.target = aten.reshape.default


def float_linears_read_contiguous(gm: GraphModule) -> None:
    """A float ``linear`` of a non-contiguous input of 3 or more dims (nn.MultiheadAttention's
    batch_first in-projection reads a transpose) runs as a ``bmm`` against the weight expanded
    per batch row: vit_b_16 at batch 8 spent 614 ms a call there, Inductor (a packed GEMM)
    479. A contiguous input takes ATen's flattened ``addmm`` (a no-op when it already is)."""
    for node in list(gm.graph.nodes):
        value = fake_value(node.args[0]) if node.op == "call_function" and node.target is aten.linear.default else None
        if value is not None and value.dim() >= 3 and value.is_floating_point():
            with gm.graph.inserting_before(node):
                contiguous = gm.graph.call_method("contiguous", (node.args[0],))
            contiguous.meta = {k: v for k, v in node.args[0].meta.items() if k in ("example_value", "val")}
            node.update_arg(0, contiguous)


def cleanup(gm: GraphModule, device: str = "cpu", fast_boundary: bool = True) -> list[str]:
    """``fast_boundary=False`` keeps the reference q/dq ops (another compiler, Inductor, fuses
    them). Returns notes for the report."""
    gm.graph.eliminate_dead_code()
    fold_constants(gm)
    gm.graph.eliminate_dead_code()
    if fast_boundary:
        fast_boundary_qdq(gm, device)
    views_accept_any_layout(gm)
    float_linears_read_contiguous(gm)
    chained = chain_own_kernels(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    drop_unused_constants(gm)
    return [chained] if chained else []
