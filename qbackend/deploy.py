"""A quantized model saved once and loaded ready to run: no torchao, no calibration, no trace.

``save`` writes a converted PT2E module (``quantize_x86``'s or ``convert_pt2e``'s result) as
weights-only records (``graph_archive.py``): the graph with its quantize / dequantize nodes, the
int8 weights it reads and its inputs' sizes, symbolic ones with export's ranges. ``load`` reads
them back into a ``qbackend.compile`` module, which lowers on the first call for the machine it
runs on (its own kernels and measured choices are per CPU, so nothing lowered is saved), from
the recorded values: for the first call's sizes, then, from a second shape on, for the
symbolic sizes. Archives of the earlier format (``torch.export.save``) still load.
"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

import torch
from torch.fx import GraphModule

from .direct import EXPORT_GUARDS, CompiledGraphModule, compile, export_values, recorded_inputs
from .graph_archive import graph_module, records
from .runnable import copied_graph

__all__ = ["save", "load"]


def save(model: GraphModule, path: str | os.PathLike) -> None:
    """Save a converted PT2E module to ``path`` (an archive ``load`` reads): its graph, the
    weights it reads and the input sizes export left symbolic (``dynamic_batch`` /
    ``dynamic_shapes``)."""
    if not isinstance(model, GraphModule):
        raise TypeError(f"qbackend.save takes a converted PT2E module (a GraphModule), got {type(model).__name__}")
    recorded, symbols = recorded_inputs(model)
    if not recorded or any(value is None for value in recorded):
        raise ValueError("qbackend.save: the module's inputs carry no recorded tensor values (is it an exported graph?)")
    for value in recorded:
        if None in value.sizes:
            raise ValueError("qbackend.save: an input size is an expression of export's symbols, or strided; only "
                             "plain symbolic sizes of contiguous inputs can be saved")
    graph = copied_graph(model)
    for node in [n for n in graph.nodes if n.op == "call_module" and n.target == EXPORT_GUARDS and not n.users]:
        graph.erase_node(node)  # (export's input checks: the loaded module checks the recorded sizes)
    values = {node.name: value for node, value in (export_values(model) or {}).items()}  # (the copy keeps the names)
    torch.save(records(GraphModule(model, graph), recorded, symbols, values), path)


def load(path: str | os.PathLike, options: Optional[dict] = None) -> CompiledGraphModule:
    """The model ``save`` wrote, as ``qbackend.compile`` gives it: lowered on its first call."""
    with zipfile.ZipFile(path) as archive:
        exported = any(name.endswith("/archive_format") for name in archive.namelist())
    if exported:  # (the earlier format: torch.export's archive)
        return compile(_exported_archive(path), options)
    gm, recorded, symbols = graph_module(torch.load(path, weights_only=True))
    return CompiledGraphModule(gm, options, recorded, symbols)


def _exported_archive(path) -> GraphModule:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantize / dequantize ops the graph calls)

    return torch.export.load(path).module()
