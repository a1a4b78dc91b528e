"""A quantized model saved once and loaded ready to run: no torchao, no calibration, no trace.

``save`` writes a converted PT2E module (``quantize_x86``'s or ``convert_pt2e``'s result) as
weights-only records (``graph_archive.py``): the graph with its quantize / dequantize nodes, the
int8 weights it reads and its inputs' sizes, symbolic ones with export's ranges. ``load`` reads
them back into a ``qbackend.compile`` module, which lowers on the first call for the machine it
runs on (its own kernels and measured choices are per CPU, so nothing lowered is saved), from
the recorded values: for the first call's sizes, then, from a second shape on, for the
symbolic sizes. Archives of the earlier format (``torch.export.save``) load with ``trusted=True``.
"""
from __future__ import annotations

import importlib.metadata
import os
import zipfile
from typing import Optional

import torch
from torch.fx import GraphModule

from qbackend.archive.archive_checks import ArchiveError, plain_data
from qbackend.archive.graph_archive import described, graph_module, records
from qbackend.flow.recipe import RECIPE
from qbackend.pipeline.direct import EXPORT_GUARDS, CompiledGraphModule, compile, export_values, recorded_inputs
from qbackend.pipeline.report import source_of
from qbackend.runtime.runnable import copied_graph
from qbackend.version import VERSION

__all__ = ["save", "load", "inspect", "ArchiveError"]


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
    sources = {node.name: source_of(node) for node in graph.nodes if source_of(node)}
    torch.save(records(GraphModule(model, graph), recorded, symbols, values, sources, _about(model)), path)


def _about(model: GraphModule) -> dict:
    """The versions that made ``model`` and its recipe, as an archive keeps them."""
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {"versions": {"qbackend": VERSION, "torch": str(torch.__version__), "torchao": torchao},
            "recipe": model.meta.get(RECIPE)}  # (None: converted otherwise than by quantize_x86 / _xpu)


def inspect(path: str | os.PathLike) -> dict:
    """What an archive ``save`` wrote says of itself, read as data and checked, without building
    its graph: ``{"versions": {...}, "recipe": {...} or None}`` (the recipe: the options
    ``quantize_x86`` / ``quantize_xpu`` were called with; None for a module converted otherwise),
    plus its inputs. ``{}`` beside the inputs for archives saved before this was recorded."""
    saved = _read(path)
    return {**described(saved), "inputs": plain_data(saved.get("inputs"), "inputs"),
            "symbols": plain_data(saved.get("symbols"), "symbols")}


def load(path: str | os.PathLike, options: Optional[dict] = None, *, trusted: bool = False) -> CompiledGraphModule:
    """The model ``save`` wrote, as ``qbackend.compile`` gives it: lowered on its first call.

    The archive is read as data and checked record by record before anything is built from it
    (``ArchiveError`` names what is wrong): no code it brings runs, and its graph calls only
    the operators ``python -m qbackend.archive_operators`` lists. ``trusted=True`` is needed
    only for the earlier format (``torch.export.save``'s archive), whose loader builds code
    from the archive's contents: pass it only for files from a source you trust."""
    try:
        with zipfile.ZipFile(path) as archive:
            exported = any(name.endswith("/archive_format") for name in archive.namelist())
    except Exception as error:  # (zipfile raises what a corrupt directory makes it hit: a bad name's UnicodeDecodeError)
        raise ArchiveError(str(path), f"not a qbackend archive ({error})") from error
    if exported:
        if not trusted:
            raise ArchiveError(str(path), "an archive of torch.export's format, whose loader runs code the file names; "
                                          "load it with trusted=True only if you trust its source, then qbackend.save "
                                          "it again")
        return compile(_exported_archive(path), options)
    gm, recorded, symbols = graph_module(_read(path))
    return CompiledGraphModule(gm, options, recorded, symbols)


def _read(path):
    if not zipfile.is_zipfile(path):  # (torch.load's message for such a file is about weights_only)
        raise ArchiveError(str(path), "not a qbackend archive (not a zip file)")
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # (torch's weights-only unpickler raises what a corrupt stream makes it hit)
        raise ArchiveError(str(path), f"not a readable qbackend archive ({type(error).__name__}: {str(error)[:200]})") \
            from error


def _exported_archive(path) -> GraphModule:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantize / dequantize ops the graph calls)

    return torch.export.load(path).module()
