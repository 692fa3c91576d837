"""Target detection: which device the compiled graph runs on, and what that device offers.

A target is what the lowering registry consults when it chooses a kernel: the device type, whether
the device is present here (a target that is not is planned for, never executed), the FBGEMM ops its
library provides, the Triton flavour, and the core count that sizes 1-D grids.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from runtime.fbgemm import fbgemm_ops

TARGETS = ("auto", "cpu", "cuda", "npu")

# fbgemm-ascend does not ship every fbgemm op: what each chip's build provides, as data.
ASCEND_FBGEMM_OPS: dict[str, frozenset[str]] = {
    "A3": frozenset(
        {
            "asynchronous_complete_cumsum",
            "dense_to_jagged",
            "jagged_to_padded_dense",
            "permute_pooled_embs",
            "permute2d_sparse_data",
            "split_embedding_codegen_forward_unweighted",
            "backward_codegen_adagrad_unweighted_exact",
            "dense_embedding_codegen_lookup_function",
            "dense_embedding_codegen_grad",
        }
    ),
}
# The chip a plan assumes when no NPU is present to ask.
DEFAULT_ASCEND_CHIP = "A3"
# Vector cores per chip (the programs of a persistent 1-D Triton grid on Ascend).
ASCEND_VECTOR_CORES = {"A3": 48}


@dataclass(frozen=True)
class Target:
    name: str  # "cpu" | "cuda" | "npu"
    available: bool  # the device is present here; False: planned only, never run
    chip: str
    num_cores: int
    fbgemm_ops: frozenset[str] = field(repr=False)
    triton: str | None  # "triton" | "triton-ascend" | None

    @property
    def device(self) -> torch.device:
        return torch.device(self.name)

    def has_fbgemm(self, op: str) -> bool:
        return op in self.fbgemm_ops

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "available": self.available,
            "chip": self.chip,
            "num_cores": self.num_cores,
            "triton": self.triton,
            "fbgemm_ops": len(self.fbgemm_ops),
        }


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def npu_available() -> bool:
    if not _has_module("torch_npu"):
        return False
    import torch_npu  # noqa: F401

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _cpu() -> Target:
    return Target("cpu", True, "cpu", os.cpu_count() or 1, fbgemm_ops(), None)


def _cuda() -> Target:
    available = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if available else None
    return Target(
        "cuda",
        available,
        props.name if props else "cuda (not present)",
        props.multi_processor_count if props else 132,
        fbgemm_ops() if available else frozenset(),
        "triton" if _has_module("triton") else None,
    )


def _npu() -> Target:
    if not npu_available():
        chip = DEFAULT_ASCEND_CHIP
        return Target("npu", False, chip, ASCEND_VECTOR_CORES[chip], ASCEND_FBGEMM_OPS[chip], "triton-ascend")
    name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
    chip = next((c for c in ASCEND_FBGEMM_OPS if c in name), DEFAULT_ASCEND_CHIP)
    props = torch.npu.get_device_properties(0)  # type: ignore[attr-defined]
    cores = int(getattr(props, "vector_core_num", 0) or ASCEND_VECTOR_CORES[chip])
    return Target("npu", True, name, cores, ASCEND_FBGEMM_OPS[chip] & fbgemm_ops(), "triton-ascend")


_DETECT = {"cpu": _cpu, "cuda": _cuda, "npu": _npu}


def synchronize(device: torch.device | None = None) -> None:
    """Wait until ``device`` (None: every accelerator this process has started) has run the work queued on it,
    so that a timer stopped after this counts the kernels, not their launches. Nothing to wait for on CPU."""
    kind = None if device is None else device.type
    if kind in (None, "cuda") and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
    npu = getattr(torch, "npu", None)
    if kind in (None, "npu") and npu is not None and npu.is_initialized():
        npu.synchronize(device)


def detect_target(requested: str = "auto") -> Target:
    """The target named by ``requested``; "auto" is the best device present (npu, cuda, cpu)."""
    if requested not in TARGETS:
        raise ValueError(f"unknown target {requested!r}; valid targets: {', '.join(TARGETS)}")
    if requested != "auto":
        return _DETECT[requested]()
    if npu_available():
        return _npu()
    if torch.cuda.is_available():
        return _cuda()
    return _cpu()
