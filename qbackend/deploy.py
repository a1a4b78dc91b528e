"""A quantized model saved once and loaded ready to run: no torchao, no calibration, no trace.

``save`` writes a converted PT2E module (``quantize_x86``'s or ``convert_pt2e``'s result) as a
``torch.export`` archive: the graph with its quantize / dequantize nodes, the int8 weights and
the symbolic sizes it was exported with. ``load`` reads it back and hands it to
``qbackend.compile``, which lowers it on the first call for the machine it runs on (its own
kernels and measured choices are per CPU, so nothing lowered is saved).
"""
from __future__ import annotations

import inspect
import os
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from .direct import EXPORT_RANGES, CompiledGraphModule, compile, symbol_range
from .runnable import copied_graph

__all__ = ["save", "load"]


def _example(value: torch.Tensor, dims: dict, ranges: Optional[dict]) -> tuple[torch.Tensor, Optional[dict]]:
    """(an input of ``value``'s recorded shape and dtype, its dynamic-shape spec): each symbolic
    size at the size export traced it with, one ``Dim`` per symbol."""
    shape, spec = [], {}
    for index, size in enumerate(value.shape):
        if isinstance(size, int):
            shape.append(size)
            continue
        symbol = symbol_range(size, ranges)
        if symbol is None:
            raise ValueError(f"qbackend.save: input size {size} is an expression of export's symbols; only plain "
                             "symbolic sizes can be saved")
        expr, low, high = symbol
        if expr not in dims:
            dims[expr] = torch.export.Dim(str(expr), min=low, max=high)
        spec[index] = dims[expr]
        shape.append(size.node.hint)
    return torch.zeros(shape, dtype=value.dtype, device=value.device), spec or None


def _graph_attributes_only(model: GraphModule) -> GraphModule:
    """``model`` holding only what its graph reads: a converted module keeps the float weights
    its int8 copies replaced (ResNet-50: 130 MB archive instead of 28 MB)."""
    lean = GraphModule(model, copied_graph(model))  # (copies the get_attr / call_module targets only)
    lean.meta.update(model.meta)
    return lean


def save(model: GraphModule, path: str | os.PathLike) -> None:
    """Save a converted PT2E module to ``path`` (a ``.pt2`` archive ``load`` reads): its graph,
    weights and the input sizes export left symbolic (``dynamic_batch`` / ``dynamic_shapes``)."""
    if not isinstance(model, GraphModule):
        raise TypeError(f"qbackend.save takes a converted PT2E module (a GraphModule), got {type(model).__name__}")
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    recorded = [n.meta.get("val") for n in placeholders]
    if not all(isinstance(v, torch.Tensor) for v in recorded):
        raise ValueError("qbackend.save: the module's inputs carry no recorded tensor values (is it an exported graph?)")
    dims: dict = {}
    ranges = getattr(model, EXPORT_RANGES, None)
    examples, specs = zip(*(_example(v, dims, ranges) for v in recorded)) if recorded else ((), ())
    in_spec = getattr(getattr(model.graph._codegen, "pytree_info", None), "in_spec", None)
    names = list(inspect.signature(model.forward).parameters)
    if in_spec is None:
        args, kwargs, by_name = tuple(examples), {}, dict(zip(names, specs))
    else:  # (export's structure: positional inputs, keyword inputs by name)
        (args, kwargs), (arg_specs, kwarg_specs) = (pytree.tree_unflatten(list(leaves), in_spec) for leaves in (examples, specs))
        by_name = {**dict(zip(names, arg_specs)), **kwarg_specs}  # (export takes specs by argument name)
    dynamic = by_name if any(s is not None for s in specs) else None
    exported = torch.export.export(_graph_attributes_only(model), tuple(args), dict(kwargs), dynamic_shapes=dynamic,
                                   strict=False)
    torch.export.save(exported, path)


def load(path: str | os.PathLike, options: Optional[dict] = None) -> CompiledGraphModule:
    """The model ``save`` wrote, as ``qbackend.compile`` gives it: lowered on its first call."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantize / dequantize ops the graph calls)

    return compile(torch.export.load(path).module(), options)
