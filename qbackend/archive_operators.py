"""The operators a saved graph may call: an explicit list of overloads, never a namespace.

A whole namespace is not an allowlist: ``aten::from_file(..., shared=True)`` maps a file for
writing. The list is what converted graphs actually call, generated (``--generate``) from:

- ``FLOWS``: every rule's example and near miss and the in-house models, through
  ``quantize_x86`` (static, dynamic, QAT; dynamic batch) and ``quantize_xpu``;
- ``ARCHITECTURES``: torch.export of the real architectures users quantize (torchvision's CNNs
  and ViT, Hugging Face encoders and decoders built from configs), where those packages are
  installed; what they call beyond the flows' quantize / dequantize ops.

Each entry is also checked to touch nothing but its tensors (``side_effect``).

    python -m qbackend.archive_operators             # the list, by source
    python -m qbackend.archive_operators --generate  # the list the flows and architectures give now
"""
from __future__ import annotations

import argparse
import importlib
import operator
import sys
from typing import Optional

import torch

# generated: python -m qbackend.archive_operators --generate (2026-11-29, torch 2.13.0, torchao 0.18.0)
FLOWS = frozenset("""
aten::adaptive_avg_pool2d.default
aten::add.Tensor
aten::add_.Tensor
aten::avg_pool2d.default
aten::cat.default
aten::chunk.default
aten::conv1d.default
aten::conv2d.default
aten::conv_transpose2d.input
aten::div.Tensor
aten::flatten.using_ints
aten::gelu.default
aten::layer_norm.default
aten::linear.default
aten::matmul.default
aten::max_pool2d.default
aten::mean.dim
aten::mul.Tensor
aten::numpy_T.default
aten::permute.default
aten::relu.default
aten::relu_.default
aten::reshape.default
aten::scaled_dot_product_attention.default
aten::sigmoid.default
aten::silu.default
aten::softmax.int
aten::sym_size.int
aten::transpose.int
aten::view.default
quantized_decomposed::choose_qparams.tensor
quantized_decomposed::dequantize_per_channel.default
quantized_decomposed::dequantize_per_channel_group.default
quantized_decomposed::dequantize_per_tensor.default
quantized_decomposed::dequantize_per_tensor.tensor
quantized_decomposed::quantize_per_channel.default
quantized_decomposed::quantize_per_tensor.default
quantized_decomposed::quantize_per_tensor.tensor
""".split())
ARCHITECTURES = frozenset("""
aten::__and__.Tensor
aten::_assert_tensor_metadata.default
aten::abs.default
aten::alias.default
aten::arange.default
aten::batch_norm.default
aten::contiguous.default
aten::cos.default
aten::cumsum.default
aten::dropout.default
aten::dropout_.default
aten::einsum.default
aten::embedding.default
aten::eq.Scalar
aten::expand.default
aten::fill_.Tensor
aten::full_like.default
aten::gather.default
aten::ge.Scalar
aten::gt.Scalar
aten::hardsigmoid.default
aten::hardswish_.default
aten::hardtanh_.default
aten::index.Tensor
aten::le.Tensor
aten::lift_fresh_copy.default
aten::log.default
aten::lt.Scalar
aten::masked_fill.Scalar
aten::min.other
aten::ne.Scalar
aten::neg.default
aten::new_ones.default
aten::new_zeros.default
aten::pad.default
aten::pow.Tensor_Scalar
aten::roll.default
aten::rsqrt.default
aten::select.int
aten::silu_.default
aten::sin.default
aten::slice.Tensor
aten::squeeze.dim
aten::sub.Tensor
aten::swapaxes.default
aten::tanh.default
aten::to.device
aten::to.dtype
aten::to.dtype_layout
aten::type_as.default
aten::unflatten.int
aten::unsqueeze.default
aten::where.ScalarOther
aten::where.self
""".split())
NAMESPACES = ("aten", "quantized_decomposed", "prims")  # (torchao's operators need torchao imported)
PYTHON_TARGETS = frozenset({"operator.getitem"})  # the Python callables a converted graph calls
ALLOWED = FLOWS | ARCHITECTURES

# schema argument types through which an operator reaches beyond its tensors
_OUTSIDE_TENSORS = ("Storage", "Generator", "ScriptObject", "Stream", "Any")


def overload_name(op: torch._ops.OpOverload) -> str:
    return f"{op.namespace}::{op._opname}.{op._overloadname}"


def resolve(name: str) -> Optional[torch._ops.OpOverload]:
    """The overload ``name`` ("ns::packet.overload") spells, if this torch has it."""
    namespace, _, op = name.partition("::")
    packet, _, overload = op.rpartition(".")
    if namespace == "quantized_decomposed":  # (registered by torch's own module, not torchao's)
        importlib.import_module("torch.ao.quantization.fx._decomposed")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None


def side_effect(op: torch._ops.OpOverload) -> Optional[str]:
    """Why ``op`` may act beyond the tensors it is given (None: it cannot)."""
    for argument in op._schema.arguments:
        if any(kind in str(argument.type) for kind in _OUTSIDE_TENSORS):
            return f"takes a {argument.type} ({argument.name})"
        if str(argument.type).startswith("str") and argument.name in ("filename", "path", "file"):
            return f"takes a file name ({argument.name})"
    return None


def _graph_ops(gm: torch.nn.Module, inputs: tuple = ()) -> set[str]:
    """The overloads ``gm`` calls (a module in quantized form, not a graph: its export's), of
    the namespaces a fresh process has without torchao."""
    if not isinstance(gm, torch.fx.GraphModule):
        gm = torch.export.export(gm, inputs, strict=True).module()
    return {overload_name(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in NAMESPACES}


def generate_flows() -> set[str]:
    """The operators of the rule examples, near misses and in-house models through the flows."""
    from qbackend import models
    from qbackend.patterns import RULES
    from qbackend.pt2e_flow import quantize_x86, quantize_xpu

    found = set()
    for rule in RULES:
        if rule.example is not None:
            module, inputs = rule.example()
            if rule.example_is_quantized:
                found |= _graph_ops(module, inputs)
            else:
                found |= _graph_ops(quantize_x86(module, inputs, [inputs], **dict(rule.example_flags)))
                found |= _graph_ops(quantize_xpu(module, inputs, [inputs]))
        for miss in rule.near_misses:
            found |= _graph_ops(*miss.build())
    encoder = models.bert_encoder_like(num_layers=1, hidden=64, heads=4, ffn=128)
    for model, inputs in ((models.tiny_resnet(), (torch.randn(2, 3, 32, 32),)), (encoder, (torch.randn(2, 16, 64),))):
        for flags in ({"dynamic_batch": True}, {"is_qat": True}, {"is_dynamic": True}):
            found |= _graph_ops(quantize_x86(model, inputs, [inputs], **flags))
    return found


# torch.export of real architectures (random weights): torchvision's and Hugging Face's definitions
TORCHVISION = ("segmentation.deeplabv3_mobilenet_v3_large", "segmentation.lraspp_mobilenet_v3_large", "resnet50", "resnext50_32x4d", "mobilenet_v3_large", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
               "shufflenet_v2_x1_0", "vit_b_16", "regnet_y_400mf", "densenet121", "googlenet", "mnasnet1_0",
               "squeezenet1_1", "swin_t", "maxvit_t", "efficientnet_v2_s", "vgg11_bn")
HUGGING_FACE = {  # model class: config arguments (small: the operators do not depend on the size)
    "BertModel": {}, "DistilBertForSequenceClassification": {}, "RobertaModel": {}, "GPT2Model": {},
    "LlamaForCausalLM": {"num_key_value_heads": 2}, "Qwen2ForCausalLM": {"num_key_value_heads": 2},
    "T5EncoderModel": {}, "ViTModel": {}, "CLIPTextModel": {}, "MistralForCausalLM": {"num_key_value_heads": 2},
    "GemmaForCausalLM": {"num_key_value_heads": 2, "head_dim": 16}, "Phi3ForCausalLM": {"num_key_value_heads": 2},
}
_SMALL_CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "num_hidden_layers": 2,
                 "dim": 64, "n_heads": 4, "hidden_dim": 128, "n_layers": 2, "n_embd": 64, "n_head": 4, "n_layer": 2,
                 "d_model": 64, "num_heads": 4, "d_ff": 128, "d_kv": 16, "num_layers": 2, "vocab_size": 1000,
                 "image_size": 32, "patch_size": 8}


def _torchvision_export(name: str):
    import types

    # (PyPI's torchvision is CUDA-built: its C ops do not load against CPU torch; the definitions need none)
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision.models

    return operator.attrgetter(name)(torchvision.models)().eval(), (torch.randn(1, 3, 224, 224),)


def _hugging_face_export(class_name: str):
    import transformers

    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**{**_SMALL_CONFIG, **HUGGING_FACE[class_name]})
    config._attn_implementation = "sdpa"
    model = model_class(config).eval()
    if class_name == "ViTModel":
        return model, (torch.randn(1, 3, 32, 32),)
    kwargs = {"use_cache": False} if "CausalLM" in class_name else {}
    ids = torch.randint(0, 1000, (2, 16))

    class Call(torch.nn.Module):  # (keyword arguments fixed, a tuple of tensors out)
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).to_tuple()

    return Call(), (ids, torch.ones_like(ids))


def generate_architectures() -> tuple[set[str], list[str]]:
    """(the operators torch.export of the real architectures calls, the sources skipped)."""
    builders = {**{name: (_torchvision_export, name) for name in TORCHVISION},
                **{name: (_hugging_face_export, name) for name in HUGGING_FACE}}
    found, skipped = set(), []
    for name, (build, argument) in builders.items():
        try:
            model, inputs = build(argument)
            with torch.no_grad():
                found |= _graph_ops(model, inputs)
        except Exception as error:  # (a package not installed, or an export torch cannot do)
            skipped.append(f"{name} ({type(error).__name__}: {str(error)[:100]})")
    return found, skipped


def _print_list(names) -> None:
    for name in sorted(names):
        print(f"    {name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qbackend.archive_operators", description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="run the flows and exports, print the lists they give")
    args = parser.parse_args(argv)
    if not args.generate:
        for title, names in (("from the flows", FLOWS), ("from real architectures", ARCHITECTURES - FLOWS)):
            print(f"{title} ({len(names)}):")
            _print_list(names)
        return 0
    flows = generate_flows()
    architectures, skipped = generate_architectures()
    print("FLOWS:")
    _print_list(flows)
    print("ARCHITECTURES:")
    _print_list(architectures - flows)
    unsafe = {name: side_effect(resolve(name)) for name in flows | architectures}
    for name, why in unsafe.items():
        if why is not None:
            print(f"UNSAFE {name}: {why}", file=sys.stderr)
    for source in skipped:
        print(f"skipped {source}")
    return 1 if any(unsafe.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
