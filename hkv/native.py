"""Build plain-C kernels on first use, cache the shared library, and load it through ctypes.

The CPU kernels of hkv (``hkv/csrc``) and of the runtime ops (``runtime/csrc``; runtime imports hkv)
are plain C with pthreads or OpenMP and no torch headers, so a build takes about a second. Libraries
are cached under ``$HKV_CACHE_DIR`` (default ``~/.cache/hkv``), keyed by the source, the flags and
this CPU's feature flags (the code is built with ``-march=native``), and written by rename so
concurrent builders never see half a file. Without a C compiler (or when the build fails) ``load``
returns None and callers keep their torch code path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", "-fopenmp", "-std=gnu11")
i64 = ctypes.c_int64
ptr = ctypes.c_void_p
i32 = ctypes.c_int


def address(t) -> int | None:
    """A tensor's data pointer for a kernel argument; None (NULL) for an absent tensor."""
    return None if t is None else t.data_ptr()


def unit_stride_rows(t):
    """``t`` with unit stride along its last dimension, as the kernels read rows (a view when it has one)."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def cache_dir() -> str:
    return os.environ.get("HKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hkv")


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build(source: str, path: str, compiler: str) -> bool:
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, source, "-o", tmp, "-lm"], check=True, capture_output=True)
        os.replace(tmp, path)
        return True
    except (OSError, subprocess.CalledProcessError):
        os.path.exists(tmp) and os.remove(tmp)
        return False


def _source_bytes(source: str) -> bytes:
    """``source`` and every local header it includes (``#include "x.h"``, next to it), so that a changed header
    rebuilds the library."""
    with open(source, "rb") as f:
        text = f.read()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join(_source_bytes(os.path.join(os.path.dirname(source), h.decode())) for h in headers)


@functools.cache
def load(source: str, signatures: tuple[tuple[str, tuple], ...]) -> ctypes.CDLL | None:
    """The library built from ``source`` with ``signatures`` ((symbol, argtypes[, restype]), ...) declared; None
    without a compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(_source_bytes(source) + " ".join(CFLAGS).encode() + _cpu_flags()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(cache_dir(), f"{stem}_{digest}.so")
    if not os.path.exists(path) and not _build(source, path, compiler):
        return None
    lib = ctypes.CDLL(path)
    for name, argtypes, *restype in signatures:
        getattr(lib, name).argtypes = list(argtypes)
        if restype:
            getattr(lib, name).restype = restype[0]
    return lib


@dataclass(frozen=True)
class NativeLibrary:
    """One C source's kernels, built on first use: ``library()`` (None without a C compiler), ``available()``,
    and ``supports(*tensors)``: every given tensor is a CPU tensor of one of ``dtypes`` and the library loads."""
    source: str
    signatures: tuple[tuple[str, tuple], ...]
    dtypes: frozenset = frozenset()

    def library(self) -> ctypes.CDLL | None:
        return load(self.source, self.signatures)

    def available(self) -> bool:
        return self.library() is not None

    def supports(self, *tensors: Any) -> bool:
        present = [t for t in tensors if t is not None]
        return all(t.device.type == "cpu" and t.dtype in self.dtypes for t in present) and self.available()
