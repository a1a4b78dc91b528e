"""A deep copy of an exported or prepared graph, without the FutureWarning torch 2.13 raises on
every copy of one (its own TreeSpec pickling reads the deprecated ``LeafSpec``): the user
would see it once per ``quantize_x86`` call for nothing they did."""
from __future__ import annotations

import copy
import warnings

import torch


def graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return copy.deepcopy(gm)
