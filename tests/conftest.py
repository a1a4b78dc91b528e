"""Fixtures shared by the test files."""
import pytest

from qbackend import native


@pytest.fixture(params=["avx2", "avx512_vnni"])
def int8_build(request, monkeypatch):
    """Run the test on each build of qbackend's int8 GEMM (native.int8_build) this CPU has:
    the AVX2 one always, the AVX512-VNNI one where the CPU has VNNI (skipped elsewhere)."""
    if request.param == "avx512_vnni" and native._vnni_library()[0] is None:
        pytest.skip(f"needs the AVX512-VNNI GEMM: {native._vnni_library()[1]}")
    monkeypatch.setattr(native, "int8_build", lambda: request.param)
    return request.param
