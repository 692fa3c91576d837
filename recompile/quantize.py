"""``recompile.quantize(model, dtype)``: inference embedding tables stored row-wise quantized (int8 / int4).

Every ``nn.EmbeddingBag`` (sum / mean) and ``nn.Embedding`` of ``model`` (also those inside TorchRec's
``EmbeddingBagCollection`` and the zoo's models) is replaced by a module holding its table in FBGEMM's fused row-wise
layout (runtime/quantized.py: per-row scale and bias; int8 is 1/4 of fp32 plus 8 bytes a row, int4 1/8 plus 4 bytes)
that looks up through ``torch.ops.recompile.grouped_embedding_bag_quantized``. Under
``torch.compile(backend="rec_ascend")`` the embedding pass groups these lookups like float ones: one call of the
quantized op for all tables feeding a stack / cat, whose native CPU kernel dequantizes in registers and sums in fp32.
hkv tables (``hkv.DynamicEmbeddingBag`` / ``DynamicEmbedding``) are converted in place of their copy: the hash table
then stores the same keys with packed rows (``DynamicEmbeddingBag.quantize_``), and its probe kernel dequantizes.

Quantizing is for inference: a model in training mode, or a table whose weight requires grad, is refused with an
error naming it unless ``force=True`` (its gradients would be lost silently otherwise).
"""
from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from hkv import DynamicEmbeddingBag
from recompile.runtime.embedding import LAYOUTS, POOLING_NAMES
from recompile.runtime.quantized import QDTYPES, dequantize_rows, quantize_rows
from hkv.rowwise import check_qdtype

OP = "recompile::grouped_embedding_bag_quantized"


@functools.cache
def _impl(layout: str) -> str:
    """The kernel this machine runs for a quantized lookup in ``layout`` (the lowering registry's choice: the
    native kernel pools, so unpooled lookups take another)."""
    from recompile.lowering import choose, detect_target

    return choose(OP, detect_target(), layout=layout).impl


class _Quantized(nn.Module):
    """A quantized table: ``weight`` (a uint8 buffer ``[rows, width]``) and its format."""

    def __init__(self, packed: Tensor, dim: int, qdtype: str, name: str, padding_idx: Optional[int]):
        super().__init__()
        self.register_buffer("weight", packed)
        self.embedding_dim, self.num_embeddings, self.qdtype, self.name = dim, packed.shape[0], qdtype, name
        self.padding_idx = padding_idx
        self.impls = {layout: _impl(layout) for layout in LAYOUTS}  # chosen here: forward is traced

    def _lookup(self, ids: Tensor, offsets: Optional[Tensor], psw: Optional[Tensor], pooling: int, last: bool,
                layout: str) -> Tensor:
        no_weights = ids.new_empty(0, dtype=torch.float32)
        pad = -1 if self.padding_idx is None else self.padding_idx
        return torch.ops.recompile.grouped_embedding_bag_quantized.default(
            [self.weight], [ids], [offsets], [no_weights if psw is None else psw], [pooling], [pad], [last],
            self.qdtype, layout, self.name, "fatal", self.impls[layout])

    def dequantized(self) -> Tensor:
        """The fp32 table the codes stand for."""
        return dequantize_rows(self.weight, self.qdtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.qdtype}"


class QuantizedEmbeddingBag(_Quantized):
    """``nn.EmbeddingBag`` (sum or mean) over a quantized table: the same ``forward``, fp32 output."""

    def __init__(self, packed: Tensor, dim: int, qdtype: str, name: str, mode: str, include_last_offset: bool,
                 padding_idx: Optional[int]):
        super().__init__(packed, dim, qdtype, name, padding_idx)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        return self._lookup(input, offsets, per_sample_weights, POOLING_NAMES[self.mode], self.include_last_offset,
                            "concat")


class QuantizedEmbedding(_Quantized):
    """``nn.Embedding`` over a quantized table: ids of any shape -> ``[*ids.shape, D]`` fp32."""

    def forward(self, input: Tensor) -> Tensor:
        rows = self._lookup(input.reshape(-1), None, None, POOLING_NAMES["none"], False, "sequence")
        return rows.view(*input.shape, self.embedding_dim)


def _refuse(name: str, module: nn.Module, force: bool) -> None:
    if not force and module.weight.requires_grad:
        raise ValueError(f"recompile.quantize: table {name!r} requires grad: a quantized table cannot be trained; "
                         "call model.requires_grad_(False) first, or pass force=True")


def _quantized(name: str, module: nn.Module, qdtype: str, force: bool) -> Optional[nn.Module]:
    """The quantized replacement of ``module`` (an hkv table: itself, checked, converted by ``_convert``), None when
    it is not a table."""
    where = f"recompile.quantize: table {name!r}"
    if isinstance(module, DynamicEmbeddingBag):
        _refuse(name, module, force)
        check_qdtype(qdtype, module.runtime.dim, where)
        return module
    if isinstance(module, nn.EmbeddingBag):
        if module.mode not in ("sum", "mean"):
            raise ValueError(f"recompile.quantize: table {name!r} pools by {module.mode!r}; only sum and mean are "
                             "quantized")
        kind = functools.partial(QuantizedEmbeddingBag, mode=module.mode,
                                 include_last_offset=module.include_last_offset)
    elif isinstance(module, nn.Embedding):
        kind = QuantizedEmbedding
    else:
        return None
    _refuse(name, module, force)
    if module.max_norm is not None:
        raise ValueError(f"recompile.quantize: table {name!r} has max_norm (it renormalises rows in place)")
    packed = quantize_rows(module.weight, qdtype, where)
    return kind(packed, module.embedding_dim, qdtype, name, padding_idx=module.padding_idx)


def _convert(new: nn.Module, qdtype: str) -> nn.Module:
    """``new`` as it replaces its table: an hkv table converts its storage now, once every table was checked."""
    return new.quantize_(qdtype) if isinstance(new, DynamicEmbeddingBag) else new


def quantize(model: nn.Module, dtype: str = "int8", *, inplace: bool = False, force: bool = False) -> nn.Module:
    """``model`` with every embedding table stored row-wise quantized as ``dtype`` ("int8" or "int4").

    A copy unless ``inplace``; hkv tables (``hkv.DynamicEmbeddingBag``) keep their keys and store packed rows.
    Refuses (ValueError naming the table) a model in training mode or a table that
    requires grad unless ``force``; raises for tables it cannot quantize (max pooling, max_norm, an odd dim in int4).
    """
    if dtype not in QDTYPES:
        raise ValueError(f"recompile.quantize: dtype {dtype!r} is not one of {QDTYPES}")
    if model.training and not force:
        raise ValueError("recompile.quantize: the model is in training mode; quantized tables are for inference: call "
                         "model.eval() first, or pass force=True")
    model = model if inplace else copy.deepcopy(model)
    replacements = []
    for name, module in model.named_modules():
        if isinstance(module, (_Quantized, DynamicEmbeddingBag)):
            continue
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            new = _quantized(full, child, dtype, force)
            if new is not None:
                replacements.append((module, child_name, new))
    if isinstance(model, (nn.Embedding, nn.EmbeddingBag, DynamicEmbeddingBag)):
        return _convert(_quantized("", model, dtype, force), dtype)
    for parent, child_name, new in replacements:
        setattr(parent, child_name, _convert(new, dtype))
    return model
