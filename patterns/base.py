"""What a rule is and what it returns: device-free, kernel-free.

A rule's ``select(anchor, graph)`` returns a ``Match`` (everything an emitter needs, proven)
or a ``Reject`` (the first reason it does not apply). Lowering tables never re-check what a
match proved; patterns never name a device or a kernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from torch.fx import GraphModule, Node

from qbackend.graph_constants import constant_value  # noqa: F401  (re-exported: the patterns import it from here)

if TYPE_CHECKING:
    from qbackend.weight_only.weight_quant import GroupQuantized


@dataclass(frozen=True)
class QParams:
    """Per-tensor affine quantization parameters as PT2E writes them."""

    scale: float
    zero_point: int
    qmin: int
    qmax: int
    dtype: torch.dtype


@dataclass(frozen=True)
class QuantizedValue:
    """An integer tensor in the graph and how to read it as float."""

    node: Node
    qparams: QParams


@dataclass(frozen=True)
class QuantizedWeight:
    """A constant int8 weight, symmetric per output channel (axis 0)."""

    int8: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor


@dataclass(frozen=True)
class ConvParams:
    stride: list
    padding: list
    dilation: list
    groups: int
    spatial_rank: int  # 1, 2 or 3


@dataclass(frozen=True)
class PostOp:
    """A unary op folded into the kernel: its oneDNN attr name, scalars and algorithm."""

    name: str
    scalars: tuple = ()
    algorithm: str = ""


@dataclass
class Match:
    rule: "Rule"
    anchor: Node  # the conv / linear / pool node
    nodes: tuple  # the matched chain, anchor first: the lowered op replaces all of them
    x: Optional[QuantizedValue] = None  # int8 rules: the quantized activation
    weight: Optional[QuantizedWeight] = None
    bias: Optional[Node] = None
    conv: Optional[ConvParams] = None
    op_args: tuple = ()  # pool / cat / view rules: what the op needs besides its int8 input(s)
    inputs: tuple = ()  # multi-input rules (cat): every int8 operand, ``x`` first
    float_source: Optional[Node] = None  # view rules hoisting a quantize: the float tensor it reads
    post_op: Optional[PostOp] = None
    output_quant: Optional[QParams] = None  # None: the result stays float
    float_dtype: torch.dtype = torch.float32
    accum: Optional[QuantizedValue] = None  # binary rules: the quantized residual operand
    accum_float: Optional[Node] = None  # binary rules adding a float residual: that operand
    accum_clobber_safe: bool = False  # in-place sum may write into the accumulator buffer
    accum_clobber_reason: str = ""
    body_end: Optional[Node] = None  # the last node before the folded post-op / quantize
    float_input: Optional[Node] = None  # weight-only rules: the float activation
    weight_only: Optional["GroupQuantized"] = None  # weight-only rules: the int4 / int8 weight

    @property
    def result(self) -> Node:
        """The last node of the chain: its users are rewired to the lowered op."""
        return self.nodes[-1]

    def without_tail(self) -> Optional["Match"]:
        """The same match with the unary post-op and output quantize left in the graph (None
        when there is no tail, or when an int8 residual needs the int8 output)."""
        if self.body_end is None or self.result is self.body_end or self.accum is not None:
            return None
        body = self.nodes[: self.nodes.index(self.body_end) + 1]
        return dataclasses.replace(self, nodes=body, post_op=None, output_quant=None)

    def post_op_names(self) -> list[str]:
        names = []
        if self.accum is not None or self.accum_float is not None:
            names.append("add")
        if self.post_op is not None:
            names.append(self.post_op.name)
        names.append(f"quantize({self.output_quant.dtype})" if self.output_quant else f"{self.float_dtype} out")
        return names


@dataclass(frozen=True)
class Reject:
    reason: str
    rule: Optional["Rule"] = None

    def __bool__(self) -> bool:
        return False


class NoMatch(Exception):
    """Raised inside a select function at the first failed check; becomes a Reject."""


def require(condition, reason: str):
    if not condition:
        raise NoMatch(reason)
    return condition


@dataclass(frozen=True)
class NearMiss:
    """A graph that looks like the rule's pattern but must not match, and why.

    ``build()`` returns (PT2E-converted module, example inputs); ``reason`` is a substring of
    the Reject reason the rule must give for it.
    """

    build: Callable[[], tuple]
    reason: str


@dataclass(frozen=True)
class Rule:
    name: str
    anchors: str  # which anchor kind this rule starts from: a key of patterns.ANCHORS
    pattern: str  # what it matches, e.g. "dq(x) -> conv -> [relu] -> [q]"
    doc: str  # before => after, one line
    select_fn: Callable[["GraphView", Node], Match]
    priority: int  # larger is tried first: longer patterns win
    example: Optional[Callable[[], tuple]] = None  # () -> (float module, example inputs)
    example_flags: tuple = ()  # quantizer config for the example, e.g. (("is_dynamic", True),)
    example_is_quantized: bool = False  # the example is already in quantized form (no PT2E run)
    near_misses: tuple[NearMiss, ...] = ()
    # the anchor ops this rule starts from, where its kind has others (None: all of them)
    anchor_ops: Optional[frozenset] = None

    def starts_at(self, anchor: Node) -> bool:
        return self.anchor_ops is None or anchor.target in self.anchor_ops

    @property
    def where(self) -> str:
        code = self.select_fn.__code__
        return f"{code.co_filename.rsplit('/', 2)[-2]}/{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"

    def select(self, graph: "GraphView", anchor: Node) -> Union[Match, Reject]:
        try:
            match = self.select_fn(graph, anchor)
        except NoMatch as why:
            return Reject(str(why), self)
        match.rule = self
        return match


@dataclass
class GraphView:
    """Read-only questions patterns ask about a frozen graph."""

    gm: GraphModule
    _order: dict = field(default_factory=dict)

    def constant(self, node) -> Optional[torch.Tensor]:
        return constant_value(self.gm, node)

    def is_graph_input(self, node: Node) -> bool:
        return node.op == "placeholder"

    def is_graph_output(self, node: Node) -> bool:
        return any(user.op == "output" for user in node.users)

    def position(self, node: Node) -> int:
        if not self._order or node not in self._order:
            self._order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self._order[node]

    def invalidate(self):
        self._order = {}


def per_dim(value, rank: int) -> list:
    """ATen's int-or-list arguments (stride=2, padding=[1]) as one value per spatial dim."""
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return value * rank if len(value) == 1 else value


def fake_value(node) -> Optional[torch.Tensor]:
    """The example (fake) tensor Dynamo recorded for a node, if any."""
    if not isinstance(node, Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None

