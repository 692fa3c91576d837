"""Lowering of the hkv table ops: the kernel that probes the hash table.

hkv (usable without recompile) keeps its probe kernels by name in ``hkv.kernels`` (``LOCATE``, ``FIND``, ``CLAIM``);
they are registered here as ``hkv::lookup``'s kernels in the one kernel table (``recompile.runtime.kernels``), each
supporting the tables on the devices where ``hkv.kernels.runs_on`` says it runs.
"""
from hkv import kernels
from hkv.ops import get_table
from recompile.lowering.registry import Impl, declare_facts, has_triton, reference, register_lowering
from recompile.runtime.kernels import register_kernel


def probes(name: str):
    """``supports`` of probe kernel ``name``: it runs on the device of the table ``table_id`` holds."""

    def supports(table_id, **_) -> bool | str:
        device = get_table(table_id).table.device
        return True if kernels.runs_on(name, device) else f"hkv kernel {name!r} does not run on {device} here"

    return supports


for _name in kernels.KERNEL_NAMES:
    register_kernel("hkv::lookup", _name, supports=probes(_name))(kernels.LOCATE[_name])


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
