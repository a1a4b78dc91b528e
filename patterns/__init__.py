"""WHAT qbackend matches: one row per rule, in a list you can print (``python -m qbackend.patterns``)."""
from __future__ import annotations

from .attention import ATTENTION_ANCHORS, FUSED_SDPA, SDPA
from .base import GraphView, Match, Reject, Rule
from .qconv import CONV_ANCHORS, QCONV
from .qconv_binary import QCONV_ADD
from .qlinear import LINEAR_ANCHORS, QLINEAR, QLINEAR_DYNAMIC
from .qlinear_binary import QLINEAR_ADD, QLINEAR_ADD_DYNAMIC
from .qadd import ADD_ANCHORS, QADD
from .qavgpool import AVG_POOL_ANCHORS, QAVGPOOL
from .qpool import POOL_ANCHORS, QMAXPOOL2D
from .qcat import CAT_ANCHORS, QCAT
from .qview import QVIEW, VIEW_ANCHORS
from .qlayernorm import NORM_ANCHORS, QLAYERNORM
from .qscale import QSCALE
from .qsmooth import QSMOOTH, SMOOTH_ANCHORS
from .weight_only import INT4_WEIGHT_LINEAR, INT8_WEIGHT_LINEAR, is_weight_matmul

RULES: tuple[Rule, ...] = (QCONV_ADD, QCONV, QLINEAR_ADD_DYNAMIC, QLINEAR_ADD, QLINEAR, QLINEAR_DYNAMIC, QMAXPOOL2D, QAVGPOOL,
                           QCAT, QVIEW, QSMOOTH, QSCALE, QLAYERNORM, QADD, INT4_WEIGHT_LINEAR, INT8_WEIGHT_LINEAR, SDPA, FUSED_SDPA)

# The node kinds the report accounts for, one line each.
ANCHORS = {"conv": CONV_ANCHORS, "linear": LINEAR_ANCHORS, "pool": POOL_ANCHORS, "avgpool": AVG_POOL_ANCHORS,
           "attention": ATTENTION_ANCHORS}
# Int8 data movement: rewritten like the others, but counted in one report line, not one line
# per node (a model has many views and cats, most of them never quantized).
MOVES = {"view": VIEW_ANCHORS, "cat": CAT_ANCHORS, "smooth": SMOOTH_ANCHORS, "norm": NORM_ANCHORS, "add": ADD_ANCHORS}
# The pass visits the graph once per sweep, each in graph order. Views go first: hoisting a
# quantize above a view chain puts it next to its producer, where the rules of the later
# sweeps (a cat, pool, conv or linear folding its output quantize, a smoothing multiply
# fused with it) then find it.
SWEEPS: tuple[tuple[str, ...], ...] = (("view",), ("cat", "smooth", "norm"), ("conv", "linear", "pool", "avgpool", "attention"),
                                        ("add",))


def _check_registry():
    names = [rule.name for rule in RULES]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        raise RuntimeError(f"duplicate rule names: {sorted(duplicates)}")
    for rule in RULES:
        if rule.anchors not in ANCHORS and rule.anchors not in MOVES:
            raise RuntimeError(f"rule {rule.name} anchors on unknown kind {rule.anchors!r}")
    swept = [kind for sweep in SWEEPS for kind in sweep]
    if sorted(swept) != sorted({**ANCHORS, **MOVES}):
        raise RuntimeError(f"every anchor kind must be in exactly one sweep: {swept}")


_check_registry()


def anchor_kind(node) -> str | None:
    """The anchor kind of ``node`` (a key of ANCHORS or MOVES), else None."""
    if node.op != "call_function":
        return None
    for kind, targets in {**ANCHORS, **MOVES}.items():
        if node.target in targets:
            return kind
    return "linear" if is_weight_matmul(node) else None


def rules_for(kind: str) -> list[Rule]:
    """Rules anchored on ``kind``, longest pattern (highest priority) first."""
    return sorted((r for r in RULES if r.anchors == kind), key=lambda r: -r.priority)


def table() -> str:
    rows = ["| rule | anchors | matches | before => after | defined at |", "|---|---|---|---|---|"]
    rows += [f"| {r.name} | {r.anchors} | `{_cell(r.pattern)}` | {_cell(r.doc)} | {r.where} |" for r in rules_for_all()]
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules_for_all() -> list[Rule]:
    return sorted(RULES, key=lambda r: (r.anchors, -r.priority))


__all__ = ["RULES", "ANCHORS", "MOVES", "SWEEPS", "GraphView", "Match", "Reject", "Rule", "anchor_kind", "rules_for", "table"]
