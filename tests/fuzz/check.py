"""One fuzz case end to end: build the seed's model, quantize it with a torchao flow (or
weight-only), compile it with qbackend through a random path, run it on a random input layout
with random special values, and compare with the reference. Returns the problems found
(empty: the case passed)."""
from __future__ import annotations

import contextlib
import math
import random
import warnings

import torch

import qbackend
from qbackend.pt2e_flow import quantize_x86, quantize_xpu

from ..helpers import int8_replacements
from ..tolerances import TOLERANCE, cosine
from .models import Case, build

SPECIALS = (0.0, 1e30, -1e30, math.inf, -math.inf, math.nan)
# kernels chosen by their fixed tables: reproducible on every machine, and no timing per layer
# (which would fill the machine's choice cache with thousands of random layers)
OPTIONS = {"kernel_choice": "prior"}


_PATTERNS: dict = {}


def _pattern_key(pattern, example_inputs, is_cuda, kwargs):
    def spell(value):
        return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value

    function = getattr(pattern, "fn", pattern)  # (torchao wraps some patterns in a WrapperModule)
    cells = tuple(cell.cell_contents for cell in function.__closure__ or ())
    return (type(pattern), function.__code__, cells, tuple(map(spell, example_inputs)), is_cuda,
            tuple((k, spell(v)) for k, v in sorted(kwargs.items())))


@contextlib.contextmanager
def _conv_bn_patterns_exported_once():
    """convert_pt2e exports torchao's 28 QAT conv-BN pattern graphs on every call on a graph
    with a BatchNorm (~1 s, 80% of a case): each graph depends only on the pattern's code,
    its closure (flags, conv function) and the example shapes, so the fuzzer keeps a copy."""
    import copy

    from torchao.quantization.pt2e import qat_utils

    export = qat_utils._get_aten_graph_module_for_pattern

    def exported_once(pattern, example_inputs, is_cuda=False, **kwargs):
        key = _pattern_key(pattern, example_inputs, is_cuda, kwargs)
        try:
            hash(key)
        except TypeError:  # (a closure holding something unhashable: exported every time)
            return export(pattern, example_inputs, is_cuda, **kwargs)
        if key not in _PATTERNS:
            _PATTERNS[key] = export(pattern, example_inputs, is_cuda, **kwargs)
        return copy.deepcopy(_PATTERNS[key])

    qat_utils._get_aten_graph_module_for_pattern = exported_once
    try:
        yield
    finally:
        qat_utils._get_aten_graph_module_for_pattern = export


def _quantized(case: Case, rng: random.Random, calibration: list):
    """(model to compile, reference module, flow description)."""
    if case.family == "weight_only":
        bits, compute = rng.choice([4, 8]), rng.choice(["auto", "int16", "bf16", "activation"])
        group = rng.choice([32, 64])
        model = qbackend.quantize_weights(case.model, bits=bits, group_size=group if bits == 4 else None, compute=compute)
        reference = _dequantized_copy(model)
        return model, reference, f"weight-only int{bits} group {group} compute {compute}"
    flow = rng.choice(["x86", "x86", "x86 7-bit activations", "x86 7-bit weights", "x86 qat", "xpu"])
    example = calibration[0]
    if flow == "xpu":
        converted = quantize_xpu(case.model, example, calibration)
    else:
        reduce_range = {"x86 7-bit activations": True, "x86 7-bit weights": "weights"}.get(flow, None)
        converted = quantize_x86(case.model, example, calibration, is_qat=flow == "x86 qat", reduce_range=reduce_range)
    return converted, converted, flow


def _dequantized_copy(model):
    """The weight-only model with every quantized weight replaced by its float dequantization."""
    import copy

    from qbackend.quantized_tensor import QuantizedLinearWeight

    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, QuantizedLinearWeight):
            module.weight = torch.nn.Parameter(module.weight.dequantize().float(), requires_grad=False)
    return reference


def _layout(rng: random.Random, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(input with ``values`` in a random memory layout, the storage it views, layout name);
    "expanded" repeats the first batch row."""
    layout = rng.choice(["contiguous", "channels_last", "transposed", "offset", "expanded"])
    if layout == "channels_last" and values.dim() in (4, 5):
        base = values.contiguous(memory_format=torch.channels_last if values.dim() == 4 else torch.channels_last_3d)
        return base, base, layout
    if layout == "transposed" and values.dim() >= 2:
        base = values.transpose(0, -1).contiguous()
        return base.transpose(0, -1), base, layout
    if layout == "offset":
        base = torch.empty(values.numel() + 7)
        base[:7] = 1.0
        view = base[7:].view(values.shape)
        view.copy_(values)
        return view, base, layout
    if layout == "expanded" and values.shape[0] > 1:  # every batch row the first one, stored once
        base = values[:1].clone()
        return base.expand_as(values), base, layout
    base = values.clone()
    return base, base, "contiguous"


def _values(rng: random.Random, shape: tuple, generator: torch.Generator, huge: bool) -> tuple[torch.Tensor, str]:
    """``huge``: finite specials of 1e30 too. Not for weight-only models: qbackend's int16
    activations keep 15 bits of each group's largest value (README), so a 1e30 beside O(1)
    values zeroes them by design (an infinity there takes the float path instead)."""
    scale = rng.choice([0.5, 1.0, 3.0])
    values = torch.randn(shape, generator=generator) * scale
    kind = rng.choice(["normal", "normal", "zeros", "specials"])
    if kind == "zeros":
        values.zero_()
    elif kind == "specials":
        flat = values.view(-1)
        for _ in range(rng.randint(1, 4)):
            special = rng.choice(SPECIALS)
            flat[rng.randrange(flat.numel())] = special if huge or not 1 < abs(special) < math.inf else math.copysign(math.inf, special)
    return values, f"{kind} x{scale}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _compare(actual, expected, family: str, stepped=frozenset()) -> list[str]:
    """``stepped``: outputs computed from an int8 value one step off the reference's (a
    rule within one step, e.g. qavgpool's ties): their float values only need the looser
    cosine of the tolerance table."""
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    if len(actual) != len(expected):
        return [f"{len(actual)} outputs, the reference has {len(expected)}"]
    problems = []
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.shape != e.shape or a.dtype != e.dtype:
            problems.append(f"output {i}: {a.dtype}{list(a.shape)} vs reference {e.dtype}{list(e.shape)}")
            continue
        if not torch.equal(a.isnan(), e.isnan()):
            problems.append(f"output {i}: NaN at {int((a.isnan() ^ e.isnan()).sum())} other positions")
        infinite = a.isinf() | e.isinf()
        if not torch.equal(a[infinite], e[infinite]):
            problems.append(f"output {i}: infinities differ at {int((a[infinite] != e[infinite]).sum())} positions")
        finite = a.isfinite() & e.isfinite()
        a, e = a[finite], e[finite]
        if e.numel() == 0 or problems:
            continue
        if family == "weight_only":
            limit = TOLERANCE["weight_only"]["max_relative_error"][torch.float32]
            error = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)
            if error > limit:
                problems.append(f"output {i}: max error {error:.4g} of the largest output (limit {limit})")
        else:
            least = TOLERANCE["float"]["min_cosine_after_a_step" if i in stepped else "min_cosine"]
            if (a - e).abs().max() > TOLERANCE["float"]["atol"] and cosine(a, e) < least:
                problems.append(f"output {i}: cosine {cosine(a, e):.6f}, max difference {(a - e).abs().max().item():.3g}")
    return problems


class _Lowered:
    """A Dynamo backend that lowers with qbackend and keeps (reference graph, inputs, lowered
    graph, report) to compare every int8 value afterwards."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from qbackend.pipeline.backend import Options, compile_graph

        runner, report, lowered = compile_graph(gm, example_inputs, Options(**OPTIONS))
        self.graphs.append((gm, list(example_inputs), lowered))
        return runner


def _int8_steps(graphs) -> tuple[list[str], set]:
    """(problems, outputs computed from a stepped value). Every int8 tensor the lowered graph
    makes in place of a reference quantize is within the tolerance table's steps of it, up to
    the first one that differs at all: downstream of it the inputs differ from the
    reference's, and so legitimately the values."""
    problems, stepped, tolerance = [], set(), TOLERANCE["int8"]
    for gm, inputs, lowered in graphs:
        compared = int8_replacements(gm, inputs, lowered)
        downstream = set()  # nodes that read a stepped value
        for node in lowered.graph.nodes:
            if any(arg in downstream for arg in node.all_input_nodes):
                downstream.add(node)
                continue
            if node not in compared:
                continue
            actual, expected, replaced = compared[node]
            if actual.shape != expected.shape:
                problems.append(f"{node.name}: shape {list(actual.shape)} vs {list(expected.shape)}")
                continue
            steps = (actual.int() - expected.int()).abs()
            if steps.max() > tolerance["max_steps"] or (steps <= 1).double().mean() < tolerance["within_one_step"]:
                problems.append(f"{node.name} vs {replaced}: up to {steps.max().item()} steps")
            elif steps.max() > 0:
                downstream.add(node)
        outputs = next(n for n in lowered.graph.nodes if n.op == "output").args[0]
        stepped |= {i for i, out in enumerate(outputs) if out in downstream}
    return problems, stepped


class InvalidCase(Exception):
    """The seed's model could not be quantized or its reference could not run: a generator
    bug, not a qbackend one (counted apart)."""


def run_case(seed: int) -> tuple[str, list[str]]:
    """(what ran, problems) for ``seed``; InvalidCase when the reference cannot run."""
    case = build(seed)
    rng = random.Random(seed * 7919 + 1)
    generator = torch.Generator().manual_seed(seed)
    calibration = [(torch.randn(case.shape, generator=generator),) for _ in range(2)]
    values, kind = _values(rng, case.shape, generator, huge=case.family != "weight_only")
    x, storage, layout = _layout(rng, values)
    path = rng.choice(["torch.compile", "qbackend.compile"])
    try:
        with _quiet(), torch.no_grad(), _conv_bn_patterns_exported_once():
            model, reference, flow = _quantized(case, rng, calibration)
            expected = reference(x.contiguous())  # (the same values, a copy)
    except Exception as error:
        raise InvalidCase(f"{case.describe()}: {type(error).__name__}: {error}") from error
    what = f"{case.describe()}; {flow}; {path}; input {layout} {kind}"
    reports = []
    options = {**OPTIONS, "report_sink": reports.append}
    stored = storage.clone()
    with _quiet(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        lowered = _Lowered()
        if path == "torch.compile":
            compiled = torch.compile(model, backend=lowered)
        else:
            compiled = qbackend.compile(model, options)
        actual = compiled(x)
        again = [compiled(x) for _ in range(2)]  # (the prepared kernels; a call that changed a constant changes the next)
        if path == "qbackend.compile" and case.family == "int8":  # (the same lowering, kept to check)
            from qbackend.pipeline.direct import _with_shapes

            lowered(_with_shapes(model, [x]), [x])
    problems, stepped = _int8_steps(lowered.graphs) if case.family == "int8" else ([], set())
    problems = _compare(actual, expected, case.family, stepped) + problems
    for call, outputs in enumerate(again, 2):
        if not all(map(_same_bits, outputs if isinstance(outputs, tuple) else (outputs,), actual if isinstance(actual, tuple) else (actual,))):
            problems.append(f"call {call} with the same input gave other values than the first")
    if not _same_bits(storage, stored):
        problems.append(f"the input's storage changed ({layout})")
    problems += [f"lowering failed: {note}" for report in reports for note in report.notes if note.startswith("lowering failed")]
    return what, problems


@contextlib.contextmanager
def _quiet():
    """torchao's and export's log lines, once per case, would drown the report."""
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
