"""SmoothQuant factors and the per-layer choice of alpha against a calibration loss.

s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha): X / s and W * s give the same product, and the
activation's outlier channels shrink. The loss of a choice is what int8 does to the layer's
output on sampled calibration rows: activation per tensor (uint8, affine, over the min / max
of every calibration row), weight per output channel (int8, symmetric), as the x86 recipe
quantizes them; the relative squared error of X @ W.T, summed over the linears that share
the input. The minimum / maximum of X / s are exact from the per-channel ones (s > 0).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from qbackend.smoothquant.smooth_stats import ChannelStats

EPS = 1e-5


def factors(stats: ChannelStats, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [C] for linears reading one activation (one s for all: they share its 1/s)."""
    act = stats.abs_max
    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    s = act.clamp(min=EPS).pow(alpha) / w_max.clamp(min=EPS).pow(1 - alpha)
    return torch.where((act > 0) & (w_max > 0), s, torch.ones_like(s)).clamp(min=EPS)


def _fake_quant_activation(x: torch.Tensor, low: float, high: float, observer=None) -> torch.Tensor:
    if observer is not None:
        obs = observer()
        obs(x)
        scale, zero_point = (float(v) for v in obs.calculate_qparams())
    else:
        low, high = min(low, 0.0), max(high, 0.0)
        scale = max((high - low) / 255, 1e-12)
        zero_point = min(max(round(-low / scale), 0), 255)
    return (torch.clamp(torch.round(x / scale) + zero_point, 0, 255) - zero_point) * scale


INT8_WEIGHTS = (-128, 127)


def _fake_quant_weight(w: torch.Tensor, weight_range: tuple = INT8_WEIGHTS) -> torch.Tensor:
    low, high = weight_range
    scale = (w.abs().amax(1, keepdim=True) / ((high - low) / 2)).clamp(min=1e-12)
    return torch.clamp(torch.round(w / scale), low, high) * scale


def int8_loss(stats: ChannelStats, weights: Sequence[torch.Tensor], s: Optional[torch.Tensor], observer=None,
              weight_range: tuple = INT8_WEIGHTS) -> float:
    """Relative squared error of the int8 layer outputs with smoothing factors ``s`` (None: none)."""
    x = stats.sample()
    s = torch.ones(x.shape[1]) if s is None else s
    low, high = float((stats.minimum / s).min()), float((stats.maximum / s).max())
    xq = _fake_quant_activation(x / s, low, high, observer)
    total = 0.0
    for w in weights:
        w = w.detach().float()
        y = x @ w.T
        total += float(((xq @ _fake_quant_weight(w * s, weight_range).T - y) ** 2).sum() / (y ** 2).sum().clamp(min=1e-30))
    return total


def choose(stats: ChannelStats, weights: Sequence[torch.Tensor], alphas: Sequence[float],
           min_gain: float, observer=None, weight_range: tuple = INT8_WEIGHTS) -> tuple[Optional[float], dict]:
    """(best alpha, or None when no alpha lowers the loss by ``min_gain`` of the unsmoothed
    loss; {alpha or None: loss})."""
    losses = {None: int8_loss(stats, weights, None, observer, weight_range)}
    for alpha in alphas:
        losses[alpha] = int8_loss(stats, weights, factors(stats, weights, alpha), observer, weight_range)
    best = min(alphas, key=lambda a: losses[a]) if alphas else None
    if best is None or losses[best] > (1 - min_gain) * losses[None]:
        return None, losses
    return best, losses
