"""Calibration and example inputs as users hand them to ``quantize_x86``: a batch as
(args, kwargs), the batches to run (each checked against what the exported model takes), and a
batch dimension made symbolic for export."""
from __future__ import annotations

import itertools
import sys
from typing import Callable, Iterable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_structure


def positional_and_keyword(inputs) -> tuple[tuple, dict]:
    """A batch as (args, kwargs): a dict is keyword inputs, a tuple or list positional ones,
    anything else (a tensor) the one positional input."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def batch_dynamic(args: tuple, kwargs: dict) -> tuple[tuple, dict, object]:
    """(args, kwargs, dynamic_shapes) with dim 0 of every tensor input one symbolic size from 1
    up (batch 1, the common serving case, shares the graph); tensors of batch 1 repeated to 2,
    as export would fix a dimension it sees as 1."""
    if args and kwargs:
        raise ValueError("dynamic_batch=True takes positional or keyword example inputs, not both")
    batch = torch.export.Dim("batch", min=1)

    def batched(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0

    def example(value):
        return torch.cat([value, value]) if batched(value) and value.shape[0] == 1 else value

    if not any(map(batched, (*args, *kwargs.values()))):
        raise ValueError("dynamic_batch=True needs at least one tensor input with a batch dimension")
    if kwargs:
        return (), {k: example(v) for k, v in kwargs.items()}, {k: {0: batch} if batched(v) else None
                                                                 for k, v in kwargs.items()}
    return tuple(map(example, args)), {}, tuple({0: batch} if batched(v) else None for v in args)


def calibration_batches(calibration, num_batches, progress, transform_fn: Optional[Callable] = None,
                        check: Optional["BatchCheck"] = None) -> Iterable:
    """The calibration batches to run: at most ``num_batches``, each ``transform_fn(batch)``
    (e.g. the inputs of a DataLoader's (input, target) pairs) and checked (``check``), behind a
    tqdm bar if asked (or by default when stderr is a terminal). No batch at all raises."""
    total = len(calibration) if hasattr(calibration, "__len__") else None  # (for the bar: a generator has none)
    if num_batches is not None:
        if num_batches < 1:
            raise ValueError(f"num_batches must be at least 1, got {num_batches}")
        calibration, total = itertools.islice(calibration, num_batches), min(total or num_batches, num_batches)
    batches = _checked(calibration, transform_fn, check)
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return batches
    from tqdm.auto import tqdm  # (an optional dependency: imported only to show the bar)

    return tqdm(batches, desc="calibrating", unit="batch", total=total)


def _checked(calibration, transform_fn, check):
    count = 0
    for count, batch in enumerate(calibration, 1):
        batch = batch if transform_fn is None else transform_fn(batch)
        if check is not None:
            check(count - 1, batch)
        yield batch
    if count == 0:
        raise ValueError("the calibration batches are empty: at least one batch must run through the model "
                         "to measure its activation ranges")


def describe(value, depth: int = 0) -> str:
    """A batch's structure in a few words: ``tuple(Tensor[8, 3, 32, 32], Tensor[8])``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}" + ("" if value.dtype == torch.float32 else f" {value.dtype}")
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(describe(v, depth + 1) for v in value[:4])
        return f"{type(value).__name__}({inner}{', ...' if len(value) > 4 else ''})"
    if isinstance(value, dict) and depth < 2:
        return "dict(" + ", ".join(f"{k}={describe(v, depth + 1)}" for k, v in list(value.items())[:4]) + ")"
    return type(value).__name__


class BatchCheck:
    """What every calibration batch must be for the exported model: the example's structure and,
    per tensor input, its dtype, rank and the sizes export fixed. A batch that differs raises
    ValueError naming the batch and the input before the model runs it (where export's guard
    says "Guard failed" and a model's own TypeError names neither)."""

    def __init__(self, example_inputs, exported: torch.fx.GraphModule):
        self.example = example_inputs
        args, kwargs = positional_and_keyword(example_inputs)
        self.positional, self.keys, self.spec = len(args), sorted(kwargs), tree_structure((args, kwargs))
        self.inputs = [(n.name, n.meta.get("val")) for n in exported.graph.nodes if n.op == "placeholder"]

    def __call__(self, index: int, batch) -> None:
        args, kwargs = positional_and_keyword(batch)
        where = f"calibration batch {index} ({describe(batch)})"
        if len(args) != self.positional or sorted(kwargs) != self.keys:
            hint = ""
            if isinstance(batch, (tuple, list)) and len(args) > self.positional >= 1:
                hint = ("; a DataLoader of (input, target) pairs? pass transform_fn=lambda batch: batch[0] "
                        "(or whatever gives the model's inputs)")
            taken = f"{self.positional} positional input(s)" + (f" and keyword inputs {self.keys}" if self.keys else "")
            raise ValueError(f"{where}: the model was exported with {taken} ({describe(self.example)}){hint}")
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self.spec:
            raise ValueError(f"{where}: nested otherwise than the example inputs ({describe(self.example)}); "
                             "one level too deep or too shallow?")
        if len(leaves) != len(self.inputs):
            return  # (export dropped or added inputs: its own checks speak)
        for leaf, (name, expected) in zip(leaves, self.inputs):
            if isinstance(expected, torch.Tensor):
                self._tensor(where, name, leaf, expected)

    @staticmethod
    def _tensor(where: str, name: str, value, expected: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: input {name!r} is a {type(value).__name__}, the model takes a tensor")
        if value.dtype != expected.dtype:
            raise ValueError(f"{where}: input {name!r} is {value.dtype}, the model was exported with {expected.dtype}")
        if value.dim() != expected.dim():
            raise ValueError(f"{where}: input {name!r} has {value.dim()} dims {list(value.shape)}, the model was exported "
                             f"with {expected.dim()}")
        for dim, (size, fixed) in enumerate(zip(value.shape, expected.shape)):
            if isinstance(fixed, int) and size != fixed:
                raise ValueError(f"{where}: input {name!r} has size {size} in dim {dim} where export fixed {fixed} "
                                 "(dynamic_batch=True, or dynamic_shapes, lets a size vary)")
