"""Lowering of the hkv table ops: the kernel that probes the hash table (``hkv.kernels``)."""
from recompile.lowering.registry import reference, register_lowering

register_lowering(
    "hkv::lookup",
    reference("hkv.table: vectorised torch probing (any device)"),
)
