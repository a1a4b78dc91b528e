"""The standard PT2E int8 flow for x86 CPUs, as users run it with torchao.

torchao is imported only inside the functions below: importing
``torchao.quantization.pt2e.quantizer.x86_inductor_quantizer`` sets
``torch._inductor.config.pre_grad_custom_pass`` and registers Inductor
quantization passes globally, which must not happen as a side effect of
importing this module.
"""

import fnmatch

import torch

from qbackend.flow import accuracy_control as control
from qbackend.flow import activation_ranges as ranges
from qbackend.flow import bias_correction as correction
from qbackend.flow import pair_bound
from qbackend.flow import recipe
from qbackend.flow.batches import BatchCheck, batch_dynamic, calibration_batches, positional_and_keyword
from qbackend.flow.graph_copy import graph_copy
from qbackend.graph_constants import constant_value
from qbackend.lowering.capabilities import int8_pairs_saturate
from qbackend.lowering.gemm import pairs_of_whole_words
from qbackend.pipeline.direct import EXPORT_RANGES
from qbackend.pipeline.static_module import mark_static
from qbackend.smoothquant.smooth_quant import smooth_quant

# (inductor_int8, the peer's recipe, is for benchmarks and tests: importable, not exported)
__all__ = ["quantize_x86", "quantize_xpu", "cpu_needs_reduce_range"]


def cpu_needs_reduce_range() -> bool:
    """True on x86 CPUs whose int8 kernels add product pairs in int16 (no VNNI): there 8-bit
    activations times 8-bit weights overflow; 7-bit weights or 7-bit activations are exact
    (lowering/capabilities.py)."""

    return int8_pairs_saturate("cpu", "conv") or int8_pairs_saturate("cpu", "linear")


REDUCE_RANGE_CHOICES = (False, True, "activations", "weights", "pairs")
SEVEN_BIT_WEIGHTS = (-64, 63)
SEVEN_BIT_BY_DEFAULT = ("weights", "pairs")  # (the global weight spec; _with_full_range_where_exact gives back 8 bits)


def _resolved_reduce_range(reduce_range):
    if reduce_range is None:
        return "pairs" if cpu_needs_reduce_range() else False
    if reduce_range not in REDUCE_RANGE_CHOICES:
        raise ValueError(f"reduce_range must be None or one of {REDUCE_RANGE_CHOICES}, got {reduce_range!r}")
    return reduce_range


def _x86_quantizer(is_qat, is_dynamic, reduce_range, keep_float, every_linear):
    import dataclasses

    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq

    config = xiq.get_default_x86_inductor_quantization_config(
        is_qat=is_qat, is_dynamic=is_dynamic, reduce_range=reduce_range in (True, "activations")
    )
    full_range = config.weight
    if reduce_range in SEVEN_BIT_BY_DEFAULT:
        low, high = SEVEN_BIT_WEIGHTS
        config = dataclasses.replace(config, weight=dataclasses.replace(config.weight, quant_min=low, quant_max=high))
    x86 = xiq.X86InductorQuantizer().set_global(config)
    for name in keep_float:
        x86.set_module_name_qconfig(name, None)
    quantizer = _with_float_layers(x86, config, keep_float, {**(LEFT_FLOAT_LINEARS if every_linear else {}), **LEFT_FLOAT_CONV3D})
    if reduce_range not in SEVEN_BIT_BY_DEFAULT:
        return quantizer
    return _with_full_range_where_exact(quantizer, full_range, bounded_pairs=reduce_range == "pairs" and not is_qat)


def _followed_by(quantizer, annotate):
    """``quantizer`` (or each of a composed one's), then a quantizer whose ``annotate(model)``
    changes the annotations made before it (composed quantizers annotate in order)."""
    from torchao.quantization.pt2e.quantizer import ComposableQuantizer, Quantizer

    class Then(Quantizer):
        def annotate(self, model):
            annotate(model)
            return model

        def validate(self, model):
            pass

    return ComposableQuantizer([*getattr(quantizer, "quantizers", [quantizer]), Then()])


def _with_full_range_where_exact(quantizer, full_range, bounded_pairs=False):
    """``quantizer`` followed by one giving back their 8-bit weights to the convs whose kernels
    are exact with them at the same speed: 7-bit weights keep int16 pair sums from saturating
    where a kernel adds two input channels' products (no VNNI), and a depthwise conv (one input
    channel per group) has no such pairs (``lowering/cpu._largest_pair_sum``); a network's stem
    runs on the stem kernel, whose AVX2 build multiplies int16 pairs (``_stem_kernel_takes``).
    ``bounded_pairs``: the convs and linears whose pairs are adjacent input channels
    (``pairs_of_whole_words``) get 8-bit weights too, each
    channel's scale set by its largest pair (``pair_bound.observer``): exact, finer than 7 bits.
    Measured (Zen 3, cosine vs fp32, the zoo's 4 batches, eager converted model): the stem's 8
    bits raise regnet_y_400mf 0.98874 -> 0.98946, resnet50 0.98203 -> 0.98261,
    efficientnet_b0 0.98914 -> 0.99044."""
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import QUANT_ANNOTATION_KEY

    import dataclasses

    convs = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default)
    if bounded_pairs:  # (with the quantizer's own observer arguments: its eps)
        observer = pair_bound.observer().with_args(**full_range.observer_or_fake_quant_ctr.p.keywords)
        pair_bounded = dataclasses.replace(full_range, observer_or_fake_quant_ctr=observer)

    def annotate(model):
        for node in model.graph.nodes:
            if node.target not in (*convs, torch.ops.aten.linear.default) or QUANT_ANNOTATION_KEY not in node.meta:
                continue
            weight, specs = node.args[1], node.meta[QUANT_ANNOTATION_KEY].input_qspec_map
            value = weight.meta.get("val")
            if weight not in specs or value is None:
                continue
            if node.target in convs and (value.shape[1] == 1 or _stem_kernel_takes(node, value)):
                specs[weight] = full_range
            elif bounded_pairs and pairs_of_whole_words(value.shape):
                specs[weight] = pair_bounded

    return _followed_by(quantizer, annotate)


# Post-ops between a stem conv and its quantize that the stem kernel folds (lowering/stem.py)
_STEM_TAILS = {torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.ops.aten.hardtanh.default,
               torch.ops.aten.hardtanh_.default, torch.ops.aten.hardswish.default, torch.ops.aten.hardswish_.default,
               torch.ops.aten.silu.default, torch.ops.aten.silu_.default}


def _stem_kernel_takes(conv, weight) -> bool:
    """Whether lowering/stem.py will run this annotated conv on qbackend's stem kernel: a 2-D
    conv of fewer than 4 input channels, groups and dilation 1, static sizes the kernel has
    room for (``stem_refusal``), its output (after a folded post-op) read by quantized ops
    only, and qbackend's kernels built here. Else 8-bit weights would leave it float where
    oneDNN's pair sums saturate (a ViT's 16x16 patch conv, a ConvNeXt stem read by a float
    LayerNorm, a batch-dynamic export)."""
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import QUANT_ANNOTATION_KEY

    from qbackend.kernels import registry
    from qbackend.lowering.stem import sizes_refusal, stem_weight

    x = conv.args[0].meta.get("val")
    stride, _, dilation, groups = (list(conv.args[3:7]) + [[1, 1], [0, 0], [1, 1], 1][len(conv.args[3:7]):])
    if not stem_weight(weight.shape, groups) or x is None or x.dim() != 4 or registry.available() is not None:
        return False
    static = tuple(x.shape) if all(isinstance(size, int) for size in x.shape) else None
    if sizes_refusal(static, weight.shape, tuple(stride) * (2 // len(stride)), list(dilation) * (2 // len(dilation))) is not None:
        return False
    end = conv
    while len(end.users) == 1 and next(iter(end.users)).target in _STEM_TAILS:
        end = next(iter(end.users))
    readers = list(end.users)
    fused_add = end is conv and any("add" in str(r.target) for r in readers)  # (a residual: the GEMM's row, not the stem's)
    return bool(readers) and not fused_add and all(
        QUANT_ANNOTATION_KEY in r.meta and end in r.meta[QUANT_ANNOTATION_KEY].input_qspec_map for r in readers)


def _kept(node, keep_float) -> bool:
    """The node belongs to a module ``keep_float`` names (or one inside it)."""
    paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    return any(path == name or path.startswith(name + ".") for path in paths for name in keep_float)


# Layers X86InductorQuantizer leaves float although their weight is a constant, annotated by
# ``_with_float_layers``: op -> the quantizer's helper that annotates their kind.
# It finds linears by their source function, and inside nn.MultiheadAttention that is the
# attention's: the in / out projections stay float (OpenVINO's recipe quantizes every MatMul
# with a constant weight). ``every_linear`` selects this row.
LEFT_FLOAT_LINEARS = {torch.ops.aten.linear.default: "_annotate_linear_node_helper"}
# It annotates 1-D and 2-D convs only; the lowering runs 3-D ones on oneDNN (``qconv3d``; torch
# 2.13 fuses no post-op into them: a ReLU after one becomes a clamp of its uint8 output,
# ``lowering/common.clamp_after``).
LEFT_FLOAT_CONV3D = {torch.ops.aten.conv3d.default: "_annotate_conv_node_helper",
                     torch.ops.aten.conv3d.padding: "_annotate_conv_node_helper"}


def _with_float_layers(quantizer, config, keep_float, helpers: dict):
    """``quantizer`` followed by a quantizer annotating each layer of ``helpers``' ops that it
    left float, with a constant weight and outside ``keep_float``, as ``quantizer`` annotates
    its kind (input, per-channel weight, output); ``quantizer`` itself when ``helpers`` is empty."""
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import QUANT_ANNOTATION_KEY

    if not helpers:
        return quantizer

    def annotate(model):
        for node in model.graph.nodes:
            helper = helpers.get(node.target) if node.op == "call_function" else None
            if (helper is not None and QUANT_ANNOTATION_KEY not in node.meta and node.args[1].op == "get_attr"
                    and not _kept(node, keep_float)):
                getattr(quantizer, helper)(node, True, config)

    return _followed_by(quantizer, annotate)


def module_paths(model: torch.nn.Module, names) -> tuple:
    """``names`` with each fnmatch pattern replaced by the module paths it matches, in the
    model's order; ValueError for an entry matching none (a typo must not quantize silently)."""
    paths = [path for path, _ in model.named_modules() if path]
    chosen = []
    for name in names:
        matched = [p for p in paths if fnmatch.fnmatchcase(p, name)]
        if not matched:
            raise ValueError(f"keep_float: {name!r} matches no module of {type(model).__name__} "
                             f"(paths look like {paths[:3]})")
        chosen += [p for p in matched if p not in chosen]
    return tuple(chosen)


def _xpu_quantizer(every_linear=True):
    import torchao.quantization.pt2e.quantizer.xpu_inductor_quantizer as xpuiq

    config = xpuiq.get_default_xpu_inductor_quantization_config()
    quantizer = xpuiq.XPUInductorQuantizer().set_global(config)
    return _with_float_layers(quantizer, config, (), LEFT_FLOAT_LINEARS if every_linear else {})


def quantize_xpu(model, example_inputs, calibration, *, every_linear=True, **flow):
    """Export, prepare, calibrate and convert ``model`` with torchao's XPUInductorQuantizer:
    signed int8 activations, per-channel symmetric int8 weights, max_pool2d left float; the
    quantizer has no QAT or dynamic options. The model may live on any device (the quantizer
    only annotates the graph): on CPU the result lowers through the CPU table, whose kernels
    read the signed activations as unsigned ones (exact, see ``lowering/signed_int8.py``).
    ``every_linear`` as ``quantize_x86`` takes it; ``flow``: the export and calibration
    keywords of ``quantize_x86`` (``dynamic_batch``, ``dynamic_shapes``, ``strict``,
    ``num_batches``, ``progress``, ``activation_ranges``, ``bias_correction``, ``transform_fn``)."""
    converted = _convert(model, example_inputs, calibration, _xpu_quantizer(every_linear), is_qat=False, **flow)
    return recipe.record(converted, "quantize_xpu", {"every_linear": every_linear, **flow})


def quantize_x86(model, example_inputs, calibration, *, is_qat=False, is_dynamic=False, reduce_range=None, smooth=None,
                 keep_float=(), every_linear=True, dynamic_batch=False, dynamic_shapes=None, strict=True, num_batches=None,
                 progress=None, target_cosine=None, validate=None, max_drop=None, activation_ranges="auto",
                 bias_correction=True, transform_fn=None, config=None):
    """Export, prepare, calibrate and convert ``model`` with X86InductorQuantizer.

    Args:
        model: an ``nn.Module``; it is left in eval mode.
        example_inputs: the inputs export traces with: a tuple of positional inputs, or a dict
            of keyword inputs (a Hugging Face tokenizer's batch).
        calibration: an iterable of batches run through the prepared model (a list, a
            generator, a ``DataLoader``): each a tuple or list of positional inputs, a dict of
            keyword inputs, or a single tensor. Each must have the example's structure, dtypes
            and ranks, and its sizes where export fixed them: a batch that does not raises
            ValueError naming it; no batch at all raises too.
        config: a ``qbackend.QuantizeConfig``: these options as one object of plain data (for a
            file, or to repeat an archive's recipe); a keyword argument that is not at its
            default must then agree with it.
        transform_fn: applied to every calibration batch first, as NNCF's
            ``nncf.Dataset(loader, transform_fn)`` does: e.g. ``lambda batch: batch[0]`` for a
            DataLoader of (input, target) pairs.
        dynamic_batch: dim 0 of every tensor input may take any size (one size shared by all
            inputs): the result runs, and ``qbackend.compile`` lowers it once, for every batch.
            An example batch of 1 is exported as 2 (export would fix a size of 1).
        dynamic_shapes: ``torch.export.export``'s ``dynamic_shapes`` as is (e.g. a sequence
            length too); not together with ``dynamic_batch``.
        strict: ``torch.export.export``'s ``strict`` (default True, see below).
        num_batches: run at most this many calibration batches.
        progress: a progress bar (tqdm) over the calibration batches; None (default): only
            when stderr is a terminal.
        target_cosine: the output cosine vs the float model to reach on the first
            ``control.ACCURACY_BATCHES`` calibration batches: while below it, one more conv / linear is
            kept float and the flow runs again, up to ``control.MAX_KEPT_FLOAT`` layers: of the layer
            whose float input helps the output most (``qbackend.flow.accuracy.input_sensitivity``)
            and the one adding the most noise of its own, the better on trial. The result's
            ``meta["accuracy"]`` holds the last report, ``meta["kept_float"]`` the layers kept.
        validate / max_drop: accuracy control by your own metric, as NNCF's
            ``quantize_with_accuracy_control``: ``validate(model)`` returns a score, higher is
            better (accuracy, F1), run on the float model once and on each candidate as
            ``qbackend.compile`` runs it; layers are kept float as for ``target_cosine`` until
            the score is at most ``max_drop`` below the float model's. Each step and its cost
            are printed when ``progress`` shows (else logged at INFO).
        is_qat / is_dynamic: forwarded to
            ``get_default_x86_inductor_quantization_config``. With ``is_qat``
            the model is exported in train mode (``prepare_qat_pt2e`` only
            builds its fused conv+BN fake-quant pattern from training-mode
            BN), then the prepared model is moved to eval before calibration
            so BN running stats stay fixed. No training happens here; this is
            the QAT graph after zero training steps. Exporting in eval mode
            instead ran but was inaccurate (tiny_resnet cosine vs fp32 0.976
            after 4 calibration batches, 0.900 after 32; 0.9999 this way).
        reduce_range: for CPUs without VNNI, whose int8 kernels add two input channels'
            products in int16, which 8-bit activations times 8-bit weights overflow.
            ``"pairs"``: 8-bit weights whose per-channel scale keeps every pair a kernel adds
            within 128 (qbackend/flow/pair_bound.py: steps ~1.5x finer than 7 bits; convs and
            linears whose input channels come in groups of 4, others 7-bit; with ``is_qat``,
            7-bit); ``"weights"``: 7-bit weights
            ([-64, 63], as ONNX Runtime's reduce_range); with both, depthwise convs, which add
            no pairs of products, and a stem the stem kernel runs keep 8 bits; ``True`` /
            ``"activations"``: 7-bit activations ([0, 127], torchao's reduce_range); ``False``:
            none. None (default): ``"pairs"`` exactly when this CPU needs it
            (``cpu_needs_reduce_range``), else ``False``. Measured on all-MiniLM-L6-v2:
            embedding cosine vs fp32 0.9929 with 7-bit weights, 0.9791 with 7-bit activations
            (per-tensor activations lose more); ResNet-18: equal.
        smooth: None, or keyword arguments of ``qbackend.smooth_quant`` (e.g.
            ``{"alpha": "search"}``): SmoothQuant runs on the exported graph with
            the same calibration batches before ``prepare_pt2e``; its report is
            ``result.meta["smooth_quant"]``.
        keep_float: module paths (e.g. ``"bert.encoder.layer.5.output.dense"``) or fnmatch
            patterns over them (``"*.output.dense"``, as ``smooth``'s alpha takes) left
            unquantized: they run in float, and qbackend's report lists them as kept. An entry
            that names no module raises.
        every_linear: True (default): also quantize the linears X86InductorQuantizer leaves
            float although their weight is a constant (nn.MultiheadAttention's in / out
            projections: ViT's 24 of 50), as OpenVINO's recipe does; False: the quantizer's
            recipe as it is. Accuracy and speed: docs/benchmarks_zoo.md. 3-D convs, which
            X86InductorQuantizer leaves float too, are quantized like 2-D ones (unless
            ``keep_float`` names them): the lowering runs them on oneDNN. So are products of a
            constant 2-D weight written as ``addmm`` / ``mm`` (Hugging Face's ``Conv1D``: GPT-2),
            made linears first.
        activation_ranges: "histogram": the quantizer's HistogramObserver ranges (each
            tensor's range of least error on the calibration data); "min_max": each
            activation's min / max over the calibration batches; "auto" (default): the one
            whose output is nearer the float model's on a calibration batch the ranges were
            not fitted to (a probe calibrated on the others of the first ``control.ACCURACY_BATCHES``),
            named with both cosines in ``result.meta["activation_ranges"]``
            (qbackend/flow/activation_ranges.py); histogram with fewer than 2 batches.
        bias_correction: True (default): each quantized conv / linear's bias absorbs the mean
            shift its weights' rounding causes on the calibration data, as OpenVINO's NNCF
            does (qbackend/flow/bias_correction.py); ``result.meta["bias_correction"]`` counts them.
            Not with ``is_qat``.

    Returns:
        The converted ``torch.fx.GraphModule`` with quantize/dequantize ops
        around the quantized conv/linear (the "reference" int8 model).

    Why ``strict=True``: torch 2.13's ``torch.export.export`` defaults to
    non-strict mode. On models that call one ``nn.ReLU`` module twice (every
    torchvision-style BasicBlock does, as do ``models.resnet18_like`` and
    ``models.tiny_resnet``), non-strict export leaves no ``source_fn_stack``
    on the ``relu_`` nodes, so ``get_source_partitions`` groups both calls
    of the shared ReLU into a single partition with two output nodes.
    Observed with torch 2.13.0+cpu / torchao 0.18.0 on both models:
    ``prepare_pt2e`` raises
    ``ValueError: Input partition has more than one output node`` from
    ``X86InductorQuantizer._get_output_nodes_of_partitions`` (reached via
    ``annotate -> _annotate_conv2d_fusion_pattern ->
    _annotate_conv2d_binary_unary``). Strict export records one source
    per call, each ReLU partition has a single output, and the flow works.
    """
    options = {name: value for name, value in locals().items() if name not in ("model", "example_inputs", "calibration", "config")}
    if config is not None:  # (its values, then this function as if called with them)
        if not isinstance(config, recipe.QuantizeConfig):
            raise TypeError(f"config must be a qbackend.QuantizeConfig, got {type(config).__name__}")
        return quantize_x86(model, example_inputs, calibration, **config.merged(options))
    flow = dict(dynamic_batch=dynamic_batch, dynamic_shapes=dynamic_shapes, strict=strict, progress=progress,
                activation_ranges=activation_ranges, bias_correction=bias_correction)
    keep_float = module_paths(model, keep_float)
    say = control.speaker(progress)
    goal = control.checked_goal(model, target_cosine, validate, max_drop, say)

    weights = _resolved_reduce_range(reduce_range)

    def convert(kept, batches, **calibration_options):
        quantizer = _x86_quantizer(is_qat, is_dynamic, weights, kept, every_linear)
        return _convert(model, example_inputs, batches, quantizer, is_qat, smooth, **calibration_options, **flow)

    if goal is None:
        converted = convert(keep_float, calibration, num_batches=num_batches, transform_fn=transform_fn)
    else:  # (the batches listed once, transformed: every trial calibrates on them)
        batches = list(calibration_batches(calibration, num_batches, False, transform_fn))
        converted = control.keep_float_until(goal, model, batches, keep_float, convert, say)
    return recipe.record(converted, "quantize_x86", options)


def _export(model, example_inputs, dynamic_batch, dynamic_shapes, strict):
    args, kwargs = positional_and_keyword(example_inputs)
    if dynamic_batch:
        if dynamic_shapes is not None:
            raise ValueError("pass dynamic_batch=True or dynamic_shapes, not both")
        args, kwargs, dynamic_shapes = batch_dynamic(args, kwargs)
    return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict).module()


def _matrix_products_as_linears(gm) -> int:
    """``addmm(bias, x, W)`` / ``mm(x, W)`` of a constant 2-D ``W`` (Hugging Face's ``Conv1D``:
    GPT-2's every projection) as ``linear(x, W^T, bias)``: X86InductorQuantizer and the
    lowering know linears only, so these stayed float (OpenVINO quantizes them as MatMuls).
    ``W^T`` is a new constant (the model's own ``W`` is left as it was). Returns how many."""
    def constant(node):  # (a parameter the get_attr reads: the model's weights and biases)
        value = constant_value(gm, node)
        return value if isinstance(value, torch.nn.Parameter) else None

    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs or node.target not in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            continue
        bias, x, weight = node.args if node.target is torch.ops.aten.addmm.default else (None, *node.args)
        value, bias_value = constant(weight), constant(bias)
        if value is None or value.dim() != 2 or (bias is not None and (bias_value is None or bias_value.shape != value.shape[1:])):
            continue
        name = f"_qb_linear_weight_{rewritten}"
        while hasattr(gm, name):
            name += "_"
        gm.register_parameter(name, torch.nn.Parameter(value.detach().t().contiguous(), requires_grad=False))
        with gm.graph.inserting_before(node):
            transposed = gm.graph.get_attr(name)
            linear = gm.graph.call_function(torch.ops.aten.linear.default, (x, transposed, bias))
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return rewritten


def _batch_norms_off_shared_convs(gm) -> int:
    """prepare_pt2e folds each BatchNorm into the conv before it (torchao's ``_fuse_conv_bn_``)
    also where the conv's output has other readers, which then read the normalized values: a
    silently different model. MaxViT's stem conv feeds its first block's shortcut and that
    block's pre-norm BatchNorm; the converted maxvit_t's output had a cosine of 0.71 against
    the float model's with nothing quantized at all. Such a BatchNorm reads the conv through
    an alias (a view: no copy), which the fold passes by; it runs as an op of its own. Returns
    how many."""
    from torchao.quantization.pt2e.utils import _is_conv_or_conv_transpose_node

    norms = (torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit_no_training.default)
    kept = 0
    for node in list(gm.graph.nodes):
        conv = node.args[0] if node.op == "call_function" and node.target in norms else None
        if conv is not None and _is_conv_or_conv_transpose_node(conv) and len(conv.users) > 1:
            with gm.graph.inserting_before(node):
                alias = gm.graph.call_function(torch.ops.aten.alias.default, (conv,))
            alias.meta = {key: value for key, value in conv.meta.items() if key in ("val", "tensor_meta")}
            node.replace_input_with(conv, alias)
            kept += 1
    if kept:
        gm.recompile()
    return kept


def _calibrate(prepared, calibration, bias_correction=False) -> tuple[list, int]:
    """Runs every calibration batch through ``prepared``, then (``bias_correction``) corrects
    its biases for their weights' rounding (qbackend/flow/bias_correction.py); returns the first
    ``control.ACCURACY_BATCHES`` and how many biases changed."""
    means = correction.InputMeans()
    recorders = correction.add_recorders(prepared, means) if bias_correction else []
    first = []
    with torch.no_grad():
        for batch in calibration:
            first += [batch][:control.ACCURACY_BATCHES - len(first)]
            args, kwargs = positional_and_keyword(batch)
            prepared(*args, **kwargs)
    if not recorders:
        return first, 0
    correction.remove(prepared, recorders)
    return first, correction.correct(prepared, means)


def _convert(model, example_inputs, calibration, quantizer, is_qat, smooth=None, *, dynamic_batch=False,
             dynamic_shapes=None, strict=True, num_batches=None, progress=None, activation_ranges="auto",
             bias_correction=True, transform_fn=None):
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e

    if activation_ranges not in ranges.CHOICES:
        raise ValueError(f"activation_ranges must be one of {ranges.CHOICES}, got {activation_ranges!r}")
    if bias_correction not in (True, False):
        raise ValueError(f"bias_correction must be True or False, got {bias_correction!r}")
    model.train(is_qat)
    exported = _export(model, example_inputs, dynamic_batch, dynamic_shapes, strict)
    model.eval()
    _batch_norms_off_shared_convs(exported)
    _matrix_products_as_linears(exported)
    calibration = calibration_batches(calibration, num_batches, progress, transform_fn, BatchCheck(example_inputs, exported))
    smooth_report = None
    if smooth is not None:
        calibration = [positional_and_keyword(batch)[0] for batch in calibration]  # (SmoothQuant runs positional batches)
        # (the search simulates the weights' real range; every_linear composes X86InductorQuantizer first)
        weight = getattr(quantizer, "quantizers", [quantizer])[0].global_config.weight
        smooth_report = smooth_quant(exported, calibration, **{"weight_range": (weight.quant_min, weight.quant_max), **smooth})
    probing = activation_ranges == "auto" and not is_qat
    unprepared = graph_copy(exported) if probing else None  # (prepare_pt2e rewrites the graph it gets)
    prepare = prepare_qat_pt2e if is_qat else prepare_pt2e
    prepared = prepare(exported, quantizer)
    if is_qat:
        move_exported_model_to_eval(prepared)
    bias_correction = bias_correction and not is_qat  # (QAT trained its biases with the rounding in place)
    checked, corrected = _calibrate(prepared, calibration, bias_correction)
    cosines = {}
    if probing:
        def probe(batches):
            probed = prepare(unprepared, quantizer)
            _calibrate(probed, batches, bias_correction)
            return probed

        activation_ranges, cosines = ranges.chosen(model, probe, checked)
    converted = ranges.converted(prepared, activation_ranges, is_qat)
    if cosines:
        converted.meta["activation_ranges"] = (activation_ranges, cosines)
    if bias_correction:
        converted.meta["bias_correction"] = corrected
    setattr(converted, EXPORT_RANGES, getattr(exported, EXPORT_RANGES, None))  # (convert drops them; batch 1's lowering needs them)
    if smooth_report is not None:
        converted.meta["smooth_quant"] = smooth_report
    return mark_static(converted)  # (torch.compile then passes no weights per call: qbackend/pipeline/static_module.py)


def inductor_int8(converted_module, example_inputs):
    """Compile a ``quantize_x86`` result the official way: Inductor + freezing.

    Inductor only fuses the dequant -> conv/linear -> quant patterns into
    oneDNN int8 kernels (with prepacked weights) when ``freezing`` is on,
    which turns weights into constants. We enable it only through
    ``torch._inductor.config.patch(freezing=True)`` so the global config stays
    untouched, and we make the first call (which is when Dynamo/Inductor
    actually compile) inside that context: ``torch.compile`` itself is lazy,
    so compiling outside the patch would silently give the unfrozen,
    unfused graph.

    The returned callable always runs under ``torch.no_grad()``: freezing
    only applies to inference graphs, and Dynamo guards on grad mode, so a
    call with grad enabled would recompile without freezing. A recompile
    for other reasons (e.g. a new input shape) also happens outside the
    patch and is not frozen; compile once per shape with this function.

    Caveat (observed with torch 2.13.0+cpu / torchao 0.18.0): the compiled
    code can write into its input tensors. On ``bert_encoder_like`` the
    residual ``x + attention(x)`` is fused into a qlinear with a binary
    post-op (``qlinear_binary_lower_count`` > 0) that accumulates in place
    into ``x``, so every call changes the caller's input. The compile call
    below therefore runs on clones, leaving ``example_inputs`` untouched;
    callers that reuse inputs afterwards must pass copies themselves.
    """
    # Importing this module registers the Inductor int8 fusion passes.
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401

    compiled = torch.compile(converted_module)
    run_without_grad = torch.no_grad()(compiled)
    with torch._inductor.config.patch(freezing=True):
        run_without_grad(*[t.clone() for t in example_inputs])
    return run_without_grad
