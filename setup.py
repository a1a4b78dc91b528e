"""The package build: qbackend's C kernels compiled into the wheel (``qbackend/kernels/prebuilt``), so a
machine that installs the wheel runs them without a C compiler. Without a compiler here the
wheel carries the sources alone and they are built on first use, as from a source checkout;
an editable install builds nothing (its kernels build on first use).

Everything else is in pyproject.toml."""
import importlib.util
import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py


def _kernel_build():
    """qbackend/kernels/kernel_build.py by path: importing the package would import torch, which the
    build environment need not have."""
    spec = importlib.util.spec_from_file_location("_qbackend_kernel_build", Path(__file__).parent / "qbackend" / "kernels" / "kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        # (a build directory left from an earlier build keeps sources renamed since: the wheel would
        # carry them, and the prebuilt libraries' key, made from the tree's sources, would then miss)
        shutil.rmtree(Path(self.build_lib) / "qbackend" / "kernels" / "csrc", ignore_errors=True)
        super().run()
        if getattr(self, "editable_mode", False):
            return
        try:
            built = _kernel_build().build_prebuilt(Path(self.build_lib) / "qbackend" / "kernels" / "prebuilt")
        except RuntimeError as error:
            self.warn(f"qbackend's C kernels are not prebuilt ({error}): they build on first use")
            return
        self.announce(f"prebuilt {', '.join(p.name for p in built)}", level=2)


class WithKernels(Distribution):
    def has_ext_modules(self):  # (the wheel holds compiled libraries: tagged for this platform)
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=WithKernels)
