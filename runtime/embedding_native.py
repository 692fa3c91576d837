"""The native CPU kernels of the grouped embedding ops (``csrc/embedding.c``), called through ctypes.

One call covers every table of a group: the forward (SUM/MEAN pooling into the ``"concat"`` or
``"stack"`` layout, or the ``"sequence"`` rows of NONE pooling), the backward (dense table gradients,
or per-id rows for sparse tables, and per-sample weight gradients) and the fused optimizer step (ids
deduplicated per table, touched rows updated in place). Tables are read through their data pointers,
never packed. The kernels take fp32 tables with unit column stride; other groups run the ATen/torch
kernels (``"cpu"``, ``"reference"``). Without a C compiler the kernels are unavailable and the
lowering keeps the other kernels.
"""
from __future__ import annotations

import array
import ctypes
import os
import threading
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from hkv.native import i32, i64, load, ptr
from runtime.embedding import BACKWARD_OP, OP, SELF_CHECKING, Feature, forward_cpu, table_gradients
from runtime.embedding_optimizer import OPTIMIZERS, STEP_OP, adam_step_size, step_each_table, table_state
from runtime.kernels import register_kernel

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "embedding.c")
SIGNATURES = (
    ("geb_forward_pooled", (i64, ptr, i64, ptr, i64, ptr, i32, i32)),
    ("geb_forward_sequence", (i64, ptr, ptr, i64, ptr, i32)),
    ("geb_backward", (i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i32)),
    ("geb_optimizer_step", (i64, ptr, i64, ptr, i64, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32)),
)
META = 13  # columns of a table's row in the kernels' meta array (csrc/embedding.c)
IDS_I64, OFFS_I64, LAST_OFFSET = 1, 2, 4
ERR_OFFSETS = 1
GRAIN = 32768
STREAM_BYTES = 4 << 20  # pooled outputs larger than this bypass the caches (non-temporal stores)
STATE_NAMES = {"exact_sgd": (), "exact_adagrad": ("sum",), "exact_rowwise_adagrad": ("sum",),
               "adam": ("exp_avg", "exp_avg_sq")}


def library() -> Optional[ctypes.CDLL]:
    return load(SOURCE, SIGNATURES)


def available() -> bool:
    return library() is not None


def _threads(ids: int) -> int:
    """Threads for a lookup of ``ids`` rows: one per GRAIN ids (forking costs more than small lookups gain)."""
    return max(1, min(torch.get_num_threads(), ids // GRAIN))


class _Buffer(array.array):
    """A flat array of numbers that ctypes passes by address (much cheaper to fill than a ctypes array)."""

    @property
    def _as_parameter_(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.buffer_info()[0])


def _int64s(values: Sequence[int]) -> _Buffer:
    return _Buffer("q", values)


def _float64s(values: Sequence[float]) -> _Buffer:
    return _Buffer("d", values)


def _group(weights, features, per_sample_weights, pooling, padding_idx, layout):
    """(meta, kept, output rows, output row stride, ids looked up); ``kept`` holds the tensors ``meta`` points into.
    None when a table (or its sample weights) is not what the kernels read: fp32 on the CPU, unit column stride."""
    meta, kept, at, looked_up = [], [], 0, 0
    dim = weights[0].shape[1]
    for t, (w, f, psw, mode, pad) in enumerate(zip(weights, features, per_sample_weights, pooling, padding_idx)):
        if w.dtype != torch.float32 or not w.is_cpu or w.stride(1) != 1 or (psw is not None and psw.dtype != torch.float32):
            return None
        ids, offs = f.ids.contiguous(), f.offsets
        n = ids.numel()
        psw = None if psw is None else psw.reshape(-1).contiguous()
        kept += (ids, psw)
        if offs is None:
            offs_ptr, bags, flags = 0, f.length, 0
        else:
            offs = offs.contiguous()
            kept.append(offs)
            offs_ptr, bags, flags = offs.data_ptr(), offs.shape[0], OFFS_I64 * (offs.dtype == torch.int64)
        flags |= IDS_I64 * (ids.dtype == torch.int64) | LAST_OFFSET * f.include_last_offset
        meta += (w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), ids.data_ptr(), n,
                 offs_ptr, bags, 0 if psw is None else psw.data_ptr(), mode, pad, t * dim if layout == "stack" else at,
                 flags)
        at += n if layout == "sequence" else w.shape[1]
        looked_up += n
    rows = at if layout == "sequence" else features[0].batch
    stride = dim if layout == "sequence" else (len(weights) * dim if layout == "stack" else at)
    return _int64s(meta), kept, rows, stride, looked_up


def _output(weights, rows: int, stride: int, layout: str) -> Tensor:
    shape = (rows, len(weights), weights[0].shape[1]) if layout == "stack" else (rows, stride)
    return weights[0].new_empty(shape)


def _raise_marked(err: _Buffer, verify: Callable[[], list[Feature]]) -> None:
    """After a kernel marked bad ids or offsets: the Python checks raise (or warn) naming the feature."""
    if any(err):
        verify()
        _reject_offsets(err, "the checks accept them")


def _reject_offsets(err: _Buffer, why: str) -> None:
    """The backward and the optimizer step get what the forward checked; their kernels still skip bad offsets."""
    bad = [t for t, e in enumerate(err) if e & ERR_OFFSETS]
    if bad:
        raise RuntimeError(f"recompile.grouped_embedding_bag: the native kernel rejected the offsets of tables {bad} "
                           f"({why})")


@register_kernel(OP, "native")
def forward(weights, features, per_sample_weights, pooling, padding_idx, layout, verify):
    group = _group(weights, features, per_sample_weights, pooling, padding_idx, layout)
    if group is None or features[0].batch < 0:  # batch < 0: include_last_offset without offsets
        return forward_cpu(weights, verify(), per_sample_weights, pooling, padding_idx, layout)
    meta, kept, rows, stride, looked_up = group
    out = _output(weights, rows, stride, layout)
    err = _int64s([0] * len(weights))
    threads = _threads(looked_up)
    if layout == "sequence":
        library().geb_forward_sequence(len(weights), meta, out.data_ptr(), stride, err, threads)
    else:
        stream = out.numel() * out.element_size() > STREAM_BYTES
        library().geb_forward_pooled(len(weights), meta, rows, out.data_ptr(), stride, err, stream, threads)
    _raise_marked(err, verify)
    return out


SELF_CHECKING.add("native")


def _grad_rows(grad: Tensor, weights, layout: str) -> tuple[Tensor, int]:
    """The output gradient and its row stride: read in place when each row is dense (a slice of a larger
    gradient, e.g. DLRM's ``cat([x.unsqueeze(1), grouped], 1)``), else a contiguous copy."""
    width = grad.shape[1] * (grad.shape[2] if layout == "stack" else 1)
    dense_rows = grad.stride(-1) == 1 and (layout != "stack" or grad.stride(1) == weights[0].shape[1])
    grad = grad if dense_rows and grad.stride(0) >= width else grad.contiguous()
    return grad, grad.stride(0)


@register_kernel(BACKWARD_OP, "native")
def backward(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad):
    group = _group(weights, features, per_sample_weights, pooling, padding_idx, layout)
    if group is None or grad.dtype != torch.float32:
        return table_gradients(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad)
    meta, kept, rows, _, _ = group
    grad, stride = _grad_rows(grad, weights, layout)
    tables = [w.new_empty((f.ids.numel(), w.shape[1]) if is_sparse else w.shape)
              for w, f, is_sparse in zip(weights, features, sparse)]
    psw_grads = [torch.empty_like(p) if want else grad.new_empty(0) for p, want in zip(per_sample_weights, psw_grad)]
    err = _int64s([0] * len(weights))
    library().geb_backward(len(weights), meta, rows, grad.data_ptr(), stride, _int64s([t.data_ptr() for t in tables]),
                           _int64s([not is_sparse for is_sparse in sparse]),
                           _int64s([p.data_ptr() if p.numel() else 0 for p in psw_grads]), err, torch.get_num_threads())
    _reject_offsets(err, "in the backward")
    return tables + psw_grads


_SCRATCH = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> Tensor:
    """A zeroed buffer of at least ``numel`` elements kept across optimizer steps (per thread: kernels run without
    the GIL): fresh memory of that size would be faulted in page by page on every step. The kernel leaves "slots"
    zero again; the other buffers it overwrites before reading."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[name] = torch.zeros(max(numel, 1), dtype=dtype)
    return buffer


@register_kernel(STEP_OP, "native")
def optimizer_step(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params):
    distinct = len({w.data_ptr() for w in weights}) == len(weights)  # the kernel updates tables in parallel
    group = _group(weights, features, per_sample_weights, pooling, padding_idx, layout)
    if group is None or grad.dtype != torch.float32 or not distinct:
        return step_each_table(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params,
                               fbgemm=False)
    meta, kept, rows, _, _ = group
    grad, stride = _grad_rows(grad, weights, layout)
    states, step_sizes = [], []
    for w, f in zip(weights, features):
        state = table_state(w, kind)
        pointers = [state[name].data_ptr() for name in STATE_NAMES[kind]]
        states += pointers + [0] * (2 - len(pointers))
        step_sizes.append(adam_step_size(state, params) if kind == "adam" and f.ids.numel() else 0.0)
    hyper = _float64s([params["lr"], params["eps"], params["beta1"], params["beta2"]])
    # The kernel numbers the optimizers in the order of OPTIMIZERS.
    err = _int64s([0] * len(weights))
    ids = [f.ids.numel() for f in features]
    sums = _scratch("sums", sum(n * w.shape[1] for n, w in zip(ids, weights)), torch.float32)
    touched = _scratch("touched", sum(ids), torch.int64)
    slots = _scratch("slots", sum(w.shape[0] for w in weights), torch.int32)  # all zero between steps
    library().geb_optimizer_step(len(weights), meta, rows, grad.data_ptr(), stride, OPTIMIZERS.index(kind), hyper,
                                 _int64s(states), _float64s(step_sizes), sums.data_ptr(), touched.data_ptr(),
                                 slots.data_ptr(), err, torch.get_num_threads())
    _reject_offsets(err, "in the optimizer step")
