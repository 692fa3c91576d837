"""The fused embedding optimizer (options embedding_optimizer) against the same optimizer run eagerly."""
import copy

import pytest
import torch

import recompile
from models.dlrm import DLRM, DLRMConfig, synthetic_batch

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


@pytest.mark.parametrize("kind", list(EAGER))
def test_fused_optimizer_matches_eager(kind):
    make_eager_opt, sparse = EAGER[kind]
    fused, eager = DLRM(SMALL), None
    eager = copy.deepcopy(fused)
    if sparse:
        _sparse_model(eager)
    options = {"embedding_optimizer": {"type": kind, "lr": LR, "eps": EPS}}
    compiled = torch.compile(fused, backend="rec_ascend", options=options)
    dense = lambda m: [p for n, p in m.named_parameters() if not n.startswith("embeddings.")]  # noqa: E731
    tables = lambda m: [p for n, p in m.named_parameters() if n.startswith("embeddings.")]  # noqa: E731
    fused_opt = torch.optim.SGD(dense(fused), lr=LR)
    eager_opts = [torch.optim.SGD(dense(eager), lr=LR), make_eager_opt(tables(eager))]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        args = synthetic_batch(SMALL, 12, gen)
        fused_opt.zero_grad()
        compiled(*args).pow(2).mean().backward()
        fused_opt.step()
        for opt in eager_opts:
            opt.zero_grad()
        eager(*args).pow(2).mean().backward()
        for opt in eager_opts:
            opt.step()
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert all(p.grad is None for p in tables(fused))


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
