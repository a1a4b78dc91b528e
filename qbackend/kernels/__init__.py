"""qbackend's own C kernels as Python sees them: the ctypes structs mirroring ``csrc``'s
(``structs``) and the loading of the libraries (``library``). The rest (each kernel family's
binding, the op registrations) moves here from ``qbackend/kernels/native.py`` and the modules that bind
one C file each."""
