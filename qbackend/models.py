"""Small, self-contained model builders for tests and benchmarks.

Plain torch.nn only (no torchvision, no downloads). Every builder takes a
``seed`` and initialises its weights from a forked RNG, so the same seed always
gives the same model and the caller's global RNG state is left untouched.
"""

import contextlib
import math

import torch
from torch import nn

__all__ = [
    "resnet18_like",
    "tiny_resnet",
    "mobilenet_v2_like",
    "bert_encoder_like",
    "build_model",
    "example_inputs",
    "calibration_batches",
    "MODEL_BUILDERS",
]


@contextlib.contextmanager
def _seeded(seed):
    """Run module construction with a fixed seed without disturbing global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _randomize_batchnorm_stats(model):
    # Fresh BN layers are the identity in eval mode (mean 0, var 1, weight 1,
    # bias 0); random stats make BN folding and int8 numerics actually matter.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-0.2, 0.2)


# --------------------------------------------------------------------------
# ResNet
# --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        # One ReLU module used twice, as torchvision does. Non-strict export
        # then yields a graph that X86InductorQuantizer rejects (see pt2e_flow).
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, stage_channels, blocks_per_stage, num_classes, stem_channels):
        super().__init__()
        self.conv1 = nn.Conv2d(3, stem_channels, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        in_channels = stem_channels
        for index, channels in enumerate(stage_channels):
            first_stride = 1 if index == 0 else 2
            blocks = [BasicBlock(in_channels, channels, first_stride)]
            blocks += [BasicBlock(channels, channels, 1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = channels
        self.stages = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.stages(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_like(num_classes=1000, *, seed=0):
    """ResNet-18 shape: 4 stages x 2 BasicBlocks, 64/128/256/512 channels."""
    with _seeded(seed):
        model = ResNet((64, 128, 256, 512), 2, num_classes, stem_channels=64)
        _randomize_batchnorm_stats(model)
    return model.eval()


def tiny_resnet(num_classes=10, *, seed=0):
    """Same structure as resnet18_like but 2 small stages, for 32x32 inputs."""
    with _seeded(seed):
        model = ResNet((16, 32), 2, num_classes, stem_channels=16)
        _randomize_batchnorm_stats(model)
    return model.eval()


# --------------------------------------------------------------------------
# MobileNetV2
# --------------------------------------------------------------------------


def _conv_bn_relu6(in_channels, out_channels, kernel_size, stride, groups=1):
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                  kernel_size // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, in_channels, out_channels, stride, expand_ratio):
        super().__init__()
        hidden = in_channels * expand_ratio
        layers = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(in_channels, hidden, 1, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),  # depthwise
            nn.Conv2d(hidden, out_channels, 1, bias=False),  # linear bottleneck
            nn.BatchNorm2d(out_channels),
        ]
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        out = self.block(x)
        return x + out if self.use_residual else out


# (expand_ratio, out_channels, repeats, first_stride), as in the MobileNetV2 paper.
_MOBILENET_V2_SETTINGS = [
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
]


class MobileNetV2(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        layers = [_conv_bn_relu6(3, 32, 3, 2)]
        in_channels = 32
        for expand_ratio, channels, repeats, first_stride in _MOBILENET_V2_SETTINGS:
            for index in range(repeats):
                stride = first_stride if index == 0 else 1
                layers.append(InvertedResidual(in_channels, channels, stride, expand_ratio))
                in_channels = channels
        layers.append(_conv_bn_relu6(in_channels, 1280, 1, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2_like(num_classes=1000, *, seed=0):
    """MobileNetV2 shape: inverted residuals, depthwise 3x3, ReLU6, residual adds."""
    with _seeded(seed):
        model = MobileNetV2(num_classes)
        _randomize_batchnorm_stats(model)
    return model.eval()


# --------------------------------------------------------------------------
# BERT-shaped encoder
# --------------------------------------------------------------------------


class SelfAttention(nn.Module):
    # Explicit q/k/v/out nn.Linear + matmul softmax (not nn.MultiheadAttention
    # or SDPA) so every projection is a plain linear the quantizer can see.
    def __init__(self, hidden, heads):
        super().__init__()
        assert hidden % heads == 0, "hidden must be divisible by heads"
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def _split_heads(self, x):
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q = self._split_heads(self.query(x))
        k = self._split_heads(self.key(x))
        v = self._split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        context = torch.matmul(torch.softmax(scores, dim=-1), v)
        context = context.transpose(1, 2).reshape(batch, seq, hidden)
        return self.out(context)


class EncoderLayer(nn.Module):
    """Post-LN transformer layer, as in the original BERT."""

    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.gelu = nn.GELU()
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ffn_norm = nn.LayerNorm(hidden)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.ffn_out(self.gelu(self.ffn_in(x))))


class Encoder(nn.Module):
    def __init__(self, num_layers, hidden, heads, ffn):
        super().__init__()
        self.layers = nn.Sequential(
            *[EncoderLayer(hidden, heads, ffn) for _ in range(num_layers)]
        )

    def forward(self, x):
        return self.layers(x)


def bert_encoder_like(num_layers=4, hidden=768, heads=12, ffn=3072, *, seed=0):
    """BERT-base-shaped encoder stack: [batch, seq, hidden] -> [batch, seq, hidden]."""
    with _seeded(seed):
        model = Encoder(num_layers, hidden, heads, ffn)
    return model.eval()


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------

MODEL_BUILDERS = {
    "resnet18_like": resnet18_like,
    "tiny_resnet": tiny_resnet,
    "mobilenet_v2_like": mobilenet_v2_like,
    "bert_encoder_like": bert_encoder_like,
}

# Per-sample input shape for each builder at its default configuration.
_INPUT_SHAPES = {
    "resnet18_like": (3, 224, 224),
    "tiny_resnet": (3, 32, 32),
    "mobilenet_v2_like": (3, 224, 224),
    "bert_encoder_like": (128, 768),  # (seq, hidden)
}


def build_model(name, **kwargs):
    """Build a model by its builder name, e.g. build_model("tiny_resnet", seed=1)."""
    return MODEL_BUILDERS[name](**kwargs)


def example_inputs(name, batch, *, seed=0):
    """Tuple of inputs for the named builder (default config), fixed seed."""
    if name not in _INPUT_SHAPES:
        raise KeyError(f"unknown model {name!r}; expected one of {sorted(_INPUT_SHAPES)}")
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, *_INPUT_SHAPES[name], generator=generator),)


def calibration_batches(name, batch, n):
    """n input tuples, each from its own seed (distinct from example_inputs' seed 0)."""
    return [example_inputs(name, batch, seed=1000 + index) for index in range(n)]
