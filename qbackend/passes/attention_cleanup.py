"""After lowering, around fused attention: its boolean mask made additive once, its output
quantized by the kernel itself, its inputs read where the projection wrote them (no views, no
copy)."""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qbackend.lowering.common import additive_mask
from qbackend.patterns.base import fake_value

from qbackend.kernels import fast_qdq
from qbackend.kernels import registry
from qbackend.kernels import attention as attention_kernel
from qbackend.passes.view_chains import positions, replayed, view_chain, writes

aten = torch.ops.aten


def attention_masks_once(gm: GraphModule) -> Optional[str]:
    """A boolean attention mask that several fused attentions read becomes the float mask they
    each built from it (0 where True, -inf where False: ATen's own conversion) once, before
    the first: all-MiniLM-L6-v2 converted its one mask in each of its 6 layers (190 vs 171 us
    an attention call at batch 1)."""
    readers: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            mask_node = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            mask, query = fake_value(mask_node), fake_value(node.args[0])
            if mask is not None and mask.dtype == torch.bool and query is not None and query.dtype == torch.float32:
                readers.setdefault(mask_node, []).append(node)
    shared = {mask: attentions for mask, attentions in readers.items() if len(attentions) > 1}
    for mask, attentions in shared.items():
        with gm.graph.inserting_before(attentions[0]):
            additive = additive_mask(gm.graph, mask)
        for attention in attentions:
            if len(attention.args) > 3:
                attention.update_arg(3, additive)
            else:
                attention.update_kwarg("attn_mask", additive)
    calls = sum(map(len, shared.values()))
    return f"{calls} attention calls share {len(shared)} float mask(s) built once" if shared else None


# Views that take any strides (a reshape copies when it must; ``view`` could fail, so it is not here)
_STRIDED_VIEWS = {aten.select.int, aten.reshape.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
                  aten.squeeze.dim, aten.slice.Tensor}
# Readers whose result does not depend on their inputs' strides
_ANY_STRIDES = {aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention,
                torch.nn.functional.scaled_dot_product_attention}


def _reads_any_strides(target) -> bool:
    """torch's attention, or ours in any form (it passes strides to the kernel, copying only a
    last dim that is not contiguous); or a function that says it (kv_append.append)."""
    return (target in _ANY_STRIDES or target in (attention_kernel.attention_f32, attention_kernel.attention_quantize)
            or getattr(target, "reads_any_strides", False)
            or str(target) in (f"{registry.NAMESPACE}.attention_f32.default", f"{registry.NAMESPACE}.attention_quantize.default"))


def _copies_values_of(user: Node, value: Node) -> bool:
    """``user`` is ``destination.index_copy_(dim, index, value)`` (a StaticCache's update): it
    reads ``value``'s values into another tensor, whatever their strides."""
    if not ((user.op == "call_method" and user.target in ("index_copy_", "index_copy"))
            or (user.op == "call_function" and user.target in (aten.index_copy_.default, aten.index_copy.default))):
        return False
    return len(user.args) == 4 and not user.kwargs and user.args[3] is value and user.args[0] is not value


def reaches_only_strided_readers(value: Node, values_only=frozenset(), readers=None) -> bool:
    """Each reader of ``value`` (or those of ``readers``), and through views every reader after
    it, takes any strides; also ``values_only`` targets where only the values matter, not the
    layout they give (a cat), and an index_copy_ of the value into another tensor."""
    pending = [(value, user) for user in (value.users if readers is None else readers)]
    while pending:
        source, user = pending.pop()
        if _copies_values_of(user, source):
            continue
        if user.op != "call_function" or user.kwargs.get("out") is not None:
            return False
        if user.target in _STRIDED_VIEWS:
            pending.extend((user, after) for after in user.users)
        elif not _reads_any_strides(user.target) and user.target not in values_only:
            return False
    return True


def attention_inputs_uncopied(gm: GraphModule) -> Optional[str]:
    """torch's MultiheadAttention makes its packed q / k / v projection contiguous before
    splitting it into heads (``unflatten ... squeeze(-2).contiguous()``): a copy of the whole
    projection, which only views then read, and then fused attention, which takes any strides.
    Without it: vit_b_16 60.8 -> 59.3 ms at batch 1, 491 -> 483 at 8, bit-identical."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.contiguous.default and len(node.args) == 1 \
                and not node.kwargs and isinstance(node.args[0], Node) and reaches_only_strided_readers(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    return f"{dropped} copy(s) before fused attention left out (it reads the strided views)" if dropped else None


def _output_quantize(attention: Node) -> Optional[Node]:
    """The uint8 quantize that is the attention's one reader, where the kernel can write its
    bytes: NaN stored as the reference's 0 (the kernel stores qmin)."""
    if len(attention.users) != 1:
        return None
    [quantize] = attention.users
    if quantize.target is not fast_qdq.quantize_per_tensor or quantize.args[0] is not attention or len(quantize.args) != 6:
        return None
    _, scale, zero_point, qmin, qmax, dtype = quantize.args
    if dtype is not torch.uint8 or quantize.kwargs.get("nan_as", 0) != qmin:
        return None
    if not (isinstance(scale, float) and all(isinstance(n, int) for n in (zero_point, qmin, qmax))):
        return None
    return quantize


def attention_output_quantized(gm: GraphModule) -> Optional[str]:
    """qbackend's attention kernel followed by the quantize of its output (the out-projection's
    input) becomes one kernel writing the bytes, in [batch, length, heads, head dim] order, with
    the quantize's arithmetic on the same float32 values (bit-identical). all-MiniLM-L6-v2 at
    batch 1: the quantize took 10-32 us a layer, the kernel writes a quarter of the bytes."""
    fused = 0
    for attention in list(gm.graph.nodes):
        if attention.op != "call_function" or attention.target is not attention_kernel.attention_f32 or attention.kwargs \
                or len(attention.args) != 5:  # (a causal one: attention_quantize takes none)
            continue
        quantize = _output_quantize(attention)
        if quantize is None:
            continue
        q, k, v, mask, scale = attention.args
        out_grid = quantize.args[1:5]
        values = [fake_value(n) if isinstance(n, Node) else None for n in (q, k, v, mask)]
        if any(value is None for value in values[:3]) or (mask is not None and values[3] is None):
            continue
        if attention_kernel.attention_quantize_refusal(*values, *out_grid) is not None:
            continue
        with gm.graph.inserting_before(quantize):
            rows = gm.graph.call_function(attention_kernel.attention_quantize, (q, k, v, mask, scale, *out_grid))
            rows.meta["example_value"] = registry.FAKES["attention_quantize"](*values, scale, *out_grid)
            heads = gm.graph.call_function(aten.transpose.int, (rows, 1, 2))  # (the [B, H, L, D] value the graph had)
            heads.meta["example_value"] = rows.meta["example_value"].transpose(1, 2)
        quantize.replace_all_uses_with(heads)
        gm.graph.erase_node(quantize)
        gm.graph.erase_node(attention)
        fused += 1
    return f"{fused} attention output quantize(s) written by the attention kernel" if fused else None


# views between a projection and the attention reading it (a merged q / k / v linear split into
# heads): the strided ones above, and ``view`` / ``unflatten`` (a replay that cannot take one
# leaves the attention as it is)
_PROJECTION_VIEWS = _STRIDED_VIEWS | {aten.view.default, aten.unflatten.int}


def _affine_strides(view: torch.Tensor, flat: torch.Tensor) -> Optional[tuple]:
    """(offset, strides) with view[i] == offset + sum(i_k * stride_k) for every index i, where
    ``view`` holds positions in ``flat`` (0 .. n - 1); None if the positions are no strided view."""
    offset = int(view.reshape(-1)[0])
    strides = []
    for dim, size in enumerate(view.shape):
        step = tuple(1 if d == dim else 0 for d in range(view.dim()))
        strides.append(int(view[step]) - offset if size > 1 else 0)
    if min(strides) < 0:
        return None
    return (offset, tuple(strides)) if torch.equal(flat.as_strided(view.shape, strides, offset), view) else None


def _projection_geometry(operands: list) -> Optional[tuple]:
    """``attention_from_projection``'s geometry for q, k, v, or None: each a strided view of one
    float32 projection of static shape (in its row-major order), the last dim contiguous. Found
    by replaying the ops on the projection's element positions: the ops' values never depend on
    the input's strides, and a reshape that copies (MultiheadAttention's heads of a batch > 1)
    still yields positions the kernel can read in place."""
    chains = [view_chain(n, _PROJECTION_VIEWS) for n in operands]
    if any(not chain for _, chain in chains) or len({root for root, _ in chains}) != 1:
        return None
    root = chains[0][0]
    value = fake_value(root)
    start = positions(root) if value is not None and value.dtype == torch.float32 else None
    if start is None:
        return None
    flat = start.reshape(-1)
    geometry = []
    for _, chain in chains:
        view = replayed(chain, start)
        if view is None:
            return None
        found = _affine_strides(view, flat) if view.dim() == 4 and view.numel() else None
        if found is None or found[1][-1] != 1:
            return None
        geometry.append((view.shape, *found))
    (q_shape, *_), (k_shape, *_) = geometry[:2]
    if k_shape[1] != q_shape[1]:  # (grouped-query heads: attention_f32 regroups the queries first)
        return None
    return (tuple(value.shape), tuple(q_shape), k_shape[2], tuple(offset for _, offset, _ in geometry),
            tuple(strides[:3] for _, _, strides in geometry))


def attention_reads_projection(gm: GraphModule) -> Optional[str]:
    """qbackend's attention whose q, k and v are views of one projection reads them where the
    projection wrote them: one call with the views' offsets and strides, fixed at compile time,
    in place of the views (9 calls a layer for BERT's merged q / k / v) and of the per-call
    operand checks."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs or node.target not in (attention_kernel.attention_f32, attention_kernel.attention_quantize) \
                or (node.target is attention_kernel.attention_f32 and len(node.args) != 5):  # (a causal one: the views stay)
            continue
        q, k, v, mask, scale, *out_grid = node.args
        geometry = _projection_geometry([q, k, v])
        if geometry is None:
            continue
        projection = view_chain(q, _PROJECTION_VIEWS)[0]
        quantize = tuple(out_grid) if out_grid else None
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(attention_kernel.attention_from_projection, (projection, geometry, mask, scale, quantize))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        rewritten += 1
    return f"{rewritten} attention call(s) read q / k / v inside their projection" if rewritten else None


# repeat_kv's three views (transformers: x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d))
_EXPANDS = frozenset({"expand", aten.expand.default})
_MERGES = frozenset({"reshape", "view", aten.reshape.default, aten.view.default})
_UNSQUEEZES = frozenset({"unsqueeze", aten.unsqueeze.default})
_NEW_HEAD_AXIS = (slice(None), slice(None), None)  # x[:, :, None] (also with ", :, :" or "..." after)


def _view_of(node, targets) -> Optional[Node]:
    """The tensor ``node`` views when it is a call of one of ``targets`` on it, else None."""
    if not isinstance(node, Node) or node.op not in ("call_method", "call_function") or node.kwargs or not node.args:
        return None
    return node.args[0] if node.target in targets and isinstance(node.args[0], Node) else None


def _new_axis_at_2(node: Node) -> bool:
    """``node`` is x[:, :, None] (any trailing ``:`` or ``...``) or x.unsqueeze(2) of a 4-D x."""
    if node.target is operator.getitem:
        index = node.args[1]
        return isinstance(index, tuple) and index[:3] == _NEW_HEAD_AXIS and all(
            i == slice(None) or i is Ellipsis for i in index[3:])
    return len(node.args) == 2 and node.args[1] in (2, -3)


def _same(a, b) -> bool:
    """Sizes known equal (symbolic ones too, without adding a guard)."""
    return statically_known_true(a == b)


def _repeated_heads(node: Node) -> Optional[Node]:
    """x, when ``node`` is repeat_kv of x [B, kv, S, D]: each head repeated n times in a row,
    [B, kv * n, S, D] (a grouped-query model's keys / values repeated for torch's attention). By
    the views and their recorded shapes, which may be symbolic (a cache length Dynamo made
    dynamic)."""
    expanded = _view_of(node, _MERGES)
    added = _view_of(expanded, _EXPANDS)
    x = _view_of(added, _UNSQUEEZES | {operator.getitem})
    if x is None or not _new_axis_at_2(added):
        return None
    shapes = [getattr(fake_value(n), "shape", None) for n in (x, expanded, node)]
    if any(shape is None for shape in shapes):
        return None
    (b, kv, s, d), wide, out = shapes
    n = wide[2] if len(wide) == 5 else None
    if not isinstance(n, int) or n < 2 or len(out) != 4:
        return None
    return x if all(_same(u, w) for u, w in zip((*wide[:2], *wide[3:]), (b, kv, s, d))) and all(
        _same(u, w) for u, w in zip(out, (b, kv * n, s, d))) else None


def repeated_kv_read_once(gm: GraphModule) -> Optional[str]:
    """Keys and values that a grouped-query model repeats for each query head (transformers'
    repeat_kv, where it does not pass enable_gqa: with a mask, so a static cache's every decode
    step) go to the own attention kernel unrepeated: it reads each key / value head once for its
    group of query heads. The repeat was a copy of the whole cache, twice per layer and step.
    Where nothing is written between the repeat and the attention."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not attention_kernel.attention_f32 or node.kwargs or len(node.args) < 5:
            continue
        keys, values = _repeated_heads(node.args[1]), _repeated_heads(node.args[2])
        if keys is None or values is None:
            continue
        q, mask = fake_value(node.args[0]), fake_value(node.args[3])
        k, v = fake_value(keys), fake_value(values)
        if any(t is None for t in (q, k, v)) or (node.args[3] is not None and mask is None):
            continue
        is_causal = bool(node.args[5]) if len(node.args) > 5 else False
        if attention_kernel.attention_refusal(q, k, v, mask, is_causal=is_causal) is not None:
            continue
        first = min(order[node.args[1].args[0].args[0]], order[node.args[2].args[0].args[0]])  # (the new axes)
        if any(writes(between) for between in nodes[first:order[node]]):  # (into the cache, or a view of it: any write)
            continue
        node.update_arg(1, keys)
        node.update_arg(2, values)
        replaced += 1
    return f"{replaced} attention call(s) read grouped keys / values unrepeated" if replaced else None

