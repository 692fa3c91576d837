"""The fused embedding optimizer (options embedding_optimizer) against the same optimizer run eagerly."""
import copy

import pytest
import torch

import recompile
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.runtime import embedding_optimizer

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

SMALL = DLRMConfig(table_rows=[40, 60, 25], dim=8, bottom=[16, 8], top=[16, 1], max_ids_per_bag=5)
LR, EPS = 0.05, 1e-6


class RowwiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's rowwise Adagrad on dense gradients, in plain torch: one accumulator per row."""

    def __init__(self, params, lr, eps):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                touched = p.grad.abs().sum(1) > 0
                state = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                state += (p.grad * p.grad).mean(1)
                update = p.grad / (state.sqrt() + group["eps"])[:, None] * -group["lr"]
                p += update * touched[:, None]


EAGER = {
    "exact_sgd": (lambda ps: torch.optim.SGD(ps, lr=LR), False),
    "exact_adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=LR, eps=EPS), False),
    "exact_rowwise_adagrad": (lambda ps: RowwiseAdagrad(ps, lr=LR, eps=EPS), False),
    "adam": (lambda ps: torch.optim.SparseAdam(ps, lr=LR, eps=EPS), True),
}


def _sparse_model(model):
    for emb in model.embeddings:
        emb.sparse = True
    return model


def _dense(model):
    return [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]


def _tables(model):
    return [p for n, p in model.named_parameters() if n.startswith("embeddings.")]


def _step(model, optimizers, args):
    for opt in optimizers:
        opt.zero_grad()
    model(*args).pow(2).mean().backward()
    for opt in optimizers:
        opt.step()


def _fused_and_eager(kind):
    """A compiled model with the fused ``kind`` on its tables (SGD on the rest), and its eager twin."""
    make_eager_opt, sparse = EAGER[kind]
    fused = DLRM(SMALL)
    eager = copy.deepcopy(fused)
    if sparse:
        _sparse_model(eager)
    options = {"embedding_optimizer": {"type": kind, "lr": LR, "eps": EPS}}
    compiled = torch.compile(fused, backend="rec_ascend", options=options)
    return (fused, compiled, [torch.optim.SGD(_dense(fused), lr=LR)],
            eager, [torch.optim.SGD(_dense(eager), lr=LR), make_eager_opt(_tables(eager))])


def _assert_same_parameters(got, want, rtol=1e-5):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", list(EAGER))
def test_fused_optimizer_matches_eager(kind):
    fused, compiled, fused_opts, eager, eager_opts = _fused_and_eager(kind)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        args = synthetic_batch(SMALL, 12, gen)
        _step(compiled, fused_opts, args)
        _step(eager, eager_opts, args)
    _assert_same_parameters(fused, eager)
    assert all(p.grad is None for p in _tables(fused))


def test_fused_state_survives_reallocation_and_round_trips():
    """The state goes with the parameter, not its storage: after ``p.data = p.data.clone()`` Adam keeps its moments
    and step counts (eager's SparseAdam does); a state_dict loaded into a copy of the model trains on alike."""
    fused, compiled, fused_opts, eager, eager_opts = _fused_and_eager("adam")
    gen = torch.Generator().manual_seed(1)
    batches = [synthetic_batch(SMALL, 12, gen) for _ in range(4)]
    for args in batches[:2]:
        _step(compiled, fused_opts, args)
        _step(eager, eager_opts, args)
    for table in _tables(fused):
        table.data = table.data.clone()  # new storage, same parameter
    _step(compiled, fused_opts, batches[2])
    _step(eager, eager_opts, batches[2])
    _assert_same_parameters(fused, eager)

    saved = embedding_optimizer.state_dict(fused)
    assert sorted(saved) == sorted(n for n, _ in fused.named_parameters() if n.startswith("embeddings."))
    assert all(s["adam"]["step"] == 3 for s in saved.values())
    restored = copy.deepcopy(fused)  # new parameters: no state until loaded
    assert embedding_optimizer.state_dict(restored) == {}
    embedding_optimizer.load_state_dict(restored, saved)
    again = embedding_optimizer.state_dict(restored)
    for name, kinds in saved.items():
        for key, value in kinds["adam"].items():
            assert torch.equal(torch.as_tensor(again[name]["adam"][key]), torch.as_tensor(value)), (name, key)
    restored_compiled = torch.compile(restored, backend="rec_ascend",
                                      options={"embedding_optimizer": {"type": "adam", "lr": LR, "eps": EPS}})
    _step(restored_compiled, [torch.optim.SGD(_dense(restored), lr=LR)], batches[3])
    _step(eager, eager_opts, batches[3])
    _assert_same_parameters(restored, eager, rtol=1e-4)  # four steps of this loss grow some weights to ~1e5


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"type": "lamb"}, "valid values: exact_sgd, exact_adagrad, exact_rowwise_adagrad, adam"),
        ({"lr": 0.1}, "must be a dict with a 'type'"),
        ({"type": "adam", "momentum": 0.9}, "valid keys: type, lr, eps, betas"),
        ({"type": "exact_sgd", "lr": -1}, "'lr'.*positive number"),
        ({"type": "adam", "betas": (0.9,)}, "two numbers in"),
    ],
)
def test_bad_embedding_optimizer_options(spec, message):
    with pytest.raises(ValueError, match=message):
        recompile.RecompileOptions.coerce({"embedding_optimizer": spec})
