"""The native CPU kernels as torch operators: how they are built (at install) and loaded (at import).

Build: ``setup.py`` calls :func:`extensions`: ``torch.utils.cpp_extension.CppExtension``s compiled when the
package is installed (``pip install --no-build-isolation -e .`` or ``pip wheel --no-build-isolation --no-deps .``;
build isolation would fetch another torch). ``recompile.runtime._C`` holds the runtime's kernels (``runtime/csrc``,
``torch.ops.recompile_native.*``), ``hkv._C`` the hash table's (``hkv/csrc``, ``torch.ops.hkv_native.*``): hkv
stays usable on its own. The kernel bodies of ``runtime/csrc`` are compiled once per instruction set (generic,
AVX2 + FMA, AVX-512) and the library picks one when it loads: the best this CPU has, or the one the environment
variable ``RECOMPILE_ISA`` names (``avx2`` measures the AVX2 path on an AVX-512 machine). No compiler runs after
install, and no ctypes: the ops go through PyTorch's dispatcher like ATen's.

Load: ``hkv.native.load`` (hkv loads its own library and never imports the runtime); :func:`isa` names the
instruction set the runtime's kernels run.
"""
from __future__ import annotations

import contextlib
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The flags of every translation unit: C-like kernel bodies with GNU vector extensions and OpenMP; fp-contract=fast
# keeps the FMAs GNU C contracted (the kernels were C), -fno-math-errno lets sqrt and exp vectorise.
CXXFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
# (extension module, sources relative to the project root)
LIBRARIES = (("recompile.runtime._C", "runtime/csrc/*.cpp"), ("hkv._C", "hkv/csrc/*.cpp"))
ISAS = ("generic", "avx2", "avx512")  # runtime/csrc/isa_<name>.cpp


def extensions() -> list:
    """The C++ extensions ``setup.py`` builds (needs torch and a C++ compiler)."""
    from torch.utils.cpp_extension import CppExtension

    return [CppExtension(name, sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern))),
                         extra_compile_args=list(CXXFLAGS), extra_link_args=list(LDFLAGS))
            for name, pattern in LIBRARIES]


def isa() -> str | None:
    """The instruction set the runtime's kernels run (generic, avx2 or avx512), None where they are not built."""
    import torch

    from hkv.native import load

    return torch.ops.recompile_native.isa() if load("recompile.runtime._C") else None


def available_isas() -> tuple[str, ...]:
    """The instruction sets this build and CPU can run, of ISAS."""
    import torch

    from hkv.native import load

    return tuple(name for name in ISAS if load("recompile.runtime._C") and torch.ops.recompile_native.isa_available(name))


@contextlib.contextmanager
def use_isa(name: str):
    """Run the runtime's kernels, and hkv's dequantizing copy-out, with instruction set ``name`` inside the block
    (tests, benchmarks); the environment variable RECOMPILE_ISA chooses for a whole process."""
    import torch

    from hkv.native import load

    libraries = [torch.ops.recompile_native] + ([torch.ops.hkv_native] if load("hkv._C") else [])
    before = [library.set_isa(name) for library in libraries]
    try:
        yield
    finally:
        for library, isa in zip(libraries, before):
            library.set_isa(isa)
