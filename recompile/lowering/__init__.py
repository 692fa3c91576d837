"""Op -> per-target implementation tables, and target detection."""
from recompile.lowering import beam_decode, dropout, embedding, hkv, interaction, jagged, offsets, sampled_softmax  # noqa: F401  (one module per op family registers its table)
from recompile.lowering.registry import LOWERINGS, Impl, candidates, choose, register_lowering
from recompile.lowering.targets import Target, detect_target

__all__ = ["LOWERINGS", "Impl", "Target", "candidates", "choose", "detect_target", "register_lowering"]
