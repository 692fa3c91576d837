"""The kernel registry walked entry by entry: every op has a reference, a fake, kernels that exist and
descriptions that name real code; op facts are declared for ops that exist and read from the registry."""
import importlib
from pathlib import Path

import pytest
import torch

import runtime  # noqa: F401  (defines torch.ops.recompile.*)
from recompile.lowering import FACTS, LOWERINGS, OpFacts, declare_facts, kernel_of, op_facts, ops_where
from recompile.lowering.registry import KINDS
from runtime.kernels import KERNELS

ROOT = Path(__file__).resolve().parent.parent


def overload(op: str) -> torch._ops.OpOverload:
    namespace, name = op.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def has_fake(op: str) -> bool:
    from torch._library.simple_registry import singleton

    return singleton.find(op).fake_impl.kernel is not None


def names_real_code(describe: str) -> bool:
    """A description that starts with a C source or a Python path names one that exists."""
    head = describe.split()[0].rstrip(":,")
    if head.endswith(".c"):
        return (ROOT / head).exists() or (ROOT / "runtime" / head).exists()
    if not head.startswith(("runtime.", "hkv.")):
        return True  # prose ("addmm + addcmul", "ATen embedding_bag per table ...")
    parts = head.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("op", sorted(LOWERINGS))
def test_every_entry_has_kernels_a_reference_a_fake_and_a_description(op):
    impls = LOWERINGS[op]
    overload(op)  # the op is defined
    assert has_fake(op), f"{op} has no fake implementation"
    assert impls[-1].kind == "reference", f"{op} does not end with its reference"
    assert len({i.impl for i in impls}) == len(impls), f"{op} names a kernel twice"
    for impl in impls:
        assert impl.kind in KINDS
        assert callable(kernel_of(op, impl)), f"{op}: {impl.impl!r} is no kernel"
        assert impl.describe.strip() and names_real_code(impl.describe), f"{op}: {impl.describe!r}"


BACKWARDS = sorted(
    name for name in KERNELS
    if name.endswith("_backward") and f"recompile::{name}" not in LOWERINGS
    and f"recompile::{name.removesuffix('_backward')}" in LOWERINGS
)
SILENT_HANDOFF = pytest.mark.xfail(
    strict=True, reason="runtime.interaction.backward_kernel: the cpu and triton dot interaction have no backward "
    "kernel, and their backward runs the reference at run time while explain names the forward's kernel")


@pytest.mark.parametrize("name", [pytest.param(n, marks=SILENT_HANDOFF) if n == "dot_interaction_backward" else n
                                  for n in BACKWARDS])
def test_backward_kernels_sit_beside_their_forward(name):
    """A backward op without its own entry runs the kernel its forward chose: it must have one of each name."""
    forward = LOWERINGS[f"recompile::{name.removesuffix('_backward')}"]
    assert has_fake(f"recompile::{name}")
    assert {i.impl for i in forward} <= set(KERNELS[name])


def test_op_facts_are_declared_for_real_ops_and_read_from_the_registry():
    for op in FACTS:
        overload(op)
    assert op_facts(torch.ops.recompile.dropout.default).random
    assert op_facts(torch.ops.aten.native_dropout.default).random  # ATen's own tag
    assert op_facts(torch.ops.aten.bernoulli.default).random and not op_facts(torch.ops.aten.mm.default).random
    assert op_facts("recompile::grouped_embedding_bag_fused") == OpFacts(bounds_checked=True, updates_in_backward=True)
    assert ops_where("bounds_checked") == {"recompile::grouped_embedding_bag", "recompile::grouped_embedding_bag_fused",
                                           "recompile::grouped_embedding_bag_quantized"}
    assert op_facts(torch.ops.hkv.lookup).stateful and not op_facts(torch.ops.hkv.unique.default).stateful
    with pytest.raises(ValueError, match="declared twice"):
        declare_facts("recompile::dropout", random=True)
