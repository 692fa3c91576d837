"""Fused embedding optimizers: ``torch.ops.recompile.embedding_optimizer_step``.

The backward of ``grouped_embedding_bag_fused`` hands every table's ids and per-id gradients here
instead of materialising dense table gradients. The step deduplicates the ids (a row looked up
twice gets the sum of its gradients once, as a dense gradient would: summing first keeps the
rounding of eager's dense update), then updates only the touched rows in place, the way FBGEMM TBE's exact optimizers and TorchRec's ``apply_optimizer_in_backward`` do:

- ``exact_sgd``: ``w -= lr * g`` (equal to ``torch.optim.SGD`` on the dense gradient);
- ``exact_adagrad``: ``s += g*g; w -= lr * g / (sqrt(s) + eps)`` (``torch.optim.Adagrad``);
- ``exact_rowwise_adagrad``: one accumulator per row, ``s += mean(g*g)`` (FBGEMM's rowwise Adagrad);
- ``adam``: moments of the touched rows only, bias correction by the table's step count
  (``torch.optim.SparseAdam``; dense ``Adam`` would also move rows that got no gradient).

Optimizer state lives per table in ``STATES``, keyed by the table's storage, created on first use.
The op is declared without mutated arguments: like an optimizer step it changes the parameters after
the last read of them in the step, and its (scalar) result is the gradient of the fused lookup's
``trigger`` so that the backward graph keeps it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad", "adam")
DEFAULTS = {"lr": 0.01, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999}

# (storage address, storage offset, shape, optimizer) -> that table's optimizer state.
STATES: dict[tuple, dict] = {}


def format_optimizer(kind: str, **params: float) -> str:
    """The op's spelling of an optimizer: ``"exact_sgd lr=0.01 eps=1e-08 ..."``."""
    return " ".join([kind, *(f"{k}={float(v)!r}" for k, v in sorted({**DEFAULTS, **params}.items()))])


def parse_optimizer(spec: str) -> tuple[str, dict[str, float]]:
    kind, *fields = spec.split()
    if kind not in OPTIMIZERS:
        raise ValueError(f"recompile.embedding_optimizer_step: optimizer {kind!r} is not one of {OPTIMIZERS}")
    return kind, {**DEFAULTS, **{k: float(v) for k, v in (f.split("=") for f in fields)}}


def table_state(weight: Tensor, kind: str) -> dict:
    key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), kind)
    state = STATES.get(key)
    if state is None:
        rows, dim = weight.shape
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=weight.device)  # noqa: E731
        state = STATES[key] = {
            "exact_sgd": lambda: {},
            "exact_adagrad": lambda: {"sum": zeros(rows, dim)},
            "exact_rowwise_adagrad": lambda: {"sum": zeros(rows)},
            "adam": lambda: {"step": 0, "exp_avg": zeros(rows, dim), "exp_avg_sq": zeros(rows, dim)},
        }[kind]()
    return state


def _sgd(w, rows, g, state, p):
    w.index_add_(0, rows, (g * -p["lr"]).to(w.dtype))


def _adagrad(w, rows, g, state, p):
    s = state["sum"].index_add_(0, rows, g * g)[rows]
    w.index_add_(0, rows, (g / (s.sqrt() + p["eps"]) * -p["lr"]).to(w.dtype))


def _rowwise_adagrad(w, rows, g, state, p):
    s = state["sum"].index_add_(0, rows, (g * g).mean(1))[rows]
    w.index_add_(0, rows, (g / (s.sqrt() + p["eps"])[:, None] * -p["lr"]).to(w.dtype))


def _adam(w, rows, g, state, p):
    state["step"] += 1
    b1, b2, step = p["beta1"], p["beta2"], state["step"]
    m = state["exp_avg"][rows].mul_(b1).add_(g, alpha=1 - b1)
    v = state["exp_avg_sq"][rows].mul_(b2).addcmul_(g, g, value=1 - b2)
    state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
    step_size = p["lr"] * math.sqrt(1 - b2**step) / (1 - b1**step)
    w.index_add_(0, rows, (m / (v.sqrt() + p["eps"]) * -step_size).to(w.dtype))


UPDATES: dict[str, Callable] = {
    "exact_sgd": _sgd, "exact_adagrad": _adagrad, "exact_rowwise_adagrad": _rowwise_adagrad, "adam": _adam,
}


@torch.library.custom_op("recompile::embedding_optimizer_step", mutates_args=())
def embedding_optimizer_step(weights: list[Tensor], ids: list[Tensor], id_grads: list[Tensor], optimizer: str) -> Tensor:
    """Update the rows ``ids[t]`` of ``weights[t]`` with the summed ``id_grads[t]``; returns a zero scalar."""
    kind, params = parse_optimizer(optimizer)
    with torch.no_grad():
        for w, i, g in zip(weights, ids, id_grads):
            if i.numel() == 0:
                continue
            rows, inverse = torch.unique(i, return_inverse=True)
            summed = torch.zeros(rows.numel(), w.shape[1], dtype=torch.float32, device=w.device).index_add_(0, inverse, g.float())
            UPDATES[kind](w, rows, summed, table_state(w, kind), params)
    return torch.zeros((), device=weights[0].device)


@embedding_optimizer_step.register_fake
def _(weights, ids, id_grads, optimizer):
    return weights[0].new_empty((), dtype=torch.float32)
