"""Target detection: which device the compiled graph runs on, and what that device offers.

A target is what the lowering registry consults when it chooses a kernel: the device type, whether
the device is present here (a target that is not is planned for, never executed), the FBGEMM ops its
library provides, the Triton flavour, and the core count that sizes 1-D grids.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from recompile.runtime.fbgemm import fbgemm_ops

TARGETS = ("auto", "cpu", "cuda", "npu")

# fbgemm-ascend does not ship every fbgemm op: what each chip's build provides (torch.ops.fbgemm names), as data,
# from fbgemm-ascend's operator list (docs/ops_api_v1.5.0.md, its "hardware support" column).
_ASCEND_EVERY_CHIP = frozenset(
    {
        "asynchronous_complete_cumsum",
        "dense_to_jagged",
        "jagged_to_padded_dense",
        "jagged_1d_to_dense",
        "jagged_2d_to_dense",
        "permute_pooled_embs",
        "permute2d_sparse_data",
        "offsets_range",
        "segment_sum_csr",
        "split_embedding_codegen_forward_unweighted",
        "backward_codegen_adagrad_unweighted_exact",
        "dense_embedding_codegen_lookup_function",
        "dense_embedding_codegen_grad",
    }
)
ASCEND_FBGEMM_OPS: dict[str, frozenset[str]] = {
    "A2": _ASCEND_EVERY_CHIP,
    "A3": _ASCEND_EVERY_CHIP,
    "A5": _ASCEND_EVERY_CHIP | {
        "jagged_dense_elementwise_add",
        "jagged_dense_elementwise_add_jagged_output",
        "jagged_dense_elementwise_mul",
        "keyed_jagged_index_select_dim1",
        "block_bucketize_sparse_features",
        "expand_into_jagged_permute",
        "group_index_select_dim0",
        "invert_permute",
        "bounds_check_indices",
        "all_to_one_device",
        "bfloat16_quantized_to_float",
        "float_to_bfloat16_quantized",
        "float_or_half_to_fused_nbit_rowwise",
        "int_nbit_split_embedding_codegen_lookup_function",
        "pruned_array_lookup",
        "pruned_array_lookup_from_row_idx",
        "pruned_hashmap_lookup",
        "emb_inplace_update",
        "init_address_lookup",
        "get_unique_indices",
        "linearize_cache_indices",
        "linearize_cache_indices_from_row_idx",
        "lru_cache_find_uncached",
        "lru_cache_populate_byte",
        "direct_mapped_lru_cache_populate_byte",
        "lxu_cache_lookup",
    },
}
# The chip a plan assumes when no NPU is present to ask.
DEFAULT_ASCEND_CHIP = "A3"
# Vector cores per chip (the programs of a persistent 1-D Triton grid on Ascend) when the device does not say;
# A5's is assumed equal to A3's until measured.
ASCEND_VECTOR_CORES = {"A2": 48, "A3": 48, "A5": 48}
# How torch_npu names each chip: device-name substrings (torch_npu.npu.get_device_name), then SoC version codes
# (torch_npu.npu.get_soc_version: Ascend910B1..B4 are 220-225, Ascend910_93xx 250-255).
ASCEND_DEVICE_NAMES = (("A5", ("Ascend910_95", "Ascend950")), ("A3", ("Ascend910_93", "Ascend910C")),
                       ("A2", ("Ascend910B",)))
ASCEND_SOC_VERSIONS = {"A2": range(220, 226), "A3": range(250, 256)}


def ascend_chip(device_name: str, soc_version: int | None) -> str | None:
    """The Atlas chip ("A2", "A3", "A5") of an NPU from what torch_npu says of it; None for another NPU."""
    for chip, names in ASCEND_DEVICE_NAMES:
        if any(name in device_name for name in names):
            return chip
    return next((chip for chip, codes in ASCEND_SOC_VERSIONS.items() if soc_version in codes), None)


@dataclass(frozen=True)
class Target:
    name: str  # "cpu" | "cuda" | "npu"
    available: bool  # the device is present here; False: planned only, never run
    chip: str  # the device's name; on NPU its Atlas chip ("A2", "A3", "A5")
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
    import torch_npu

    name = torch_npu.npu.get_device_name(0)
    get_soc_version = getattr(torch_npu.npu, "get_soc_version", None)
    chip = ascend_chip(name, get_soc_version() if get_soc_version else None)
    props = torch_npu.npu.get_device_properties(0)
    cores = int(getattr(props, "vector_core_num", 0) or ASCEND_VECTOR_CORES.get(chip, 1))
    ops = ASCEND_FBGEMM_OPS.get(chip, frozenset()) & fbgemm_ops()  # another NPU: no fbgemm-ascend ops assumed
    return Target("npu", True, chip or name, cores, ops, "triton-ascend")


_DETECT = {"cpu": _cpu, "cuda": _cuda, "npu": _npu}


def accelerators_started() -> dict[str, Any]:
    """The accelerators this process has started, by device type: their modules (``torch.cuda``, ``torch.npu``)."""
    modules = {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}
    return {kind: module for kind, module in modules.items() if module is not None and module.is_initialized()}


def synchronize(device: torch.device | None = None) -> None:
    """Wait until ``device`` (None: every accelerator this process has started) has run the work queued on it,
    so that a timer stopped after this counts the kernels, not their launches. Nothing to wait for on CPU."""
    for kind, module in accelerators_started().items():
        if device is None or device.type == kind:
            module.synchronize(device)


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
