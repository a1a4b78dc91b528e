"""Shared test helpers: PT2E conversion, capturing what the backend does, a stable graph printer."""
from __future__ import annotations

import operator
import threading
from typing import Callable

import torch
from torch.fx import GraphModule, Interpreter

import pytest

from qbackend.kernels import registry as kernel_registry
from qbackend.pipeline import cleanup
from qbackend.pipeline.backend import Options, compile_graph
from qbackend.pipeline.direct import CompiledGraphModule
from qbackend.kernels.kernel_chain import KernelChain, Ref, kernels
from qbackend.pt2e_flow import quantize_x86

from tests.tolerances import assert_int8_close, assert_outputs_close


def lowering_keys(compiled: CompiledGraphModule) -> list:
    """The lowerings a ``qbackend.compile`` module made, least recently used first:
    ``CompiledGraphModule.SYMBOLIC``, or the shape of the first input the lowering is for."""
    return [key if key == CompiledGraphModule.SYMBOLIC else key[0][1] for key in compiled.lowered]


# tests whose subject is qbackend's own kernels (the rest run either way: $QBACKEND_KERNELS=off)
needs_own_kernels = pytest.mark.skipif(kernel_registry.available() is not None, reason=f"needs qbackend's own kernels: {kernel_registry.available()}")


def quantize(module, inputs, calibration=None, **flags):
    """7-bit activations unless asked otherwise: exact on every x86 CPU (without VNNI the
    kernels overflow 8-bit ones), so the lowered graphs are the same on every machine.
    Calibrated on ``inputs`` unless given batches."""
    torch.manual_seed(0)
    return quantize_x86(module, inputs, [inputs] if calibration is None else calibration, **{"reduce_range": True, **flags})


class Captured:
    """Compiles through Dynamo with qbackend and keeps every graph's reference and result."""

    def __init__(self, registry=None, **options):
        self.options = Options(**options)
        self.registry = registry
        self.graphs = []  # (dynamo gm, example inputs, lowered gm, report)

    def __call__(self, gm, example_inputs):
        runner, report, lowered = compile_graph(gm, example_inputs, self.options, self.registry)
        self.graphs.append((gm, list(example_inputs), lowered, report))
        return runner

    @property
    def report(self):
        assert len(self.graphs) == 1, f"expected one graph, got {len(self.graphs)}"
        return self.graphs[0][3]

    @property
    def lowered(self) -> GraphModule:
        assert len(self.graphs) == 1
        return self.graphs[0][2]


def compile_and_run(module, inputs, registry=None, **options):
    """(compiled output, reference output, Captured)."""
    torch._dynamo.reset()
    captured = Captured(registry, **options)
    with torch.no_grad():
        expected = module(*inputs)
        actual = torch.compile(module, backend=captured)(*inputs)
    return actual, expected, captured


class _Recorder(Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        value = super().run_node(n)
        # a copy: an in-place sum later in the graph may legally overwrite this buffer
        self.values[n.name] = value.clone() if isinstance(value, torch.Tensor) and not value.is_mkldnn else value
        return value


def assert_matches_reference(module, inputs, registry=None, intermediates=True, outputs=True, **options):
    """Compiled vs reference: ``outputs`` (tolerance table) and, with ``intermediates``, every int8
    tensor the lowered graph produces in place of a reference quantize (int8 tolerance). Deep
    models check outputs only: a one-step difference upstream legitimately shifts later layers
    (and a float output computed from it, checked by its int8 inputs alone)."""
    actual, expected, captured = compile_and_run(module, inputs, registry, **options)
    if outputs:
        assert_outputs_close(actual, expected, type(module).__name__)
    for gm, example_inputs, lowered, _ in captured.graphs if intermediates else ():
        for node, (actual, expected, replaced) in int8_replacements(gm, example_inputs, lowered).items():
            assert_int8_close(actual, expected, f"{node.name} vs {replaced}")
    return captured


def with_and_without_chains(compile: Callable, monkeypatch) -> tuple:
    """(``compile()``'s captured graphs, the same compiled without kernel chains)."""
    chained = compile()
    with monkeypatch.context() as patch:  # (undo() would also undo conftest's fixed kernel choice)
        patch.setattr(cleanup, "chain_own_kernels", lambda gm, **_: None)
        return chained, compile()


def assert_one_chain_of_c_steps(chained, separate, kernels: list, inputs: list) -> KernelChain:
    """``chained`` holds one chain, of ``kernels`` (their names, in order), prepared as C programs,
    whose outputs are ``separate``'s, byte for byte, on every one of ``inputs`` (the first call
    runs the steps one by one; later ones, the program)."""
    (chain,) = [n.target for n in chained.lowered.graph.nodes if isinstance(n.target, KernelChain)]
    assert [kernel for _, kernel, _ in chain.listing()] == kernels
    with torch.no_grad():
        for x in inputs:
            assert all(torch.equal(a, b) for a, b in zip(chained.lowered(x), separate.lowered(x)))
    assert list(chain._programs.values()) and None not in chain._programs.values()
    return chain


def int8_replacements(gm: GraphModule, example_inputs: list, lowered: GraphModule) -> dict:
    """{lowered node: (its int8 value in the reference's dtype, the reference value, the name
    of the reference quantize it replaces)} for one run of both graphs on ``example_inputs``.
    (A quantize the pass moved above a view chain has no reference node; the chain's end,
    which replaces the reference's quantize, is there instead.)"""
    reference, got = _Recorder(gm), _Recorder(lowered)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        reference.run(*example_inputs)
        got.run(*[example_inputs[placeholders.index(n.name)] for n in lowered.graph.nodes if n.op == "placeholder"])
    found = {}
    for node in lowered.graph.nodes:
        replaced, value = node.meta.get("qbackend_replaces"), got.values.get(node.name)
        if replaced in reference.values and isinstance(value, torch.Tensor) and not value.is_floating_point():
            expected = reference.values[replaced]
            found[node] = (_in_reference_dtype(value, expected), expected, replaced)
    return found


def _in_reference_dtype(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor the CPU table made from a signed int8 one (zero point + 128) in the
    reference's int8 terms."""
    if actual.dtype == torch.uint8 and expected.dtype == torch.int8:
        return (actual.int() - 128).to(torch.int8)
    return actual


def chained_convs(gm: GraphModule) -> list:
    """The conv kernel calls (GEMM, depthwise, stem) that kernel chains in ``gm`` run."""
    return [step for node in gm.graph.nodes if isinstance(node.target, KernelChain) for step in node.target.steps
            if step.kernel in ("qconv", "qconv_depthwise", "qconv_stem")]


def kernel_calls(gm: GraphModule, kernel: str) -> list:
    """The argument tuples of each call of own kernel ``kernel`` (a kernel_chain.kernels() name)
    in ``gm``: graph nodes, or steps of its kernel chains (arguments as the chain holds them)."""
    plain = kernels()[kernel][0]
    calls = []
    for node in gm.graph.nodes:
        if node.target is plain:
            calls.append(node.args)
        elif isinstance(node.target, KernelChain):
            calls.extend(step.args for step in node.target.steps if step.kernel == kernel)
    return calls


def op_name(target) -> str:
    """An op's short name: ``aten.reshape``, ``conv_gemm.qconv``."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    return f"{target.__module__.split('.')[-1]}.{target.__name__}"


def chain_lines(node, fmt) -> list:
    """A kernel chain's steps, as the graph held them before (their values named as the nodes
    were), then the chain call and the steps whose values leave it."""
    chain = node.target
    names = [step.name for step in chain.steps]

    def operand(a):
        if isinstance(a, Ref):
            return fmt(node.args[a.index]) if a.source == "input" else names[a.index]
        return "<const>" if isinstance(a, torch.Tensor) else fmt(a)

    def line(step) -> str:
        args = [operand(a) for a in step.args]
        if step.kernel is not None:
            return f"{step.name} = {op_name(kernels()[step.kernel][0])}({', '.join(args)})"
        if step.view is operator.getitem:
            return f"{step.name} = {args[0]}[{args[1]}]"
        if isinstance(step.view, str):
            return f"{step.name} = {args[0]}.{step.view}({', '.join(args[1:])})"
        return f"{step.name} = {op_name(step.view)}({', '.join(args)})"

    lines = [line(step) for step in chain.steps]
    leaving = ", ".join(names[i] for i in chain.outputs)
    return lines + [f"{node.name} = kernel_chain({', '.join(fmt(a) for a in node.args)}) of {len(names)} steps -> ({leaving})"]


def lowered_lines(module, inputs, *words: str):
    """(compiled output, reference output, Captured, the lowered graph's ``short_graph`` lines
    holding any of ``words``)."""
    actual, expected, captured = compile_and_run(module, inputs)
    lines = [line for line in short_graph(captured.lowered).splitlines() if any(word in line for word in words)]
    return actual, expected, captured, "\n".join(lines)


def short_graph(gm: GraphModule) -> str:
    """A stable, short printout for expecttest: op names without namespaces noise, constants
    as <const>, floats to 3 significant digits."""

    def fmt(arg):
        if isinstance(arg, torch.fx.Node):
            return "<const>" if arg.op == "get_attr" else arg.name
        if isinstance(arg, float):
            return f"{arg:.3g}"
        if isinstance(arg, (list, tuple)):
            inner = ", ".join(fmt(a) for a in arg)
            return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
        if isinstance(arg, torch.dtype):
            return str(arg).replace("torch.", "")
        return repr(arg)

    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "call_function" and isinstance(node.target, KernelChain):
            lines.extend(chain_lines(node, fmt))
        elif node.op == "call_function":
            args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name} = {op_name(node.target)}({', '.join(args)})")
        elif node.op == "call_method":
            args = [fmt(a) for a in node.args[1:]] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name} = {fmt(node.args[0])}.{node.target}({', '.join(args)})")
        elif node.op == "output":
            lines.append(f"return {fmt(node.args[0])}")
    return "\n".join(lines)


def assert_fused_into_quantize(example, kernel: str, replaced: str, report_phrase: str) -> Captured:
    """A float op and its quantize (``example()``: module, inputs) lowered onto one own
    kernel: the reference's values, ``<family module>.<kernel>(`` in the graph and no ``replaced`` op
    left, and the report's count of such fusions."""
    torch.manual_seed(0)
    module, inputs = example()
    captured = assert_matches_reference(quantize(module, inputs), inputs)
    graph = short_graph(captured.lowered)
    family = kernel_registry.PLAIN[kernel].__module__.split(".")[-1]
    assert f"{family}.{kernel}(" in graph and replaced not in graph, graph
    assert report_phrase in str(captured.report), str(captured.report)
    return captured


def dynamo_graph(module, inputs) -> tuple:
    """(the one graph Dynamo captures of ``module`` on ``inputs``, its example inputs)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=capture)(*inputs)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def lower_without_running(module, inputs, registry=None, **options):
    """(lowered GraphModule, report) for the graph Dynamo captures, without running the
    lowered graph: for devices this machine lacks (XPU), checked at graph level."""
    _, report, lowered = compile_graph(*dynamo_graph(module, inputs), Options(**options), registry)
    return lowered, report


def onednn_linear_rows() -> int:
    """A row count for int8 linears that oneDNN's qlinear runs (qbackend's own GEMM kernel takes
    up to lowering/gemm.py LIMITS' max_rows, per build): for tests of oneDNN-specific graphs."""
    from qbackend.lowering.gemm import LIMITS

    return max(limits.max_rows for limits in LIMITS.values()) + 8


SATURATION_REASON = "adds pairs of products in int16"


def cpu_saturates() -> bool:
    """Whether this machine's int8 kernels overflow 8-bit activations (x86 without VNNI)."""
    from qbackend.lowering.capabilities import int8_pairs_saturate

    return int8_pairs_saturate("cpu", "conv") or int8_pairs_saturate("cpu", "linear")


def simulate_cpu(monkeypatch, saturates: bool):
    """Lower as on a CPU whose int8 kernels do (no VNNI) or do not saturate; graph-level only
    when that is not this machine."""
    import qbackend.lowering.cpu as cpu

    monkeypatch.setattr(cpu, "int8_pairs_saturate", lambda device, kind: saturates)


def onednn_only(monkeypatch):
    """Lower as without qbackend's own kernels (QBACKEND_KERNELS=off): for graph tests whose
    subject is oneDNN's ops or the int8 flow between them, the same graph on every CPU and build."""
    monkeypatch.setattr(kernel_registry, "available", lambda: "qbackend's own kernels are off for this test")


def dense_convs_on_onednn(monkeypatch):
    """Keep 3x3 convs of zero-point-0 inputs on oneDNN on every GEMM build (the zmm build takes
    small ones, lowering/gemm.py max_dense_macs): for tests whose subject is oneDNN's conv."""
    import dataclasses

    from qbackend.lowering import gemm

    for build, limits in list(gemm.LIMITS.items()):
        monkeypatch.setitem(gemm.LIMITS, build, dataclasses.replace(limits, max_dense_macs=0))


def in_threads(calls: list, on_error: Callable = lambda: None) -> list:
    """Each of ``calls`` run in a thread of its own; their results in order. An exception in one
    (lost in the thread otherwise) fails the caller, after ``on_error`` ran (e.g. a barrier's
    abort: the threads waiting there for the failed one go on)."""
    results, errors = [None] * len(calls), []

    def run(k):
        try:
            results[k] = calls[k]()
        except BaseException as error:
            errors.append(error)
            on_error()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results
