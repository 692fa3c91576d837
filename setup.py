"""Builds the native CPU kernels (runtime/native.py ``extensions``) when the package is installed.

Install with torch already present and without build isolation (isolation would download another torch):
``pip install --no-build-isolation -e .`` or ``pip wheel --no-build-isolation --no-deps .``. Everything else
about the distribution is in pyproject.toml.
"""
import importlib.util
import os
import shutil
import sys
import tomllib

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _native():
    """runtime/native.py, loaded by path (importing the runtime package would define every op)."""
    spec = importlib.util.spec_from_file_location("_recompile_native_build", os.path.join(HERE, "runtime", "native.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _require_compiler() -> None:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        sys.exit(f"recompile: building the native CPU kernels needs a C++ compiler with OpenMP ({compiler!r} not found; "
                 "on Debian/Ubuntu: apt-get install g++). Set CXX to use another one.")


try:
    from torch.utils.cpp_extension import BuildExtension
except ImportError:
    sys.exit("recompile: torch must be installed before building (pip install torch==2.13.0, then "
             "pip install --no-build-isolation .)")


class BuildNative(BuildExtension):
    """BuildExtension with its object files in the checkout's build/native, whatever the command: ninja then
    compiles only what changed since the last build of this checkout, so the wheel built after the editable install
    (make wheel-check) compiles nothing again. Setuptools' default is a temporary folder per editable install."""

    def finalize_options(self) -> None:
        if self.build_temp is None:
            self.build_temp = os.path.join(HERE, "build", "native")
        super().finalize_options()


_require_compiler()
# runtime/ and models/ install as recompile.runtime and recompile.models (pyproject.toml's package-dir, read here for
# their subpackages). Their modules import each other relatively; a checkout finds them under the same names
# (recompile/__init__.py).
with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
    FOLDERS = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
NESTED = [f"{name}.{p}" for name, folder in FOLDERS.items() for p in find_packages(os.path.join(HERE, folder))]
setup(packages=find_packages(include=["recompile", "recompile.*", "hkv", "hkv.*"]) + list(FOLDERS) + NESTED,
      package_dir=FOLDERS,
      ext_modules=_native().extensions(), cmdclass={"build_ext": BuildNative})
