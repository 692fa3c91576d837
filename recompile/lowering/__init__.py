"""Op -> per-target implementation tables, and target detection."""
from recompile.lowering import beam_decode, dropout, embedding, hkv, interaction, jagged, offsets, quantized, recurrent, sampled_softmax, serving  # noqa: F401
# (one module per op family registers its table)
from recompile.lowering.registry import (
    FACTS, LOWERINGS, Impl, OpFacts, candidates, choose, declare_facts, kernel_of, op_facts, ops_where, register_lowering,
)
from recompile.lowering.targets import Target, detect_target

__all__ = [
    "FACTS", "LOWERINGS", "Impl", "OpFacts", "Target", "candidates", "choose", "declare_facts", "detect_target", "kernel_of",
    "op_facts", "ops_where", "register_lowering",
]
