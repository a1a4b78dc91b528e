"""Random small models built from what qbackend lowers, one per seed (the same seed, the same
model and inputs on every machine): conv1d / 2d / 3d (grouped, depthwise, strided, dilated,
padded, with BatchNorm), linears on 2-D..4-D inputs, every post-op, residual adds in both
orders and in place, cat / pool / view chains, attention blocks, position ids changed in place.
``Case.describe`` spells the model so a failure can be read without running it."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

# post-ops, by name (None: no post-op)
ACTIVATIONS = {
    None: nn.Identity, "relu": nn.ReLU, "relu6": nn.ReLU6, "hardtanh": lambda: nn.Hardtanh(-1.0, 1.0),
    "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "tanh": nn.Tanh, "hardswish": nn.Hardswish, "silu": nn.SiLU, "sigmoid": nn.Sigmoid,
}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


class ConvAct(nn.Sequential):
    def __init__(self, rng, dims, cin, cout, kernel, stride, padding, dilation, groups):
        layers = [CONV[dims](cin, cout, kernel, stride, padding, dilation, groups, bias=rng.random() < 0.8)]
        if rng.random() < 0.3:
            layers.append(BATCH_NORM[dims](cout))
        layers.append(ACTIVATIONS[rng.choice(list(ACTIVATIONS))]())
        super().__init__(*layers)


class Residual(nn.Module):
    """body(x) + x, x + body(x), or torchvision's in-place ``out += x``; then maybe ReLU."""

    def __init__(self, body, order, relu):
        super().__init__()
        self.body, self.order, self.relu = body, order, nn.ReLU() if relu else nn.Identity()

    def forward(self, x):
        y = self.body(x)
        if self.order == "inplace":
            y += x
        else:
            y = y + x if self.order == "body_first" else x + y
        return self.relu(y)


class Branches(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=1)


class Pool(nn.Module):
    def __init__(self, kind, dims):
        super().__init__()
        self.kind, self.dims = kind, dims

    def forward(self, x):
        if self.kind == "max":
            return F.max_pool2d(x, 2, 2) if self.dims == 2 else F.max_pool1d(x, 2, 2)
        if self.kind == "avg":
            return F.avg_pool2d(x, 2, 2) if self.dims == 2 else F.avg_pool1d(x, 2, 2)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1) if self.dims == 2 else x.mean(dim=tuple(range(2, x.dim()))), 1)


class ToSequence(nn.Module):
    """(N, C, *spatial) -> (N, positions, C), as a ViT's patch embedding."""

    def forward(self, x):
        return x.flatten(2).transpose(1, 2)


class LinearAct(nn.Sequential):
    def __init__(self, rng, fin, fout):
        super().__init__(nn.Linear(fin, fout, bias=rng.random() < 0.8), ACTIVATIONS[rng.choice(list(ACTIVATIONS))]())


class Attention(nn.Module):
    """Self-attention over (N, L, D) by hand (q / k / v linears, head split, scaled scores with
    an optional additive mask, softmax, output linear), through SDPA, or torch's
    MultiheadAttention."""

    def __init__(self, rng, dim, length):
        super().__init__()
        self.heads = rng.choice([h for h in (1, 2, 4) if dim % h == 0])
        self.style = rng.choice(["manual", "sdpa", "mha"])
        if self.style == "mha":
            self.mha = nn.MultiheadAttention(dim, self.heads, batch_first=True)
        else:
            self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.register_buffer("mask", torch.randn(1, 1, length, length) if rng.random() < 0.4 else None)

    def _split(self, x):
        n, length, dim = x.shape
        return x.view(n, length, self.heads, dim // self.heads).transpose(1, 2)

    def forward(self, x):
        if self.style == "mha":
            return self.mha(x, x, x, need_weights=False)[0]
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        if self.style == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        else:
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            y = (scores if self.mask is None else scores + self.mask).softmax(-1) @ v
        n, heads, length, head_dim = y.shape
        return self.out(y.transpose(1, 2).reshape(n, length, heads * head_dim))


class Positions(nn.Module):
    """x + a position embedding whose ids a transformer computes from constants and changes in
    place: ``arange`` (or a copy of a buffer of ids) shifted by ``+=`` (RoBERTa's padding
    offset), doubled and clamped (``mul_``, ``clamp_``), masked (``masked_fill_``), or T5's
    relative buckets (``+=`` of a ``where``, mean over the keys); ``runtime``: a value of the
    input is added in place too. Folded, such a write changed the next call's ids."""

    KINDS = ("offset", "clamp", "masked", "buckets")

    def __init__(self, rng, dim, length):
        super().__init__()
        self.kind, self.runtime = rng.choice(self.KINDS), rng.random() < 0.4
        self.table = nn.Embedding(2 * length + 4, dim)
        self.register_buffer("ids", torch.arange(length) if rng.random() < 0.5 else None)

    def describe(self) -> str:
        return f"positions[{self.kind}{', buffer' if self.ids is not None else ''}{', runtime' if self.runtime else ''}]"

    def forward(self, x):
        length = x.shape[-2]
        ids = torch.arange(length) if self.ids is None else self.ids[:length].clone()
        if self.kind == "buckets":
            relative = ids[None, :] - ids[:, None]
            ids = 0
            ids += (relative > 0).long() * length
            ids += torch.where(relative.abs() < 2, relative.abs(), 2 + relative.abs() // 2)
        elif self.kind == "offset":
            ids += 2
        elif self.kind == "clamp":
            ids.mul_(2).clamp_(max=length + 1)
        else:
            ids.masked_fill_(ids >= length // 2, 0)
        if self.runtime:
            ids += (x.amax() > 0).long()
        positions = self.table(ids)
        return x + (positions.mean(0) if self.kind == "buckets" else positions)


class Outputs(nn.Module):
    """The chain's end, and with ``tap`` also an intermediate value (a second output)."""

    def __init__(self, layers, tap):
        super().__init__()
        self.layers, self.tap = nn.ModuleList(layers), tap

    def forward(self, x):
        tapped = None
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == self.tap:
                tapped = x
        return x if tapped is None else (x, tapped)


@dataclass
class Case:
    seed: int
    model: nn.Module
    shape: tuple
    family: str  # "int8" (PT2E flows) or "weight_only"
    steps: list = field(default_factory=list)

    def describe(self) -> str:
        return f"seed {self.seed}: {self.family} input {self.shape}: " + " -> ".join(self.steps)


def _conv(rng, dims, cin, size, steps, keep_shape=False):
    """A random conv of ``dims`` spatial dims on ``cin`` channels of ``size``; (module, cout,
    out size). ``keep_shape``: same channels and size (a residual body)."""
    kernel = rng.choice([1, 3] if dims == 3 else [1, 3, 5] if min(size) >= 5 else [1, 3])
    dilation = rng.choice([1, 1, 2]) if kernel > 1 and min(size) > 2 * (kernel - 1) else 1
    reach = dilation * (kernel - 1)
    if keep_shape:
        stride, padding, cout = 1, reach // 2, cin
    else:
        stride = rng.choice([1, 1, 2])
        padding = rng.choice([0, reach // 2, reach // 2 + 1]) if reach else 0
        cout = rng.choice([4, 8, 16, 24, 32])
    groups = 1
    if rng.random() < 0.35:
        groups = cin if rng.random() < 0.6 else next((g for g in (2, 4) if cin % g == 0), 1)
        cout = cin if keep_shape or groups == cin else cout - cout % groups or groups
    out = tuple((s + 2 * padding - reach - 1) // stride + 1 for s in size)
    if min(out) < 1:
        return _conv(rng, dims, cin, size, steps, keep_shape)
    steps.append(f"conv{dims}d({cin}->{cout}, k{kernel} s{stride} p{padding} d{dilation} g{groups})")
    return ConvAct(rng, dims, cin, cout, kernel, stride, padding, dilation, groups), cout, out


def _spatial_model(rng, dims, steps):
    channels = rng.choice([1, 3, 4, 8, 16])
    size = tuple(rng.choice([4, 6, 8]) for _ in range(dims)) if dims == 3 else tuple(rng.choice([7, 8, 12, 16]) for _ in range(dims))
    shape, layers = (channels, *size), []
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.5 or channels < 2:
            conv, channels, size = _conv(rng, dims, channels, size, steps)
            layers.append(conv)
        elif roll < 0.75:
            order = rng.choice(["body_first", "residual_first", "inplace"])
            steps.append(f"residual[{order}](")
            body, _, _ = _conv(rng, dims, channels, size, steps, keep_shape=True)
            steps.append(")")
            layers.append(Residual(body, order, rng.random() < 0.5))
        elif roll < 0.87:
            steps.append("cat(")
            a, ca, size_a = _conv(rng, dims, channels, size, steps, keep_shape=True)
            b, cb, _ = _conv(rng, dims, channels, size, steps, keep_shape=True)
            steps.append(")")
            layers.append(Branches(a, b))
            channels = ca + cb
        elif dims < 3 and min(size) >= 4:
            kind = rng.choice(["max", "avg"])
            steps.append(f"{kind}_pool")
            layers.append(Pool(kind, dims))
            size = tuple(s // 2 for s in size)
    roll = rng.random()
    if roll < 0.4:
        steps.append("global_pool, flatten")
        layers.append(Pool("global", dims))
        layers.append(LinearAct(rng, channels, rng.choice([3, 10, 16])))
        steps.append("linear")
    elif roll < 0.7:
        steps.append("to_sequence")
        layers.append(ToSequence())
        layers.extend(_sequence_layers(rng, channels, int(torch.tensor(size).prod()), steps))
    return layers, shape


def _sequence_layers(rng, dim, length, steps, attention_fits=True):
    """Layers on (..., dim) inputs; ``attention_fits``: the input is (N, length, dim)."""
    layers = []
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.45:
            out = rng.choice([8, 16, 32, 48])
            steps.append(f"linear({dim}->{out})")
            layers.append(LinearAct(rng, dim, out))
            dim = out
        elif roll < 0.65:
            steps.append(f"residual(linear({dim}->{dim}))")
            layers.append(Residual(LinearAct(rng, dim, dim), rng.choice(["body_first", "residual_first", "inplace"]),
                                   rng.random() < 0.3))
        elif roll < 0.8 and dim % 16 == 0 and attention_fits:
            attention = Attention(rng, dim, length)
            steps.append(f"attention[{attention.style}, {attention.heads} heads, mask {attention.mask is not None}]({dim})")
            layers.append(Residual(attention, "residual_first", False) if rng.random() < 0.5 else attention)
        else:
            steps.append("layer_norm")
            layers.append(nn.LayerNorm(dim))
    return layers


def _linear_model(rng, steps):
    dim = rng.choice([8, 16, 32, 64])
    lead = tuple(rng.choice([1, 3, 5]) for _ in range(rng.randint(0, 2)))  # 2-D..4-D input
    return _sequence_layers(rng, dim, lead[-1] if lead else 1, steps, len(lead) == 1), (*lead, dim)


def _weight_only_model(rng, steps):
    dim = first = rng.choice([64, 128])
    lead = tuple(rng.choice([1, 3, 7]) for _ in range(rng.randint(0, 2)))
    layers = []
    for _ in range(rng.randint(1, 3)):
        out = rng.choice([40, 64, 128])
        steps.append(f"linear({dim}->{out})")
        layers.append(LinearAct(rng, dim, out))
        dim = out
    return layers, (*lead, first)


def build(seed: int) -> Case:
    """The model of ``seed`` (weights from torch's generator seeded with it)."""
    rng, steps = random.Random(seed), []
    torch.manual_seed(seed)
    roll = rng.random()
    if roll < 0.12:
        family, (layers, shape) = "weight_only", _weight_only_model(rng, steps)
    else:
        family = "int8"
        layers, shape = _linear_model(rng, steps) if roll < 0.35 else _spatial_model(rng, rng.choice([1, 2, 2, 2, 3]), steps)
    if not layers:
        steps.append("linear")
        layers.append(LinearAct(rng, shape[-1], 8))
    tap = rng.randrange(len(layers)) if len(layers) > 1 and rng.random() < 0.2 else None
    for module in layers:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):  # stats a trained model has
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    # half the linear models on (N, L, D) start with Positions, drawn from a stream of their own
    # after every other draw (the other seeds' models stay as they were; so do test_fuzz.py's REGRESSIONS)
    positions = random.Random(seed * 7919 + 4)
    if family == "int8" and roll < 0.35 and len(shape) == 2 and positions.random() < 0.5:
        layers.insert(0, Positions(positions, shape[-1], shape[0]))
        steps.insert(0, layers[0].describe())
        tap = None if tap is None else tap + 1
    model = Outputs(layers, tap).eval()
    batch = rng.choice([1, 1, 2, 3, 5])
    return Case(seed, model, (batch, *shape), family, steps + ([f"(also returns step {tap})"] if tap is not None else []))
