"""One line per conv / linear / pool: what it became, or the first reason it stayed as it was.

Int8 data movement (view chains, cats) gets one line for all of them: how many of each kind
now run on int8. Their per-node decisions are in ``Report.moves`` (most views and cats of a
model never touch a quantized tensor; a line each would bury the conv / linear lines).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from torch.fx import Node


def source_of(node: Node) -> str:
    """Where the user wrote this op: the innermost module path, else the last stack frame."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _ = list(stack.values())[-1]
        return str(path).replace("L['self'].", "").replace("L__self___", "")
    frames = [line.strip() for line in node.meta.get("stack_trace", "").splitlines() if line.strip().startswith("File ")]
    if frames:  # 'File "/path/model.py", line 12, in forward' -> 'model.py:12'
        path, line = frames[-1].split('"')[1], frames[-1].split("line ")[1].split(",")[0]
        return f"{path.rsplit('/', 1)[-1]}:{line}"
    return ""


@dataclass(frozen=True)
class Attempt:
    rule: str
    reason: str
    where: str  # file:line of the rule
    matched: bool = True  # the pattern matched but the device could not run it


@dataclass
class Decision:
    node: str
    kind: str  # "conv" / "linear"
    source: str
    lowered: bool
    rule: Optional[str] = None
    op: Optional[str] = None  # the real op, e.g. onednn::qconv_pointwise.default
    post_ops: list = field(default_factory=list)
    reason: str = ""  # not lowered: the first reason; lowered: a note (e.g. residual copied)
    where: str = ""  # file:line of the rule that gave the reason
    tried: list = field(default_factory=list)  # an Attempt for every rule that did not apply
    float_layer: bool = False  # kept: neither operand quantized (the model left it float)
    weight_from_outside: bool = False  # kept: a quantized input, but a float weight the graph gets as an input

    def line(self) -> str:
        name = f"{self.node}" + (f" ({self.source})" if self.source else "")
        if self.lowered:
            note = f"  [{self.reason}]" if self.reason else ""
            return f"LOWERED  {self.kind:<6} {name}: {self.rule} -> {self.op} + {', '.join(self.post_ops)}{note}"
        where = f"  ({self.where})" if self.where else ""
        return f"KEPT     {self.kind:<6} {name}: {self.reason}{where}"


# multiply rule -> how the report names one and several
# rules that fold a float op into the quantize after it (their kinds: FUSED_KINDS)
FUSED_INTO_QUANTIZE = {"qsmooth": ("smoothing multiply", "smoothing multiplies"), "qscale": ("channel scale", "channel scales"),
                       "qlayernorm": ("LayerNorm", "LayerNorms"), "qadd": ("float sum", "float sums")}
FUSED_KINDS = ("smooth", "norm", "add")


@dataclass
class Report:
    device: str
    decisions: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # graph-level facts (missing ops, fallbacks)
    graphs: int = 1
    moves: list = field(default_factory=list)  # a Decision per view chain / cat, lowered or not
    chains: int = 0  # own-kernel chain calls (one C call each) the lowered graphs make

    @property
    def lowered(self) -> list:
        return [d for d in self.decisions if d.lowered]

    @property
    def kept(self) -> list:
        return [d for d in self.decisions if not d.lowered]

    def merge(self, other: "Report") -> "Report":
        return Report(self.device if self.device == other.device else f"{self.device},{other.device}",
                      self.decisions + other.decisions, self.notes + other.notes, self.graphs + other.graphs,
                      self.moves + other.moves, self.chains + other.chains)

    def moves_line(self) -> str:
        """e.g. 'int8 flow: 2 view chains, 1 cat run on int8; 3 smoothing multiplies fused into
        their quantize' (empty when none does)."""
        counts = Counter(d.kind for d in self.moves if d.lowered and d.kind not in FUSED_KINDS)
        fused = Counter(d.rule for d in self.moves if d.lowered and d.kind in FUSED_KINDS)
        labels = {"view": "view chain"}
        parts = [f"{n} {labels.get(kind, kind)}{'s' * (n != 1)}" for kind, n in sorted(counts.items(), reverse=True)]
        text = [f"{', '.join(parts)} run on int8"] if parts else []
        text += [f"{n} {FUSED_INTO_QUANTIZE[rule][n != 1]} fused into {'their' if n != 1 else 'its'} quantize"
                 for rule, n in sorted(fused.items())]
        return f"int8 flow: {'; '.join(text)}" if text else ""

    def summary(self) -> str:
        return (f"qbackend [{self.device}]: {len(self.lowered)} of {len(self.decisions)} conv / linear / pool / attention ops lowered"
                f" in {self.graphs} graph(s), {len(self.kept)} kept")

    def __str__(self) -> str:
        moves = [self.moves_line()] if self.moves_line() else []
        return "\n".join([self.summary()] + [d.line() for d in self.decisions] + moves + [f"note: {n}" for n in self.notes])
