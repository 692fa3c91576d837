"""The kernel registry walked entry by entry: every op has a reference, a fake, kernels that exist and
descriptions that name real code; backward kernels sit beside their forward; op facts are declared for ops that
exist. The choice is made at compile time on the fake inputs by each kernel's ``supports``: forcing a kernel's
``supports`` to fail makes the report name the next kernel, and that kernel is the one that runs."""
import importlib
from pathlib import Path

import pytest
import torch

import recompile
from recompile import runtime  # noqa: F401  (defines torch.ops.recompile.*)
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.lowering import FACTS, LOWERINGS, OpFacts, candidates, declare_facts, detect_target, kernel_of, op_facts
from recompile.lowering import ops_where
from recompile.lowering.registry import KINDS, overload
from recompile.runtime import interaction_native
from recompile.runtime.kernels import KERNELS, SUPPORTS, UnsupportedInputs
from test_interaction_pass import FM, CrossNet

ROOT = Path(__file__).resolve().parent.parent
CPU = detect_target("cpu")


def has_fake(op: str) -> bool:
    from torch._library.simple_registry import singleton

    return singleton.find(op).fake_impl.kernel is not None


def names_real_code(describe: str) -> bool:
    """A description that starts with a C source or a Python path names one that exists."""
    head = describe.split()[0].rstrip(":,")
    if head.endswith((".c", ".h")):
        return any((base / head).exists() for base in (ROOT, ROOT / "runtime"))
    if not head.startswith(("recompile.runtime.", "hkv.")):
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
        assert callable(SUPPORTS[op][impl.impl]), f"{op}: {impl.impl!r} has no supports"
        assert impl.describe.strip() and names_real_code(impl.describe), f"{op}: {impl.describe!r}"


BACKWARDS = sorted(
    op for op in KERNELS
    if op.endswith("_backward") and op not in LOWERINGS and op.removesuffix("_backward") in LOWERINGS
)


@pytest.mark.parametrize("op", BACKWARDS)
def test_backward_kernels_sit_beside_their_forward(op):
    """A backward op without its own entry runs the kernel its forward chose: it must have one of each name, but for
    a forward kernel of inference calls only, which refuses a call that saves for the backward (LSTM's ``aten``)."""
    name = op.removesuffix("_backward")
    assert has_fake(op)
    missing = {i.impl for i in LOWERINGS[name]} - set(KERNELS[op])
    assert all(SUPPORTS[name][impl](torch.empty(1, 1, 1), save=True) is not True for impl in missing), f"{op} lacks {missing}"


def test_op_facts_are_declared_for_real_ops_and_read_from_the_registry():
    for op in FACTS:
        overload(op)
    assert op_facts(torch.ops.recompile.dropout.default).random
    assert op_facts(torch.ops.aten.native_dropout.default).random  # ATen's own tag
    assert op_facts(torch.ops.aten.bernoulli.default).random and not op_facts(torch.ops.aten.mm.default).random
    assert op_facts("recompile::grouped_embedding_bag_fused") == OpFacts(bounds_checked=True, updates_in_backward=True)
    assert ops_where("bounds_checked") == {"recompile::grouped_embedding_bag", "recompile::grouped_embedding_bag_fused",
                                           "recompile::jagged_within", "recompile::hstu_attention",
                                           "recompile::jagged_softmax_attention",
                                           "recompile::grouped_embedding_bag_quantized"}
    assert op_facts(torch.ops.hkv.lookup).stateful and not op_facts(torch.ops.hkv.unique.default).stateful
    with pytest.raises(ValueError, match="declared twice"):
        declare_facts("recompile::dropout", random=True)


# ---------------------------------------------------------------------------------------------
# The choice is made at compile time, and is what runs.

SMALL = DLRMConfig(table_rows=[50, 80, 120, 30], dim=8, bottom=[16, 8], top=[16, 1])


def _dlrm(dtype=torch.float32):
    model = DLRM(SMALL).to(dtype)
    dense, *sparse = synthetic_batch(SMALL, 6)
    return model, (dense.to(dtype), *sparse)


def _cross():
    return CrossNet(), (torch.randn(5, 12),)


def _fm():
    return FM(), (torch.randn(5, 4, 6), torch.randn(5, 10))


MODELS = {
    "recompile::grouped_embedding_bag": _dlrm,
    "recompile::dot_interaction": _dlrm,
    "recompile::cross_stack": _cross,
    "recompile::cross_layer": _cross,
    "recompile::fm_second_order": _fm,
}
FORCED = [(op, impl.impl) for op in MODELS for impl in candidates(op, CPU) if impl.kind != "reference"]


def _record_calls(monkeypatch, op: str) -> list[str]:
    """Every kernel of ``op`` (and of its backward) wrapped to append its name to the list returned."""
    ran = []
    for name in (op, op + "_backward"):
        for impl, fn in list(KERNELS.get(name, {}).items()):
            monkeypatch.setitem(KERNELS[name], impl, lambda *a, _fn=fn, _tag=f"{name}:{impl}", **k:
                                ran.append(_tag) or _fn(*a, **k))
    return ran


def _named_and_ran(monkeypatch, op: str, model, inputs):
    """(the kernels the report names for ``op``'s regions, the kernels of ``op`` and its backward that ran) when
    the pipeline's final graphs run forward and backward on the captured inputs."""
    report = recompile.explain(model, *inputs, options={"target": "cpu"})
    named = {r.impl.impl for g in report.graphs for r in g.ctx.regions if r.op == op}
    ran = _record_calls(monkeypatch, op)
    for graph in report.graphs:
        inputs = [x.detach().requires_grad_() if x.is_floating_point() else x for x in graph.inputs]
        outputs = graph.modules[-1](*inputs)
        loss = sum(o.float().sum() for o in torch.utils._pytree.tree_leaves(outputs) if o.requires_grad)
        loss.backward()
    return named, {tag.split(":")[-1] for tag in ran}, {tag for tag in ran if "_backward:" in tag}


@pytest.mark.parametrize("op, forced", FORCED)
def test_a_kernel_that_does_not_support_the_inputs_is_passed_over_for_the_next(monkeypatch, op, forced):
    """``forced`` and the kernels preferred to it say they do not support the inputs: the next one is named and runs."""
    model, inputs = MODELS[op]()
    order = [impl.impl for impl in candidates(op, CPU)]
    for impl in order[:order.index(forced) + 1]:
        monkeypatch.setitem(SUPPORTS[op], impl, lambda **_: "forced off by the test")
    named, ran, backward = _named_and_ran(monkeypatch, op, model, inputs)
    expected = order[order.index(forced) + 1]
    assert named == {expected} and ran == {expected}, (named, ran)
    if op + "_backward" in KERNELS:
        assert backward == {f"{op}_backward:{expected}"}


def test_the_choice_reads_the_fake_inputs():
    """float64 features: the native kernel does not take them, and the compile-time choice says so."""
    model, inputs = _dlrm(torch.float64)
    regions = recompile.explain(model, *inputs, options={"target": "cpu"}).to_dict()["regions"]
    assert [r["impl"] for r in regions if r["op"] == "recompile::dot_interaction"] == ["cpu"]


@pytest.mark.skipif(not interaction_native.available(), reason="built without the native kernels")
def test_a_kernel_called_on_inputs_it_does_not_support_raises_naming_the_op_and_why():
    features = [torch.randn(4, 8, dtype=torch.float64) for _ in range(3)]
    with pytest.raises(UnsupportedInputs, match=r"recompile::dot_interaction: kernel 'native'.*float64"):
        torch.ops.recompile.dot_interaction(features, None, True, False, "native")
