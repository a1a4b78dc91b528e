"""qbackend's own CPU kernels (``csrc/*.c``, AVX2 and AVX512-VNNI), for what torch's kernels do
slowly here, and everything that touches them through ctypes.

Each kernel family has one module beside its C source, holding its op schema, argument checks
and refusals, implementation (the ctypes call), fake implementation, the plain function eager
graphs call (the op without the dispatcher) and its kernel chain step: ``weight_only_mm``,
``depthwise``, ``grouped``, ``conv_gemm``, ``stem``, ``pools``, ``attention``,
``scale_quantize``, ``layer_norm_quantize``, ``add_quantize``, ``quantize`` (plain functions
only, as ``fast_qdq`` that runs them), and the float kernels the LLM and graph passes call
(``rms_norm``, ``rotary``, ``silu_mul``, ``kv_append``, ``kv_int8``, ``dense_weight_only``,
``l2_normalize``, ``channel_shuffle``, ``batch_norm_quantize``, ``huge_pages``), and a weight-only
linear's packing per device (``weight_only_linear``).

Shared below them: ``library`` (which kernels may run, loading a library with its structs
checked: ``structs``), ``isa`` (the libraries loaded here, the int8 / GEMM build that runs, C
functions declared), ``common`` (the conv and pool families' checks and prepared calls),
``chain_step``. Above them: ``registry`` (the ``qbackend::`` ops registered on first use,
``available``, ``op``, ``own_kernel``) and ``kernel_chain`` (runs of own-kernel calls as one C
call). ``kernel_build`` compiles the sources once per machine with the system C compiler (as
Inductor does for its own kernels), cached by a hash of sources, flags and compiler. No AVX2,
no compiler, or a failed build: ``registry.available`` says why and the lowering keeps torch's
kernels.

This package imports nothing from qbackend's graph layers (passes, lowering, patterns, llm,
pipeline): only ``qbackend.ops``, ``qbackend.weight_only``, torch and the standard library sit
below it (pyproject.toml's import contracts).
"""
