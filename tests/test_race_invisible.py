"""The autotune race is invisible: timing candidates on a call's inputs changes none of the caller's tensors,
buffers, autograd graph or random stream, and every candidate draws the same random numbers, so that an empty
and a warm cache give the same numbers (``docs/determinism.md``; the checks are ``tests/race_checks.py``)."""
import copy

import pytest
import torch
import torch.nn as nn

from models.zoo import MODELS
from torch._inductor.compile_fx import compile_fx

from recompile import backend as rec_backend
from tests import race_checks


@pytest.fixture(autouse=True)
def _fast(tmp_path, monkeypatch, quick_race):
    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    race_checks.inductor_draws_its_own_numbers(monkeypatch)


def _bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))


def test_batchnorm_statistics_count_one_step():
    """The race ran the training graph many times and each run updated the running statistics (104 steps)."""
    model, x = _bn_mlp(), torch.randn(512, 32)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    torch.compile(model, backend="rec_ascend")(x).sum().backward()
    assert model[1].num_batches_tracked.item() == 1
    for name, buffer in ref.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=1e-5, atol=1e-6, msg=name)
    x_eval = torch.randn(64, 32)
    torch.testing.assert_close(model.eval()(x_eval), ref.eval()(x_eval), rtol=1e-4, atol=1e-5)


class Scatter(nn.Module):
    """Dynamo splits it at repeat_interleave: a later graph writes into a tensor an earlier one made."""

    def __init__(self):
        super().__init__()
        self.e, self.b = nn.Embedding(100, 8), nn.Linear(8, 8)

    def forward(self, ids, offsets):
        x = self.e(ids)
        lengths = offsets[1:] - offsets[:-1]
        pad = torch.zeros(lengths.numel(), 6, 8)
        pos = torch.arange(ids.numel()) - torch.repeat_interleave(offsets[:-1], lengths)
        row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pad[row, pos] = x
        return (self.b(pad).relu() + pad)[row, pos]


def test_a_graph_writing_into_an_earlier_graphs_tensor_trains_on_its_first_step():
    """The race ran the later graph on the caller's tensor, whose autograd history each run replaced and freed."""
    model = Scatter()
    ref = copy.deepcopy(model)
    ids, offsets = torch.randint(0, 100, (9,)), torch.tensor([0, 2, 5, 9])
    out = torch.compile(model, backend="rec_ascend")(ids, offsets)
    out.pow(2).sum().backward()
    ref(ids, offsets).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_race_touches_no_input_and_draws_no_random_number():
    """Inputs written by the graph (without grad) are put back; the caller's RNG is where eager leaves it."""
    def bump(x, counter):
        counter += 1
        return torch.relu(x) * counter

    x, counter = torch.randn(64), torch.zeros(1)
    torch.manual_seed(3)
    out = torch.compile(bump, backend="rec_ascend")(x, counter)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert counter.item() == 1 and torch.equal(out, torch.relu(x)) and torch.equal(after, torch.rand(1))


def _zoo(name):
    def make():
        workload = MODELS[name]("small", seed=0, batch=4)
        return workload.model, workload.inputs, workload.loss
    return make


@pytest.mark.parametrize("name", [name if name == "dlrm" else pytest.param(name, marks=pytest.mark.slow)
                                  for name in MODELS])  # every zoo model; make test keeps DLRM
def test_zoo_models_give_the_same_numbers_whatever_the_cache_and_the_candidate(name, tmp_path, monkeypatch):
    race_checks.assert_race_invisible(_zoo(name), 3, tmp_path, monkeypatch)


def test_bn_and_dropout_give_the_same_numbers_whatever_the_cache_and_the_candidate(tmp_path, monkeypatch):
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        return model, (torch.randn(64, 16),), lambda out: out.pow(2).mean()

    race_checks.assert_race_invisible(make, 3, tmp_path, monkeypatch)


class Bookkeeping(nn.Module):
    """Writes whose results nothing uses: a training lookup that inserts its ids, and two in-place updates of a
    buffer whose order matters."""

    def __init__(self):
        super().__init__()
        import hkv

        options = hkv.DynamicEmbTableOptions(dim=4, max_capacity=64, init_capacity=16, bucket_capacity=16)
        self.seen = hkv.DynamicEmbeddingBag(options, "sum")
        self.register_buffer("count", torch.ones(1))
        self.lin = nn.Linear(4, 4)

    def forward(self, x, ids, offsets):
        self.seen(ids, offsets)  # unused: only inserts
        self.count.mul_(3)
        self.count.add_(1)
        return self.lin(x) * 2


@pytest.mark.parametrize("autotune_on", [True, False])
def test_a_mutating_op_whose_result_is_unused_still_runs_in_order(autotune_on, monkeypatch):
    if not autotune_on:  # through the real Inductor, which drops an op that declares no effect
        monkeypatch.setattr(rec_backend, "compile_fx", compile_fx)
    model = Bookkeeping()
    ids, offsets = torch.tensor([3, 9, 2**40 + 1]), torch.tensor([0, 2])
    out = torch.compile(model, backend="rec_ascend", options={"autotune": autotune_on})(torch.randn(2, 4), ids, offsets)
    assert out.shape == (2, 4)
    assert model.count.item() == 4  # (1 * 3) + 1, once
    assert model.seen.table.contains(ids).all() and model.seen.table.size() == 3


class CrossBN(nn.Module):
    """A cross layer (a rec region, which ``verify`` checks) after a BatchNorm that updates its statistics."""

    def __init__(self):
        super().__init__()
        self.bn, self.a = nn.BatchNorm1d(16), nn.Linear(16, 16)

    def forward(self, x0):
        x0 = self.bn(x0)
        return torch.tanh(x0 * self.a(x0) + x0)


@pytest.mark.parametrize("training", [False, True])
def test_verify_runs_the_graphs_without_touching_the_callers_tensors(training):
    """``verify=True`` runs each pass's graphs before and after on the call's inputs: inside the race's sandbox."""
    torch.manual_seed(0)
    model, x = CrossBN(), torch.randn(32, 16)
    ref = copy.deepcopy(model)
    with torch.set_grad_enabled(training):
        out = torch.compile(model, backend="rec_ascend", options={"verify": True, "autotune": False})(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)
    assert model.bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
