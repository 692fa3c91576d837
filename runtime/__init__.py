"""recompile's custom ops (``torch.ops.recompile.*``), their reference implementations and kernels.

Importing this package defines the ops. It never imports ``recompile``.
"""
from runtime import offsets  # noqa: F401  (defines torch.ops.recompile.complete_cumsum)
from runtime import embedding  # noqa: F401  (defines torch.ops.recompile.grouped_embedding_bag)
from runtime import jagged  # noqa: F401  (jagged_to_padded_dense, dense_to_jagged, jagged bmm and softmax)
from runtime import jagged_attention  # noqa: F401  (hstu_attention, jagged_softmax_attention)
from runtime import jagged_attention_native  # noqa: F401  (the native CPU kernel of hstu_attention)
from runtime import paged_attention  # noqa: F401  (hstu_paged_attention: HSTU serving over a paged KV cache)
from runtime import padded_attention  # noqa: F401  (padded_softmax_attention: padded histories, additive mask)
from runtime import interaction  # noqa: F401,E402  (dot_interaction, cross_layer, fm_second_order)
from runtime import embedding_optimizer  # noqa: F401  (defines torch.ops.recompile.embedding_optimizer_step)
from runtime import embedding_native  # noqa: F401  (the native CPU kernels of the grouped embedding ops)
from runtime import quantized  # noqa: F401  (defines torch.ops.recompile.grouped_embedding_bag_quantized)
from runtime import dropout  # noqa: F401  (defines torch.ops.recompile.dropout)
from runtime import sampled_softmax  # noqa: F401  (defines torch.ops.recompile.sampled_softmax_loss)
from runtime import beam_decode_attention  # noqa: F401  (defines torch.ops.recompile.beam_decode_attention)
from runtime.kernels import KERNELS, get_kernel, register_kernel

__all__ = ["KERNELS", "get_kernel", "register_kernel"]
