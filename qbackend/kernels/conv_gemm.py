"""The int8 GEMM for convs up to 3x3 and linears (``csrc/conv_gemm_int8.c``, AVX2; built again
for AVX512-VNNI on ymm and on zmm registers, ``conv_gemm_int8_vnni.c``,
``conv_gemm_int8_vnni512.c``, and for AMX-INT8, ``conv_gemm_int8_amx.c``: ``isa.gemm_build``
picks; int16 weights run the exact AVX2 build, ``conv_gemm_int8_exact16.c``, whatever the
CPU): ``qbackend::qconv``. onednn's
qconv_pointwise / qlinear_pointwise spend ~50 us per call before computing, and their AVX2 int8
kernels are slower than this GEMM's below a few thousand output rows.
"""
from __future__ import annotations

import ctypes

import torch

from qbackend.kernels import isa, library
from qbackend.kernels.chain_step import FOUR
from qbackend.kernels.common import (ACTIVATIONS, FOUR_SIGNATURE, Kernel, Prepared, cached_prepared, channels_last_like, check_constants,
                                     check_levels, check_nchw_uint8, checked_window, make_prepared, new_output, output_hw,
                                     prepared_chain_call)
from qbackend.kernels.structs import ConvCall

SCHEMAS = {
    "qconv": "qconv(Tensor x, Tensor weight, Tensor mult, Tensor add, Tensor? residual, float residual_scale, "
             "float low, float high, float out_scale, int out_zero_point, int qmin, int qmax, bool float_out=False, "
             "str activation='none', int[2] kernel_size=[1, 1], int[2] stride=[1, 1], int[2] padding=[0, 0], "
             "int[2] dilation=[1, 1], int x_zero_point=0) -> Tensor",
}
# every build (qb_conv_call, _vnni, _vnni512, _amx, _exact16) is (threads, call, x, residual, y, yf) -> 0 / -1
# (a scratch buffer could not be allocated): FOUR_SIGNATURE
EXACT16_FUNCTION = "qb_conv_call_exact16"  # (the AVX2 library's: int16 weights, exact for any int8 values)


MAX_TAPS = 9  # kernel positions qconv takes (conv_gemm_int8.c MAX_TAPS): up to 3x3


GEMM_BLOCK = 16  # output channels per packed weight row, every build (conv_gemm_int8.c PACKED; Cout padded)


def _prepare_conv(x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point,
                  qmin, qmax, float_out, activation, kernel_size, stride, padding, dilation, x_zero_point) -> Prepared:
    """Check one call site's arguments and make its ConvCall."""
    check_nchw_uint8(x, None, "qconv")
    oh, ow = checked_window("qconv", x.shape[2], x.shape[3], kernel_size, stride, padding, dilation)
    check_levels("qconv", x_zero_point, out_zero_point, qmin, qmax)
    cout, taps = mult.numel(), kernel_size[0] * kernel_size[1]
    if not 1 <= taps <= MAX_TAPS:
        raise ValueError(f"qbackend::qconv takes up to {MAX_TAPS} kernel positions, got kernel {list(kernel_size)}")
    n, cin, h, w = x.shape
    packed_cin, packed_cout = -(-cin // 4) * 4, -(-cout // GEMM_BLOCK) * GEMM_BLOCK  # (the packing pads both with zero weights)
    if weight.numel() != taps * packed_cin * packed_cout:
        raise ValueError(f"qbackend::qconv: {weight.numel()} packed weights are not {cin} -> {cout} channels x {taps} "
                         f"kernel positions ({taps * packed_cin * packed_cout}: Cin and Cout padded)")
    exact16 = weight.dtype == torch.int16
    check_constants("qconv", (weight, torch.int16 if exact16 else torch.int8, weight.numel()), (mult, torch.float32, cout),
                    (add, torch.float32, cout))
    if activation not in ACTIVATIONS:
        raise ValueError(f"qbackend::qconv: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    if residual is not None and residual.dtype != torch.float32:  # a float32 residual, or a uint8 one checked like the input
        check_nchw_uint8(residual, cout, "qconv (residual)")
    call = ConvCall(n, h, w, cin, oh, ow, *kernel_size, *stride, *padding, *dilation, cout, x_zero_point,
                    weight.data_ptr(), mult.data_ptr(), add.data_ptr(), residual is not None and residual.dtype == torch.float32,
                    residual_scale, ACTIVATIONS[activation], low, high, 1.0 / out_scale, out_zero_point, qmin, qmax)
    if exact16:
        gemm = isa.c_function(EXACT16_FUNCTION, FOUR_SIGNATURE, ctypes.c_int)
    else:
        needed, function = library.GEMM_BUILDS[isa.gemm_build()]
        gemm = (isa.c_function if needed == "avx2" else isa.vnni_function)(function, FOUR_SIGNATURE, ctypes.c_int)
    return make_prepared(call, (n, cout, oh, ow), torch.float32 if float_out else torch.uint8, gemm, (mult, add))


def _conv_prepared(x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point, qmin, qmax,
                   float_out=False, activation="none", kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                   x_zero_point=0, *, trusted=False) -> Prepared:
    """``trusted``: the constants are the lowering's own, so a prepared call is taken unchecked;
    the registered op (any caller) checks every call."""
    args = (mult, add, None if residual is None else residual.dtype, residual_scale, low, high, out_scale, out_zero_point,
            qmin, qmax, float_out, activation, kernel_size, stride, padding, dilation, x_zero_point)  # (a residual: its dtype)
    return cached_prepared(weight, trusted, x, args, lambda: _prepare_conv(x, weight, mult, add, residual, *args[3:]))


def _conv(x, weight, mult, add, residual, *args, trusted=False):
    prepared = _conv_prepared(x, weight, mult, add, residual, *args, trusted=trusted)
    shape, float_out = prepared.shape, prepared.dtype == torch.float32
    x = x.contiguous(memory_format=torch.channels_last)
    y = new_output(x, prepared)
    if residual is not None:
        if residual.shape != shape or residual.device.type != "cpu":
            raise ValueError(f"qbackend::qconv: residual {tuple(residual.shape)} on {residual.device} for output {shape}")
        residual = residual.contiguous(memory_format=torch.channels_last)
    if prepared.function(torch.get_num_threads(), prepared.address, x.data_ptr(),
                         None if residual is None else residual.data_ptr(), None if float_out else y.data_ptr(),
                         y.data_ptr() if float_out else None):
        raise MemoryError("qbackend::qconv: a thread could not allocate its scratch")
    return y


def _conv_fake(x, weight, mult, add, residual, residual_scale, low, high, out_scale, out_zero_point, qmin, qmax,
               float_out=False, activation="none", kernel_size=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
               x_zero_point=0):
    n, _, h, w = x.shape
    oh, ow = output_hw(h, w, kernel_size, stride, padding, dilation)
    return channels_last_like(x, (n, mult.numel(), oh, ow), torch.float32 if float_out else torch.uint8)


def qconv(*args):
    """``qbackend::qconv`` without the dispatcher round trip (see ``qconv_depthwise``)."""
    return _conv(*args, trusted=True)


chain_call = prepared_chain_call(_conv_prepared, FOUR)
KERNELS = {"qconv": Kernel(SCHEMAS["qconv"], _conv, _conv_fake, qconv)}
qconv.fresh_output = True  # (patterns/inplace.py: a later kernel may write into its output)
