"""Lowering of the jagged ops (runtime/jagged.py): FBGEMM where the target's library has the op,
else the Triton kernel on accelerators, else the CPU kernel (index arithmetic, length
buckets), else the reference. HSTU attention on CPU: the native C kernel (runtime/csrc/jagged_attention.h)
first."""
from recompile.lowering.registry import (Impl, declare_facts, has_fbgemm, has_triton, native_on_cpu, on_cpu,
                                         reference, register_lowering)
from recompile.runtime import jagged_attention_native, padded_attention

# recompile op -> the FBGEMM op with its semantics.
FBGEMM_EQUIVALENTS = {
    "jagged_to_padded_dense": "jagged_to_padded_dense",
    "dense_to_jagged": "dense_to_jagged",
    "jagged_dense_elementwise_add": "jagged_dense_elementwise_add_jagged_output",
    "jagged_dense_elementwise_mul": "jagged_dense_elementwise_mul",
    "jagged_softmax": "jagged_softmax",
    "jagged_softmax_backward": "jagged_softmax_backward",
    "jagged_jagged_bmm": "jagged_jagged_bmm",
    "jagged_dense_bmm": "jagged_dense_bmm",
}

# Triton kernels where the library lacks the op (fbgemm-ascend A2/A3 has only the conversions).
TRITON_JAGGED = {
    "jagged_to_padded_dense": "recompile.runtime.triton_kernels.jagged_dense (per (row tile, column block))",
    "dense_to_jagged": "recompile.runtime.triton_kernels.jagged_dense (per (row tile, column block))",
    "jagged_dense_elementwise_add": "recompile.runtime.triton_kernels.jagged_dense (per (row tile, column block), floating)",
    "jagged_dense_elementwise_mul": "recompile.runtime.triton_kernels.jagged_dense (per (row tile, column block), floating)",
    "jagged_dense_bmm": "recompile.runtime.triton_kernels.jagged_bmm (per (row tile, column block) of each sequence)",
    "jagged_jagged_bmm": "recompile.runtime.triton_kernels.jagged_bmm (per (sequence, M block, N block), over its rows)",
    "jagged_softmax": "recompile.runtime.triton_kernels.jagged_softmax (online max and sum per (sequence, column block))",
    "jagged_softmax_backward": "recompile.runtime.triton_kernels.jagged_softmax (sum of g * y, then y (g - sum), per "
                               "(sequence, column block))",
}

for _op, _fbgemm in FBGEMM_EQUIVALENTS.items():
    register_lowering(
        f"recompile::{_op}",
        Impl("fbgemm", "library", has_fbgemm(_fbgemm), f"torch.ops.fbgemm.{_fbgemm}"),
        *((Impl("triton", "triton", has_triton, TRITON_JAGGED[_op]),) if _op in TRITON_JAGGED else ()),
        Impl("cpu", "cpu_kernel", on_cpu, f"recompile.runtime.jagged ({_op}, cpu)"),
        reference(f"recompile.runtime.jagged.{_op}_reference"),
    )

# Attention on jagged sequences: the Triton kernel on accelerators; on CPU the native kernel (HSTU), then
# length buckets of dense ATen ops.
TRITON_ATTENTION = {
    "hstu_attention": "recompile.runtime.triton_kernels.jagged_attention (forward over query tiles; position and time bias, "
                      "targets, contextual prefix in the kernel)",
    "hstu_attention_backward": "recompile.runtime.triton_kernels.jagged_attention (dq over query tiles, dk dv and both bias "
                               "grads over key tiles)",
    "jagged_softmax_attention": "recompile.runtime.triton_kernels.softmax_attention (online softmax over query tiles)",
    "jagged_softmax_attention_backward": "recompile.runtime.triton_kernels.softmax_attention (forward recomputed for the "
                                         "log-sum-exp, dq over query tiles, dk dv over key tiles)",
}
NATIVE_ATTENTION = {
    "hstu_attention": "csrc/jagged_attention.h: tiles of each sequence, bias and mask fused, no padding",
    "hstu_attention_backward": "csrc/jagged_attention.h: scores recomputed per tile, dq dk dv and bias grads fused",
}
native_attention_runs = native_on_cpu(jagged_attention_native.available)
for _op in ("hstu_attention", "hstu_attention_backward", "jagged_softmax_attention",
            "jagged_softmax_attention_backward"):
    triton_impl = (Impl("triton", "triton", has_triton, TRITON_ATTENTION[_op]),) if _op in TRITON_ATTENTION else ()
    native_impl = (Impl("native", "cpu_kernel", native_attention_runs, NATIVE_ATTENTION[_op]),) if _op in NATIVE_ATTENTION else ()
    register_lowering(
        f"recompile::{_op}",
        *triton_impl,
        *native_impl,
        Impl("cpu", "cpu_kernel", on_cpu, f"recompile.runtime.jagged_attention ({_op}, length-bucketed dense)"),
        reference(f"recompile.runtime.jagged_attention ({_op}, padded to the longest sequence)"),
    )

register_lowering("recompile::jagged_within", reference("recompile.runtime.jagged.jagged_within_reference"))

# The ops the jagged pass emits check their offsets per options.bounds_check: "warning"/"ignore" repair offsets
# the captured graph would take as they are, so with those modes the captured graph is no autotune candidate.
for _op in ("jagged_within", "hstu_attention", "jagged_softmax_attention"):
    declare_facts(f"recompile::{_op}", bounds_checked=True)

# Attention on padded histories with an additive mask: keys after the last attended one cut per sequence; on CPU
# the native kernel (fused per (sequence, head)) first.
for _op in ("padded_softmax_attention", "padded_softmax_attention_backward"):
    register_lowering(
        f"recompile::{_op}",
        Impl("native", "cpu_kernel", native_on_cpu(padded_attention.native_available),
             f"csrc/padded_attention.h ({_op}: per (sequence, head), the keys each row weighs, softmax in cache)"),
        Impl("cpu", "cpu_kernel", on_cpu, f"recompile.runtime.padded_attention ({_op}, keys cut to the attended ones, grouped)"),
        reference(f"recompile.runtime.padded_attention ({_op}, the padded formula)"),
    )
