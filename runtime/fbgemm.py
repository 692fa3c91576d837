"""Loading the FBGEMM op library: fbgemm-gpu (CUDA), fbgemm-gpu-cpu, or fbgemm-ascend (NPU)."""
from __future__ import annotations

import functools
import importlib

import torch

# Python packages that register torch.ops.fbgemm.*, in the order tried.
FBGEMM_PACKAGES = ("fbgemm_gpu", "fbgemm_ascend")


@functools.cache
def load_fbgemm() -> str | None:
    """Import the first FBGEMM package present; return its name, or None when there is none."""
    for name in FBGEMM_PACKAGES:
        try:
            importlib.import_module(name)
        except (ImportError, OSError):
            continue
        return name
    return None


def fbgemm_ops() -> frozenset[str]:
    """Names of the ``torch.ops.fbgemm`` ops registered in this process (after loading the library)."""
    load_fbgemm()
    prefix = "fbgemm::"
    return frozenset(
        name[len(prefix):].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(prefix)
    )


def fbgemm_op(name: str):
    """``torch.ops.fbgemm.<name>``, loading the library first."""
    load_fbgemm()
    return getattr(torch.ops.fbgemm, name)
