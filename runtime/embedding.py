"""Grouped embedding lookups: ``torch.ops.recompile.grouped_embedding_bag``.

One call looks up every feature of a group, each in its own table, with FBGEMM TBE semantics:

- ``weights[t]``: feature t's table ``[rows_t, D_t]`` (the user's parameter itself, never packed);
- ``indices[t]``: 1-D ids with ``offsets[t]`` (bag starts, or B+1 boundaries when
  ``include_last_offset[t]``), or 2-D ``[B, L]`` ids with ``offsets[t] = None`` (fixed-size bags),
  or, for NONE pooling, 1-D ids with ``offsets[t] = None``;
- ``pooling[t]``: ``SUM``, ``MEAN`` (an empty bag gives 0) or ``NONE`` (no pooling: one row per id);
- ``per_sample_weights[t]``: a weight per id (SUM only, as ``F.embedding_bag``), or an empty tensor
  for none (schemas cannot carry gradients through a list of optional tensors);
- ``padding_idx[t]``: an id excluded from its bag (and from MEAN's count), -1 for none.

The output is written in the layout its consumer wants: ``"concat"`` ``[B, sum(D)]`` (TorchRec's
KeyedTensor), ``"stack"`` ``[B, T, D]`` (an interaction's input), or ``"sequence"`` ``[sum(N_t), D]``
for NONE pooling (the ids of every feature, in order). Gradients flow to the tables (dense, or
sparse COO where ``sparse[t]``) and to the per-sample weights.

Ids are checked against their table per ``bounds_check`` (FBGEMM's BoundsCheckMode): ``"fatal"``
raises naming the feature and the id, ``"warning"`` replaces bad ids by 0 and warns, ``"ignore"``
replaces them silently. Malformed offsets (not starting at 0, decreasing, or not ending within /
at ``len(indices)``) are always rejected.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor

from .kernels import get_kernel, register_kernel

OP = "grouped_embedding_bag"
BACKWARD_OP = "grouped_embedding_bag_backward"

SUM, MEAN, NONE = 0, 1, 2
POOLING_NAMES = {"sum": SUM, "mean": MEAN, "none": NONE}
LAYOUTS = ("concat", "stack", "sequence")
BOUNDS_CHECK = ("fatal", "warning", "ignore")
INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Feature:
    """One feature's ids: flat ids, its offsets as given (None for 2-D ids) and, on demand, B+1 bag bounds."""

    __slots__ = ("ids", "offsets", "include_last_offset", "batch", "length", "_bounds", "_bags")

    def __init__(self, indices: Tensor, offsets: Optional[Tensor], include_last_offset: bool):
        self.ids, self.offsets, self.include_last_offset = indices.reshape(-1), offsets, include_last_offset
        self._bounds = self._bags = None
        if offsets is None:  # 2-D [B, L]: B bags of L ids; 1-D (NONE pooling only): a bag per id
            self.batch, self.length = indices.shape if indices.dim() == 2 else (indices.shape[0], 1)
        else:
            self.batch, self.length = offsets.shape[0] - int(include_last_offset), None

    @property
    def bounds(self) -> Tensor:
        """The B+1 bag boundaries (offsets with the last one included), in the ids' dtype."""
        if self._bounds is None:
            if self.offsets is None:
                step = self.length or 1
                self._bounds = torch.arange(0, self.batch * self.length + 1, step, device=self.ids.device)
                self._bounds = self._bounds if self.length else self.ids.new_zeros(self.batch + 1)
            elif self.include_last_offset:
                self._bounds = self.offsets
            else:
                self._bounds = torch.cat([self.offsets, self.offsets.new_full((1,), self.ids.numel())])
            self._bounds = self._bounds.to(self.ids.dtype)
        return self._bounds

    def bag_of_id(self) -> Tensor:
        if self._bags is None:
            lengths = self.bounds.diff().long()
            bags = torch.arange(self.batch, device=self.ids.device)
            self._bags = bags.repeat_interleave(lengths, output_size=self.ids.numel())
        return self._bags


def _check_empty_offsets(name: str, indices: Tensor, offsets: Optional[Tensor], include_last_offset: bool) -> None:
    """Empty offsets are no bags: they take no ids (a shape check, run before any kernel and by the fake)."""
    if offsets is not None and offsets.numel() == 0 and (include_last_offset or indices.numel()):
        raise ValueError(f"recompile.grouped_embedding_bag: feature {name!r}: offsets are empty but there are "
                         f"{indices.numel()} ids")


def _check_offsets(name: str, indices: Tensor, offsets: Tensor, include_last_offset: bool) -> None:
    n = indices.numel()
    if offsets.numel() == 0:
        return
    first, last = int(offsets[0]), int(offsets[-1])
    bad = (offsets.diff() < 0).nonzero()
    if first != 0 or bad.numel():
        at = f"offsets[0] = {first}" if first != 0 else f"offsets[{int(bad[0, 0]) + 1}] < offsets[{int(bad[0, 0])}]"
        raise ValueError(f"recompile.grouped_embedding_bag: feature {name!r}: offsets must start at 0 and not decrease ({at})")
    if (last != n) if include_last_offset else (last > n):
        rule = "end at" if include_last_offset else "not exceed"
        raise ValueError(
            f"recompile.grouped_embedding_bag: feature {name!r}: offsets must {rule} len(indices) = {n}, last offset is {last}"
        )


def checked_ids(name: str, ids: Tensor, rows: int, mode: str) -> Tensor:
    """``ids`` with out-of-range entries handled per ``mode`` (see the module docstring)."""
    if ids.numel() == 0:
        return ids
    bad = (ids < 0) | (ids >= rows)
    if not bool(bad.any()):
        return ids
    first = int(ids[bad][0])
    message = f"feature {name!r}: id {first} is out of range for its table of {rows} rows ({int(bad.sum())} bad ids)"
    if mode == "fatal":
        raise IndexError(f"recompile.grouped_embedding_bag: {message}")
    if mode == "warning":
        warnings.warn(f"recompile.grouped_embedding_bag: {message}; they are replaced by id 0", stacklevel=3)
    return ids.masked_fill(bad, 0)


def feature_names(names: str, num: int) -> list[str]:
    """The ops take the features' names as one comma-separated string (schemas have no str[])."""
    split = names.split(",")
    if len(split) != num:
        raise ValueError(f"recompile.grouped_embedding_bag: {len(split)} feature names {names!r} for {num} tables")
    return split


def present(per_sample_weights: Sequence[Tensor]) -> list[Optional[Tensor]]:
    """The per-sample weights with "none" (an empty tensor) as None."""
    return [p if p.numel() else None for p in per_sample_weights]


def _validate(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names, bounds_check):
    num = len(weights)
    lists = dict(indices=indices, offsets=offsets, per_sample_weights=per_sample_weights, pooling=pooling,
                 padding_idx=padding_idx, include_last_offset=include_last_offset, names=names)
    for key, value in lists.items():
        if len(value) != num:
            raise ValueError(f"recompile.grouped_embedding_bag: {key} has {len(value)} entries for {num} tables")
    if layout not in LAYOUTS:
        raise ValueError(f"recompile.grouped_embedding_bag: layout {layout!r} is not one of {LAYOUTS}")
    if bounds_check not in BOUNDS_CHECK:
        raise ValueError(f"recompile.grouped_embedding_bag: bounds_check {bounds_check!r} is not one of {BOUNDS_CHECK}")
    if num == 0:
        raise ValueError("recompile.grouped_embedding_bag: no tables")
    for t in range(num):
        w, ids, offs, name = weights[t], indices[t], offsets[t], names[t]
        where = f"recompile.grouped_embedding_bag: feature {name!r}"
        if w.dim() != 2 or w.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"{where}: table must be 2-D float32/float16/bfloat16, got {tuple(w.shape)} {w.dtype}")
        if w.dtype != weights[0].dtype:
            raise ValueError(f"{where}: table dtype {w.dtype} differs from the group's {weights[0].dtype}")
        if ids.dtype not in INDEX_DTYPES or (offs is not None and offs.dtype not in INDEX_DTYPES):
            raise ValueError(f"{where}: indices and offsets must be int32 or int64")
        plain = offs is None and ids.dim() == 1 and pooling[t] == NONE  # unpooled ids, one row each
        if not plain and (ids.dim() != (2 if offs is None else 1) or (offs is not None and offs.dim() != 1)):
            raise ValueError(f"{where}: indices must be 1-D with 1-D offsets, or 2-D without offsets; got {ids.dim()}-D")
        if pooling[t] not in (SUM, MEAN, NONE):
            raise ValueError(f"{where}: pooling {pooling[t]} is not SUM (0), MEAN (1) or NONE (2)")
        if (pooling[t] == NONE) != (layout == "sequence"):
            raise ValueError(f"{where}: pooling NONE goes with layout 'sequence' only, and only it")
        _check_empty_offsets(name, ids, offs, include_last_offset[t])
        psw = per_sample_weights[t]
        if psw is not None and (pooling[t] != SUM or psw.shape != ids.shape):
            raise ValueError(f"{where}: per_sample_weights need pooling SUM and the shape of indices {tuple(ids.shape)}")
        if layout != "concat" and w.shape[1] != weights[0].shape[1]:
            raise ValueError(f"{where}: layout {layout!r} needs one dim for all tables, got {w.shape[1]} and {weights[0].shape[1]}")


def _offsets_ok(features: Sequence[Feature]) -> bool:
    """Every feature's offsets well formed, checked for all at once (one sync): each starts at 0, never
    decreases, and ends within (``include_last_offset``: at) its ids."""
    given = [f for f in features if f.offsets is not None and f.offsets.numel()]
    if any(f.batch < 0 for f in features) or any(f.offsets is not None and f.offsets.numel() == 0 and f.ids.numel()
                                                 for f in features):
        return False
    if not given:
        return True
    offsets = torch.cat([f.offsets for f in given])
    sizes = [f.offsets.shape[0] for f in given]
    lasts = list(itertools.accumulate(sizes, initial=-1))[1:]
    firsts = [last - size + 1 for last, size in zip(lasts, sizes)]
    steps = offsets.diff()
    steps[lasts[:-1]] = 0  # across two features' offsets
    ends, counts = offsets[lasts], torch.tensor([f.ids.numel() for f in given], device=offsets.device)
    exact = torch.tensor([f.include_last_offset for f in given], device=offsets.device)
    ok = (offsets[firsts] == 0).all() & (steps >= 0).all() & (ends <= counts).all() & ((ends == counts) | ~exact).all()
    return bool(ok)


def _ids_in_range(features: Sequence[Feature], weights: Sequence[Tensor]) -> bool:
    """Every id within its table, for all features at once (one sync)."""
    looked_up = [(f.ids, w.shape[0]) for f, w in zip(features, weights) if f.ids.numel()]
    if not looked_up:
        return True
    lows, highs = zip(*(torch.aminmax(ids) for ids, _ in looked_up))
    rows = torch.tensor([rows for _, rows in looked_up], device=lows[0].device)
    return bool((torch.stack(lows) >= 0).all() & (torch.stack(highs) < rows).all())


def raw_features(indices, offsets, include_last_offset) -> list[Feature]:
    """Every feature as given, unchecked."""
    return [Feature(*args) for args in zip(indices, offsets, include_last_offset)]


def check_batches(features: Sequence[Feature], layout: str) -> None:
    batch = {f.batch for f in features}
    if len(batch) > 1 and layout != "sequence":
        raise ValueError(f"recompile.grouped_embedding_bag: features have different batch sizes {sorted(batch)}")


def features_of(weights, indices, offsets, include_last_offset, names, layout, bounds_check, check=True) -> list[Feature]:
    """Every feature with its offsets and ids checked; all features at once, per feature only to report.

    ``check=False`` (the backward, whose forward checked the same tensors) only repeats the id fix-up
    of ``"warning"``/``"ignore"``, silently.
    """
    features = raw_features(indices, offsets, include_last_offset)
    if not check:
        if bounds_check != "fatal":
            for f, w in zip(features, weights):
                f.ids = table_ids(f.ids, w.shape[0], bounds_check)
        return features
    check_batches(features, layout)
    if not _offsets_ok(features):
        for f, ids, offs, ilo, name in zip(features, indices, offsets, include_last_offset, names):
            if offs is not None:
                _check_offsets(name, ids, offs, ilo)
    if not _ids_in_range(features, weights):
        for f, w, name in zip(features, weights, names):
            f.ids = checked_ids(name, f.ids, w.shape[0], bounds_check)
    return features


def _assemble(outs: Sequence[Tensor], layout: str) -> Tensor:
    if layout == "stack":
        return torch.stack(list(outs), dim=1)
    return torch.cat(list(outs), dim=0 if layout == "sequence" else 1)


def output_slices(out: Tensor, dims: Sequence[int], counts: Sequence[int], layout: str) -> list[Tensor]:
    """Feature t's part of a grouped output (or of its gradient)."""
    parts, start = [], 0
    for t, (d, n) in enumerate(zip(dims, counts)):
        if layout == "stack":
            parts.append(out[:, t])
        elif layout == "sequence":
            parts.append(out[start:start + n])
        else:
            parts.append(out[:, start:start + d])
        start += n if layout == "sequence" else d
    return parts


# ---------------------------------------------------------------------------------------------
# Kernels. Forward: (weights, features, per_sample_weights, pooling, padding_idx, layout) -> output;
# a kernel in RAW_KERNELS gets the op's own arguments instead (weights, indices, offsets, per_sample_weights
# (empty: none), pooling, padding_idx, include_last_offset, layout, names, bounds_check): it checks what it reads
# itself, reads no row outside its table, and runs ``checked_lookup`` (the checks above: they raise or warn) when
# it met a bad id, bad offsets or inputs it does not take as given.
# Backward: (grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad)
#   -> per table its dense gradient [rows_t, D_t], or where sparse[t] the gradient of every id's row
#   ([N_t, D_t], zero for padding ids); then, where psw_grad[t], the gradient of its per-sample weights.
RAW_KERNELS: set[str] = set()


def _id_scale(f: Feature, psw: Optional[Tensor], pooling: int, padding_idx: int) -> Optional[Tensor]:
    """Each id's factor in its bag's pooled row: padding -> 0, times its sample weight, over the bag's count for MEAN.

    None when every factor is 1 (SUM or NONE, no weights, no padding).
    """
    if pooling != MEAN and psw is None and padding_idx < 0:
        return None
    keep = (f.ids != padding_idx).float() if padding_idx >= 0 else torch.ones(f.ids.numel(), device=f.ids.device)
    scale = keep if psw is None else keep * psw.reshape(-1).float()
    if pooling == MEAN:
        count = torch.zeros(f.batch, device=keep.device).index_add_(0, f.bag_of_id(), keep)
        scale = scale / count.clamp(min=1).index_select(0, f.bag_of_id())
    return scale


def _scaled(rows: Tensor, scale: Optional[Tensor]) -> Tensor:
    return rows if scale is None else rows * scale[:, None]


def _pool_reference(w: Tensor, f: Feature, psw: Optional[Tensor], pooling: int, padding_idx: int) -> Tensor:
    rows = w.index_select(0, f.ids)
    if pooling == NONE:
        return rows
    weighted = _scaled(rows.float(), _id_scale(f, psw, pooling, padding_idx))
    return weighted.new_zeros(f.batch, w.shape[1]).index_add_(0, f.bag_of_id(), weighted).to(w.dtype)


@register_kernel(OP, "reference")
def _forward_reference(weights, features, per_sample_weights, pooling, padding_idx, layout):
    outs = [_pool_reference(*args) for args in zip(weights, features, per_sample_weights, pooling, padding_idx)]
    return _assemble(outs, layout)


@register_kernel(OP, "cpu")
def forward_cpu(weights, features, per_sample_weights, pooling, padding_idx, layout):
    """ATen's embedding_bag per table (FBGEMM's EmbeddingSpMDM inside), the forward-only variant: the
    backward needs none of its bag bookkeeping."""
    outs = []
    for w, f, psw, mode, pad in zip(weights, features, per_sample_weights, pooling, padding_idx):
        if mode == NONE:
            outs.append(w.index_select(0, f.ids))
            continue
        psw = None if psw is None else psw.reshape(-1)
        offsets, last = (f.offsets, f.include_last_offset) if f.offsets is not None else (f.bounds, True)
        outs.append(torch.ops.aten._embedding_bag_forward_only(w, f.ids, offsets, False, mode, False, psw, last, pad)[0])
    return _assemble(outs, layout)


@register_kernel(OP, "triton")
def _forward_triton(*lookup):
    """Every table in one launch; ids and offsets checked in the kernel and reported after (see the module)."""
    from .triton_kernels.embedding import grouped_embedding_bag_forward

    return grouped_embedding_bag_forward(*lookup)


RAW_KERNELS.add("triton")


def id_gradients(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, psw_grad):
    """The gradient of every id's row, then of every per-sample weight (empty where not wanted)."""
    parts = output_slices(grad, [w.shape[1] for w in weights], [f.ids.numel() for f in features], layout)
    id_grads, psw_grads = [], []
    for g, w, f, psw, mode, pad, want in zip(parts, weights, features, per_sample_weights, pooling, padding_idx, psw_grad):
        rows = g.to(torch.float32, copy=True) if mode == NONE else g.float().index_select(0, f.bag_of_id())  # per id
        id_grads.append(_scaled(rows, _id_scale(f, psw, mode, pad)).to(w.dtype))
        if not want:
            psw_grads.append(g.new_empty(0))
            continue
        dots = (rows * w.index_select(0, f.ids).float()).sum(1)
        keep = f.ids != pad if pad >= 0 else torch.ones_like(dots, dtype=torch.bool)
        psw_grads.append((dots * keep).reshape(psw.shape).to(psw.dtype))
    return id_grads + psw_grads


def table_gradients(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad):
    """The backward in torch: per-id gradients, summed into dense table gradients where not ``sparse``."""
    grads = id_gradients(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, psw_grad)
    tables = [g if is_sparse else torch.zeros_like(w).index_add_(0, f.ids, g)
              for w, f, g, is_sparse in zip(weights, features, grads, sparse)]
    return tables + grads[len(weights):]


# The per-id gradient is a gather and a scale, which ATen already vectorises: it is the CPU kernel too.
register_kernel(BACKWARD_OP, "reference")(table_gradients)
register_kernel(BACKWARD_OP, "cpu")(table_gradients)


@register_kernel(BACKWARD_OP, "triton")
def _backward_triton(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad):
    """Dense table gradients in one launch; sparse tables and sample-weight gradients in torch."""
    if any(sparse) or any(psw_grad):
        return table_gradients(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse,
                               psw_grad)
    from .triton_kernels.embedding import grouped_embedding_bag_backward

    tables = grouped_embedding_bag_backward(grad, weights, features, per_sample_weights, pooling, padding_idx, layout)
    return tables + [grad.new_empty(0) for _ in weights]


def grouped_embedding_bag_reference(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                    include_last_offset, layout, names, bounds_check="fatal") -> Tensor:
    """The whole op in plain torch (the oracle for tests)."""
    _validate(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names, bounds_check)
    features = features_of(weights, indices, offsets, include_last_offset, names, layout, bounds_check)
    return _forward_reference(weights, features, per_sample_weights, pooling, padding_idx, layout)


# ---------------------------------------------------------------------------------------------
# The ops.


def checked_lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout,
                   names, bounds_check) -> tuple[list[Feature], list[Optional[Tensor]]]:
    """The op's arguments checked (raising or warning naming the feature): its features and per-sample weights."""
    names, per_sample_weights = feature_names(names, len(weights)), present(per_sample_weights)
    _validate(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names, bounds_check)
    return features_of(weights, indices, offsets, include_last_offset, names, layout, bounds_check), per_sample_weights


def _lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
            bounds_check, impl) -> Tensor:
    kernel = get_kernel(OP, impl)
    if impl in RAW_KERNELS:  # the checks every kernel must agree on that a raw kernel would not make itself
        for args in zip(feature_names(names, len(weights)), indices, offsets, include_last_offset):
            _check_empty_offsets(*args)
        return kernel(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout,
                      names, bounds_check)
    features, per_sample_weights = checked_lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                                  include_last_offset, layout, names, bounds_check)
    return kernel(weights, features, per_sample_weights, pooling, padding_idx, layout)


def _lookup_fake(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
                 bounds_check) -> Tensor:
    names, per_sample_weights = feature_names(names, len(weights)), present(per_sample_weights)
    _validate(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names, bounds_check)
    w = weights[0]
    if layout == "sequence":
        return w.new_empty(sum(ids.numel() for ids in indices), w.shape[1])
    ids, offs, last = indices[0], offsets[0], include_last_offset[0]
    batch = ids.shape[0] if offs is None else offs.shape[0] - int(last)
    if layout == "stack":
        return w.new_empty(batch, len(weights), w.shape[1])
    return w.new_empty(batch, sum(x.shape[1] for x in weights))


# The arguments every op of the family takes to describe the lookups (their schema, then their names).
LOOKUP_SCHEMA = ("Tensor[] weights, Tensor[] indices, Tensor?[] offsets, Tensor[] per_sample_weights, int[] pooling, "
                 "int[] padding_idx, bool[] include_last_offset")


@torch.library.custom_op(
    "recompile::grouped_embedding_bag", mutates_args=(),
    schema=f"({LOOKUP_SCHEMA}, bool[] sparse, str layout, str names, str bounds_check, str impl) -> Tensor",
)
def grouped_embedding_bag(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, sparse,
                          layout, names, bounds_check, impl) -> Tensor:
    return _lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
                   bounds_check, impl)


@grouped_embedding_bag.register_fake
def _(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, sparse, layout, names,
      bounds_check, impl):
    return _lookup_fake(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout,
                        names, bounds_check)


@torch.library.custom_op(
    "recompile::grouped_embedding_bag_fused", mutates_args=(),
    schema=f"(Tensor trigger, {LOOKUP_SCHEMA}, str layout, str names, str bounds_check, str optimizer, "
           "str optimizer_impl, str impl) -> Tensor",
)
def grouped_embedding_bag_fused(trigger, weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                include_last_offset, layout, names, bounds_check, optimizer, optimizer_impl, impl) -> Tensor:
    """grouped_embedding_bag whose backward runs ``optimizer`` on the touched rows instead of returning table gradients
    (``recompile.embedding_optimizer_step`` with kernel ``optimizer_impl``).

    ``trigger`` is a scalar that requires grad: its gradient is the optimizer step's result, which keeps the
    step in the backward graph. The tables get no ``.grad``.
    """
    return _lookup(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
                   bounds_check, impl)


@grouped_embedding_bag_fused.register_fake
def _(trigger, weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
      bounds_check, optimizer, optimizer_impl, impl):
    return _lookup_fake(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout,
                        names, bounds_check)


@torch.library.custom_op(
    "recompile::grouped_embedding_bag_backward", mutates_args=(),
    schema=f"(Tensor grad, {LOOKUP_SCHEMA}, bool[] sparse, bool[] psw_grad, str layout, str names, str bounds_check, "
           "str impl) -> Tensor[]",
)
def grouped_embedding_bag_backward(grad, weights, indices, offsets, per_sample_weights, pooling, padding_idx,
                                   include_last_offset, sparse, psw_grad, layout, names, bounds_check, impl) -> list[Tensor]:
    """Per table its dense gradient, or where ``sparse`` the gradient of every id's row; then the gradient of every
    per-sample weight (empty where not wanted)."""
    names, per_sample_weights = feature_names(names, len(weights)), present(per_sample_weights)
    features = features_of(weights, indices, offsets, include_last_offset, names, layout, bounds_check, check=False)
    return get_kernel(BACKWARD_OP, impl)(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse,
                                         psw_grad)


@grouped_embedding_bag_backward.register_fake
def _(grad, weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, sparse, psw_grad,
      layout, names, bounds_check, impl):
    table_grads = [w.new_empty((ids.numel(), w.shape[1]) if is_sparse else w.shape)
                   for w, ids, is_sparse in zip(weights, indices, sparse)]
    psw_grads = [psw.new_empty(psw.shape if want else 0) for psw, want in zip(per_sample_weights, psw_grad)]
    return table_grads + psw_grads


def table_ids(indices: Tensor, rows: int, bounds_check: str) -> Tensor:
    """The flat ids the forward looked up (bad ids replaced by 0 unless fatal): traceable, no sync."""
    ids = indices.reshape(-1)
    return ids if bounds_check == "fatal" else ids.masked_fill((ids < 0) | (ids >= rows), 0)


def _is_tensor_list(x) -> bool:
    """Autograd of custom ops wants a list of gradients for a list of tensors, one None otherwise."""
    return isinstance(x, list) and all(isinstance(v, Tensor) for v in x)


def _setup_context(ctx, inputs, output):
    fused = isinstance(inputs[0], Tensor)  # grouped_embedding_bag_fused: (trigger, weights, ...)
    ctx.tensor_lists = [_is_tensor_list(x) and len(x) for x in inputs]
    if fused:
        (_, weights, indices, offsets, psw, pooling, padding_idx, ilo, layout, names, bounds_check, optimizer, optimizer_impl,
         impl) = inputs
        sparse = [False] * len(weights)
    else:
        weights, indices, offsets, psw, pooling, padding_idx, ilo, sparse, layout, names, bounds_check, impl = inputs
        optimizer = optimizer_impl = None
    ctx.save_for_backward(*weights, *indices, *offsets, *psw)
    ctx.num, ctx.fused = len(weights), fused
    ctx.args = (pooling, padding_idx, ilo, sparse, layout, names, bounds_check, optimizer, optimizer_impl, impl)


def _backward(ctx, grad):
    num, first = ctx.num, int(ctx.fused)
    saved = ctx.saved_tensors
    weights, indices, offsets, psw = (list(saved[i * num:(i + 1) * num]) for i in range(4))
    pooling, padding_idx, ilo, sparse, layout, names, bounds_check, optimizer, optimizer_impl, impl = ctx.args
    psw_needs = ctx.needs_input_grad[first + 3]
    psw_grad = [bool(p.numel()) and want for p, want in zip(psw, psw_needs)]
    lookup = weights, indices, offsets, psw, pooling, padding_idx, ilo  # grad as it comes: kernels read strided rows
    grads_in = [[None] * n if n is not False else None for n in ctx.tensor_lists]
    grads = [None] * (2 * num)
    if not ctx.fused or any(psw_grad):
        sparse = [True] * num if ctx.fused else sparse  # fused: only the sample weights' gradients are kept
        grads = torch.ops.recompile.grouped_embedding_bag_backward(grad, *lookup, sparse, psw_grad, layout, names,
                                                                   bounds_check, impl)
    if ctx.fused:
        grads_in[0] = torch.ops.recompile.embedding_optimizer_step(
            grad, *lookup, layout, names, bounds_check, optimizer, optimizer_impl
        )
    else:
        grads_in[0] = [  # the ids were checked by the forward
            torch.sparse_coo_tensor(table_ids(i, w.shape[0], bounds_check)[None], g, w.shape, check_invariants=False)
            if is_sparse else g
            for w, i, g, is_sparse in zip(weights, indices, grads[:num], sparse)
        ]
    # An empty tensor is "no weights" to the op, but a weight tensor over no ids still gets its (empty) gradient.
    grads_in[first + 3] = [g if want else (torch.zeros_like(p) if asked else None)
                           for g, want, p, asked in zip(grads[num:], psw_grad, psw, psw_needs)]
    return tuple(grads_in)


grouped_embedding_bag.register_autograd(_backward, setup_context=_setup_context)
grouped_embedding_bag_fused.register_autograd(_backward, setup_context=_setup_context)
