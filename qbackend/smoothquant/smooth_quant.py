"""SmoothQuant as a pre-pass on an exported graph, before ``prepare_pt2e``.

    gm = torch.export.export(model, inputs, strict=True).module()
    report = qbackend.smooth_quant(gm, calibration_batches, alpha="search")
    print(report)            # every linear: smoothed or not, alpha, where 1/s went and why
    prepared = prepare_pt2e(gm, quantizer) ...

Linears reading the same activation form a group with one s. Their weight columns are
multiplied by s (a fresh constant per linear: a weight tied elsewhere is never touched), and
1/s is folded into the producer when only the group can see it (``smooth_placement``), else
inserted as ``x * (1/s)`` read by the group alone, which qbackend folds into the activation
quantize (``patterns/qsmooth.py``). The float model computes the same function; the original
parameters are never modified (the exported module shares them with the user's model).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import constant_value
from qbackend.pipeline.report import source_of
from qbackend.smoothquant import smooth_search
from qbackend.smoothquant.smooth_placement import Fold, placement
from qbackend.smoothquant.smooth_stats import observe

aten = torch.ops.aten
AlphaSpec = Union[float, None, str, Mapping[str, Optional[float]], Callable[[str], Optional[float]]]
SEARCH_ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass
class SmoothLine:
    linear: str
    source: str
    smoothed: bool
    alpha: Optional[float] = None
    placed: str = ""  # where 1/s went
    reason: str = ""  # not smoothed: why; smoothed explicitly: why not folded
    losses: Optional[dict] = None  # searched: {alpha or None: calibration loss}

    def line(self) -> str:
        name = f"{self.linear} ({self.source})" if self.source else self.linear
        if not self.smoothed:
            return f"NOT SMOOTHED {name}: {self.reason}" + self._loss_note()
        why = f" (not folded: {self.reason})" if self.reason else ""
        return f"SMOOTHED     {name}: alpha {self.alpha:g}, 1/s {self.placed}{why}" + self._loss_note()

    def _loss_note(self) -> str:
        if not self.losses:
            return ""
        best = min(v for k, v in self.losses.items() if k is not None) if len(self.losses) > 1 else None
        return f"  [int8 loss {self.losses[None]:.3g} unsmoothed" + (f", {best:.3g} best alpha]" if best is not None else "]")


@dataclass
class SmoothReport:
    lines: list

    @property
    def smoothed(self) -> list:
        return [line for line in self.lines if line.smoothed]

    def __str__(self) -> str:
        folded = sum(1 for line in self.smoothed if line.placed.startswith("folded"))
        head = (f"smooth_quant: {len(self.smoothed)} of {len(self.lines)} linears smoothed "
                f"({folded} folded into their producer, {len(self.smoothed) - folded} explicit)")
        return "\n".join([head] + [line.line() for line in self.lines])


def _groups(gm: GraphModule) -> dict[Node, list[Node]]:
    """{activation: the linears with a constant 2-D weight reading it}, in graph order."""
    groups: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default and isinstance(node.args[0], Node):
            weight = constant_value(gm, node.args[1])
            if weight is not None and weight.dim() == 2 and weight.is_floating_point():
                groups.setdefault(node.args[0], []).append(node)
    return groups


def _alpha_for(spec: AlphaSpec, linear: Node) -> Optional[float]:
    if callable(spec):
        return spec(source_of(linear) or linear.name)
    if isinstance(spec, Mapping):
        for pattern, alpha in spec.items():
            if fnmatch.fnmatchcase(source_of(linear), pattern) or fnmatch.fnmatchcase(linear.name, pattern):
                return alpha
        return None
    return spec


class _Editor:
    """Adds constants and nodes with the fake values the quantizer reads (``meta['val']``)."""

    def __init__(self, gm: GraphModule):
        self.gm, self.count = gm, 0

    def _fake(self, like: Node, value: torch.Tensor):
        fake = like.meta.get("val")
        mode = getattr(fake, "fake_mode", None)
        return mode.from_tensor(value) if mode is not None else value

    def constant(self, value: torch.Tensor, hint: str, like: Node) -> Node:
        name = f"_smoothquant_{hint}_{self.count}"
        self.count += 1
        value = value.detach()  # (a constant: no autograd history from the weight it was scaled from)
        self.gm.register_buffer(name, value)
        node = self.gm.graph.get_attr(name)
        node.meta["val"] = self._fake(like, value)
        return node

    def replace_constant(self, user: Node, old: Node, value: torch.Tensor, hint: str) -> Node:
        with self.gm.graph.inserting_before(user):
            new = self.constant(value, hint, old)
        user.replace_input_with(old, new)
        if not old.users:
            self.gm.graph.erase_node(old)
        return new

    def scale_input(self, x: Node, inv_s: torch.Tensor, linears: list[Node]) -> Node:
        with self.gm.graph.inserting_before(linears[0]):
            inv = self.constant(inv_s.to(x.meta["val"].dtype), "inv_s", x)
            mul = self.gm.graph.call_function(aten.mul.Tensor, (x, inv))
        fake = x.meta.get("val")
        if fake is not None:
            with fake.fake_mode:
                mul.meta["val"] = fake * inv.meta["val"]
        for linear in linears:
            linear.replace_input_with(x, mul)
        return mul


def _smooth_group(gm, editor, x, linears, s) -> tuple[str, str]:
    """Scale the group's weights by s and place 1/s: (where it went, why not folded)."""
    fold, why_not = placement(gm, x, linears)
    for linear in linears:
        weight = constant_value(gm, linear.args[1])
        editor.replace_constant(linear, linear.args[1], weight * s.to(weight.dtype), "weight")
    if isinstance(fold, Fold):
        for node, how in fold.constants:
            editor.replace_constant(fold.producer, node, how(constant_value(gm, node), s), "folded")
        return f"folded into {fold.producer.name}", ""
    mul = editor.scale_input(x, 1.0 / s, linears)
    return f"explicit multiply {mul.name} on its input", why_not


def smooth_quant(gm: GraphModule, calibration: Sequence[tuple], alpha: AlphaSpec = "search", *,
                 alphas: Sequence[float] = SEARCH_ALPHAS, min_gain: float = 0.05, max_rows: int = 2048, observer=None,
                 weight_range: tuple = smooth_search.INT8_WEIGHTS) -> SmoothReport:
    """Smooth the linears of an exported module in place; return one line per linear.

    Args:
        gm: ``torch.export.export(...).module()`` (before ``prepare_pt2e``).
        calibration: batches (tuples of inputs); iterated once.
        alpha: a number for every linear; a mapping of fnmatch patterns over the module path
            (or node name) to alpha (None or no match: not smoothed); a callable path -> alpha;
            or "search": per group of linears sharing an input, the alpha of ``alphas`` with the
            lowest int8 calibration loss, or none when no alpha lowers it by ``min_gain``.
            Linears sharing an input share s; the first one's alpha applies to the group.
        min_gain: the search smooths a group only if its loss drops by this fraction.
        max_rows: calibration rows sampled per activation for the search.
        observer: the search's activation quantizer, a factory of observers with
            ``calculate_qparams`` (e.g. the quantizer's HistogramObserver); default: min / max
            over every calibration row. On MiniLM the histogram made the search 7x slower and
            no more accurate (docs/design-notes.md).
        weight_range: the integer range the weights will be quantized to, for the search's
            simulation ((-64, 63) for 7-bit weights; ``quantize_x86`` passes its own).
    """
    groups = _groups(gm)
    stats = observe(gm, calibration, set(groups), max_rows if alpha == "search" else 0)
    editor, lines = _Editor(gm), {}
    for x, linears in groups.items():
        weights = [constant_value(gm, linear.args[1]) for linear in linears]
        losses = None
        if x not in stats:
            chosen, reason = None, "its input was never computed during calibration"
        elif alpha == "search":
            chosen, losses = smooth_search.choose(stats[x], weights, alphas, min_gain, observer, weight_range)
            reason = f"no alpha in {list(alphas)} lowers the int8 calibration loss by {min_gain:.0%}"
        else:
            chosen, reason = _alpha_for(alpha, linears[0]), "no alpha given for it"
        placed = ""
        if chosen is not None:
            placed, reason = _smooth_group(gm, editor, x, linears, smooth_search.factors(stats[x], weights, chosen))
        for linear in linears:
            lines[linear] = SmoothLine(linear.name, source_of(linear), chosen is not None, chosen, placed, reason, losses)
    gm.graph.lint()
    gm.recompile()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return SmoothReport([lines[n] for n in sorted(lines, key=order.get)])
