"""The native CPU kernels of the grouped embedding ops (``csrc/embedding.h``, the C++ ops
``torch.ops.recompile_native.geb_*``).

One call covers every table of a group: the forward (SUM/MEAN pooling into the ``"concat"`` or
``"stack"`` layout, or the ``"sequence"`` rows of NONE pooling), the backward (dense table gradients,
or per-id rows for sparse tables, and per-sample weight gradients) and the fused optimizer step (ids
deduplicated per table, touched rows updated in place). Tables are read through their data pointers,
never packed. The kernels take fp32, fp16 and bf16 tables of one dtype with unit column stride (summing in fp32;
the optimizer step fp32 only): ``native_reads`` and ``step_reads`` say so at compile time, and the lowering chooses
the ATen/torch kernels (``"cpu"``, ``"reference"``) for other groups, or where the package was built without its
native kernels. Called on inputs they do not read, they raise. The kernels read the
tables through ``meta``, a table of data pointers and sizes this module writes (one row per table).
"""
from __future__ import annotations

import array
import operator
import threading
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hkv.native import NativeLibrary
from .embedding import BACKWARD_OP, NONE, OP, RAW_KERNELS, checked_lookup
from .embedding_optimizer import OPTIMIZERS, STEP_OP, adam_step_size, table_state
from .kernels import native_supports, register_kernel, require

# The columns of a table's row in the kernels' meta array, and their number (csrc/embedding.h).
W_PTR, ROWS, DIM, W_STRIDE, IDS, N_IDS, OFFS, N_OFFS, PSW, POOLING, PAD, OUT_AT, FLAGS, META = range(14)
IDS_I64, OFFS_I64, LAST_OFFSET, DTYPE_SHIFT = 1, 2, 4, 3
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernels' element types, by code
ERR_OFFSETS = 1
GRAIN = 2048
STREAM_BYTES = 4 << 20  # pooled outputs larger than this bypass the caches (non-temporal stores)
STATE_NAMES = {"exact_sgd": (), "exact_adagrad": ("sum",), "exact_rowwise_adagrad": ("sum",),
               "adam": ("exp_avg", "exp_avg_sq")}


NATIVE = NativeLibrary("recompile.runtime._C", frozenset(DTYPES))
available = NATIVE.available
ops = torch.ops.recompile_native


def _present(t: Optional[Tensor]) -> bool:
    """Per-sample weights are given (None or an empty tensor: none; a symbolic size: a real tensor)."""
    n = 0 if t is None else t.numel()
    return not isinstance(n, int) or n > 0


def native_reads(weights, per_sample_weights=(), **_) -> bool | str:
    """``supports`` of the lookup kernels: CPU tables of one of DTYPES, all alike, with unit column stride; per-sample
    weights of the tables' dtype."""
    answer = native_supports(NATIVE, weights)
    if answer is not True:
        return answer
    dtype = weights[0].dtype
    if any(w.dtype != dtype for w in weights):
        return f"tables of dtypes {sorted({str(w.dtype) for w in weights})}: the kernels take one dtype per group"
    if any(w.dim() != 2 or w.stride(1) != 1 for w in weights):
        return "a table without unit column stride"
    if any(_present(p) and p.dtype != dtype for p in per_sample_weights):
        return f"per-sample weights of another dtype than the {dtype} tables"
    return True


def step_reads(weights, **_) -> bool | str:
    """``supports`` of the optimizer step: float32 tables the lookup kernels read, each a different table (they are
    updated in parallel)."""
    answer = native_reads(weights)
    if answer is True and weights[0].dtype != torch.float32:
        answer = f"{weights[0].dtype} tables: the optimizer step takes float32"
    if answer is True and len({id(w) if is_fake(w) else w.data_ptr() for w in weights}) != len(weights):
        answer = "a table given twice: the step updates tables in parallel"
    return answer


def _reject(op: str, weights, per_sample_weights, answer: bool | str = True) -> None:
    """Raise ``UnsupportedInputs`` for inputs the kernels do not read, with ``supports``' reason where it has one."""
    if answer is True:
        answer = native_reads(weights, per_sample_weights)
    require(op, "native", "inputs the kernels do not read as given" if answer is True else answer)


def _threads(ids: int) -> int:
    """Threads for a lookup of ``ids`` rows: one per GRAIN ids (forking costs more than small lookups gain)."""
    return max(1, min(torch.get_num_threads(), ids // GRAIN))


def _int64s(values: Sequence[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _float64s(values: Sequence[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _shared(values: Sequence[int]) -> tuple[array.array, Tensor]:
    """An int64 array (cheap to write element by element from Python) and a tensor over the same memory."""
    buffer = array.array("q", values)
    return buffer, torch.frombuffer(buffer, dtype=torch.int64)


class _Plan:
    """A group's tables as the kernels read them: ``meta``'s columns that depend on the tables and the lookup's
    static arguments, written once; a call writes its ids', offsets' and sample weights' columns only."""

    __slots__ = ("meta", "meta_t", "err", "err_t", "num", "dim", "width", "layout", "pooling", "last", "dtype", "type_flags")

    def __init__(self, weights, pooling, padding_idx, include_last_offset, layout):
        self.num, self.dim, self.layout, self.dtype = len(weights), weights[0].shape[1], layout, weights[0].dtype
        self.pooling, self.last = tuple(pooling), tuple(include_last_offset)
        self.type_flags = DTYPES.index(self.dtype) << DTYPE_SHIFT
        meta, at = [], 0
        for t, (w, mode, pad) in enumerate(zip(weights, pooling, padding_idx)):
            row = [0] * META
            row[W_PTR], row[ROWS], row[DIM], row[W_STRIDE] = w.data_ptr(), w.shape[0], w.shape[1], w.stride(0)
            row[POOLING], row[PAD], row[OUT_AT] = mode, pad, t * self.dim if layout == "stack" else at
            meta += row
            at += w.shape[1]
        (self.meta, self.meta_t), (self.err, self.err_t), self.width = _shared(meta), _shared([0] * self.num), at

    def fill(self, indices, offsets, per_sample_weights) -> Optional[tuple[int, int]]:
        """Write a call's ids, offsets and sample weights into ``meta``: (output rows, ids looked up), or None where
        they are not what the kernels read as given (wrong dtypes or shapes, not contiguous, not on the CPU)."""
        meta, batch, looked_up, sequence, dtype = self.meta, None, 0, self.layout == "sequence", self.dtype
        for row, ids, offs, psw, mode, last in zip(range(0, META * self.num, META), indices, offsets,
                                                   per_sample_weights, self.pooling, self.last):
            flags = _ID_FLAGS.get(ids.dtype)
            if flags is None or not ids.is_cpu or not ids.is_contiguous():
                return None
            if offs is None:
                if ids.dim() == 2:
                    bags, length = ids.shape
                elif ids.dim() == 1 and mode == NONE:
                    bags, length = ids.shape[0], 1
                else:
                    return None
                meta[row + OFFS] = 0
                meta[row + N_OFFS] = length
            else:
                offset_flags = _OFFSET_FLAGS.get(offs.dtype)
                if offset_flags is None or ids.dim() != 1 or offs.dim() != 1 or not offs.is_cpu or not offs.is_contiguous():
                    return None
                bags = offs.shape[0]
                meta[row + OFFS] = offs.data_ptr()
                meta[row + N_OFFS] = bags
                flags |= offset_flags | LAST_OFFSET * last
                bags -= last
            if batch is None:
                batch = bags
            elif bags != batch and not sequence:
                return None
            if psw.numel():
                if psw.dtype is not dtype or psw.shape != ids.shape or not psw.is_contiguous():
                    return None
                meta[row + PSW] = psw.data_ptr()
            else:
                meta[row + PSW] = 0
            n = ids.numel()
            meta[row + IDS] = ids.data_ptr()
            meta[row + N_IDS] = n
            meta[row + FLAGS] = flags | self.type_flags
            if sequence:
                meta[row + OUT_AT] = looked_up
            looked_up += n
        if batch is None or batch < 0:
            return None
        return (looked_up if sequence else batch), looked_up

    def output(self, rows: int) -> Tensor:
        shape = {"stack": (rows, self.num, self.dim), "concat": (rows, self.width)}.get(self.layout, (rows, self.dim))
        return torch.empty(shape, dtype=self.dtype)

    def stride(self) -> int:
        return {"stack": self.num * self.dim, "concat": self.width}.get(self.layout, self.dim)


_ID_FLAGS = {torch.int64: IDS_I64, torch.int32: 0}
_OFFSET_FLAGS = {torch.int64: OFFS_I64, torch.int32: 0}
_SHAPE, _ON_CPU = operator.attrgetter("shape"), operator.attrgetter("is_cpu")
_PLANS = threading.local()  # per thread: a call writes its plan's meta
MAX_PLANS = 64


def _plan(weights, pooling, padding_idx, include_last_offset, layout) -> Optional[_Plan]:
    """The group's plan, cached by the tables' addresses, shapes, strides and dtypes and the static arguments;
    None when a table is not what the kernels read (DTYPES on the CPU, unit column stride)."""
    key = (layout, tuple(pooling), tuple(padding_idx), tuple(include_last_offset), tuple(map(Tensor.data_ptr, weights)),
           tuple(map(_SHAPE, weights)), tuple(map(Tensor.stride, weights)), tuple(map(_ON_CPU, weights)), weights[0].dtype)
    plans = _PLANS.__dict__.setdefault("plans", {})
    plan = plans.get(key, False)
    if plan is False:
        readable = all(w.dtype in DTYPES and w.dtype == weights[0].dtype and w.is_cpu and w.dim() == 2 and w.stride(1) == 1
                       for w in weights)
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[key] = _Plan(weights, pooling, padding_idx, include_last_offset, layout) if readable else None
    return plan


def _features_plan(weights, features, per_sample_weights, pooling, padding_idx, layout):
    """The plan of checked features (the backward's and the optimizer step's), filled: (plan, output rows, the
    tensors its meta points into), or None where the kernels do not read them."""
    plan = _plan(weights, pooling, padding_idx, [f.include_last_offset for f in features], layout)
    if plan is None:
        return None
    indices = [(f.ids if f.offsets is not None or (f.length == 1 and mode == NONE) else f.ids.view(f.batch, f.length))
               .contiguous() for f, mode in zip(features, pooling)]
    offsets = [None if f.offsets is None else f.offsets.contiguous() for f in features]
    psws = [_EMPTY if p is None else p.reshape(i.shape).contiguous() for p, i in zip(per_sample_weights, indices)]
    filled = plan.fill(indices, offsets, psws)
    return None if filled is None else (plan, filled[0], (indices, offsets, psws))


_EMPTY = torch.empty(0)


def _raise_marked(err: array.array, check: Callable[[], object]) -> None:
    """After a kernel marked bad ids or offsets: the Python checks raise (or warn) naming the feature."""
    if any(err):
        check()
        _reject_offsets(err, "the checks accept them")


def _reject_offsets(err: array.array, why: str) -> None:
    """The backward and the optimizer step get what the forward checked; their kernels still skip bad offsets."""
    bad = [t for t, e in enumerate(err) if e & ERR_OFFSETS]
    if bad:
        raise RuntimeError(f"recompile.grouped_embedding_bag: the native kernel rejected the offsets of tables {bad} "
                           f"({why})")


def _run_forward(plan: _Plan, rows: int, looked_up: int) -> Tensor:
    out = plan.output(rows)
    threads = _threads(looked_up)
    if plan.layout == "sequence":
        ops.geb_forward_sequence(plan.num, plan.meta_t, out, plan.dim, plan.err_t, threads)
    else:
        stream = out.numel() * out.element_size() > STREAM_BYTES
        ops.geb_forward_pooled(plan.num, plan.meta_t, rows, out, plan.stride(), plan.err_t, stream, threads)
    return out


@register_kernel(OP, "native", supports=native_reads)
def forward(weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
            bounds_check):
    """Every table in one call; the Python checks run only when the kernel marked an error or the inputs are not
    what it reads as given (then they raise, or the inputs are made so)."""
    lookup = (weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
              bounds_check)
    plan = _plan(weights, pooling, padding_idx, include_last_offset, layout)
    filled = plan.fill(indices, offsets, per_sample_weights) if plan is not None else None
    if filled is None:
        features, psws = checked_lookup(*lookup)
        found = _features_plan(weights, features, psws, pooling, padding_idx, layout)
        if found is None:
            _reject(OP, weights, per_sample_weights)
        plan, rows, alive = found  # alive: the tensors meta points into
        filled = rows, sum(f.ids.numel() for f in features)
    out = _run_forward(plan, *filled)
    _raise_marked(plan.err, lambda: checked_lookup(*lookup))
    return out


RAW_KERNELS.add("native")


def _grad_rows(grad: Tensor, weights, layout: str) -> tuple[Tensor, int]:
    """The output gradient and its row stride: read in place when each row is dense (a slice of a larger
    gradient, e.g. DLRM's ``cat([x.unsqueeze(1), grouped], 1)``), else a contiguous copy."""
    width = grad.shape[1] * (grad.shape[2] if layout == "stack" else 1)
    dense_rows = grad.stride(-1) == 1 and (layout != "stack" or grad.stride(1) == weights[0].shape[1])
    grad = grad if dense_rows and grad.stride(0) >= width else grad.contiguous()
    return grad, grad.stride(0)


@register_kernel(BACKWARD_OP, "native", supports=native_reads)
def backward(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, sparse, psw_grad):
    found = _features_plan(weights, features, per_sample_weights, pooling, padding_idx, layout)
    if found is None or grad.dtype != found[0].dtype:
        _reject(BACKWARD_OP, weights, per_sample_weights, True if found is None else f"a {grad.dtype} gradient")
    plan, rows, alive = found  # alive: the tensors meta points into
    grad, stride = _grad_rows(grad, weights, layout)
    tables = [w.new_empty((f.ids.numel(), w.shape[1]) if is_sparse else w.shape)
              for w, f, is_sparse in zip(weights, features, sparse)]
    psw_grads = [torch.empty_like(p) if want else grad.new_empty(0) for p, want in zip(per_sample_weights, psw_grad)]
    ops.geb_backward(plan.num, plan.meta_t, rows, grad, stride, _int64s([t.data_ptr() for t in tables]),
                     _int64s([not is_sparse for is_sparse in sparse]),
                     _int64s([p.data_ptr() if p.numel() else 0 for p in psw_grads]), plan.err_t)
    _reject_offsets(plan.err, "in the backward")
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


@register_kernel(STEP_OP, "native", supports=step_reads)
def optimizer_step(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params):
    found = _features_plan(weights, features, per_sample_weights, pooling, padding_idx, layout)
    answer = step_reads(weights)
    if answer is True and grad.dtype != torch.float32:
        answer = f"a {grad.dtype} gradient: the optimizer step takes float32"
    if found is None or answer is not True:
        _reject(STEP_OP, weights, per_sample_weights, answer)
    plan, rows, alive = found  # alive: the tensors meta points into
    grad, stride = _grad_rows(grad, weights, layout)
    states, step_sizes = [], []
    for w, f in zip(weights, features):
        state = table_state(w, kind)
        pointers = [state[name].data_ptr() for name in STATE_NAMES[kind]]
        states += pointers + [0] * (2 - len(pointers))
        step_sizes.append(adam_step_size(state, params) if kind == "adam" and f.ids.numel() else 0.0)
    hyper = _float64s([params["lr"], params["eps"], params["beta1"], params["beta2"]])
    # The kernel numbers the optimizers in the order of OPTIMIZERS.
    ids = [f.ids.numel() for f in features]
    sums = _scratch("sums", sum(n * w.shape[1] for n, w in zip(ids, weights)), torch.float32)
    touched = _scratch("touched", sum(ids), torch.int64)
    slots = _scratch("slots", sum(w.shape[0] for w in weights), torch.int32)  # all zero between steps
    ops.geb_optimizer_step(plan.num, plan.meta_t, rows, grad, stride, OPTIMIZERS.index(kind), hyper, _int64s(states),
                           _float64s(step_sizes), sums, touched, slots, plan.err_t)
    _reject_offsets(plan.err, "in the optimizer step")
