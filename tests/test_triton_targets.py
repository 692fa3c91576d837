"""NPU target detection tells Atlas A2, A3 and A5 apart from what torch_npu says (faked here: no NPU), with each
chip's fbgemm-ascend ops as data; and the NPU plan runs a Triton kernel for every op that has one."""
import sys
from types import SimpleNamespace

import pytest

from recompile.lowering import LOWERINGS, choose, detect_target, targets
from recompile.lowering.targets import ASCEND_FBGEMM_OPS, ascend_chip


def fake_torch_npu(monkeypatch, name, soc=None, cores=0):
    npu = SimpleNamespace(get_device_name=lambda index=0: name,
                          get_device_properties=lambda index=0: SimpleNamespace(vector_core_num=cores))
    if soc is not None:
        npu.get_soc_version = lambda: soc
    monkeypatch.setitem(sys.modules, "torch_npu", SimpleNamespace(npu=npu))
    monkeypatch.setattr(targets, "npu_available", lambda: True)
    monkeypatch.setattr(targets, "fbgemm_ops", lambda: frozenset().union(*ASCEND_FBGEMM_OPS.values()))


@pytest.mark.parametrize("name, soc, chip", [
    ("Ascend910B1", 220, "A2"), ("Ascend910B4", None, "A2"), ("Ascend910", 224, "A2"),
    ("Ascend910_9391", 250, "A3"), ("Ascend910_9382", None, "A3"), ("Ascend910", 253, "A3"),
    ("Ascend910_9589", None, "A5"), ("Ascend950PR", 260, "A5"),
])
def test_chip_from_device_name_or_soc_version(monkeypatch, name, soc, chip):
    assert ascend_chip(name, soc) == chip
    fake_torch_npu(monkeypatch, name, soc, cores=40)
    target = detect_target("npu")
    assert target.available and target.chip == chip and target.num_cores == 40
    assert target.fbgemm_ops == ASCEND_FBGEMM_OPS[chip]
    assert detect_target("auto").chip == chip


def test_chips_differ_in_their_fbgemm_ops(monkeypatch):
    assert ASCEND_FBGEMM_OPS["A2"] == ASCEND_FBGEMM_OPS["A3"] < ASCEND_FBGEMM_OPS["A5"]
    fake_torch_npu(monkeypatch, "Ascend950PR")
    a5 = detect_target("npu")
    fake_torch_npu(monkeypatch, "Ascend910B2")
    a2 = detect_target("npu")
    op = "recompile::jagged_dense_elementwise_mul"
    assert choose(op, a5).kind == "library" and choose(op, a2).kind == "triton"


def test_another_npu_gets_no_fbgemm_ascend_ops(monkeypatch):
    fake_torch_npu(monkeypatch, "Ascend310P3", 202)
    target = detect_target("npu")
    assert target.chip == "Ascend310P3" and not target.fbgemm_ops and target.num_cores == 1


@pytest.mark.parametrize("name", [None, "Ascend910B1", "Ascend910_9391", "Ascend950PR"])
def test_every_op_with_a_triton_kernel_runs_it_on_npu(monkeypatch, name):
    if name:
        fake_torch_npu(monkeypatch, name, cores=48)
    target = detect_target("npu")
    with_triton = [op for op, impls in LOWERINGS.items() if any(impl.kind == "triton" for impl in impls)]
    assert {"recompile::hstu_attention", "recompile::jagged_softmax_attention", "recompile::grouped_embedding_bag",
            "recompile::embedding_optimizer_step"} <= set(with_triton)
    for op in with_triton:
        assert choose(op, target).kind in ("library", "triton"), op
