"""Feature interactions: ``torch.ops.recompile.dot_interaction``, the DCN cross ops and ``fm_second_order``.

- ``dot_interaction(features, prefix, upper, self_interaction)``: the DLRM dot interaction. ``features``
  is a list of ``[B, D]`` (one feature each) and ``[B, n, D]`` tensors that together make the feature
  matrix ``T`` ``[B, F, D]`` (``T`` itself, or the items a model stacks: kernels that can read them in
  place never build ``T``). It computes only the needed pairwise dot products ``<f_r, f_c>``, in the
  order of ``triu_indices(F, F, 1)`` (``upper``, TorchRec) or ``tril_indices(F, F, -1)`` (the original
  DLRM), with the diagonal when ``self_interaction``; with a ``prefix`` ``[B, K]`` it writes the final
  ``cat([prefix, pairs], 1)`` layout directly.
- ``cross_layer(x0, x, weight, bias, down)``: a DCN-v2 cross layer, ``x0 * (x @ W^T + b) + x``, or the
  low-rank ``x0 * ((x @ V^T) @ U^T + b) + x`` when ``down`` (V) is given (``weight`` is U).
- ``cross_stack(x0, x, weights, biases, downs, save)``: L cross layers in a row over one ``x0`` (DCN-v2's
  cross stack), full or low rank, biases all or none; returns ``(x_L, saved)``, ``saved`` the per-layer
  results the backward reads (not differentiable; none unless ``save``: an inference graph keeps nothing).
- ``cross_mixture(x0, x, gate, downs, mids, ups, biases, activation, save)``: one DCN-Mix layer (TorchRec's
  ``LowRankMixtureCrossNet``), ``sum_e softmax(x G^T)_e * x0 * (U_e act(C_e act(V_e x)) + b_e) + x``; returns
  ``(out, saved)``, ``saved`` the gates and the experts' intermediates the backward reads (as ``cross_stack``).
- ``vector_cross(x0, x, weights, biases)``: L DCN-v1 cross layers ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l``
  (RecBole's DCN, TorchRec's ``VectorCrossNet``), a vector ``w_l`` [D] per layer, biases all or none; the
  backward recomputes the layers from the inputs (nothing else is saved).
- ``fm_second_order(v, reduce)``: the factorisation-machine second order term over ``v`` ``[B, F, D]``,
  ``0.5 * ((sum_f v)^2 - sum_f v^2)`` per dimension ``[B, D]``, or summed over D to ``[B, 1]``
  (``reduce``; the flattened TorchRec ``FactorizationMachine`` is ``v = x.unsqueeze(-1)`` with ``reduce``).

Kernels: ``reference`` (plain torch, the oracle), ``cpu`` (torch), ``native`` (C++, ``csrc/interaction.h``
through ``recompile.runtime.interaction_native``; chosen at compile time where it reads the inputs), ``triton``. Backward
passes are ops of their own (``dot_interaction_backward``, ``cross_epilogue_backward``,
``cross_stack_backward``, ``cross_mixture_backward``, ``vector_cross_backward``, ``fm_second_order_backward``).
The autograd of ``fm_second_order``, ``cross_stack`` and ``vector_cross`` on the CPU is C++ (``csrc/ops.cpp``, the
AutogradCPU key), so a CPU call runs no Python; the ``register_autograd`` formulas here serve the other devices (and
the other ops on the CPU).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import interaction_native as native
from .kernels import get_kernel, native_supports, register_kernel, require


# ---------------------------------------------------------------------------------------------
# dot interaction


@functools.lru_cache(maxsize=64)
def _pair_indices_cpu(num_features: int, upper: bool, self_interaction: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = num_features
    if upper:
        rows, cols = torch.triu_indices(n, n, 0 if self_interaction else 1)
    else:
        rows, cols = torch.tril_indices(n, n, 0 if self_interaction else -1)
    return rows, cols


def pair_indices(num_features: int, upper: bool, self_interaction: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the pairs ``dot_interaction`` returns, in its output order."""
    rows, cols = _pair_indices_cpu(num_features, upper, self_interaction)
    return rows.to(device), cols.to(device)


def flat_pair_indices(num_features: int, upper: bool, self_interaction: bool, device=None) -> torch.Tensor:
    """``rows * F + cols``: the pairs' positions in the flattened [F*F] product matrix."""
    rows, cols = _pair_indices_cpu(num_features, upper, self_interaction)
    return (rows * num_features + cols).to(device)


def num_pairs(num_features: int, self_interaction: bool) -> int:
    return num_features * (num_features + (1 if self_interaction else -1)) // 2


def feature_matrix(features: list[torch.Tensor]) -> torch.Tensor:
    """The [B, F, D] feature matrix the items ``[B, D]`` (one feature) or ``[B, n, D]`` (n features) make."""
    if len(features) == 1 and features[0].dim() == 3:
        return features[0]
    return torch.cat([t.unsqueeze(1) if t.dim() == 2 else t for t in features], 1)


def num_features(features: list[torch.Tensor]) -> int:
    return sum(1 if t.dim() == 2 else t.shape[1] for t in features)


def split_features(grad: torch.Tensor, features: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grad`` [B, F, D] split back into the items' shapes."""
    sizes = [1 if t.dim() == 2 else t.shape[1] for t in features]
    return [g.squeeze(1) if t.dim() == 2 else g for g, t in zip(grad.split(sizes, 1), features)]


def dot_interaction_reference(
    features: list[torch.Tensor], prefix: torch.Tensor | None, upper: bool, self_interaction: bool
) -> torch.Tensor:
    T = feature_matrix(features)
    dots = torch.bmm(T, T.transpose(1, 2))
    rows, cols = pair_indices(T.shape[1], upper, self_interaction, T.device)
    pairs = dots[:, rows, cols]
    return pairs if prefix is None else torch.cat([prefix, pairs], 1)


register_kernel("dot_interaction", "reference")(dot_interaction_reference)


@register_kernel("dot_interaction", "cpu")
def _dot_interaction_cpu(features, prefix, upper, self_interaction):
    """One bmm, then one index_select of the needed pairs from the flattened [B, F*F] products."""
    T = feature_matrix(features)
    batch, n, _ = T.shape
    dots = torch.bmm(T, T.transpose(1, 2)).view(batch, n * n)
    pairs = dots.index_select(1, flat_pair_indices(n, upper, self_interaction, T.device))
    return pairs if prefix is None else torch.cat([prefix, pairs], 1)


def native_reads(**arguments) -> bool | str:
    """``supports`` of the native kernels: every tensor argument is one the C++ operators read."""
    return native_supports(native.NATIVE, *arguments.values())


@register_kernel("dot_interaction", "native", supports=native_reads)
def _dot_interaction_native(features, prefix, upper, self_interaction):
    """Only the needed pairs, read from the items in place and written after the prefix (csrc/interaction.h)."""
    require("dot_interaction", "native", native_reads(features=features, prefix=prefix))
    return native.dot_interaction(features, prefix, upper, self_interaction)


@register_kernel("dot_interaction", "triton")
def _dot_interaction_triton(features, prefix, upper, self_interaction):
    from .triton_kernels.interaction import dot_interaction

    return dot_interaction(feature_matrix(features), prefix, upper, self_interaction)


def _check_dot_interaction(features: list[torch.Tensor], prefix: torch.Tensor | None) -> None:
    shapes = [tuple(t.shape) for t in features]
    batch = features[0].shape[0] if features else None
    ok = bool(features) and all(t.dim() in (2, 3) and t.dtype == features[0].dtype for t in features)
    ok = ok and all(t.shape[0] == batch and t.shape[-1] == features[0].shape[-1] for t in features)
    if not ok:
        raise ValueError(
            "recompile.dot_interaction: features must be one or more [B, D] or [B, n, D] tensors of one B, D and "
            f"dtype, got shapes {shapes} of {[t.dtype for t in features]}"
        )
    if prefix is not None and (prefix.dim() != 2 or prefix.shape[0] != batch or prefix.dtype != features[0].dtype):
        raise ValueError(
            f"recompile.dot_interaction: prefix must be [B, K] of {features[0].dtype} with B={batch}, "
            f"got shape {tuple(prefix.shape)} of {prefix.dtype}"
        )


@torch.library.custom_op("recompile::dot_interaction", mutates_args=())
def dot_interaction(
    features: list[torch.Tensor], prefix: torch.Tensor | None, upper: bool, self_interaction: bool,
    impl: str,
) -> torch.Tensor:
    _check_dot_interaction(features, prefix)
    return get_kernel("dot_interaction", impl)(features, prefix, upper, self_interaction)


@dot_interaction.register_fake
def _(features, prefix, upper, self_interaction, impl):
    _check_dot_interaction(features, prefix)
    k = 0 if prefix is None else prefix.shape[1]
    return features[0].new_empty(features[0].shape[0], k + num_pairs(num_features(features), self_interaction))


def dot_interaction_backward_reference(grad, features, k, upper, self_interaction):
    """d/dT of the pairs: scatter the pair grads into a [B, F, F] matrix G, then (G + G^T) @ T."""
    T = feature_matrix(features)
    batch, n, _ = T.shape
    g = grad.new_zeros(batch, n * n)
    g.index_copy_(1, flat_pair_indices(n, upper, self_interaction, T.device), grad[:, k:])
    g = g.view(batch, n, n)
    return split_features(torch.bmm(g + g.transpose(1, 2), T), features)


# The scatter and one bmm is the torch kernel of the backward on every device: the "cpu" and "triton" forwards'
# backward (there is no Triton backward kernel; the lowering's descriptions say so).
for _impl in ("reference", "cpu", "triton"):
    register_kernel("dot_interaction_backward", _impl)(dot_interaction_backward_reference)


@register_kernel("dot_interaction_backward", "native", supports=native_reads)
def _dot_interaction_backward_native(grad, features, k, upper, self_interaction):
    require("dot_interaction_backward", "native", native_reads(grad=grad, features=features))
    return native.dot_interaction_backward(grad, features, k, upper, self_interaction)


# The backward is an op of its own so that tracing it (aot_autograd, dynamic shapes) never builds the
# pair indices from a symbolic feature count.
@torch.library.custom_op("recompile::dot_interaction_backward", mutates_args=())
def dot_interaction_backward(
    grad: torch.Tensor, features: list[torch.Tensor], k: int, upper: bool, self_interaction: bool, impl: str
) -> list[torch.Tensor]:
    kernel = get_kernel("dot_interaction_backward", impl)
    return _unaliased(kernel(grad.contiguous(), features, k, upper, self_interaction))


def _unaliased(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous tensors of their own (views of one result, e.g. its splits, may not be an op's outputs)."""
    return [g.contiguous() if g._base is None else g.clone(memory_format=torch.contiguous_format) for g in grads]


@dot_interaction_backward.register_fake
def _(grad, features, k, upper, self_interaction, impl):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in features]


def _dot_setup(ctx, inputs, output):
    features, prefix, upper, self_interaction, impl = inputs
    ctx.save_for_backward(*features)
    ctx.config = (0 if prefix is None else prefix.shape[1], upper, self_interaction, prefix is not None, impl)


def _dot_backward(ctx, grad):
    k, upper, self_interaction, has_prefix, impl = ctx.config
    grads = dot_interaction_backward(grad, list(ctx.saved_tensors), k, upper, self_interaction, impl)
    return grads, grad[:, :k] if has_prefix else None, None, None, None


dot_interaction.register_autograd(_dot_backward, setup_context=_dot_setup)


# ---------------------------------------------------------------------------------------------
# DCN-v2 cross layer


def _cross_hidden(x, weight, bias, down):
    z = x if down is None else F.linear(x, down)
    return F.linear(z, weight, bias)


def cross_layer_reference(x0, x, weight, bias, down):
    return x0 * _cross_hidden(x, weight, bias, down) + x


register_kernel("cross_layer", "reference")(cross_layer_reference)


@register_kernel("cross_layer", "cpu")
def _cross_layer_cpu(x0, x, weight, bias, down):
    """The matmul, with the bias in addmm and ``x0 * h + x`` as one addcmul pass."""
    z = x if down is None else torch.mm(x, down.t())
    h = torch.mm(z, weight.t()) if bias is None else torch.addmm(bias, z, weight.t())
    return torch.addcmul(x, x0, h)


@register_kernel("cross_layer", "native", supports=native_reads)
def _cross_layer_native(x0, x, weight, bias, down):
    """The matmul through torch (MKL), then bias, ``x0 *`` and ``+ x`` as one native pass."""
    require("cross_layer", "native", native_reads(x0=x0, x=x, weight=weight, bias=bias, down=down))
    z = x if down is None else torch.mm(x, down.t())
    return native.cross_epilogue(x0, x, torch.mm(z, weight.t()), bias)


@register_kernel("cross_layer", "triton")
def _cross_layer_triton(x0, x, weight, bias, down):
    from .triton_kernels.interaction import cross_layer

    return cross_layer(x0, x, weight, bias, down)


def _check_cross_layer(x0, x, weight, bias, down):
    d = x.shape[-1]
    rank = weight.shape[1]
    ok = x0.shape == x.shape and x.dim() == 2 and weight.dim() == 2 and weight.shape[0] == d
    ok = ok and (bias is None or tuple(bias.shape) == (d,))
    ok = ok and (rank == d if down is None else tuple(down.shape) == (rank, d))
    if not ok:
        shapes = {n: None if t is None else tuple(t.shape) for n, t in
                  dict(x0=x0, x=x, weight=weight, bias=bias, down=down).items()}
        raise ValueError(
            "recompile.cross_layer: expected x0, x [B, D], weight [D, D] (or [D, r] with down [r, D]) "
            f"and bias [D]; got {shapes}"
        )


@torch.library.custom_op("recompile::cross_layer", mutates_args=())
def cross_layer(
    x0: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, down: torch.Tensor | None,
    impl: str,
) -> torch.Tensor:
    _check_cross_layer(x0, x, weight, bias, down)
    return get_kernel("cross_layer", impl)(x0, x, weight, bias, down)


@cross_layer.register_fake
def _(x0, x, weight, bias, down, impl):
    _check_cross_layer(x0, x, weight, bias, down)
    return torch.empty_like(x)


def _cross_setup(ctx, inputs, output):
    x0, x, weight, bias, down, impl = inputs
    ctx.save_for_backward(x0, x, weight, bias, down)
    ctx.impl = impl


def _epilogue_grads_torch(grad, x0, h, bias):
    """(grad_h, grad_x0, grad_bias) of ``x0 * (h + bias) + x``."""
    grad_h = grad * x0
    hb = h if bias is None else h + bias
    return grad_h, grad * hb, None if bias is None else grad_h.sum(0)


# The epilogue's backward is an op of its own so that aot_autograd traces it as one opaque call (the native
# kernel reads data pointers, which fake tensors do not have).
@torch.library.custom_op("recompile::cross_epilogue_backward", mutates_args=())
def cross_epilogue_backward(
    grad: torch.Tensor, x0: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, grad_x0, grad_bias) of ``x0 * (h + bias) + x``; grad_bias is empty without a bias."""
    if impl == "native":
        require("cross_epilogue_backward", impl, native_reads(grad=grad, x0=x0, h=h, bias=bias))
        grad_h, grad_x0, grad_bias = native.cross_epilogue_backward(grad, x0, h, bias)
    else:
        grad_h, grad_x0, grad_bias = _epilogue_grads_torch(grad, x0, h, bias)
    return grad_h, grad_x0, grad.new_empty(0) if grad_bias is None else grad_bias


@cross_epilogue_backward.register_fake
def _(grad, x0, h, bias, impl):
    return torch.empty_like(grad), torch.empty_like(grad), grad.new_empty(0) if bias is None else torch.empty_like(bias)


def _cross_backward(ctx, grad):
    """out = x0 * (h + b) + x with h = z W^T, z = x V^T (or x): h is recomputed, not stored."""
    x0, x, weight, bias, down = ctx.saved_tensors
    z = x if down is None else torch.mm(x, down.t())
    grad_h, grad_x0, grad_bias = cross_epilogue_backward(grad, x0, torch.mm(z, weight.t()), bias, ctx.impl)
    grad_weight = torch.mm(grad_h.t(), z)
    grad_z = torch.mm(grad_h, weight)
    grad_down = None if down is None else torch.mm(grad_z.t(), x)
    grad_x = grad + (grad_z if down is None else torch.mm(grad_z, down))
    return grad_x0, grad_x, grad_weight, None if bias is None else grad_bias, grad_down, None


cross_layer.register_autograd(_cross_backward, setup_context=_cross_setup)


# ---------------------------------------------------------------------------------------------
# DCN-v2 cross stack: L cross layers sharing x0 in one op


def cross_stack_reference(x0, x, weights, biases, downs):
    for layer, weight in enumerate(weights):
        x = cross_layer_reference(x0, x, weight, biases[layer] if biases else None, downs[layer] if downs else None)
    return x


def stack_saved(saved: list[torch.Tensor], x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_l, h_l + b_l) of ``layer`` from a cross stack's ``saved`` (2L - 1 [B, D] tensors: h_l + b_l for every
    layer, then the inputs x_1 .. x_{L-1}; x_0 is the stack's input ``x``)."""
    layers = (len(saved) + 1) // 2
    return (x if layer == 0 else saved[layers + layer - 1]), saved[layer]


def _cross_stack_torch(x0, x, weights, biases, downs, save=True):
    """(x_L, saved): per layer the matmul (MKL) with the bias, and ``x0 * hb + x`` as one addcmul pass; what the
    backward reads is these results, kept when ``save`` (one [B, D] tensor each: a single block would be a fresh
    mapping, page-faulted in, on every call; and an inference call keeps none, so that its memory is reused)."""
    hbs, inputs = [], []
    for layer, weight in enumerate(weights):
        z = x if not downs else torch.mm(x, downs[layer].t())
        hb = torch.addmm(biases[layer], z, weight.t()) if biases else torch.mm(z, weight.t())
        if save:
            hbs.append(hb)
            inputs.append(x)
        x = torch.addcmul(x, x0, hb)
    return x, hbs + inputs[1:]


@register_kernel("cross_stack", "reference")
def _cross_stack_reference_kernel(x0, x, weights, biases, downs, save):
    return (cross_stack_reference(x0, x, weights, biases, downs),
            _cross_stack_torch(x0, x, weights, biases, downs, save)[1])


register_kernel("cross_stack", "cpu")(_cross_stack_torch)


@register_kernel("cross_stack", "native", supports=native_reads)
def _cross_stack_native(x0, x, weights, biases, downs, save):
    require("cross_stack", "native", native_reads(x0=x0, x=x, weights=weights, biases=biases, downs=downs))
    return native.cross_stack(x0, x, weights, biases, downs, save)


@register_kernel("cross_stack", "triton")
def _cross_stack_triton(x0, x, weights, biases, downs, save):
    from .triton_kernels.interaction import cross_stack

    return cross_stack(x0, x, weights, biases, downs, save)


def _check_cross_stack(x0, x, weights, biases, downs):
    if not weights or len(biases) not in (0, len(weights)) or len(downs) not in (0, len(weights)):
        raise ValueError(
            "recompile.cross_stack: expected one or more weights and as many biases and downs (or none), got "
            f"{len(weights)} weights, {len(biases)} biases, {len(downs)} downs"
        )
    for layer, weight in enumerate(weights):
        try:
            _check_cross_layer(x0, x, weight, biases[layer] if biases else None, downs[layer] if downs else None)
        except ValueError as exc:
            raise ValueError(f"recompile.cross_stack: layer {layer}: {exc}") from None


@torch.library.custom_op("recompile::cross_stack", mutates_args=())
def cross_stack(
    x0: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
    downs: list[torch.Tensor], save: bool, impl: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(x_L, saved): L DCN-v2 cross layers ``x_{l+1} = x0 * (x_l W_l^T + b_l) + x_l`` (W_l = U_l V_l when
    ``downs`` are given) from ``x_0 = x``; ``saved`` holds what the backward reads (not differentiable)."""
    _check_cross_stack(x0, x, weights, biases, downs)
    return get_kernel("cross_stack", impl)(x0, x, weights, biases, downs, save)


@cross_stack.register_fake
def _(x0, x, weights, biases, downs, save, impl):
    _check_cross_stack(x0, x, weights, biases, downs)
    return torch.empty_like(x), [torch.empty_like(x) for _ in range(2 * len(weights) - 1 if save else 0)]


@torch.library.custom_op("recompile::cross_stack_backward", mutates_args=())
def cross_stack_backward(
    grad: torch.Tensor, x0: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], downs: list[torch.Tensor],
    saved: list[torch.Tensor], has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(grad_x0, grad_x, grad_weights, grad_biases, grad_downs), last layer first back to the first: per layer
    two (full rank) or four (low rank) matmuls; grad_x0 and the grad of x_l accumulate in place (a C pass for
    the elementwise part measured no faster than these ATen calls). On the CPU the same calls run from C++
    (csrc/ops.cpp ``cross_stack_backward_native``, below autograd): no Python per call."""
    grad_x0 = None
    g = grad
    grad_weights, grad_biases, grad_downs = [], [], []
    for layer in reversed(range(len(weights))):
        x_in, hb = stack_saved(saved, x, layer)
        grad_hb = g * x0
        grad_x0 = g * hb if grad_x0 is None else grad_x0.addcmul_(g, hb)
        z = x_in if not downs else torch.mm(x_in, downs[layer].t())
        grad_weights.append(torch.mm(grad_hb.t(), z))
        if has_bias:
            grad_biases.append(grad_hb.sum(0))
        if downs:
            grad_z = torch.mm(grad_hb, weights[layer])
            grad_downs.append(torch.mm(grad_z.t(), x_in))
            grad_hb, weight = grad_z, downs[layer]
        else:
            weight = weights[layer]
        g = torch.addmm(g, grad_hb, weight) if g is grad else g.addmm_(grad_hb, weight)  # g is ours after one
    return grad_x0, g if g is not grad else g.clone(), grad_weights[::-1], grad_biases[::-1], grad_downs[::-1]


@cross_stack_backward.register_fake
def _(grad, x0, x, weights, downs, saved, has_bias):
    # the weights' grads are mm outputs: contiguous, also for a weight passed as a transposed view (x @ W)
    return (torch.empty_like(x0), torch.empty_like(grad), [w.new_empty(w.shape) for w in weights],
            [grad.new_empty(w.shape[0]) for w in weights] if has_bias else [], [v.new_empty(v.shape) for v in downs])


def _keep_saved(ctx, saved: list[torch.Tensor]) -> None:
    """An op's ``saved`` outputs are for its backward only: not differentiable, and no zero-filled grads."""
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)


def _check_saved(op: str, saved: list[torch.Tensor], expected: int) -> None:
    if len(saved) != expected:
        raise RuntimeError(f"recompile.{op}: called with save=False (an inference graph), then differentiated")


def _cross_stack_setup(ctx, inputs, output):
    x0, x, weights, biases, downs, save, impl = inputs
    _keep_saved(ctx, output[1])
    ctx.save_for_backward(x0, x, *weights, *downs, *output[1])
    ctx.layers, ctx.has_bias, ctx.low_rank = len(weights), bool(biases), bool(downs)


def _cross_stack_backward(ctx, grad, grad_saved):
    x0, x, *params = ctx.saved_tensors
    layers, ranks = ctx.layers, ctx.layers if ctx.low_rank else 0
    weights, downs, saved = params[:layers], params[layers:layers + ranks], params[layers + ranks:]
    if grad is None:  # x_L unused (grads are not materialised)
        return None, None, [None] * layers, [None] * layers if ctx.has_bias else [], [None] * ranks, None, None
    _check_saved("cross_stack", saved, 2 * layers - 1)
    grad_x0, grad_x, grad_weights, grad_biases, grad_downs = cross_stack_backward(
        grad, x0, x, weights, downs, saved, ctx.has_bias)
    return grad_x0, grad_x, grad_weights, grad_biases, grad_downs, None, None


cross_stack.register_autograd(_cross_stack_backward, setup_context=_cross_stack_setup)


# ---------------------------------------------------------------------------------------------
# DCN-v2 mixture of low-rank experts (TorchRec LowRankMixtureCrossNet, one layer)

@dataclass(frozen=True)
class Activation:
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (grad of the output, the input) -> grad of the input


ACTIVATIONS = {
    "relu": Activation(torch.relu, lambda grad, pre: grad * (pre > 0)),
    "identity": Activation(lambda t: t, lambda grad, pre: grad),
}


def cross_mixture_reference(x0, x, gate, downs, mids, ups, biases, activation):
    """``sum_e g_e * x0 * (U_e act(C_e act(V_e x)) + b_e) + x`` with ``g = softmax(x G^T)`` over the experts
    (without ``mids``: ``U_e act(V_e x)``)."""
    act = ACTIVATIONS[activation].fn
    gates = torch.softmax(F.linear(x, gate), 1)
    out = x
    for e, (down, up) in enumerate(zip(downs, ups)):
        z = act(F.linear(x, down))
        if mids:
            z = act(F.linear(z, mids[e]))
        out = out + gates[:, e:e + 1] * (x0 * F.linear(z, up, biases[e] if biases else None))
    return out


def _mixture_forward(x0, x, gate, downs, mids, ups, biases, activation, save=True):
    """All experts in three matmuls: ``x [V_1; ...; V_E]^T``, the C_e as one bmm, and the U_e as one matmul over
    the gate-scaled ranks (``sum_e g_e z_e U_e^T = (g * z) [U_1 ... U_E]^T``); biases as ``g [b_1; ...]``, then
    ``x0 * y + x`` in one addcmul. Returns (out, saved): with ``save`` the gates ``[B, E]``, the pre-activations
    ``a = x V^T`` ``[B, E, r]``, ``y`` ``[B, D]`` and, with ``mids``, ``c = act(a) C^T`` ``[B, E, r]``."""
    act = ACTIVATIONS[activation].fn
    batch, experts, rank = x.shape[0], len(downs), downs[0].shape[0]
    gates = torch.softmax(torch.mm(x, gate.t()), 1)
    a = torch.mm(x, torch.cat(downs).t()).view(batch, experts, rank)
    z1 = act(a)
    c = torch.bmm(z1.transpose(0, 1), torch.stack(mids).transpose(1, 2)).transpose(0, 1) if mids else None
    z2 = z1 if c is None else act(c)
    y = torch.mm((z2 * gates.unsqueeze(2)).reshape(batch, experts * rank), torch.cat(ups, 1).t())
    if biases:
        y = torch.addmm(y, gates, torch.stack(biases))
    return torch.addcmul(x, x0, y), ([gates, a, y, *([] if c is None else [c])] if save else [])


register_kernel("cross_mixture", "cpu")(_mixture_forward)


@register_kernel("cross_mixture", "native", supports=native_reads)
def _cross_mixture_native(x0, x, gate, downs, mids, ups, biases, activation, save):
    """Inference: per tile of rows the gate, every expert and ``x0 * y + x`` in one C pass where the weights stay in
    cache (csrc/interaction.h; the same call, below autograd, serves compiled graphs without this Python).
    Training: the batched torch forward, whose intermediates its backward reads."""
    require("cross_mixture", "native", native_reads(x0=x0, x=x, gate=gate, downs=downs, mids=mids, ups=ups,
                                                    biases=biases))
    out = None if save else native.cross_mixture(x0, x, gate, downs, mids, ups, biases, activation)
    return (out, []) if out is not None else _mixture_forward(x0, x, gate, downs, mids, ups, biases, activation, save)


def _output_and_saved(kernel: Callable) -> Callable:
    """A kernel computing only the output, with the intermediates the backward reads from ``_mixture_forward``."""
    def run(x0, x, gate, downs, mids, ups, biases, activation, save):
        out = kernel(x0, x, gate, downs, mids, ups, biases, activation)
        return out, (_mixture_forward(x0, x, gate, downs, mids, ups, biases, activation)[1] if save else [])
    return run


register_kernel("cross_mixture", "reference")(_output_and_saved(cross_mixture_reference))


def _mixture_backward(grad, x0, x, gate, downs, mids, ups, biases, activation, saved):
    """The gradients of (x0, x, gate, *downs, *mids, *ups, *biases) from the forward's ``saved``."""
    act = ACTIVATIONS[activation]
    batch, experts, rank = x.shape[0], len(downs), downs[0].shape[0]
    gates, a, y, *rest = saved
    c = rest[0] if mids else None
    z1 = act.fn(a)
    z2 = z1 if c is None else act.fn(c)
    grad_x0, grad_y = grad * y, grad * x0
    s = (z2 * gates.unsqueeze(2)).reshape(batch, experts * rank)
    grad_ups = torch.mm(grad_y.t(), s).split(rank, 1)
    grad_s = torch.mm(grad_y, torch.cat(ups, 1)).view(batch, experts, rank)
    grad_gates = (grad_s * z2).sum(2)
    grad_biases = []
    if biases:
        grad_biases = list(torch.mm(gates.t(), grad_y).unbind(0))
        grad_gates = grad_gates + torch.mm(grad_y, torch.stack(biases).t())
    grad_z = grad_s * gates.unsqueeze(2)
    grad_mids = []
    if mids:
        grad_c = act.grad(grad_z, c).transpose(0, 1)  # [E, B, r]
        grad_mids = list(torch.bmm(grad_c.transpose(1, 2), z1.transpose(0, 1)).unbind(0))
        grad_z = torch.bmm(grad_c, torch.stack(mids)).transpose(0, 1)
    grad_a = act.grad(grad_z, a).reshape(batch, experts * rank)
    grad_downs = torch.mm(grad_a.t(), x).split(rank, 0)
    grad_logits = gates * (grad_gates - (grad_gates * gates).sum(1, keepdim=True))
    grad_x = grad + torch.mm(grad_a, torch.cat(downs)) + torch.mm(grad_logits, gate)
    return [grad_x0, grad_x, torch.mm(grad_logits.t(), x), *grad_downs, *grad_mids, *grad_ups, *grad_biases]


@register_kernel("cross_mixture", "triton")
@_output_and_saved
def _cross_mixture_triton(x0, x, gate, downs, mids, ups, biases, activation):
    """The fused Triton forward; training also runs the batched torch forward for what the backward reads."""
    from .triton_kernels.interaction import cross_mixture

    return cross_mixture(x0, x, gate, downs, mids, ups, biases, activation == "relu")


def _check_cross_mixture(x0, x, gate, downs, mids, ups, biases, activation):
    experts = len(downs)
    d = x.shape[-1]
    rank = downs[0].shape[0] if downs else 0
    ok = experts > 0 and x0.shape == x.shape and x.dim() == 2 and tuple(gate.shape) == (experts, d)
    ok = ok and len(ups) == experts and len(mids) in (0, experts) and len(biases) in (0, experts)
    ok = ok and all(tuple(v.shape) == (rank, d) for v in downs) and all(tuple(u.shape) == (d, rank) for u in ups)
    ok = ok and all(tuple(c.shape) == (rank, rank) for c in mids) and all(tuple(b.shape) == (d,) for b in biases)
    if not ok or activation not in ACTIVATIONS:
        raise ValueError(
            "recompile.cross_mixture: expected x0, x [B, D], gate [E, D], E downs [r, D], E ups [D, r], E or no "
            f"mids [r, r] and biases [D], activation in {sorted(ACTIVATIONS)}; got x {tuple(x.shape)}, "
            f"gate {tuple(gate.shape)}, downs {[tuple(v.shape) for v in downs]}, ups {[tuple(u.shape) for u in ups]}, "
            f"mids {[tuple(c.shape) for c in mids]}, biases {[tuple(b.shape) for b in biases]}, {activation!r}"
        )


@torch.library.custom_op("recompile::cross_mixture", mutates_args=())
def cross_mixture(
    x0: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, downs: list[torch.Tensor], mids: list[torch.Tensor],
    ups: list[torch.Tensor], biases: list[torch.Tensor], activation: str, save: bool, impl: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(out, saved): one DCN-Mix layer; ``saved`` holds what the backward reads (not differentiable; none unless
    ``save``)."""
    _check_cross_mixture(x0, x, gate, downs, mids, ups, biases, activation)
    return get_kernel("cross_mixture", impl)(x0, x, gate, downs, mids, ups, biases, activation, save)


@cross_mixture.register_fake
def _(x0, x, gate, downs, mids, ups, biases, activation, save, impl):
    _check_cross_mixture(x0, x, gate, downs, mids, ups, biases, activation)
    if not save:
        return torch.empty_like(x), []
    batch, experts, rank = x.shape[0], len(downs), downs[0].shape[0]
    c = [x.new_empty(experts, batch, rank).transpose(0, 1)] if mids else []  # the bmm's [E, B, r], transposed
    return torch.empty_like(x), [x.new_empty(batch, experts), x.new_empty(batch, experts, rank), torch.empty_like(x), *c]


@torch.library.custom_op("recompile::cross_mixture_backward", mutates_args=())
def cross_mixture_backward(
    grad: torch.Tensor, x0: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, downs: list[torch.Tensor],
    mids: list[torch.Tensor], ups: list[torch.Tensor], biases: list[torch.Tensor], activation: str,
    saved: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The gradients of (x0, x, gate, *downs, *mids, *ups, *biases) (``_mixture_backward``)."""
    return _unaliased(_mixture_backward(grad, x0, x, gate, downs, mids, ups, biases, activation, saved))


@cross_mixture_backward.register_fake
def _(grad, x0, x, gate, downs, mids, ups, biases, activation, saved):
    return [torch.empty_like(t) for t in (x0, x, gate, *downs, *mids, *ups, *biases)]


def _expert_params(params: list, experts: int, mids: int, biases: int) -> tuple[list, list, list, list, list]:
    """(downs, mids, ups, biases, the rest) from their concatenation."""
    e, m, b = experts, mids, biases
    return params[:e], params[e:e + m], params[e + m:2 * e + m], params[2 * e + m:2 * e + m + b], params[2 * e + m + b:]


def _cross_mixture_setup(ctx, inputs, output):
    x0, x, gate, downs, mids, ups, biases, activation, save, impl = inputs
    _keep_saved(ctx, output[1])
    ctx.save_for_backward(x0, x, gate, *downs, *mids, *ups, *biases, *output[1])
    ctx.sizes, ctx.activation = (len(downs), len(mids), len(biases)), activation


def _cross_mixture_backward(ctx, grad, grad_saved):
    x0, x, gate, *params = ctx.saved_tensors
    downs, mids, ups, biases, saved = _expert_params(params, *ctx.sizes)
    if grad is None:  # the output unused (grads are not materialised)
        return None, None, None, *_expert_params([None] * len(params), *ctx.sizes)[:4], None, None, None
    _check_saved("cross_mixture", saved, 4 if mids else 3)  # gates, a, y (and c)
    grad_x0, grad_x, grad_gate, *grads = cross_mixture_backward(grad, x0, x, gate, downs, mids, ups, biases,
                                                                ctx.activation, saved)
    return grad_x0, grad_x, grad_gate, *_expert_params(grads, *ctx.sizes)[:4], None, None, None


cross_mixture.register_autograd(_cross_mixture_backward, setup_context=_cross_mixture_setup)


# ---------------------------------------------------------------------------------------------
# DCN-v1 vector cross: L layers x_{l+1} = x0 * (x_l . w_l) + b_l + x_l in one op


def _flat(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layers' vectors as [D] (a weight or bias may come as [D], [1, D] or [D, 1])."""
    return [p.reshape(-1) for p in params]


def vector_cross_reference(x0, x, weights, biases):
    """Layer by layer, as DCN-v1 writes it."""
    for layer, w in enumerate(_flat(weights)):
        x = x0 * (x @ w).unsqueeze(1) + x
        if biases:
            x = x + biases[layer].reshape(-1)
    return x


register_kernel("vector_cross", "reference")(vector_cross_reference)


@register_kernel("vector_cross_backward", "reference")
def vector_cross_backward_reference(grad, x0, x, weights, biases):
    """Layer by layer, last first: ``g_l = g_{l+1} + (g_{l+1} . x0) w_l``."""
    inputs, scalars = [], []
    for layer, w in enumerate(_flat(weights)):
        inputs.append(x)
        scalars.append((x @ w).unsqueeze(1))
        x = vector_cross_reference(x0, x, weights[layer:layer + 1], biases[layer:layer + 1] if biases else [])
    g, grad_x0, grad_weights, grad_biases = grad, torch.zeros_like(x0), [], []
    for layer in reversed(range(len(weights))):
        ds = (g * x0).sum(1)
        grad_x0 = grad_x0 + g * scalars[layer]
        grad_weights.append((ds @ inputs[layer]).reshape(weights[layer].shape))
        if biases:
            grad_biases.append(g.sum(0).reshape(biases[layer].shape))
        g = g + ds.unsqueeze(1) * weights[layer].reshape(-1)
    return grad_x0, g, grad_weights[::-1], grad_biases[::-1]


def _vector_cross_scalars(x0, x, W, Bc):
    """(s, S): the layers' scalars ``s_l = x_l . w_l`` [B, L] and their exclusive prefix sums ``S_l``, from two
    [B, D] x [D, L] matmuls: ``x_l = x + x0 * S_l + Bc_l`` (``Bc_l`` the biases before layer l), so
    ``s_l = x . w_l + S_l (x0 . w_l) + Bc_l . w_l``."""
    P, Q = torch.mm(x, W.t()), torch.mm(x0, W.t())
    c = (Bc * W).sum(1) if Bc is not None else None
    s, S = torch.empty_like(P), torch.empty_like(P)
    total = P.new_zeros(P.shape[0])
    for layer in range(W.shape[0]):
        S[:, layer] = total
        s[:, layer] = torch.addcmul(P[:, layer], total, Q[:, layer]) + (0 if c is None else c[layer])
        total = total + s[:, layer]
    return s, S, Q


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, 0) - t


def _vector_cross_params(weights, biases, dtype):
    W = torch.stack(_flat(weights)).to(dtype)
    Bm = torch.stack(_flat(biases)).to(dtype) if biases else None
    return W, Bm


@register_kernel("vector_cross", "cpu")
def _vector_cross_torch(x0, x, weights, biases):
    """All layers from two matmuls and one ``x + x0 * S_L + sum_l b_l`` pass (``_vector_cross_scalars``), in
    float32 for 16-bit inputs."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x0f, xf = x0.to(acc), x.to(acc)
    W, Bm = _vector_cross_params(weights, biases, acc)
    s, S, _ = _vector_cross_scalars(x0f, xf, W, None if Bm is None else _exclusive_cumsum(Bm))
    base = xf if Bm is None else xf + Bm.sum(0)
    return torch.addcmul(base, x0f, (S[:, -1] + s[:, -1]).unsqueeze(1)).to(x.dtype)


def vector_cross_backward_torch(grad, x0, x, weights, biases):
    """(grad_x0, grad_x, grad_weights, grad_biases) in closed form from ``g_{l+1} = G + sum_{k>l} ds_k w_k``:
    ``ds_l = G . x0 + sum_{k>l} ds_k (x0 . w_k)``, grad_x = ``G + ds W``, grad_x0 = ``G S_L + (ds S) W``,
    grad_w_l = ``ds_l^T x + (ds_l S_l)^T x0 + sum(ds_l) Bc_l``, grad_b_l = ``sum(G) + sum_{k>l} sum(ds_k) w_k``."""
    acc = torch.promote_types(x.dtype, torch.float32)
    G, x0f, xf = grad.to(acc), x0.to(acc), x.to(acc)
    W, Bm = _vector_cross_params(weights, biases, acc)
    Bc = None if Bm is None else _exclusive_cumsum(Bm)
    s, S, Q = _vector_cross_scalars(x0f, xf, W, Bc)
    R = (G * x0f).sum(1)
    ds, carry = torch.empty_like(s), torch.zeros_like(R)
    for layer in reversed(range(W.shape[0])):
        ds[:, layer] = R + carry
        carry = torch.addcmul(carry, ds[:, layer], Q[:, layer])
    dsS = ds * S
    grad_x = torch.addmm(G, ds, W)
    grad_x0 = torch.addmm(G * (S[:, -1] + s[:, -1]).unsqueeze(1), dsS, W)
    grad_W = torch.addmm(torch.mm(ds.t(), xf), dsS.t(), x0f)
    grad_biases = []
    if Bm is not None:
        col = ds.sum(0).unsqueeze(1)  # [L, 1]
        grad_W = grad_W + col * Bc
        later = torch.flip(_exclusive_cumsum(torch.flip(col * W, (0,))), (0,))  # sum_{k>l} sum(ds_k) w_k
        grad_biases = [(G.sum(0) + later[layer]).to(b.dtype).reshape(b.shape) for layer, b in enumerate(biases)]
    grad_weights = [grad_W[layer].to(w.dtype).reshape(w.shape) for layer, w in enumerate(weights)]
    return grad_x0.to(x0.dtype), grad_x.to(x.dtype), grad_weights, grad_biases


register_kernel("vector_cross_backward", "cpu")(vector_cross_backward_torch)


@register_kernel("vector_cross", "native", supports=native_reads)
def _vector_cross_native(x0, x, weights, biases):
    """Per sample, the layers over one row kept in registers and L1 (csrc/interaction.h): x and x0 read once,
    the output written once."""
    require("vector_cross", "native", native_reads(x0=x0, x=x, weights=weights, biases=biases))
    return native.vector_cross(x0, x, _flat(weights), _flat(biases))


@register_kernel("vector_cross_backward", "native", supports=native_reads)
def _vector_cross_backward_native(grad, x0, x, weights, biases):
    require("vector_cross_backward", "native", native_reads(grad=grad, x0=x0, x=x, weights=weights, biases=biases))
    grad_x0, grad_x, grad_W, grad_B = native.vector_cross_backward(grad, x0, x, _flat(weights), _flat(biases))
    return (grad_x0, grad_x, [g.to(w.dtype).reshape(w.shape) for g, w in zip(grad_W, weights)],
            [g.to(b.dtype).reshape(b.shape) for g, b in zip(grad_B, biases)] if biases else [])


def _check_vector_cross(x0, x, weights, biases):
    d = x.shape[-1] if x.dim() else None
    ok = x.dim() == 2 and x0.shape == x.shape and bool(weights) and len(biases) in (0, len(weights))
    ok = ok and all(p.dim() <= 2 and p.numel() == d and p.dtype == x.dtype for p in (*weights, *biases))
    if not ok or x0.dtype != x.dtype:
        raise ValueError(
            "recompile.vector_cross: expected x0, x [B, D] of one dtype, one or more weights of D elements ([D], "
            "[1, D] or [D, 1]) and as many biases (or none), all of that dtype; got x0 "
            f"{tuple(x0.shape)} {x0.dtype}, x {tuple(x.shape)} {x.dtype}, weights "
            f"{[(tuple(w.shape), w.dtype) for w in weights]}, biases {[(tuple(b.shape), b.dtype) for b in biases]}"
        )


@torch.library.custom_op("recompile::vector_cross", mutates_args=())
def vector_cross(
    x0: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], impl: str
) -> torch.Tensor:
    """x_L of L DCN-v1 cross layers ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l`` from ``x_0 = x``. The backward
    recomputes the layers from the inputs (nothing saved but them)."""
    _check_vector_cross(x0, x, weights, biases)
    return get_kernel("vector_cross", impl)(x0, x, weights, biases)


@vector_cross.register_fake
def _(x0, x, weights, biases, impl):
    _check_vector_cross(x0, x, weights, biases)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("recompile::vector_cross_backward", mutates_args=())
def vector_cross_backward(
    grad: torch.Tensor, x0: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(grad_x0, grad_x, grad_weights, grad_biases) of ``vector_cross``, each in its input's shape."""
    grad_x0, grad_x, grad_weights, grad_biases = get_kernel("vector_cross_backward", impl)(
        grad, x0, x, weights, biases)
    fresh = functools.partial(torch.clone, memory_format=torch.contiguous_format)  # [D] each: rows of one [L, D]
    return grad_x0.contiguous(), grad_x.contiguous(), [fresh(g) for g in grad_weights], [fresh(g) for g in grad_biases]


@vector_cross_backward.register_fake
def _(grad, x0, x, weights, biases, impl):
    like = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)
    return like(x0), like(x), [like(w) for w in weights], [like(b) for b in biases]


def _vector_cross_setup(ctx, inputs, output):
    x0, x, weights, biases, impl = inputs
    ctx.save_for_backward(x0, x, *weights, *biases)
    ctx.layers, ctx.impl = len(weights), impl


def _vector_cross_backward(ctx, grad):
    x0, x, *params = ctx.saved_tensors
    weights, biases = params[:ctx.layers], params[ctx.layers:]
    grad_x0, grad_x, grad_weights, grad_biases = vector_cross_backward(grad, x0, x, weights, biases, ctx.impl)
    return grad_x0, grad_x, grad_weights, grad_biases, None


vector_cross.register_autograd(_vector_cross_backward, setup_context=_vector_cross_setup)


# ---------------------------------------------------------------------------------------------
# factorisation machine, second order


def fm_second_order_reference(v: torch.Tensor, reduce: bool) -> torch.Tensor:
    s = v.sum(1)
    out = 0.5 * (s * s - (v * v).sum(1))
    return out.sum(1, keepdim=True) if reduce else out


register_kernel("fm_second_order", "reference")(fm_second_order_reference)


@register_kernel("fm_second_order", "cpu")
def _fm_cpu(v, reduce):
    """Sum and sum of squares accumulated in fp32, combined in place."""
    acc = v.to(torch.promote_types(v.dtype, torch.float32))
    out = acc.sum(1).square_().sub_(acc.square().sum(1)).mul_(0.5)
    return (out.sum(1, keepdim=True) if reduce else out).to(v.dtype)


@register_kernel("fm_second_order", "native", supports=native_reads)
def _fm_native(v, reduce):
    """Sum and sum of squares per sample in one pass over the fields (csrc/interaction.h)."""
    require("fm_second_order", "native", native_reads(v=v))
    return native.fm_second_order(v, reduce)


@register_kernel("fm_second_order", "triton")
def _fm_triton(v, reduce):
    from .triton_kernels.interaction import fm_second_order

    return fm_second_order(v, reduce)


def _check_fm(v):
    if v.dim() != 3:
        raise ValueError(f"recompile.fm_second_order: v must be [B, F, D], got shape {tuple(v.shape)}")


@torch.library.custom_op("recompile::fm_second_order", mutates_args=())
def fm_second_order(v: torch.Tensor, reduce: bool, impl: str) -> torch.Tensor:
    _check_fm(v)
    return get_kernel("fm_second_order", impl)(v, reduce)


@fm_second_order.register_fake
def _(v, reduce, impl):
    _check_fm(v)
    return v.new_empty(v.shape[0], 1 if reduce else v.shape[2])


def fm_second_order_backward_reference(grad: torch.Tensor, v: torch.Tensor, reduce: bool) -> torch.Tensor:
    """d out_d / d v_fd = grad_d (sum_f v_fd - v_fd) (``grad`` [B, D], or [B, 1] with ``reduce``)."""
    return grad.unsqueeze(1) * (v.sum(1, keepdim=True) - v)


for _impl in ("reference", "cpu", "triton"):  # the torch formula: one broadcast pass, on any device
    register_kernel("fm_second_order_backward", _impl)(fm_second_order_backward_reference)


@register_kernel("fm_second_order_backward", "native", supports=native_reads)
def _fm_backward_native(grad, v, reduce):
    require("fm_second_order_backward", "native", native_reads(grad=grad, v=v))
    return native.fm_second_order_backward(grad, v, reduce)


@torch.library.custom_op("recompile::fm_second_order_backward", mutates_args=())
def fm_second_order_backward(grad: torch.Tensor, v: torch.Tensor, reduce: bool, impl: str) -> torch.Tensor:
    """The gradient of ``v`` (an op, like the epilogue's: the native kernel reads pointers)."""
    return get_kernel("fm_second_order_backward", impl)(grad, v, reduce)


@fm_second_order_backward.register_fake
def _(grad, v, reduce, impl):
    return torch.empty_like(v)


# On the CPU the autograd of fm_second_order is C++ (csrc/ops.cpp's FmSecondOrder, the AutogradCPU key: no Python
# per call); this formula, the same, serves the other devices.
def _fm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.reduce, ctx.impl = inputs[1], inputs[2]


def _fm_backward(ctx, grad):
    (v,) = ctx.saved_tensors
    return fm_second_order_backward(grad, v, ctx.reduce, ctx.impl), None, None


fm_second_order.register_autograd(_fm_backward, setup_context=_fm_setup)
