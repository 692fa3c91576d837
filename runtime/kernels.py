"""The kernels of every custom op, keyed by the op and the kernel's name, each with what it supports.

``KERNELS["recompile::dot_interaction"]["native"]`` is a callable; a name without a namespace is a ``recompile::``
op (``KERNELS["dot_interaction"]`` is the same table). ``recompile.lowering`` orders an op's kernels per target
and, at compile time, asks each kernel's ``supports`` about the op's fake arguments: the first kernel the target
runs that supports them is recorded in the graph (the op's ``impl`` argument) and in the report. The kernel then
runs on those inputs and nothing else: a kernel called on inputs it does not support raises ``UnsupportedInputs``
naming the op and the reason; it never hands the call to another kernel.

Names in use:

- ``reference``: plain torch, the oracle for tests; runs on every device.
- ``cpu``: our CPU kernel in torch (ATen ops arranged for the op).
- ``native``: our C++ CPU operator (``runtime/csrc``, ``torch.ops.recompile_native.*``).
- ``fbgemm``: the library op (``torch.ops.fbgemm.*`` from fbgemm-gpu, fbgemm-gpu-cpu or fbgemm-ascend).
- ``triton``: a Triton kernel (CUDA through triton, Ascend through triton-ascend; tested on CPU
  under ``TRITON_INTERPRET=1``).

A backward op (``<op>_backward``) has a kernel of each name its forward has: the forward's choice, made on the
forward's inputs, is the backward's, and ``supports`` of a forward kernel answers for its backward too.

``supports(**arguments)`` takes the op's arguments by their schema names (fake tensors at compile time, real ones
at run time; a predicate names the ones it reads and takes ``**_`` for the rest) and returns True, or a string
saying why not ("float64 tables: the kernels take float32, float16, bfloat16").
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Union

import torch

Supported = Union[bool, str]  # True, or why the kernel does not support the inputs


class UnsupportedInputs(ValueError):
    """A kernel was called on inputs its ``supports`` rejects (the lowering chooses among those that accept)."""


def qualified(op: str) -> str:
    """"namespace::name" of ``op``; a bare name is a ``recompile::`` op."""
    return op if "::" in op else f"recompile::{op}"


class _ByOp(dict):
    """A dict keyed by "namespace::name" that also answers to a ``recompile::`` op's bare name."""

    def __missing__(self, op: str):
        if "::" in op:
            raise KeyError(op)
        return self[qualified(op)]

    def __contains__(self, op: object) -> bool:
        return dict.__contains__(self, qualified(op) if isinstance(op, str) else op)


KERNELS: dict[str, dict[str, Callable]] = _ByOp()
SUPPORTS: dict[str, dict[str, Callable[..., Supported]]] = _ByOp()


def supports_anything(**_) -> Supported:
    return True


def register_kernel(op: str, impl: str, supports: Callable[..., Supported] = supports_anything
                    ) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as kernel ``impl`` of ``op`` ("namespace::name", or a ``recompile::`` op's bare
    name), running on the inputs ``supports`` accepts."""

    def wrap(fn: Callable) -> Callable:
        table = KERNELS.setdefault(qualified(op), {})
        if impl in table:
            raise ValueError(f"kernel {impl!r} of op {op!r} is registered twice")
        table[impl] = fn
        SUPPORTS.setdefault(qualified(op), {})[impl] = supports
        return fn

    return wrap


def get_kernel(op: str, impl: str) -> Callable:
    table = KERNELS.get(qualified(op))
    if table is None:
        raise KeyError(f"op {op!r} has no kernels; known ops: {sorted(KERNELS)}")
    try:
        return table[impl]
    except KeyError:
        raise ValueError(f"op {op!r} has no kernel {impl!r}; it has {sorted(table)}") from None


def why_not(op: str, impl: str, /, **arguments: Any) -> str | None:
    """None when kernel ``impl`` of ``op`` supports ``arguments`` (the op's, by name), else the reason."""
    answer = SUPPORTS[qualified(op)].get(impl, supports_anything)(**arguments)
    if answer is True:
        return None
    return answer or "its supports() is False"


def require(op: str, impl: str, answer: Supported) -> None:
    """Raise ``UnsupportedInputs`` unless ``answer`` (a ``supports`` result on the inputs of this call) is True."""
    if answer is not True:
        raise UnsupportedInputs(f"{qualified(op)}: kernel {impl!r} does not support these inputs "
                                f"({answer or 'its supports() is False'}); it runs only where the lowering chose it")


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += _tensors(v)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def native_supports(library, *tensors: Any) -> Supported:
    """Whether the C++ operators of ``library`` (a ``hkv.native.NativeLibrary``) read ``tensors`` (tensors, lists
    of them, None): the library is built, and every tensor is on the CPU, of a dtype its kernels are built for."""
    if not library.available():
        return f"{library.module} is not built"
    for t in _tensors(tensors):
        if t.device.type != "cpu":
            return f"a tensor on {t.device}: the native kernels run on the CPU"
        if t.dtype not in library.dtypes:
            takes = ", ".join(sorted(str(d).removeprefix("torch.") for d in library.dtypes))
            return f"{str(t.dtype).removeprefix('torch.')} tensors: the native kernels take {takes}"
    return True
