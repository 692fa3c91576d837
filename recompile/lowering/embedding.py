"""Lowering of recompile::grouped_embedding_bag (and its backward, which follows the forward's choice).

FBGEMM's table-batched ops (``split_embedding_codegen_lookup_*``, ``dense_embedding_codegen_lookup_function``)
read every table from one packed ``weights`` buffer; the user's tables are separate parameters and
packing them would copy every table on every call, so the grouped lookup runs our own kernels: on CPU
the native C kernel (all tables in one OpenMP call), else ATen's embedding_bag per table.
"""
from recompile.lowering.registry import (
    Impl, declare_facts, has_triton, native_on_cpu, on_cpu, reference, register_lowering,
)
from recompile.runtime import embedding_native

native_runs = native_on_cpu(embedding_native.available)  # runtime/csrc/embedding.h


register_lowering(
    "recompile::grouped_embedding_bag",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.embedding: every table's bags in one launch, ids and "
         "offsets checked in the kernel and reported after; the backward's dense gradients in one launch"),
    Impl("native", "cpu_kernel", native_runs, "runtime/csrc/embedding.h: every table and bag in one OpenMP call"),
    Impl("cpu", "cpu_kernel", on_cpu, "ATen embedding_bag per table (FBGEMM EmbeddingSpMDM) in one op"),
    reference("recompile.runtime.embedding.grouped_embedding_bag_reference"),
)

# The fused optimizer's step (not timed: it updates the tables): the Triton kernel on accelerators, the native kernel (ids deduplicated and touched
# rows updated for all tables in one call), else FBGEMM's CPU exact-SGD op per table where it applies (SUM
# pooling, fp32, no per-sample weights or padding), else deduplication and row updates in torch.
register_lowering(
    "recompile::embedding_optimizer_step",
    Impl("triton", "triton", has_triton, "recompile.runtime.triton_kernels.embedding_optimizer: ids sorted on the device, "
         "each touched row's gradient summed and updated, all tables in one launch"),
    Impl("native", "cpu_kernel", native_runs, "runtime/csrc/embedding.h: dedup + row updates of all tables in one call"),
    Impl("fbgemm", "library", lambda target: on_cpu(target) and target.has_fbgemm("split_embedding_backward_codegen_sgd_cpu"),
         "torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu per table (exact_sgd)"),
    reference("recompile.runtime.embedding_optimizer: unique ids, summed gradients, row updates"),
)
declare_facts("recompile::grouped_embedding_bag", bounds_checked=True)
# The fused lookup runs grouped_embedding_bag's kernels; its backward is embedding_optimizer_step.
declare_facts("recompile::grouped_embedding_bag_fused", bounds_checked=True, updates_in_backward=True)
declare_facts("recompile::embedding_optimizer_step", stateful=True)
