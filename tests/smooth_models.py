"""Small transformer-shaped models for the SmoothQuant tests: each places 1/s one way, or
recreates one hazard where folding would be wrong. Inputs have outlier channels (20x)."""
import math

import torch
import torch.nn as nn

C = 16


def outlier_inputs(batch=2, seq=5, channels=C, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, channels, generator=generator)
    x[..., [3, 11]] *= 20
    return (x,)


class PreNormQKV(nn.Module):
    """LayerNorm read only by three linears: 1/s folds into the LayerNorm's weight and bias."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.weight[[3, 11]] = 15.0

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) * self.v(h)


class LinearLinear(nn.Module):
    """A linear whose output only the next linear reads: 1/s folds into the rows of the first."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, 32), nn.Linear(32, C)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class RMSScale(nn.Module):
    """x * rsqrt(mean(x^2)) * weight, RMSNorm written out: 1/s folds into the weight of the
    per-channel multiply."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 3.0, C))
        self.fc = nn.Linear(C, 8)

    def forward(self, x):
        return self.fc(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight)


class PostNormResidual(nn.Module):
    """Post-LN BERT: the LayerNorm output feeds the linear AND the residual add."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        h = self.norm(x)
        return h + self.fc(h)


class SharedHalfGelu(nn.Module):
    """GELU written as x * (1 + erf(x / sqrt 2)) * 0.5 with the 0.5 a [1] constant that the
    residual path multiplies by too (Intel Neural Compressor's ViT failure)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, 32), nn.Linear(32, C)
        self.register_buffer("one_half", torch.tensor([0.5]))

    def forward(self, x):
        h = self.fc1(x)
        gelu = h * (1 + torch.erf(h / math.sqrt(2))) * self.one_half
        return self.fc2(gelu) + x * self.one_half


class SharedChannelConstant(nn.Module):
    """One per-channel constant read by two multiplies: folding into it would scale both."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 2.0, C))
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return self.fc(x * self.gain) + torch.tanh(x) * self.gain


class OneElementScale(nn.Module):
    """A multiply by a [1] constant of its own: shape [1] against [C] channels."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor([1.7]))
        self.fc = nn.Linear(C, 8)

    def forward(self, x):
        return self.fc(torch.relu(x) * self.scale)


class TinyPostLNBlock(nn.Module):
    """One post-LN encoder layer (no attention): LN -> FFN1 -> GELU -> FFN2 -> + residual -> LN."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.fc1, self.fc2 = nn.Linear(C, 64), nn.Linear(64, C)
        with torch.no_grad():
            self.norm1.weight[[3, 11]] = 12.0

    def forward(self, x):
        h = self.norm1(x)
        return self.norm2(h + self.fc2(torch.nn.functional.gelu(self.fc1(h))))
