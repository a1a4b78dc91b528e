"""``python -m qbackend.archive_operators [--generate [--write]]``: the operators a saved graph
may call (``operator_allowlist.py``), by source; ``--generate`` runs the flows and exports that
give them (needs torchao; torchvision and transformers where installed), ``--write`` puts the
result in ``operator_allowlist.py``.
"""
from __future__ import annotations

import argparse
import operator
import re
import sys
from pathlib import Path

import torch

from qbackend import models
from qbackend.patterns import RULES
from qbackend.pt2e_flow import quantize_x86, quantize_xpu
from qbackend.archive.operator_allowlist import ARCHITECTURES, FLOWS, LAYERS, NAMESPACES, overload_name, resolve, side_effect

def graph_ops(gm: torch.nn.Module, inputs: tuple = ()) -> set[str]:
    """The overloads ``gm`` calls (a module in quantized form, not a graph: its export's), of
    the namespaces a fresh process has without torchao."""
    if not isinstance(gm, torch.fx.GraphModule):
        gm = torch.export.export(gm, inputs, strict=True).module()
    return {overload_name(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in NAMESPACES}


def generate_flows() -> set[str]:
    """The operators of the rule examples, near misses and in-house models through the flows."""
    found = set()
    for rule in RULES:
        if rule.example is not None:
            module, inputs = rule.example()
            if rule.example_is_quantized:
                found |= graph_ops(module, inputs)
            else:
                found |= graph_ops(quantize_x86(module, inputs, [inputs], **dict(rule.example_flags)))
                found |= graph_ops(quantize_xpu(module, inputs, [inputs]))
        for miss in rule.near_misses:
            found |= graph_ops(*miss.build())
    encoder = models.bert_encoder_like(num_layers=1, hidden=64, heads=4, ffn=128)
    for model, inputs in ((models.tiny_resnet(), (torch.randn(2, 3, 32, 32),)), (encoder, (torch.randn(2, 16, 64),))):
        for flags in ({"dynamic_batch": True}, {"is_qat": True}, {"is_dynamic": True}):
            found |= graph_ops(quantize_x86(model, inputs, [inputs], **flags))
    return found


# torch.export of real architectures (random weights): torchvision's and Hugging Face's definitions
TORCHVISION = ("segmentation.deeplabv3_mobilenet_v3_large", "segmentation.lraspp_mobilenet_v3_large", "resnet50",
               "resnext50_32x4d", "mobilenet_v3_large", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
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
                 "image_size": 32, "patch_size": 8,
                 "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}


def _torchvision_export(name: str):
    import types

    # (PyPI's torchvision is CUDA-built: its C ops do not load against CPU torch; the definitions need none)
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision.models

    weights = {"weights_backbone": None} if name.startswith("segmentation.") else {}  # (no download)
    return operator.attrgetter(name)(torchvision.models)(**weights).eval(), (torch.randn(1, 3, 224, 224),)


def _hugging_face_export(class_name: str):
    import transformers

    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**{**_SMALL_CONFIG, **HUGGING_FACE[class_name]})
    config._attn_implementation = "sdpa"
    model = model_class(config).eval()
    if class_name == "ViTModel":
        return model, (torch.randn(1, 3, 32, 32),)
    kwargs = {"use_cache": False} if "CausalLM" in class_name or class_name == "GPT2Model" else {}
    ids = torch.randint(0, 1000, (2, 16))

    class Call(torch.nn.Module):  # (keyword arguments fixed, a tuple of tensors out)
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).to_tuple()

    return Call(), (ids, torch.ones_like(ids))


# torch.nn's layers as models use them: (constructor, input shape)
NN_LAYERS = {
    "Conv3d": (lambda nn: nn.Conv3d(4, 4, 3, padding=1), (1, 4, 6, 6, 6)),
    "ConvTranspose1d": (lambda nn: nn.ConvTranspose1d(4, 4, 3), (1, 4, 8)),
    "ConvTranspose3d": (lambda nn: nn.ConvTranspose3d(4, 4, 3), (1, 4, 4, 4, 4)),
    "MaxPool1d": (lambda nn: nn.MaxPool1d(2), (1, 4, 8)), "MaxPool3d": (lambda nn: nn.MaxPool3d(2), (1, 4, 4, 4, 4)),
    "AvgPool1d": (lambda nn: nn.AvgPool1d(2), (1, 4, 8)), "AvgPool3d": (lambda nn: nn.AvgPool3d(2), (1, 4, 4, 4, 4)),
    "AdaptiveAvgPool1d": (lambda nn: nn.AdaptiveAvgPool1d(1), (1, 4, 8)),
    "AdaptiveMaxPool2d": (lambda nn: nn.AdaptiveMaxPool2d(1), (1, 4, 8, 8)),
    "BatchNorm1d": (lambda nn: nn.BatchNorm1d(4), (2, 4, 8)), "BatchNorm3d": (lambda nn: nn.BatchNorm3d(4), (1, 4, 2, 2, 2)),
    "GroupNorm": (lambda nn: nn.GroupNorm(2, 4), (1, 4, 8, 8)), "InstanceNorm2d": (lambda nn: nn.InstanceNorm2d(4), (1, 4, 8, 8)),
    "RMSNorm": (lambda nn: nn.RMSNorm(8), (2, 8)), "LocalResponseNorm": (lambda nn: nn.LocalResponseNorm(2), (1, 4, 8, 8)),
    "Upsample": (lambda nn: nn.Upsample(scale_factor=2), (1, 4, 8, 8)),
    "UpsampleBilinear": (lambda nn: nn.Upsample(scale_factor=2, mode="bilinear"), (1, 4, 8, 8)),
    "PixelShuffle": (lambda nn: nn.PixelShuffle(2), (1, 8, 4, 4)), "PixelUnshuffle": (lambda nn: nn.PixelUnshuffle(2), (1, 2, 8, 8)),
    "ChannelShuffle": (lambda nn: nn.ChannelShuffle(2), (1, 4, 4, 4)),
    "ReflectionPad2d": (lambda nn: nn.ReflectionPad2d(1), (1, 4, 8, 8)),
    "ReplicationPad2d": (lambda nn: nn.ReplicationPad2d(1), (1, 4, 8, 8)), "ZeroPad2d": (lambda nn: nn.ZeroPad2d(1), (1, 4, 8, 8)),
    "ELU": (lambda nn: nn.ELU(), (2, 8)), "SELU": (lambda nn: nn.SELU(), (2, 8)), "CELU": (lambda nn: nn.CELU(), (2, 8)),
    "Mish": (lambda nn: nn.Mish(), (2, 8)), "Softplus": (lambda nn: nn.Softplus(), (2, 8)),
    "LeakyReLU": (lambda nn: nn.LeakyReLU(), (2, 8)), "PReLU": (lambda nn: nn.PReLU(), (2, 8)),
    "ReLU6": (lambda nn: nn.ReLU6(), (2, 8)), "Hardswish": (lambda nn: nn.Hardswish(), (2, 8)),
    "GELUtanh": (lambda nn: nn.GELU(approximate="tanh"), (2, 8)), "GLU": (lambda nn: nn.GLU(), (2, 8)),
    "Softsign": (lambda nn: nn.Softsign(), (2, 8)), "LogSoftmax": (lambda nn: nn.LogSoftmax(-1), (2, 8)),
    "Softmin": (lambda nn: nn.Softmin(-1), (2, 8)), "Threshold": (lambda nn: nn.Threshold(0.1, 0.0), (2, 8)),
    "Unflatten": (lambda nn: nn.Unflatten(1, (2, 4)), (2, 8)), "Flatten": (lambda nn: nn.Flatten(), (2, 2, 4)),
    "Unfold": (lambda nn: nn.Unfold(2), (1, 4, 8, 8)), "Fold": (lambda nn: nn.Fold((4, 4), 2), (1, 16, 9)),
    "MultiheadAttention": (lambda nn: _SelfAttention(nn.MultiheadAttention(8, 2, batch_first=True)), (2, 4, 8)),
    "TransformerEncoderLayer": (lambda nn: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), (2, 4, 8)),
    "CosineSimilarity": (lambda nn: _Pair(nn.CosineSimilarity()), (2, 8)),
    "PairwiseDistance": (lambda nn: _Pair(nn.PairwiseDistance()), (2, 8)),
    "Bilinear": (lambda nn: _Pair(nn.Bilinear(8, 8, 4)), (2, 8)),
}


class _SelfAttention(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class _Pair(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, x.flip(0))


def generate_layers() -> set[str]:
    """The operators torch.export of torch.nn's layers calls."""
    found = set()
    for build, shape in NN_LAYERS.values():
        found |= graph_ops(build(torch.nn).eval(), (torch.randn(shape),))
    return found


def generate_architectures() -> tuple[set[str], list[str]]:
    """(the operators torch.export of the real architectures calls, the sources skipped)."""
    builders = {**{name: (_torchvision_export, name) for name in TORCHVISION},
                **{name: (_hugging_face_export, name) for name in HUGGING_FACE}}
    found, skipped = set(), []
    for name, (build, argument) in builders.items():
        try:
            model, inputs = build(argument)
            with torch.no_grad():
                found |= graph_ops(model, inputs)
        except Exception as error:  # (a package not installed, or an export torch cannot do)
            skipped.append(f"{name} ({type(error).__name__}: {str(error)[:100]})")
    return found, skipped


def _write(groups: dict) -> None:
    """Each list's literal in operator_allowlist.py replaced by the generated one."""
    path = Path(__file__).with_name("operator_allowlist.py")
    source = path.read_text()
    for title, names in groups.items():
        literal = f'{title} = frozenset("""\n' + "\n".join(sorted(names)) + '\n""".split())'
        source = re.sub(rf'{title} = frozenset\("""\n.*?""".split\(\)\)', lambda _: literal, source, flags=re.S)
    path.write_text(source)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qbackend.archive_operators", description=__doc__.splitlines()[0])
    parser.add_argument("--generate", action="store_true", help="run the flows and exports, print the lists they give")
    parser.add_argument("--write", action="store_true", help="with --generate: write them into operator_allowlist.py")
    args = parser.parse_args(argv)
    if args.generate:
        flows = generate_flows()
        layers = generate_layers() - flows
        architectures, skipped = generate_architectures()
        groups = {"FLOWS": flows, "LAYERS": layers, "ARCHITECTURES": architectures - flows - layers}
    else:
        groups, skipped = {"FLOWS": FLOWS, "LAYERS": LAYERS, "ARCHITECTURES": ARCHITECTURES}, []
    for title, names in groups.items():
        print(f"{title} ({len(names)}):")
        for name in sorted(names):
            print(f"    {name}")
    for source in skipped:
        print(f"skipped {source}")
    unsafe = {name: side_effect(resolve(name)) for names in groups.values() for name in names}
    for name, why in unsafe.items():
        if why is not None:
            print(f"UNSAFE {name}: {why}")
    if args.generate and args.write and not any(unsafe.values()):
        _write(groups)
    return 1 if any(unsafe.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
