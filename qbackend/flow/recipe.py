"""How a model was quantized, kept with it: the options ``quantize_x86`` / ``quantize_xpu`` were
called with and what the flow chose, as plain data in the converted module's meta, which
``qbackend.save`` writes into the archive and ``qbackend.inspect`` reads back."""
from __future__ import annotations

import torch

RECIPE = "qbackend_recipe"  # the converted module's meta key


def record(converted: torch.fx.GraphModule, flow: str, options: dict) -> torch.fx.GraphModule:
    kept = converted.meta.get("kept_float")
    converted.meta[RECIPE] = {
        "flow": flow, "options": {name: _plain(value) for name, value in options.items()},
        "chosen": {"activation_ranges": _plain(converted.meta.get("activation_ranges")),
                   "bias_corrected": converted.meta.get("bias_correction"),
                   "kept_float": None if kept is None else _plain(kept)}}
    return converted


def _plain(value):
    """``value`` as JSON-like data of exactly the plain types: containers kept, a function by its
    name, anything else by its (short) repr."""
    if value is None:
        return None
    for plain in (bool, int, float, str):  # (a subclass, e.g. an IntEnum, as its plain type: archives keep no others)
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
