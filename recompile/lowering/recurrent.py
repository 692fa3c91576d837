"""Lowering of recompile::gru and recompile::lstm: an LSTM's inference call through ATen's oneDNN LSTM on the CPU,
the native CPU kernels, and the reference (the step formulas in torch) anywhere."""
from recompile.lowering.registry import Impl, native_on_cpu, on_cpu, reference, register_lowering
from recompile.runtime import recurrent


def _native(kind: str) -> Impl:
    return Impl("native", "cpu_kernel", native_on_cpu(recurrent.available),
                f"runtime/csrc/{kind}.h: all steps' input projections in one GEMM, per step a GEMM and one fused "
                "gate pass; backward through time over the saved gates")


REFERENCE = reference("recompile.runtime.recurrent.recurrent_reference (the step formulas in torch, a loop over steps)")
register_lowering("recompile::gru", _native("gru"), REFERENCE)
register_lowering("recompile::lstm",
                  Impl("aten", "aten", on_cpu, "torch.lstm below autograd (oneDNN's LSTM), for inference calls"),
                  _native("lstm"), REFERENCE)
