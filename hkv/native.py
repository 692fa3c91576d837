"""Load a package's native CPU kernels: C++ torch operators built at install (``runtime/native.py`` says how).

``NativeLibrary("hkv._C", dtypes)`` is one built library: ``available()`` loads it into ``torch.ops`` (once, with
``torch.ops.load_library``) and is False, with a warning, where the package was not built (a checkout without
``pip install --no-build-isolation -e .``); ``supports(*tensors)`` is True when every given tensor is a CPU tensor
of one of the dtypes its kernels are built for and the library loads (the operators check the same). There is no
compiler at run time and no ctypes.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

BUILD_HINT = "pip install --no-build-isolation -e . (a C++ compiler with OpenMP is needed once, at install)"


def unit_stride_rows(t):
    """``t`` with unit stride along its last dimension, as the kernels read rows (a view when it has one)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def library_path(module: str) -> str | None:
    """Where the built library of ``module`` ("hkv._C") is, or None where it was not built."""
    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None and spec.origin and os.path.exists(spec.origin) else None


@functools.cache
def load(module: str) -> bool:
    """Load ``module``'s operators into torch.ops (once); False, with a warning, where it was not built."""
    path = library_path(module)
    if path is None:
        warnings.warn(f"{module}: the native CPU kernels are not built ({BUILD_HINT}); their ops run other kernels",
                      RuntimeWarning, stacklevel=3)
        return False
    torch.ops.load_library(path)
    return True


@dataclass(frozen=True)
class NativeLibrary:
    """One built library of native kernels (``module``) and the dtypes its kernels are built for."""
    module: str
    dtypes: frozenset = frozenset()

    def __post_init__(self):
        load(self.module)  # the ops exist in torch.ops from here on

    def available(self) -> bool:
        return load(self.module)

    def supports(self, *tensors: Any) -> bool:
        present = [t for t in tensors if t is not None]
        return all(t.device.type == "cpu" and t.dtype in self.dtypes for t in present) and self.available()
