"""Lowering of recompile::dropout: the native CPU kernel, and the reference (torch integer ops) anywhere."""
from recompile.lowering.registry import Impl, declare_facts, native_on_cpu, reference, register_lowering
from recompile.runtime import dropout

register_lowering(
    "recompile::dropout",
    Impl("native", "cpu_kernel", native_on_cpu(dropout.available), "runtime/csrc/dropout.h: hash, test, scale in one pass"),
    reference("recompile.runtime.dropout.dropout_reference"),
)
declare_facts("recompile::dropout", random=True)
