"""qbackend's own C kernels as Python sees them: the ctypes structs mirroring ``csrc``'s
(``structs``). The rest (building, loading, each kernel family's binding) moves here from
``qbackend/native.py`` and the modules that bind one C file each."""
