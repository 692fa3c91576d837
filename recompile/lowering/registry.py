"""The kernel registry: for each custom op, its kernels per target in order of preference, and the op's facts.

An entry (``register_lowering``) lists an op's implementations, most preferred first, each naming a kernel of the
op in ``recompile.runtime.kernels`` (the one table of kernels, keyed by the op: ``recompile::`` ops register theirs beside
the op, ``hkv::lookup``'s probe kernels are registered by ``recompile.lowering.hkv``), what kind it is, when a
target can run it, and what it does. ``choose(op, target, *args)`` walks the list and takes the first
implementation the target runs whose kernel ``supports`` the op's arguments (fake tensors at compile time): that
is the kernel recorded in the graph and in the report, and the one that runs (kernels raise on inputs they do not
support rather than hand the call to another). The usual order: library op, Triton kernel, CPU kernels,
reference. A backward op runs the kernel of the same name its forward chose.

``op_facts(op)`` says what the autotuner and ``verify`` must know about an op without reading its name: whether
it draws random numbers (declared here, or ATen's ``torch.Tag.nondeterministic_seeded``), changes state the graph
does not own, checks ids against ``options.bounds_check``, or updates parameters in its backward.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from recompile.lowering.targets import Target
from recompile.runtime.kernels import get_kernel, why_not

KINDS = ("library", "triton", "cpu_kernel", "aten", "reference")


@dataclass(frozen=True)
class Impl:
    impl: str  # the kernel's name among the op's kernels in runtime.kernels
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
    """The callable ``impl`` names for ``op`` (its entry in ``recompile.runtime.kernels``)."""
    return get_kernel(op, impl.impl)


def overload(op: str) -> torch._ops.OpOverload:
    namespace, name = op.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def bind(op: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``op``'s arguments by their schema names (defaults filled in), from a call's ``args`` and ``kwargs``."""
    schema = overload(op)._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    return bound


def unsupported(op: str, impl: Impl, arguments: dict[str, Any]) -> str | None:
    """Why ``impl``'s kernel does not take ``arguments`` (bound by ``bind``), or None when it does."""
    return why_not(op, impl.impl, **arguments)


def candidates(op: str, target: Target, *args: Any, **kwargs: Any) -> list[Impl]:
    """Every implementation of ``op`` the target can run, most preferred first; given the op's arguments (fake
    tensors), only those whose kernel supports them."""
    try:
        impls = LOWERINGS[op]
    except KeyError:
        raise KeyError(f"no lowering registered for {op!r}; known: {sorted(LOWERINGS)}") from None
    runnable = [impl for impl in impls if impl.runs_on(target)]
    if not args and not kwargs:
        return runnable
    arguments = bind(op, args, kwargs)
    return [impl for impl in runnable if unsupported(op, impl, arguments) is None]


def choose(op: str, target: Target, *args: Any, **kwargs: Any) -> Impl:
    """The implementation of ``op`` to run on ``target``: the first it can run whose kernel supports the op's
    arguments ``args``/``kwargs`` (fake tensors at compile time; none given: the target decides alone)."""
    found = candidates(op, target, *args, **kwargs)
    if not found:
        raise ValueError(f"{op}: no kernel on {target.name} supports these arguments (not even the reference)")
    return found[0]


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
