"""The lowering registry: for each custom op, its implementations per target in order of preference, and
the op's facts.

An entry names a kernel (the op's ``impl`` argument: a name in ``runtime.kernels`` for ``recompile::`` ops, in
``hkv.kernels`` for ``hkv::`` ops; ``kernel_of`` resolves it), what kind it is, and when a target can run it.
``choose`` walks the list and takes the first the target can run, so the usual order is: library op, Triton
kernel, CPU kernel, reference.

``op_facts(op)`` says what the autotuner and ``verify`` must know about an op without reading its name: whether
it draws random numbers (declared here, or ATen's ``torch.Tag.nondeterministic_seeded``), changes state the graph
does not own, checks ids against ``options.bounds_check``, or updates parameters in its backward.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

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


@dataclass(frozen=True)
class OpFacts:
    random: bool = False  # draws random numbers: two runs differ, so runs cannot be compared
    stateful: bool = False  # changes state the graph does not own (a hash-table insert): a timing run trains
    bounds_checked: bool = False  # options.bounds_check "warning"/"ignore" clamp or skip ids eager would raise on
    updates_in_backward: bool = False  # its backward updates parameters in place (a fused optimizer)


FACTS: dict[str, OpFacts] = {}


def declare_facts(op: str, **facts: bool) -> None:
    """Declare what is true of op ``op`` ("namespace::name"); every fact left out is False."""
    if op in FACTS:
        raise ValueError(f"facts of {op!r} are declared twice")
    FACTS[op] = OpFacts(**facts)


def op_name(op) -> str:
    """"namespace::name" of an op overload, packet or name."""
    if isinstance(op, str):
        return op
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise TypeError(f"not an op: {op!r}")


def op_facts(op) -> OpFacts:
    """The facts of ``op`` (an OpOverload, a packet or "namespace::name"): those declared, plus ``random`` for an
    op tagged ``torch.Tag.nondeterministic_seeded`` (ATen's random ops)."""
    facts = FACTS.get(op_name(op), OpFacts())
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags:
        facts = OpFacts(**{**{f.name: getattr(facts, f.name) for f in fields(facts)}, "random": True})
    return facts


def ops_where(fact: str) -> frozenset[str]:
    """The declared ops of which ``fact`` (a field of OpFacts) is true."""
    return frozenset(op for op, facts in FACTS.items() if getattr(facts, fact))


def kernel_of(op: str, impl: Impl) -> Callable:
    """The callable ``impl`` names for ``op``: a ``runtime.kernels`` entry, or ``hkv.kernels``' probe."""
    namespace, name = op.split("::")
    if namespace == "hkv":
        from hkv.kernels import LOCATE

        return LOCATE[impl.impl]
    from runtime.kernels import get_kernel

    return get_kernel(name, impl.impl)


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
