"""Lowering of recompile::sampled_softmax_loss: the native CPU kernel, and the reference (torch) anywhere."""
from recompile.lowering.registry import Impl, native_on_cpu, reference, register_lowering
from recompile.runtime import sampled_softmax

register_lowering(
    "recompile::sampled_softmax_loss",
    Impl("native", "cpu_kernel", native_on_cpu(sampled_softmax.available),
         "runtime/csrc/sampled_softmax.h: hits by binary search, each row's max, exp-sum and gradient in cache"),
    reference("recompile.runtime.sampled_softmax.sampled_softmax_loss reference (cat, masked_fill, logsumexp)"),
)
