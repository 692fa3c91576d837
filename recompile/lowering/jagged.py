"""Lowering of the jagged ops (runtime/jagged.py): FBGEMM where the target's library has the op,
else the CPU kernel (index arithmetic, length buckets), else the reference."""
from recompile.lowering.registry import Impl, has_fbgemm, has_triton, on_cpu, reference, register_lowering

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

for _op, _fbgemm in FBGEMM_EQUIVALENTS.items():
    register_lowering(
        f"recompile::{_op}",
        Impl("fbgemm", "library", has_fbgemm(_fbgemm), f"torch.ops.fbgemm.{_fbgemm}"),
        Impl("cpu", "cpu_kernel", on_cpu, f"runtime.jagged ({_op}, cpu)"),
        reference(f"runtime.jagged.{_op}_reference"),
    )

# Attention on jagged sequences: the Triton kernel on accelerators, length buckets on CPU.
TRITON_ATTENTION = {
    "hstu_attention": "runtime.triton_kernels.jagged_attention",
    "hstu_attention_backward": "length-bucketed dense on the device (after the Triton forward)",
}
for _op in ("hstu_attention", "hstu_attention_backward", "jagged_softmax_attention",
            "jagged_softmax_attention_backward"):
    triton_impl = (Impl("triton", "triton", has_triton, TRITON_ATTENTION[_op]),) if _op in TRITON_ATTENTION else ()
    register_lowering(
        f"recompile::{_op}",
        *triton_impl,
        Impl("cpu", "cpu_kernel", on_cpu, f"runtime.jagged_attention ({_op}, length-bucketed dense)"),
        reference(f"runtime.jagged_attention ({_op}, padded to the longest sequence)"),
    )

register_lowering("recompile::jagged_within", reference("runtime.jagged.jagged_within_reference"))
