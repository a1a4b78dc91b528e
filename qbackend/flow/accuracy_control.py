"""Keeping layers float until a quantized model is accurate enough: by its output's cosine
against the float model (``quantize_x86(target_cosine=...)``) or by the user's own metric
(``validate=fn, max_drop=...``, as NNCF's ``quantize_with_accuracy_control``), with each step
and its cost said as it goes (a search had run 479 s showing nothing).

Each step tries two guesses at the layer to keep float, the better kept: the one whose float
input helps the output most (input quantization's cost) and the one adding the most noise of
its own (its weights' too: on all-MiniLM-L6-v2, layer 0's FFN output linear takes the output
from 0.953 to 0.989 while its float input alone gains 0.001).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from qbackend.flow.accuracy import accuracy_report, input_sensitivity
from qbackend.pipeline.direct import compile as qbackend_compile

log = logging.getLogger("qbackend")

ACCURACY_BATCHES = 4  # calibration batches the output cosine and the guesses are computed on
MAX_KEPT_FLOAT = 8  # layers a search may keep float


@dataclass(frozen=True)
class Goal:
    """What accurate enough means: ``score(converted, report)``, higher is better, and the
    score that is enough (``reached``)."""

    name: str  # the score's name, as progress lines say it
    score: Callable  # (converted module, its AccuracyReport) -> float
    reached: Callable  # score -> bool


def cosine_goal(target: float) -> Goal:
    return Goal("output cosine", lambda converted, report: report.output.cosine, lambda value: value >= target)


def metric_goal(validate: Callable, max_drop: float, model, say: Callable) -> Goal:
    """The user's metric (higher is better) on the model qbackend compiles, at most ``max_drop``
    below the float model's."""
    started = time.perf_counter()
    baseline = float(validate(model))
    say(f"validate: the float model scores {baseline:.6g} ({time.perf_counter() - started:.1f} s a validation); "
        f"quantized, it may score down to {baseline - max_drop:.6g}")
    return Goal("validate", lambda converted, report: float(validate(qbackend_compile(converted))),
                lambda value: baseline - value <= max_drop)


def speaker(progress: Optional[bool]) -> Callable:
    """Where progress lines go: stderr when ``progress`` (None: when stderr is a terminal, as the
    calibration bar), else the ``qbackend`` logger at INFO."""
    shown = sys.stderr.isatty() if progress is None else bool(progress)
    return (lambda text: print(f"qbackend: {text}", file=sys.stderr, flush=True)) if shown else (lambda text: log.info(text))


def added_noise(layer) -> float:
    """The noise a layer adds, as a fraction of its output's power: its output's error less
    what its input brought (SQNR in dB is not additive; noise powers roughly are)."""
    inherited = 10 ** (-layer.input_sqnr_db / 10) if math.isfinite(layer.input_sqnr_db) else 0.0
    return 10 ** (-layer.sqnr_db / 10) - inherited


def keep_float_until(goal: Goal, model, calibration: list, keep_float, convert: Callable, say: Callable):
    """``convert(kept, batches)`` again with one more layer kept float until ``goal`` is reached
    (or ``MAX_KEPT_FLOAT`` are kept); returns the last converted module, its ``meta["accuracy"]``
    the AccuracyReport, ``meta["kept_float"]`` the layers kept."""
    kept, checked = list(keep_float), calibration[:ACCURACY_BATCHES]
    started = time.perf_counter()
    converted = convert(tuple(kept), calibration)
    report = accuracy_report(model, converted, checked)
    value = goal.score(converted, report)
    step_s = time.perf_counter() - started
    if not goal.reached(value):
        say(f"{goal.name} {value:.6g}: not enough; each step keeps one more layer float, trying 2 (~{2 * step_s:.0f} s "
            f"a step), at most {MAX_KEPT_FLOAT} steps (~{2 * step_s * MAX_KEPT_FLOAT:.0f} s)")
    while not goal.reached(value) and len(kept) - len(keep_float) < MAX_KEPT_FLOAT:
        open_layers = [e for e in report.layers if e.path not in kept]
        if not open_layers:
            break
        sensitivity = input_sensitivity(model, converted, checked)
        guesses = {max(open_layers, key=lambda e: sensitivity.get(e.path, -1.0)).path, max(open_layers, key=added_noise).path}
        trials = {}
        for path in sorted(guesses):
            trial = convert(tuple(kept + [path]), calibration)
            trial_report = accuracy_report(model, trial, checked)
            trials[path] = (goal.score(trial, trial_report), trial, trial_report)
        best = max(trials, key=lambda path: trials[path][0])
        kept.append(best)
        value, converted, report = trials[best]
        say(f"step {len(kept) - len(keep_float)}: {best} kept float, {goal.name} {value:.6g}")
    if not goal.reached(value):
        log.warning("quantize_x86: %s %.6g is not enough with %d layer(s) kept float", goal.name, value, len(kept))
    converted.meta["accuracy"], converted.meta["kept_float"] = report, kept[len(keep_float):]
    return converted


def checked_goal(model, target_cosine, validate, max_drop, say) -> Optional[Goal]:
    """The goal quantize_x86's options ask for (None: none), or ValueError for options that do not go together."""
    if (validate is None) != (max_drop is None):
        raise ValueError("validate and max_drop go together: validate(model) -> a score, higher is better; max_drop: how "
                         "far below the float model's score the quantized model's may be")
    if validate is not None and target_cosine is not None:
        raise ValueError("pass target_cosine or validate / max_drop, not both")
    if validate is not None:
        if not callable(validate) or not max_drop >= 0:
            raise ValueError(f"validate must be callable and max_drop a number >= 0, got {validate!r}, {max_drop!r}")
        return metric_goal(validate, max_drop, model, say)
    return None if target_cosine is None else cosine_goal(target_cosine)
