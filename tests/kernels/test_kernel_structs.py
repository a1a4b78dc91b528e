"""The ctypes structs (qbackend/kernels/structs.py) against their C structs (csrc/call_structs.h):
a library whose structs differ from Python's is refused when loaded."""
import ctypes

import pytest

from qbackend.kernels import kernel_build
from qbackend.kernels import library, structs

from tests.helpers import needs_own_kernels


def _without(struct, field: str):
    """``struct`` with ``field`` left out, under the same C name."""
    return type(struct.__name__, (ctypes.Structure,), {"c_name": struct.c_name,
                                                       "_fields_": [f for f in struct._fields_ if f[0] != field]})


def test_every_library_reports_the_layouts():
    assert all(kernel_build.CSRC / "struct_layout.c" in sources for sources, _ in kernel_build.LIBRARIES.values())


@needs_own_kernels
def test_the_loaded_library_matches_every_struct():
    structs.check_layouts(library.loaded())  # (the loader checked it too: available() is None)
    assert len({s.c_name for s in structs.STRUCTS}) == len(structs.STRUCTS)


@needs_own_kernels
@pytest.mark.parametrize("mismatch", [
    # the last field: the size stays (padding after the float), the field count does not
    lambda: _without(structs.DepthwiseCall, "norm_eps"),
    lambda: _without(structs.ConvCall, "x_zp"),  # every field after it moves
    lambda: type("Wider", (ctypes.Structure,), {"c_name": "operand_t", "_fields_": [("base", ctypes.c_long), ("offset", ctypes.c_long)]}),
    lambda: type("Unknown", (ctypes.Structure,), {"c_name": "no_such_call_t", "_fields_": [("n", ctypes.c_int)]}),
], ids=["last-field-removed", "field-removed", "field-widened", "no-such-struct"])
def test_a_library_whose_struct_differs_is_not_loaded(monkeypatch, mismatch):
    struct = mismatch()
    monkeypatch.setattr(structs, "STRUCTS", structs.STRUCTS + (struct,))
    with pytest.raises(RuntimeError, match=f"C struct {struct.c_name} .* its ctypes mirror {struct.__name__}"):
        library.loaded()
