"""Fixtures shared by the test files."""
import pytest

from qbackend.kernels import choice_cache, isa, library


@pytest.fixture(autouse=True)
def _zmm_gemm_on_every_vnni_cpu(monkeypatch):
    """Lowered graphs (pinned with expecttest) must not depend on isa.zmm_speedup's probe of
    this core: every AVX512-VNNI CPU lowers as one that prefers zmm (the zmm build runs on
    all of them; ``int8_build`` below runs the kernels' numerics on every build)."""
    monkeypatch.setattr(isa, "zmm_speedup", lambda: isa.ZMM_MIN_SPEEDUP)


@pytest.fixture(autouse=True)
def _kernel_choice_from_the_fixed_tables(monkeypatch):
    """Lowered graphs (pinned with expecttest) must not depend on which kernel is faster on
    this machine: kernels are chosen by their fixed tables (tests/kernels/test_kernel_choice.py
    measures)."""
    monkeypatch.setenv("QBACKEND_KERNEL_CHOICE", "prior")


@pytest.fixture(params=list(library.GEMM_BUILDS))
def int8_build(request, monkeypatch):
    """Run the test on each build of qbackend's int8 kernels this CPU has (isa.gemm_build:
    the AVX2 one always; where the CPU has AVX512-VNNI, its GEMM on ymm and on zmm registers, and
    where it has AMX-INT8, on tiles).
    Returns isa.int8_build's value."""
    build = library.GEMM_BUILDS[request.param][0]
    if build == "avx512_vnni" and isa._vnni_library()[0] is None:
        pytest.skip(f"needs the AVX512-VNNI kernels: {isa._vnni_library()[1]}")
    if request.param == "avx512_amx" and not isa.amx_ready():
        pytest.skip("needs AMX-INT8")
    monkeypatch.setattr(isa, "int8_build", lambda: build)
    monkeypatch.setattr(isa, "gemm_build", lambda: request.param)
    return build


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty directory for the machine's measured choices (qbackend/kernels/choice_cache.py)."""
    monkeypatch.setenv("QBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_cache, "_shared", None)
    return tmp_path


@pytest.fixture(autouse=True)
def _dynamo_suppress_errors_as_each_test_found_it():
    """torch 2.13's ``torch._dynamo.config.patch(suppress_errors=...)`` leaves the option marked as
    set by the user when it restores the value: qbackend would then read the default False as a
    wish for strict lowering in every later test (strict_mode)."""
    import torch._dynamo.config as dynamo_config

    override = dynamo_config._config["suppress_errors"].user_override  # (a ContextVar in torch 2.13)
    saved = override.get()
    yield
    override.set(saved)
