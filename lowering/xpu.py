"""Intel GPU (XPU): the rows XPU is known to run; the rest Unsupported until verified on a device."""
from __future__ import annotations

from .base import Lowering, Unsupported
from .common import COMMON
from .weight_only import emit_weight_only, limits_for

TABLE = {
    "qconv": COMMON["qconv"],
    "qlinear": COMMON["qlinear"],
    "qlinear_dynamic": Unsupported("XPUInductorQuantizer has no dynamic quantization"),
    "qlinear_add_dynamic": Unsupported("XPUInductorQuantizer has no dynamic quantization"),
    "qconv_add": Unsupported("binary conv on XPU is not verified yet (tracked by the XPU lowering issue)"),
    "qlinear_add": Unsupported("binary linear on XPU is not verified yet (tracked by the XPU lowering issue)"),
    "qmaxpool2d": Unsupported("int8 max pool on XPU is not verified yet (tracked by the XPU lowering issue)"),
    "int4_weight_linear": Lowering(emit_weight_only, ("int4_pack", "int4_mm_scales_zeros"), limits_for("xpu")),
    "int8_weight_linear": Lowering(emit_weight_only, ("int8_weight_only_mm",), limits_for("xpu")),
    "qavgpool": Unsupported("int8 average pool on XPU is not verified yet (tracked by the XPU lowering issue)"),
    # plain ATen data movement, exact on any device that has the op
    "qcat": COMMON["qcat"],
    "qview": COMMON["qview"],
    "qsmooth": COMMON["qsmooth"],
}
