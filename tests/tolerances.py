"""The one tolerance table for comparing qbackend with the reference (the converted PT2E
module run eagerly). Stated once; every numerics test reads it from here."""
import torch

TOLERANCE = {
    # integer tensors, in quantization steps of their own scale
    "int8": {"within_one_step": 0.999, "max_steps": 2},
    # float outputs: cosine, or every element within atol: a reference of zeros has no cosine,
    # and a LayerNorm of a near-constant row (a zero input plus a bias) scales 1-ulp differences
    # of its input by 1 / sqrt(eps) ~ 316 (fuzz seeds 1671, 2239, 2611: up to 4.2e-5 on outputs
    # that are all below 1e-4)
    "float": {"min_cosine": 0.9999, "atol": 1e-4,
              # computed from an int8 value a rule within one step (qavgpool's ties) made one step
              # off: a 3x4x2 pool output measured 0.9974
              "min_cosine_after_a_step": 0.99},
    # weight-only linears vs the fp32 linear on the dequantized weight, as a fraction of the
    # largest output. The kernels run bf16 activations by default; measured on the test MLPs:
    # fp32 models <= 0.4%, bf16 models (whose every intermediate is bf16) <= 1.1%
    "weight_only": {"min_cosine": 0.9999, "max_relative_error": {torch.float32: 0.01, torch.bfloat16: 0.02}},
    # qbackend's int16 kernels on fp32 models: activations keep 15 bits per group (measured
    # <= 3e-5). bf16 models are bound by their own bf16 intermediates: the row above.
    "weight_only_int16": {"min_cosine": 0.999999, "max_relative_error": {torch.float32: 1e-4}},
    # qbackend's float32 attention kernel vs torch's: the same float32 sums in another order
    # (and its e^x within 2e-7); measured <= 2.2e-5 absolute on scores of std ~9
    "attention_f32": {"rtol": 1e-4, "atol": 1e-4},
    # qbackend's RMSNorm kernel vs the graph's ops: the mean of squares summed in another order,
    # every other step rounded as the reference rounds it
    "rms_norm": {"rtol": 4e-7, "atol": 1e-7},
    # qbackend's SiLU (its own e^x, within 2e-7) times b vs torch's: measured <= 3.3e-7 relative
    "silu_mul": {"rtol": 5e-7, "atol": 1e-12},
    "l2_normalize": {"rtol": 3e-7, "atol": 1e-12},  # (the norm's sum in another order: an ulp or two)
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def assert_int8_close(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, expected.dtype, actual.shape, expected.shape)
    steps = (actual.int() - expected.int()).abs()
    tol = TOLERANCE["int8"]
    within = (steps <= 1).double().mean().item()
    assert within >= tol["within_one_step"], f"{what}: only {within:.5f} of elements within 1 step"
    assert steps.max().item() <= tol["max_steps"], f"{what}: max difference {steps.max().item()} steps"


def assert_float_close(actual: torch.Tensor, expected: torch.Tensor, what: str = ""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    c = cosine(actual, expected)
    assert c >= TOLERANCE["float"]["min_cosine"], f"{what}: cosine {c:.6f}"


def assert_outputs_close(actual, expected, what: str = ""):
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e.is_floating_point():
            assert_float_close(a, e, f"{what} output {i}")
        else:
            assert_int8_close(a, e, f"{what} output {i}")


def assert_weight_only_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", kind: str = "weight_only"):
    """``expected``: the fp32 linear computed with the dequantized weight, cast to the model's dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    tol = TOLERANCE[kind]
    c = cosine(actual, expected)
    relative = ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()
    assert c >= tol["min_cosine"], f"{what}: cosine {c:.6f}"
    limit = tol["max_relative_error"][expected.dtype]
    assert relative <= limit, f"{what}: max error {relative:.4f} of the largest output (limit {limit})"
