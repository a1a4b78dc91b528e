"""SmoothQuant calibration: per-channel statistics of the activations that linears read.

The exported graph runs under an FX Interpreter that records, for each watched node (the
input of a group of linears), the per-channel min and max over every calibration row (the
last dimension is the channel) and a fixed-size sample of rows for the per-layer search.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Interpreter, Node


@dataclass
class ChannelStats:
    minimum: torch.Tensor  # [C]
    maximum: torch.Tensor  # [C]
    rows: list = field(default_factory=list)  # sampled [n, C] float32 rows
    kept: int = 0

    @property
    def abs_max(self) -> torch.Tensor:
        return torch.maximum(self.minimum.abs(), self.maximum.abs())

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0, self.minimum.numel())


class _Observer(Interpreter):
    def __init__(self, gm: GraphModule, watched: set, max_rows: int, generator: torch.Generator):
        super().__init__(gm)
        self.watched, self.max_rows, self.generator = watched, max_rows, generator
        self.stats: dict[Node, ChannelStats] = {}

    def run_node(self, n):
        value = super().run_node(n)
        if n in self.watched and isinstance(value, torch.Tensor):
            self._record(n, value.detach().reshape(-1, value.shape[-1]).float())
        return value

    def _record(self, n: Node, rows: torch.Tensor):
        low, high = rows.amin(0), rows.amax(0)
        stats = self.stats.get(n)
        if stats is None:
            stats = self.stats[n] = ChannelStats(low, high)
        else:
            stats.minimum, stats.maximum = torch.minimum(stats.minimum, low), torch.maximum(stats.maximum, high)
        room = self.max_rows - stats.kept
        if room > 0:
            pick = torch.randperm(rows.shape[0], generator=self.generator)[:room]
            stats.rows.append(rows[pick].clone())
            stats.kept += pick.numel()


def observe(gm: GraphModule, calibration, watched: set, max_rows: int = 2048) -> dict[Node, ChannelStats]:
    """Run every calibration batch (a tuple of inputs) through ``gm``; {node: ChannelStats}."""
    observer = _Observer(gm, watched, max_rows, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for batch in calibration:
            observer.run(*batch)
    return observer.stats
