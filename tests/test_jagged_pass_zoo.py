"""The jagged pass on the zoo's sequential models (models/sequential.py): their padded attention becomes the
jagged kernels, outputs and gradients equal eager, and a stream of batches compiles at most twice."""
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from models.zoo import MODELS
from recompile.backend import rec_ascend
from tests.checks import train_step
from tests.test_jagged_pass import count_hstu_kernel_calls


def workload(name, seed=0, batch=None):
    w = MODELS[name]("small", seed, batch)
    w.model.eval()  # dropout off: the compiled and eager runs draw no masks
    return w


def assert_compiled_equals_eager(model, inputs):
    """Loss and every gradient within 1e-5 of eager, relative to the tensor's largest entry (Inductor alone
    reorders the float sums of these gradients, of magnitude 1e3, by that much)."""
    out_c, grads_c = train_step(torch.compile(model, backend="rec_ascend"), inputs)
    out_e, grads_e = train_step(model, inputs)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name, ge in grads_e.items():
        torch.testing.assert_close(grads_c[name], ge, rtol=1e-5, atol=1e-5 * float(ge.abs().max()), msg=name)


def regions(model, inputs):
    report = recompile.explain(model, *inputs).to_dict()
    return report, [(r["kind"], r["op"]) for r in report["regions"]]


def test_zoo_hstu_attention_becomes_jagged():
    w = workload("hstu")
    report, found = regions(w.model, w.inputs)
    assert found.count(("attention", "recompile::hstu_attention")) == w.model.encoder.cfg.num_layers
    assert ("jagged", "recompile::jagged_within") in found
    assert report["fallbacks"] == []
    final = report["stages"][-1]["code"]
    assert "index_copy" not in final and "einsum" not in final


@pytest.mark.slow  # static shapes; make test checks the same model dynamic (test_models.py zoo[hstu])
def test_zoo_hstu_forward_and_grads_equal_eager():
    torch._dynamo.reset()
    w = workload("hstu")
    assert_compiled_equals_eager(w.model, w.inputs)


@pytest.mark.slow  # test_models.py zoo[hstu] (one compile over three batch sizes) in make test
def test_zoo_hstu_varying_batches_compile_at_most_twice(monkeypatch):
    calls = count_hstu_kernel_calls(monkeypatch)
    torch._dynamo.reset()
    model = workload("hstu").model
    # Autotune off: the test pins the kernel it counts.
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    compiled = torch.compile(model, backend=counter)
    batches = (4, 6, 9, 13)
    with torch.no_grad():
        for seed, batch in enumerate(batches):
            inputs = workload("hstu", seed, batch).inputs
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2
    assert len(calls) == len(batches) * model.encoder.cfg.num_layers  # the dynamic graph runs it too
