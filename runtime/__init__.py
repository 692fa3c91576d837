"""recompile's custom ops (``torch.ops.recompile.*``), their reference implementations and kernels.

Importing this package defines the ops. The checkout's top-level folder ``runtime/``, installed as
``recompile.runtime`` (no top-level ``runtime`` to shadow a user's own): its modules import each other relatively,
and it imports nothing of ``recompile`` but the package's lazy ``__init__`` (no passes, no Inductor).
"""
from . import offsets  # noqa: F401  (defines torch.ops.recompile.complete_cumsum)
from . import embedding  # noqa: F401  (defines torch.ops.recompile.grouped_embedding_bag)
from . import jagged  # noqa: F401  (jagged_to_padded_dense, dense_to_jagged, jagged bmm and softmax)
from . import jagged_attention  # noqa: F401  (hstu_attention, jagged_softmax_attention)
from . import jagged_attention_native  # noqa: F401  (the native CPU kernel of hstu_attention)
from . import paged_attention  # noqa: F401  (hstu_paged_attention: HSTU serving over a paged KV cache)
from . import padded_attention  # noqa: F401  (padded_softmax_attention: padded histories, additive mask)
from . import interaction  # noqa: F401,E402  (dot_interaction, cross_layer, fm_second_order)
from . import embedding_optimizer  # noqa: F401  (defines torch.ops.recompile.embedding_optimizer_step)
from . import embedding_native  # noqa: F401  (the native CPU kernels of the grouped embedding ops)
from . import quantized  # noqa: F401  (defines torch.ops.recompile.grouped_embedding_bag_quantized)
from . import dropout  # noqa: F401  (defines torch.ops.recompile.dropout)
from . import sampled_softmax  # noqa: F401  (defines torch.ops.recompile.sampled_softmax_loss)
from . import beam_decode_attention  # noqa: F401  (defines torch.ops.recompile.beam_decode_attention)
from . import recurrent  # noqa: F401  (defines torch.ops.recompile.gru)
from .kernels import KERNELS, get_kernel, register_kernel

__all__ = ["KERNELS", "get_kernel", "register_kernel"]
