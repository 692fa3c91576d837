"""Lowering of the hkv table ops: the kernel that probes the hash table (``hkv.kernels``)."""
from hkv import kernels
from recompile.lowering.registry import Impl, declare_facts, has_triton, reference, register_lowering


def cpu_kernel_runs(target) -> bool:
    return target.name == "cpu" and kernels.runs_on("cpu", target.device)


register_lowering(
    "hkv::lookup",
    Impl("triton", "triton", has_triton, "hkv.triton_kernels.locate (probe) + gather"),
    Impl("cpu", "cpu_kernel", cpu_kernel_runs,
         "hkv/csrc/probe.h: one pass per key (hash, probe, claim, score, row), threads over bucket ranges"),
    reference("hkv.table: vectorised torch probing (any device)"),
)
# Lookups insert missing ids and their backward applies the optimizer to the table: all change the table.
for op in ("hkv::lookup", "hkv::embedding_lookup", "hkv::update"):
    declare_facts(op, stateful=True)
