"""What one kernel call becomes as a step of a kernel chain (kernel_chain.py, csrc/kernel_chain.c).

Each own-kernel family says, for one call's actual arguments and result, which C entry runs it
and with which prepared arguments, or that this call cannot be a step (then the chain runs its
steps one by one, as the graph did). The operands are the call's own tensors: the chain finds
where each lives (a chain input, a step's output, a view of either) from the first run.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

# kernel_chain.c ``enum kind``: (threads, call, a, b, c, d) / (threads, call, x, y) / a .. f / (threads, call, bases, a)
FOUR, X_TO_Y, SIX, LIST = 0, 1, 2, 3
SCRATCH = "scratch"  # an operand: the chain's scratch region (shared by its steps, which run one after another)


@dataclass(frozen=True, eq=False)
class KeyLength:
    """An operand: ``keys``' length (dim 2) as a number, given per call where the keys are a
    KV cache append's (it grows every decode step), else fixed by the program."""

    keys: torch.Tensor


@dataclass(frozen=True, eq=False)
class At:
    """An operand: the address ``offset`` bytes into ``tensor`` (a tensor of the call), for a
    kernel that reads several operands out of one buffer (attention's q, k, v in their projection)."""

    tensor: torch.Tensor
    offset: int


@dataclass(frozen=True)
class StepCall:
    kind: int  # FOUR, X_TO_Y, SIX or LIST
    function: int  # address of the C entry
    call: int  # address of its prepared arguments
    operands: tuple  # 4 (FOUR), 2 (X_TO_Y), 6 (SIX) or 1 (LIST): tensors of this call, At, SCRATCH, KeyLength or None
    keep: object  # what ``call`` is and points into (held while the chain lives)
    scratch: int = 0  # bytes of scratch the step needs
    listed: tuple = ()  # LIST: the call's tensors its C entry resolves itself, their Operands written into ``listed_into``
    listed_into: object = None  # (a ctypes array of Operand the prepared call points to)


def step_call(function: int, struct, operands: tuple, keep: object = None, scratch: int = 0, kind: int = FOUR,
              listed: tuple = (), listed_into: object = None) -> StepCall:
    """A StepCall of the C entry at ``function`` with ``struct`` (a ctypes object) as its call."""
    return StepCall(kind, function, ctypes.addressof(struct), operands, (struct, keep), scratch, listed, listed_into)


def plain_float32(*tensors: Optional[torch.Tensor]) -> bool:
    """Plain (not fake, not subclassed) float32 CPU tensors, None allowed."""
    return all(t is None or (type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def dense(*tensors: Optional[torch.Tensor]) -> bool:
    """Contiguous (a step reads its operands' rows back to back), None allowed."""
    return all(t is None or t.is_contiguous() for t in tensors)
