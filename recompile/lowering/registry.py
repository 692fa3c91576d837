"""The lowering registry: for each custom op, its implementations per target in order of preference.

An entry names a kernel of ``runtime.kernels`` (the op's ``impl`` argument), what kind it is, and
when a target can run it. ``choose`` walks the list and takes the first the target can run, so the
usual order is: library op, Triton kernel, CPU kernel, reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from recompile.lowering.targets import Target

KINDS = ("library", "triton", "cpu_kernel", "aten", "reference")


@dataclass(frozen=True)
class Impl:
    impl: str  # the kernel's name in runtime.kernels
    kind: str  # one of KINDS
    runs_on: Callable[[Target], bool]
    describe: str  # what runs, for reports: "torch.ops.fbgemm.asynchronous_complete_cumsum"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"lowering kind {self.kind!r} is not one of {KINDS}")


LOWERINGS: dict[str, tuple[Impl, ...]] = {}


def register_lowering(op: str, *impls: Impl) -> None:
    """Declare the implementations of ``op`` ("recompile::name"), most preferred first."""
    if op in LOWERINGS:
        raise ValueError(f"lowering for {op!r} is registered twice")
    if not impls or impls[-1].kind != "reference":
        raise ValueError(f"lowering for {op!r} must end with its reference implementation")
    LOWERINGS[op] = impls


def candidates(op: str, target: Target) -> list[Impl]:
    """Every implementation of ``op`` the target can run, most preferred first."""
    try:
        impls = LOWERINGS[op]
    except KeyError:
        raise KeyError(f"no lowering registered for {op!r}; known: {sorted(LOWERINGS)}") from None
    return [impl for impl in impls if impl.runs_on(target)]


def choose(op: str, target: Target) -> Impl:
    return candidates(op, target)[0]


# Predicates the tables share.
def on_cpu(target: Target) -> bool:
    return target.name == "cpu"


def native_on_cpu(available: Callable[[], bool]) -> Callable[[Target], bool]:
    """On CPU, when the package was built with its native C++ kernels (``available()``)."""

    def runs(target: Target) -> bool:
        return on_cpu(target) and available()

    return runs


def has_triton(target: Target) -> bool:
    """Triton kernels run on accelerators (CUDA through triton, NPU through triton-ascend)."""
    return target.name != "cpu" and target.triton is not None


def has_fbgemm(op: str) -> Callable[[Target], bool]:
    return lambda target: target.has_fbgemm(op)


def anywhere(target: Target) -> bool:
    return True


def reference(describe: str) -> Impl:
    return Impl("reference", "reference", anywhere, describe)
