"""Lowering of recompile::grouped_embedding_bag_quantized (row-wise int8 / int4 tables, runtime/quantized.py).

FBGEMM's CPU TBE for quantized tables (``int_nbit_split_embedding_codegen_lookup_function``) reads every table from
one packed buffer with fp16 scale/bias in front of each row; the user's tables are separate buffers in the fused
layout (scale/bias after the codes), and repacking them would copy every table on every call, so the lookup runs
our own kernel: on CPU the native C++ kernel (all tables in one OpenMP call, rows dequantized in registers), else
the reference (dequantize the looked-up rows, bag in torch).
"""
from recompile.lowering.registry import Impl, declare_facts, native_on_cpu, reference, register_lowering
from recompile.runtime import embedding_native

register_lowering(
    "recompile::grouped_embedding_bag_quantized",
    Impl("native", "cpu_kernel", native_on_cpu(embedding_native.available),
         "runtime/csrc/quantized.h: every table and bag in one OpenMP call, dequantized in registers"),
    reference("recompile.runtime.quantized.grouped_embedding_bag_quantized_reference"),
)
declare_facts("recompile::grouped_embedding_bag_quantized", bounds_checked=True)
