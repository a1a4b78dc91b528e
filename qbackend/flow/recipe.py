"""How a model was quantized, kept with it: the options ``quantize_x86`` / ``quantize_xpu`` were
called with and what the flow chose, as plain data in the converted module's meta, which
``qbackend.save`` writes into the archive and ``qbackend.inspect`` reads back; and those options
as one object (``QuantizeConfig``) that is plain data both ways."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

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


# quantize_x86's options that are code or torch objects, not data: recorded by name or repr, not configured
NOT_DATA = ("dynamic_shapes", "progress", "transform_fn", "validate")


@dataclass(frozen=True)
class QuantizeConfig:
    """``quantize_x86``'s options as one object, plain data both ways (torchao's and Optimum's
    configs are so): ``qbackend.quantize_x86(model, inputs, batches, config=c)``; ``c.to_dict()``
    for a JSON file; ``QuantizeConfig.from_dict(d)`` reads one back, also the options an archive
    recorded (``qbackend.inspect(path)["recipe"]["options"]``). What is code or a torch object
    (``dynamic_shapes``, ``transform_fn``, ``validate``, ``progress``) stays a keyword argument.
    Each field means what quantize_x86's argument of that name does."""

    is_qat: bool = False
    is_dynamic: bool = False
    reduce_range: Union[None, bool, str] = None
    smooth: Optional[dict] = None
    keep_float: tuple = ()
    every_linear: bool = True
    dynamic_batch: bool = False
    strict: bool = True
    num_batches: Optional[int] = None
    target_cosine: Optional[float] = None
    max_drop: Optional[float] = None
    activation_ranges: str = "auto"
    bias_correction: bool = True

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _is_plain(value):
                raise ValueError(f"QuantizeConfig.{field.name}: {value!r} is not plain data")
        object.__setattr__(self, "keep_float", tuple(self.keep_float))

    def to_dict(self) -> dict:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, options: dict) -> "QuantizeConfig":
        """A config from plain data: a ``to_dict()``, or an archive's recorded options (whose
        non-data entries, ``NOT_DATA``, are skipped). An unknown name is a ValueError."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known - set(NOT_DATA))
        if unknown:
            raise ValueError(f"QuantizeConfig: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**{name: value for name, value in options.items() if name in known})

    def merged(self, keywords: dict) -> dict:
        """``keywords`` (quantize_x86's, as called) with this config's values: ValueError where a
        keyword left at its default is not the config's."""
        defaults = QuantizeConfig()
        clashes = [name for name in self.to_dict() if keywords[name] != getattr(defaults, name)
                   and keywords[name] != getattr(self, name)]
        if clashes:
            raise ValueError(f"pass {', '.join(clashes)} in config or as keyword arguments, not both")
        return {**keywords, **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)}}


def _is_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_is_plain, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False
