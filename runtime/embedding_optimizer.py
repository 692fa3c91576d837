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

Optimizer state lives per table in ``STATES``, keyed by the parameter object itself (as ``torch.optim`` keys
its state), so it survives the parameter's data being reallocated (``p.data = ...``, ``.to()`` in place) and goes
with the parameter; it is created on first use. ``state_dict(model)`` / ``load_state_dict(model, state)`` read
and restore it by parameter name.
The op is declared without mutated arguments: like an optimizer step it changes the parameters after
the last read of them in the step, and its (scalar) result is the gradient of the fused lookup's
``trigger`` so that the backward graph keeps it.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .embedding import (LOOKUP_SCHEMA, SUM, Feature, _id_scale, feature_names, features_of, id_gradients,
                               output_slices, present)
from .fbgemm import fbgemm_op
from .kernels import get_kernel, register_kernel

STEP_OP = "embedding_optimizer_step"
OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad", "adam")
DEFAULTS = {"lr": 0.01, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999}

# table (the parameter the op is given) -> {optimizer: its state}; entries go with their parameter.
STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def format_optimizer(kind: str, **params: float) -> str:
    """The op's spelling of an optimizer: ``"exact_sgd lr=0.01 eps=1e-08 ..."``."""
    return " ".join([kind, *(f"{k}={float(v)!r}" for k, v in sorted({**DEFAULTS, **params}.items()))])


def parse_optimizer(spec: str) -> tuple[str, dict[str, float]]:
    kind, *fields = spec.split()
    if kind not in OPTIMIZERS:
        raise ValueError(f"recompile.embedding_optimizer_step: optimizer {kind!r} is not one of {OPTIMIZERS}")
    return kind, {**DEFAULTS, **{k: float(v) for k, v in (f.split("=") for f in fields)}}


def _new_state(kind: str, weight: Tensor) -> dict:
    rows, dim = weight.shape
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=weight.device)  # noqa: E731
    return {
        "exact_sgd": lambda: {},
        "exact_adagrad": lambda: {"sum": zeros(rows, dim)},
        "exact_rowwise_adagrad": lambda: {"sum": zeros(rows)},
        "adam": lambda: {"step": 0, "exp_avg": zeros(rows, dim), "exp_avg_sq": zeros(rows, dim)},
    }[kind]()


def table_state(weight: Tensor, kind: str) -> dict:
    """``weight``'s state for optimizer ``kind``, created (zero) on first use; a table whose shape changed since
    its state was made is rejected rather than updated from state of another shape."""
    states = STATES.get(weight)
    if states is None:
        states = STATES[weight] = {}
    state = states.get(kind)
    if state is None:
        state = states[kind] = _new_state(kind, weight)
    for value in state.values():
        if isinstance(value, Tensor) and value.shape[0] != weight.shape[0]:
            raise ValueError(f"recompile.embedding_optimizer_step: a table of shape {tuple(weight.shape)} has {kind} "
                             f"state for {value.shape[0]} rows (the table was resized); load_state_dict a matching state")
    return state


def state_dict(module: torch.nn.Module) -> dict[str, dict[str, dict]]:
    """The fused optimizer state of ``module``'s tables, for checkpoints: ``{parameter name: {optimizer type:
    {"sum" | "exp_avg" | "exp_avg_sq": tensor, "step": int}}}``, copies of the live state (tables that no fused
    step has touched yet are absent)."""
    out: dict[str, dict[str, dict]] = {}
    for name, weight in module.named_parameters():
        for kind, state in STATES.get(weight, {}).items():
            out.setdefault(name, {})[kind] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}
    return out


def load_state_dict(module: torch.nn.Module, state: dict[str, dict[str, dict]]) -> None:
    """Replace the state of ``module``'s tables by what ``state_dict`` returned (copied; every name and every
    tensor's shape must match the table as it is now). Nothing is changed unless all of it matches."""
    params = dict(module.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise KeyError(f"recompile.embedding_optimizer.load_state_dict: no parameter(s) {missing} in the module")
    loaded = []
    for name, kinds in state.items():
        for kind, saved in kinds.items():
            if kind not in OPTIMIZERS:
                raise ValueError(f"recompile.embedding_optimizer.load_state_dict: {name!r}: optimizer {kind!r} is not "
                                 f"one of {OPTIMIZERS}")
            fresh = _new_state(kind, params[name])
            if set(saved) != set(fresh):
                raise ValueError(f"recompile.embedding_optimizer.load_state_dict: {name!r} ({kind}) has state "
                                 f"{sorted(saved)}, expected {sorted(fresh)}")
            for key, value in saved.items():
                if isinstance(value, Tensor):
                    if value.shape != fresh[key].shape:
                        raise ValueError(f"recompile.embedding_optimizer.load_state_dict: {name!r} ({kind}) {key!r} "
                                         f"has shape {tuple(value.shape)}, expected {tuple(fresh[key].shape)}")
                    fresh[key].copy_(value)
                else:
                    fresh[key] = value
            loaded.append((params[name], kind, fresh))
    for weight, kind, fresh in loaded:
        STATES.setdefault(weight, {})[kind] = fresh


def _sgd(w, rows, g, state, p):
    w.index_add_(0, rows, (g * -p["lr"]).to(w.dtype))


def _adagrad(w, rows, g, state, p):
    s = state["sum"].index_add_(0, rows, g * g)[rows]
    w.index_add_(0, rows, (g / (s.sqrt() + p["eps"]) * -p["lr"]).to(w.dtype))


def _rowwise_adagrad(w, rows, g, state, p):
    s = state["sum"].index_add_(0, rows, (g * g).mean(1))[rows]
    w.index_add_(0, rows, (g / (s.sqrt() + p["eps"])[:, None] * -p["lr"]).to(w.dtype))


def adam_step_size(state: dict, p: dict) -> float:
    """Count a step of the table and return its bias-corrected learning rate."""
    state["step"] += 1
    return p["lr"] * math.sqrt(1 - p["beta2"] ** state["step"]) / (1 - p["beta1"] ** state["step"])


def _adam(w, rows, g, state, p):
    step_size = adam_step_size(state, p)
    b1, b2 = p["beta1"], p["beta2"]
    m = state["exp_avg"][rows].mul_(b1).add_(g, alpha=1 - b1)
    v = state["exp_avg_sq"][rows].mul_(b2).addcmul_(g, g, value=1 - b2)
    state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
    w.index_add_(0, rows, (m / (v.sqrt() + p["eps"]) * -step_size).to(w.dtype))


UPDATES: dict[str, Callable] = {
    "exact_sgd": _sgd, "exact_adagrad": _adagrad, "exact_rowwise_adagrad": _rowwise_adagrad, "adam": _adam,
}


def _fbgemm_sgd(grad: Tensor, weight: Tensor, feature: Feature, pooling: int, params: dict) -> None:
    """FBGEMM's CPU exact SGD on one table: deduplicates and updates the rows from the pooled gradient itself."""
    rows, dim = weight.shape
    n = feature.ids.numel()
    fbgemm_op(FBGEMM_UPDATES["exact_sgd"])(
        grad.contiguous(), weight.view(-1), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
        torch.tensor([0, dim], dtype=torch.int32), dim, torch.tensor([0, rows]), rows.bit_length(), feature.ids.long(),
        feature.bounds.long(), pooling, torch.ones(n), False, torch.tensor(params["lr"]), 0,
    )


# FBGEMM's CPU ops for the optimizers they compute like ours, and when one applies to a table.
FBGEMM_UPDATES = {"exact_sgd": "split_embedding_backward_codegen_sgd_cpu"}
FBGEMM_KERNELS = {"exact_sgd": _fbgemm_sgd}


def _fbgemm_applies(kind: str, weight: Tensor, psw, pooling: int, padding_idx: int) -> bool:
    return (kind in FBGEMM_KERNELS and pooling == SUM and psw is None and padding_idx < 0
            and weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu")


def _step_rows(grad, weight, feature, psw, pooling, padding_idx, layout, kind, params) -> None:
    """Our kernel: the ids' gradients, summed per touched row, then the optimizer's row update."""
    single = "sequence" if layout == "sequence" else "concat"
    id_grad = id_gradients(grad, [weight], [feature], [psw], [pooling], [padding_idx], single, [False])[0]
    rows, inverse = torch.unique(feature.ids, return_inverse=True)
    summed = torch.zeros(rows.numel(), weight.shape[1], dtype=torch.float32, device=weight.device)
    summed.index_add_(0, inverse, id_grad.float())
    UPDATES[kind](weight, rows, summed, table_state(weight, kind), params)


def step_each_table(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params, fbgemm) -> None:
    parts = output_slices(grad, [w.shape[1] for w in weights], [f.ids.numel() for f in features], layout)
    for g, w, f, psw, mode, pad in zip(parts, weights, features, per_sample_weights, pooling, padding_idx):
        if f.ids.numel() == 0:
            continue
        if fbgemm and _fbgemm_applies(kind, w, psw, mode, pad):
            FBGEMM_KERNELS[kind](g, w, f, mode, params)
        else:
            _step_rows(g, w, f, psw, mode, pad, layout, kind, params)


# Kernels: (grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params) -> None.
register_kernel(STEP_OP, "reference")(functools.partial(step_each_table, fbgemm=False))
register_kernel(STEP_OP, "fbgemm")(functools.partial(step_each_table, fbgemm=True))


@register_kernel(STEP_OP, "triton")
def _step_triton(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params) -> None:
    """Every table's touched rows in one launch (runtime.triton_kernels.embedding_optimizer), where it applies."""
    from .triton_kernels import embedding_optimizer as kernel

    if not kernel.supports(weights, kind):
        return step_each_table(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params,
                               fbgemm=False)
    states = [table_state(w, kind) if f.ids.numel() else {} for w, f in zip(weights, features)]  # as the reference
    step_sizes = [adam_step_size(state, params) if kind == "adam" and state else 0.0 for state in states]
    factors = [_id_scale(*args) for args in zip(features, per_sample_weights, pooling, padding_idx)]
    tensors = [[v for v in state.values() if isinstance(v, Tensor)] for state in states]
    kernel.optimizer_step(grad, weights, features, factors, tensors, step_sizes, layout, kind, params)


@torch.library.custom_op(
    "recompile::embedding_optimizer_step", mutates_args=("weights",),
    schema=f"(Tensor grad, {LOOKUP_SCHEMA.replace('Tensor[] weights', 'Tensor(a!)[] weights')}, str layout, str names, str bounds_check, str optimizer, str impl) -> Tensor",
)
def embedding_optimizer_step(grad, weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset,
                             layout, names, bounds_check, optimizer, impl) -> Tensor:
    """Apply ``optimizer`` to the rows of every table the lookup touched, from the gradient of the grouped
    output ``grad``; returns a zero scalar. ``impl``: ``"native"`` (runtime.embedding_native: all tables in one C
    call), ``"triton"`` (all tables in one launch), ``"fbgemm"`` (FBGEMM's CPU op where it applies) or
    ``"reference"``."""
    kind, params = parse_optimizer(optimizer)
    names, per_sample_weights = feature_names(names, len(weights)), present(per_sample_weights)
    features = features_of(weights, indices, offsets, include_last_offset, names, layout, bounds_check, check=False)
    with torch.no_grad():
        get_kernel(STEP_OP, impl)(grad, weights, features, per_sample_weights, pooling, padding_idx, layout, kind, params)
    return grad.new_zeros((), dtype=torch.float32)


@embedding_optimizer_step.register_fake
def _(grad, weights, indices, offsets, per_sample_weights, pooling, padding_idx, include_last_offset, layout, names,
      bounds_check, optimizer, impl):
    return grad.new_empty((), dtype=torch.float32)
