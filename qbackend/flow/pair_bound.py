"""8-bit weights that stay exact on x86 CPUs without VNNI (``reduce_range="pairs"``), for convs
and linears whose pairs are adjacent input channels (lowering/gemm.py ``pairs_of_whole_words``).

There the int8 kernels (qbackend's GEMM and grouped conv, oneDNN's convs and linears) add the
products of two adjacent input channels in int16 (vpmaddubsw): with uint8 activations up to 255,
255 x max(|w_a + w_b|, |w_a|, |w_b|) must fit 32767 (a pair of one sign adds up; of opposite
signs it never passes its larger member), so a pair's integers may add up to 128 in magnitude.
7-bit weights ([-64, 63]) keep every pair within that: a per-channel scale of absmax / 63.5.
Here each output channel's scale is that largest reach over its pairs / 127 instead, 8-bit
integers whose every pair rounds to at most 128 (each to at most 127): ResNet-50's convs get
1.41-1.52x finer steps than 7 bits with |w_a| + |w_b| as the bound, ~7% finer again counting
signs (regnet_y_400mf ~9%); never coarser. Shrinking only the pairs past the bound at 8-bit
scales was tried: ~2% of pairs move by tens of steps, 20x 7 bits' squared error.
"""
from __future__ import annotations

import functools

from qbackend.lowering.gemm import largest_pair_sums

SCALE_STEPS = 127  # a pair's largest reach / scale: rounded, each pair within 128


@functools.cache
def observer():
    """The weight observer: torchao's per-channel min / max observer whose range is each channel's
    largest pair reach (``largest_pair_sums``), so the symmetric scale, range / 127.5, is that
    reach / SCALE_STEPS. Built on first use: torchao stays out of qbackend's import path."""
    from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver

    class PairBoundObserver(PerChannelMinMaxObserver):
        def forward(self, x_orig):
            x = super().forward(x_orig)
            bound = largest_pair_sums(x.detach().to(self.max_val.dtype)) * (127.5 / SCALE_STEPS)
            self.min_val.resize_(bound.shape).copy_(-bound)
            self.max_val.resize_(bound.shape).copy_(bound)
            return x

    return PairBoundObserver
