"""Select and emit: for each anchor (conv / linear / pool, and the int8 data movement: views,
cats), sweep by sweep (``patterns.SWEEPS``) and in graph order within a sweep, the first rule
that matches AND that the device can run is emitted; every other outcome is recorded with its
reason.

``qbackend.explain`` runs this same function: the report and the pass cannot disagree.
"""
from __future__ import annotations

from typing import Optional

from torch.fx import GraphModule, Node

from qbackend.kernels import choice_cache
from qbackend.lowering import PREPARE, TABLES, EmitContext, Lowering, Unsupported, finish
from qbackend.lowering.choice import mode as choice_mode
from qbackend.lowering.common import ANCHOR
from qbackend.patterns import ANCHORS, SWEEPS, GraphView, Reject, anchor_kind, rules_for
from qbackend.patterns.qdq import quantized_operand

from qbackend.pipeline.report import Attempt, Decision, Report, source_of


def _unavailable(ctx: EmitContext, entry, match) -> Optional[str]:
    """Why this device cannot run ``entry`` for this match (None if it can)."""
    if isinstance(entry, Unsupported):
        return entry.reason
    for logical in entry.needs_of(match):
        resolved = ctx.op(logical)
        if not resolved:
            return resolved.reason
    reason = entry.limits(match) if entry.limits is not None else None
    if reason is not None and entry.runs_anyway is not None and entry.runs_anyway(ctx, match):
        return None
    return reason


def _runnable(ctx: EmitContext, entry, match):
    """(match the device can run, note about what was left unfused) or raise CannotRun. A
    post-op the kernel refuses stays in the graph rather than losing the whole lowering."""
    reason = _unavailable(ctx, entry, match)
    if reason is None:
        return match, ""
    trimmed = match.without_tail()
    if trimmed is not None and _unavailable(ctx, entry, trimmed) is None:
        left = ", ".join(n for n in match.post_op_names() if n not in trimmed.post_op_names())
        return trimmed, f"{left} not fused: {reason}"
    raise CannotRun(f"{match.rule.name} matched but {ctx.device} cannot run it: {reason}")


class CannotRun(Exception):
    pass


def _emit(ctx: EmitContext, lowering: Lowering, match) -> Node:
    graph = ctx.gm.graph
    with graph.inserting_before(match.result):
        new = lowering.emit(ctx, match)
    new.meta.update(match.result.meta)  # same shape and dtype: later prepacks tune for this shape
    new.meta["qbackend_rule"] = match.rule.name
    new.meta["qbackend_replaces"] = match.result.name
    new.meta[ANCHOR] = match.anchor.name  # (its report line: rewrites after lowering name it)
    match.result.replace_all_uses_with(new)
    # Erase the chain now: DCE would keep an in-place post-op (relu_) and so the float conv.
    for node in reversed(match.nodes):
        if not node.users:
            graph.erase_node(node)
            ctx.erased.add(node)
    return new


def decide(view: GraphView, ctx: EmitContext, table: dict, anchor: Node, kind: str) -> Decision:
    decision = Decision(anchor.name, kind, source_of(anchor), lowered=False)
    for rule in filter(lambda rule: rule.starts_at(anchor), rules_for(kind)):
        match = rule.select(view, anchor)
        if isinstance(match, Reject):
            decision.tried.append(Attempt(rule.name, match.reason, rule.where, matched=False))
            continue
        try:
            match, note = _runnable(ctx, table[rule.name], match)
            ctx.notes, ctx.kernel = [note] if note else [], ""
            new = _emit(ctx, table[rule.name], match)
        except CannotRun as why:
            decision.tried.append(Attempt(rule.name, str(why), rule.where))
            continue
        except Exception as error:  # a kernel refusing its arguments at prepack time
            decision.tried.append(Attempt(rule.name, f"{rule.name} failed to emit: {type(error).__name__}: {error}", rule.where))
            continue
        view.invalidate()
        decision.lowered = True
        decision.rule, decision.op = rule.name, ctx.kernel or _op_name(new)
        decision.post_ops = match.post_op_names()
        decision.reason = "; ".join(ctx.notes)
        return decision
    # Not lowered. A rule that matched but that the device refused says the most; otherwise
    # the most general rule (tried last) names the basic requirement that failed, where a
    # longer rule's "no add follows" would hide it.
    refused = [a for a in decision.tried if a.matched]
    first = refused[0] if refused else decision.tried[-1]
    decision.reason, decision.where = first.reason, first.where
    if not refused and kind in ("conv", "linear") and not any(quantized_operand(view, a) for a in anchor.args[:2]):
        decision.float_layer = True
        decision.reason, decision.where = (f"a float {kind}: neither its input nor its weight is dequantized (left float "
                                           "when the model was quantized: by the quantizer's recipe or keep_float)"), ""
    elif kind in ("conv", "linear") and _weight_from_outside(view, anchor):
        decision.weight_from_outside = True
        decision.reason, decision.where = (f"its input is quantized but its weight is a float input of this graph: the "
                                           "weight's dequantize ran outside it (Dynamo split the model there: a graph "
                                           "break)"), ""
    return decision


def _weight_from_outside(view, anchor: Node) -> bool:
    """A conv / linear whose input is dequantized in this graph and whose weight is a float
    placeholder: what a graph Dynamo split off a converted model gets (its weights' dequantize
    ops landed in an earlier graph), a layer no quantizer leaves so."""
    x, weight = anchor.args[:2]
    return (quantized_operand(view, x) and isinstance(weight, Node) and weight.op == "placeholder"
            and not quantized_operand(view, weight))


def _op_name(node: Node) -> str:
    target = node.target
    return target.name() if hasattr(target, "name") else str(target)


def lower(gm: GraphModule, device: str, registry=None, weight_only_compute: str = "auto",
          weight_only_dense_rows: Optional[int] = None, need_meta: bool = False, kernel_choice: Optional[str] = None) -> Report:
    """``kernel_choice``: lowering/choice.py's mode (None: $QBACKEND_KERNEL_CHOICE, else "measure")."""
    report = Report(device)
    anchors = [(n, anchor_kind(n)) for n in gm.graph.nodes]
    anchors = [(n, kind) for n, kind in anchors if kind is not None]
    order = {n.name: i for i, (n, _) in enumerate(anchors)}
    table = TABLES.get(device)
    if table is None:
        reason = f"no lowering table for device {device!r} (qbackend knows {sorted(TABLES)}); ran unlowered"
        report.notes.append(reason)
        report.decisions = [Decision(n.name, kind, source_of(n), False, reason=reason) for n, kind in anchors if kind in ANCHORS]
        return report
    view, ctx = GraphView(gm), EmitContext(gm, device, registry, need_meta=need_meta, weight_only_compute=weight_only_compute,
                                            weight_only_dense_rows=weight_only_dense_rows, kernel_choice=choice_mode(kernel_choice))
    if ctx.kernel_choice != "prior":
        ctx.choices = choice_cache.shared()
    for prepare in PREPARE[device]:
        note = prepare(gm)
        if note:
            report.notes.append(note)
    for name, entry in table.items():
        unresolved = [r for r in map(ctx.op, getattr(entry, "needs", ())) if not r]
        if unresolved:
            report.notes.append(f"rule {name} disabled on {device}: {unresolved[0].reason}")
    for sweep in SWEEPS:
        for anchor, kind in anchors:
            if kind in sweep and anchor not in ctx.erased:  # (a view chain's later ops go with its first)
                decisions = report.decisions if kind in ANCHORS else report.moves
                decisions.append(decide(view, ctx, table, anchor, kind))
    finish(ctx, report)
    report.decisions.sort(key=lambda d: order[d.node])
    return report
