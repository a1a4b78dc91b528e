"""After lowering: drop dead nodes, fold constant subgraphs, run the q/dq that remain on the
fast exact implementations, and keep views valid on channels-last kernel outputs. Before
lowering: drop inference-mode dropouts, which return their input and would hide a residual
add from the linear that feeds it."""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from qbackend.lowering.common import static_shape
from qbackend.lowering.signed_int8 import nan_as
from qbackend.patterns.base import fake_value

from qbackend.kernels import fast_qdq
from qbackend.kernels import layer_norm_quantize, registry
from qbackend.passes.attention_cleanup import attention_inputs_uncopied, attention_masks_once, attention_output_quantized, attention_reads_projection, repeated_kv_read_once
from qbackend.passes.batch_norm_quantize import batch_norms_quantized
from qbackend.passes.channel_shuffle import shuffles_in_one_pass
from qbackend.passes.constant_fills import MAX_ELEMENTS, fresh_value
from qbackend.passes.constant_writes import FoldedConstants
from qbackend.passes.dead_code import eliminate_dead_code, writes
from qbackend.llm.dense_swiglu import swiglus_fused
from qbackend.llm.dense_weight_only import dense_slices_pass
from qbackend.passes.direct_ops import direct_ops
from qbackend.passes.depthwise_norm import depthwise_norms_fused
from qbackend.passes.float_linear import float_linears
from qbackend.graph_constants import drop_unused_constants
from qbackend.llm.huge_pages import streamed_weights_on_huge_pages
from qbackend.passes.in_place import op_schema
from qbackend.kernels.kernel_chain import chain_own_kernels
from qbackend.llm.kv_append import kv_cache_appends
from qbackend.llm.kv_int8 import kv_cache_int8
from qbackend.passes.l2_normalize import l2_normalizes_fused
from qbackend.passes.pool_quantize import pools_read_floats
from qbackend.llm.rms_norm import rms_norms_fused
from qbackend.llm.rotary import rotaries_fused
from qbackend.llm.rotary_table import rotary_tables_cached
from qbackend.llm.silu_mul import silu_muls_fused
from qbackend.passes.view_chains import view_chains_collapsed
from qbackend.ops import graph_op, resolve

aten = torch.ops.aten
METADATA_ASSERT = aten._assert_tensor_metadata.default  # (it only raises: a chain may run after it)


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


# Factories of fixed values: a transformer's masks start from ``arange`` over the sequence
# (all-MiniLM-L6-v2's ~20 mask-building ops per call fold with them: 6.02 -> 5.88 ms at batch 1)
_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
              aten.full.default, aten.scalar_tensor.default}


# qbackend's own kernels as the lowered graph calls them (plain functions) that only read their
# inputs and return new tensors: every form but the in-place ``add_quantize_``
_PURE_KERNELS = frozenset(function for name, function in registry.PLAIN.items() if not name.endswith("_"))


def _foldable(constants: FoldedConstants, node: Node) -> bool:
    if node.op == "call_function" and node.target in _PURE_KERNELS:  # (Swin V2's position-bias MLP: two linears)
        return all(constants.value(n) is not None for n in node.all_input_nodes)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    inputs = node.all_input_nodes
    if not inputs:
        value = fake_value(node)
        return node.target in _FACTORIES and value is not None and value.numel() <= MAX_ELEMENTS
    return all(constants.value(n) is not None for n in inputs)


def fold_constants(gm: GraphModule) -> list[str]:
    """Evaluate ops whose inputs are all constants (e.g. the float weight of a conv that was
    not lowered: dequantize_per_channel of a frozen int8 weight) once, at compile time, and
    the writes into such values that take constants only (constant_writes.py). Returns notes
    for the report: the folded values the graph changes at run time, copied on every call."""
    constants = FoldedConstants(gm)
    for node in list(gm.graph.nodes):
        if constants.fold_write(node):
            continue
        value, checked = fresh_value(gm, node), False
        if value is None and _foldable(constants, node):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: getattr(gm, n.target))
            value = node.target(*args, **kwargs)
            checked = value is None and not op_schema(node.target).returns  # (an assert on constants holds on every call)
        if isinstance(value, torch.Tensor) or checked:
            constants.replace(node, value)
        else:
            constants.kept(node)
    return constants.copy_per_call()


def _channels_last_readers() -> set:
    """The ops that read their first argument (a conv input) channels-last: oneDNN's 2-D int8
    convs and qbackend's conv kernels."""
    readers = {r.op for r in (resolve(name, "cpu") for name in ("qconv", "qconv_tensor", "qconv_binary", "qconv_binary_tensor")) if r}
    if registry.available() is None:
        readers.update(form for name in ("qconv", "qconv_depthwise", "qconv_stem") for form in registry.own_kernel_forms(name))
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
                    fused = gm.graph.call_function(fast_qdq.quantize_dequantize_per_tensor, node.args,
                                                   {"out_dtype": out_dtype.pop(), **nan_as(node)})
                fused.meta = dict(users[0].meta)
                for user in users:
                    user.replace_all_uses_with(fused)
                    gm.graph.erase_node(user)
                gm.graph.erase_node(node)
                continue
        node.target = fast_qdq.quantize_per_tensor_channels_last if _feeds_convs_only(node, readers) else fast_qdq.quantize_per_tensor
        node.kwargs = nan_as(node)
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


# own kernels' results that are contiguous whatever their inputs: (plain function, tuple index or None)
_CONTIGUOUS_RESULTS = {(layer_norm_quantize.layer_norm_and_quantize, 0), (layer_norm_quantize.layer_norm_and_quantize, 1), (layer_norm_quantize.layer_norm_quantize, None)}


def _always_contiguous(node) -> bool:
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        return (node.args[0].target, node.args[1]) in _CONTIGUOUS_RESULTS
    return (node.target, None) in _CONTIGUOUS_RESULTS


def contiguous_copies_dropped(gm: GraphModule) -> None:
    """``x.contiguous()`` returns x itself where x is contiguous: on an own kernel's result that
    always is (the LayerNorm's float output, made dense for the residual add of the linear
    after it), the call is left out (~3 us each, 12 a forward of all-MiniLM-L6-v2)."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is aten.contiguous.default and len(node.args) == 1
                and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format
                and _always_contiguous(node.args[0])):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


# view ops -> the Tensor method taking the same positional arguments: a method call costs ~1.1 us
# less than the operator's (Python's OpOverload.__call__; reshape 1.8 vs 3.2 us, transpose 1.1
# vs 2.0), and all-MiniLM-L6-v2's lowered graph makes ~110 such calls a forward
_VIEW_METHODS = {aten.reshape.default: "reshape", aten.view.default: "view", aten.transpose.int: "transpose",
                 aten.permute.default: "permute", aten.unsqueeze.default: "unsqueeze", aten.squeeze.dim: "squeeze",
                 aten.select.int: "select", aten.flatten.using_ints: "flatten"}


def _narrow_args(node: Node) -> Optional[tuple]:
    """(dim, start, length) of a unit-step slice with int bounds from 0 within a static size."""
    x, dim, start, end, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
    shape = static_shape(x) if isinstance(x, Node) else None
    if shape is None or step != 1 or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return None
    start, end = 0 if start is None else start, shape[dim] if end is None else end
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= min(end, shape[dim])):
        return None
    return dim, start, min(end, shape[dim]) - start


def views_as_tensor_methods(gm: GraphModule) -> None:
    """Run the graph's view ops as Tensor methods (the same values; see _VIEW_METHODS)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target in _VIEW_METHODS:
            node.op, node.target = "call_method", _VIEW_METHODS[node.target]
        elif node.target is aten.slice.Tensor and (narrow := _narrow_args(node)) is not None:
            node.op, node.target, node.args = "call_method", "narrow", (node.args[0], *narrow)


def cleanup(gm: GraphModule, device: str = "cpu", fast_boundary: bool = True, kernel_choice: Optional[str] = None,
            weight_only_compute: str = "auto", kv_cache: str = "float") -> list[str]:
    """``fast_boundary=False`` keeps the reference q/dq ops (another compiler, Inductor, fuses
    them); ``kernel_choice``: lowering/choice.py's mode; ``kv_cache``: kv_int8.py's option.
    Returns notes for the report."""
    eliminate_dead_code(gm)
    copied = fold_constants(gm)
    eliminate_dead_code(gm)
    if fast_boundary:
        fast_boundary_qdq(gm, device)
    views_accept_any_layout(gm)
    if fast_boundary:
        contiguous_copies_dropped(gm)
    notes = [*copied, float_linears(gm, device, kernel_choice) if fast_boundary else None, attention_masks_once(gm),
             attention_output_quantized(gm) if fast_boundary else None, attention_inputs_uncopied(gm),
             repeated_kv_read_once(gm) if fast_boundary else None,
             attention_reads_projection(gm) if fast_boundary else None, kv_cache_appends(gm) if fast_boundary else None,
             kv_cache_int8(gm) if fast_boundary and kv_cache == "int8" else None,
             rotary_tables_cached(gm) if fast_boundary and device == "cpu" else None,
             rotaries_fused(gm) if fast_boundary else None, rms_norms_fused(gm) if fast_boundary else None,
             silu_muls_fused(gm) if fast_boundary else None, l2_normalizes_fused(gm) if fast_boundary else None,
             shuffles_in_one_pass(gm) if fast_boundary else None, batch_norms_quantized(gm) if fast_boundary else None,
             depthwise_norms_fused(gm) if fast_boundary else None, pools_read_floats(gm) if fast_boundary else None,
             dense_slices_pass(gm, kernel_choice, weight_only_compute) if fast_boundary and device == "cpu" else None,
             swiglus_fused(gm) if fast_boundary and device == "cpu" else None,
             view_chains_collapsed(gm) if fast_boundary else None,
             streamed_weights_on_huge_pages(gm) if device == "cpu" else None,
             direct_ops(gm) if fast_boundary else None]
    if fast_boundary:  # (the passes above read the view ops' targets)
        views_as_tensor_methods(gm)
    eliminate_dead_code(gm)  # (before the chains: a dead view would be a step)
    # (last: the runs it replaces are the graph's final calls)
    notes.append(chain_own_kernels(gm, movable=lambda node: not writes(node) or node.target is METADATA_ASSERT))
    gm.graph.lint()
    gm.recompile()
    drop_unused_constants(gm)
    return [note for note in notes if note]
