"""The CPU kernel of hkv tables (``csrc/probe.c``), built on first use and cached, called through ctypes.

The library is plain C with pthreads (no torch headers), so the first build takes about a second; it
is cached under ``$HKV_CACHE_DIR`` (default ``~/.cache/hkv``) keyed by the source's hash, and written
by rename so concurrent builders never see half a file. Without a C compiler the kernel is simply
unavailable and tables probe with the vectorised torch code.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "probe.c")
CFLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-std=gnu99")
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def _cache_dir() -> str:
    return os.environ.get("HKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hkv")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None when no C compiler is present."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"hkv_probe_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        try:
            subprocess.run([compiler, *CFLAGS, SOURCE, "-o", tmp], check=True, capture_output=True)
            os.replace(tmp, path)
        except (OSError, subprocess.CalledProcessError):
            os.path.exists(tmp) and os.remove(tmp)
            return None
    lib = ctypes.CDLL(path)
    lib.hkv_locate.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int]
    lib.hkv_find.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.hkv_claim.argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, ctypes.c_int]
    return lib


def available() -> bool:
    return library() is not None


def locate(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, keys: torch.Tensor) -> torch.Tensor:
    keys = keys.contiguous()
    slots = torch.empty_like(keys)
    library().hkv_locate(table_keys.data_ptr(), num_buckets, bucket_size, keys.data_ptr(), keys.numel(),
                         slots.data_ptr(), torch.get_num_threads())
    return slots


def find(table_keys: torch.Tensor, num_buckets: int, bucket_size: int, values: torch.Tensor, keys: torch.Tensor):
    """(rows, found, slots): the value rows of ``keys`` (zero where absent), in one pass."""
    keys = keys.contiguous()
    n = keys.numel()
    out = values.new_empty(n, values.shape[1])
    found = torch.empty(n, dtype=torch.bool)
    slots = torch.empty_like(keys)
    library().hkv_find(table_keys.data_ptr(), num_buckets, bucket_size, values.data_ptr(),
                       values.shape[1] * values.element_size(), keys.data_ptr(), n, out.data_ptr(),
                       found.data_ptr(), slots.data_ptr(), torch.get_num_threads())
    return out, found, slots


def claim(table_keys: torch.Tensor, table_scores: torch.Tensor, num_buckets: int, bucket_size: int,
          keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Store new unique keys with their scores in free slots; the slot of each, -1 where the bucket is full."""
    keys, scores = keys.contiguous(), scores.contiguous()
    slots = torch.empty_like(keys)
    library().hkv_claim(table_keys.data_ptr(), table_scores.data_ptr(), num_buckets, bucket_size, keys.data_ptr(),
                        scores.data_ptr(), keys.numel(), slots.data_ptr(), torch.get_num_threads())
    return slots
