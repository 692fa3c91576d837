"""A unidirectional multi-layer GRU as one op: ``torch.ops.recompile.gru`` (and its ``gru_backward``).

``gru(input, hx, weights, has_biases, num_layers, batch_first, save)`` computes what
``torch.gru(input, hx, weights, has_biases, num_layers, 0.0, train, False, batch_first)`` does (``nn.GRU``'s
call once Dynamo traces it): ``input`` ``[T, B, I]`` (``[B, T, I]`` with ``batch_first``), ``hx`` ``[L, B, H]`` or
None (zeros), ``weights`` per layer ``[w_ih, w_hh, b_ih, b_hh]`` (``[w_ih, w_hh]`` without biases, as
``nn.GRU._flat_weights``). It returns ``(output, h_n, saved)``: with ``save`` (autograd will run through it)
``saved`` holds each layer's output but the last and each layer's gates ``r, z, n, hn`` per step (``[.., 4H]``),
which ``gru_backward`` reads instead of recomputing; without, ``saved`` is empty. No dropout between layers
(``recompile.passes.recurrent`` leaves a GRU that has one to ATen).

Why an op: ATen's ``gru`` is CompositeImplicitAutograd, so AOT autograd decomposes it into a handful of ops per
step and layer, forward and backward, and Inductor's compile of that graph takes several times a plain
compile's (``docs/recurrent.md``). As one op it stays one node in both graphs.

Kernels: ``reference`` (plain torch: the step formulas in a loop, forward and backward through time) and
``native`` (``csrc/gru.h``: input projections of all steps in one GEMM, a GEMM and one fused gate pass per step;
backward through time over the saved gates; float32, float64, bfloat16 and float16 on the CPU).
"""
from __future__ import annotations

from typing import Optional

import torch

from hkv.native import NativeLibrary
from .kernels import get_kernel, native_supports, register_kernel, require

OP, BACKWARD = "gru", "gru_backward"
DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
NATIVE = NativeLibrary("recompile.runtime._C", DTYPES)
available = NATIVE.available


def _layer_weights(weights: list[torch.Tensor], has_biases: bool, layer: int) -> list[Optional[torch.Tensor]]:
    k = 4 if has_biases else 2
    w = weights[layer * k:(layer + 1) * k]
    return w if has_biases else [*w, None, None]


def _steps(x: torch.Tensor, batch_first: bool) -> list[torch.Tensor]:
    return list(x.unbind(1 if batch_first else 0))


def gru_reference(input: torch.Tensor, hx: Optional[torch.Tensor], weights: list[torch.Tensor], has_biases: bool,
                  num_layers: int, batch_first: bool, save: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The GRU's step formulas in plain torch (the oracle; ``csrc/gru.h`` states them)."""
    dim = 1 if batch_first else 0
    batch = input.shape[1 - dim]
    x, last, outputs, gates = input, [], [], []
    for layer in range(num_layers):
        w_ih, w_hh, b_ih, b_hh = _layer_weights(weights, has_biases, layer)
        hidden = w_hh.shape[1]
        h = hx[layer] if hx is not None else input.new_zeros(batch, hidden)
        ys, gs = [], []
        for xt in _steps(x, batch_first):
            ir, iz, in_ = torch.nn.functional.linear(xt, w_ih, b_ih).chunk(3, 1)
            hr, hz, hn = torch.nn.functional.linear(h, w_hh, b_hh).chunk(3, 1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(in_ + r * hn)
            h = (1 - z) * n + z * h
            ys.append(h)
            gs.append(torch.cat([r, z, n, hn], 1))
        x = torch.stack(ys, dim) if ys else input.new_empty(*input.shape[:2], hidden)
        last.append(h)
        if save:
            outputs += [x] if layer + 1 < num_layers else []
            gates.append(torch.stack(gs, dim) if gs else input.new_empty(*input.shape[:2], 4 * hidden))
    return x, torch.stack(last), outputs + gates


def gru_backward_reference(grad_output: Optional[torch.Tensor], grad_hn: Optional[torch.Tensor],
                           input: torch.Tensor, hx: Optional[torch.Tensor], weights: list[torch.Tensor],
                           output: torch.Tensor, saved: list[torch.Tensor], has_biases: bool, num_layers: int,
                           batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Backward through time in plain torch over the gates ``gru_reference`` recomputes (``saved`` unread: a
    custom op's implementation runs below autograd, so this cannot differentiate the forward)."""
    dim = 1 if batch_first else 0
    _, _, kept = gru_reference(input, hx, weights, has_biases, num_layers, batch_first, True)
    outputs, gates = kept[:num_layers - 1] + [output], kept[num_layers - 1:]
    batch, hidden = input.shape[1 - dim], weights[1].shape[1]
    grad_weights, grad_h0, dy = [], [], grad_output
    for layer in reversed(range(num_layers)):
        w_ih, w_hh, _, _ = _layer_weights(weights, has_biases, layer)
        x, y = input if layer == 0 else outputs[layer - 1], outputs[layer]
        h0 = hx[layer] if hx is not None else input.new_zeros(batch, hidden)
        dh = grad_hn[layer] if grad_hn is not None else input.new_zeros(batch, hidden)
        ys, steps = _steps(y, batch_first), _steps(gates[layer], batch_first)
        dys = _steps(dy, batch_first) if dy is not None else [None] * len(ys)
        dgi, dgh = [None] * len(ys), [None] * len(ys)
        for t in reversed(range(len(ys))):
            dh = dh + dys[t] if dys[t] is not None else dh
            r, z, n, hn = steps[t].chunk(4, 1)
            dn = dh * (1 - z) * (1 - n * n)
            dr, dz = dn * hn * r * (1 - r), dh * ((ys[t - 1] if t else h0) - n) * z * (1 - z)
            dgi[t], dgh[t] = torch.cat([dr, dz, dn], 1), torch.cat([dr, dz, dn * r], 1)
            dh = dh * z + dgh[t] @ w_hh
        grad_h0.insert(0, dh)
        dgi_all, dgh_all = torch.stack(dgi, dim).flatten(0, 1), torch.stack(dgh, dim).flatten(0, 1)
        prev = torch.cat([h0.unsqueeze(dim), y.narrow(dim, 0, len(ys) - 1)], dim).flatten(0, 1)
        grads = [dgi_all.T @ x.flatten(0, 1), dgh_all.T @ prev]
        grad_weights[:0] = grads + ([dgi_all.sum(0), dgh_all.sum(0)] if has_biases else [])
        dy = (dgi_all @ w_ih).view(x.shape)
    return dy, torch.stack(grad_h0), grad_weights


register_kernel(OP, "reference")(gru_reference)
register_kernel(BACKWARD, "reference")(gru_backward_reference)


def native_reads(input: torch.Tensor, hx: Optional[torch.Tensor] = None, weights: list = (), **_) -> bool | str:
    return native_supports(NATIVE, input, hx, weights)


@register_kernel(OP, "native", supports=native_reads)
def _gru_native(input, hx, weights, has_biases, num_layers, batch_first, save):
    require(OP, "native", native_reads(input, hx, weights))
    return torch.ops.recompile_native.gru_fwd(input, hx, weights, has_biases, num_layers, batch_first, save)


@register_kernel(BACKWARD, "native", supports=native_reads)
def _gru_backward_native(grad_output, grad_hn, input, hx, weights, output, saved, has_biases, num_layers, batch_first):
    require(BACKWARD, "native", native_reads(input, hx, weights))
    return torch.ops.recompile_native.gru_bwd(grad_output, grad_hn, input, hx, weights, output, saved, has_biases,
                                              num_layers, batch_first)


def _check(input: torch.Tensor, hx: Optional[torch.Tensor], weights: list[torch.Tensor], has_biases: bool,
           num_layers: int, batch_first: bool) -> tuple[int, int, int]:
    """(T, B, H), or a clear error naming the argument at fault."""
    if input.dtype not in DTYPES:
        raise TypeError(f"recompile.gru: input has dtype {input.dtype}; the op takes "
                        f"{', '.join(sorted(str(d) for d in DTYPES))}")
    if input.dim() != 3:
        raise ValueError(f"recompile.gru: input must be 3-D ([T, B, I], or [B, T, I] with batch_first), got "
                         f"shape {tuple(input.shape)}")
    if num_layers < 1 or len(weights) != num_layers * (4 if has_biases else 2):
        raise ValueError(f"recompile.gru: {len(weights)} weights for {num_layers} layers "
                         f"({'with' if has_biases else 'without'} biases)")
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else input.shape[:2]
    if steps == 0:
        raise ValueError("recompile.gru: input has no steps (sequence length 0), as torch.gru refuses")
    hidden = weights[1].shape[1]
    for layer in range(num_layers):
        w_ih, w_hh = _layer_weights(weights, has_biases, layer)[:2]
        inputs = input.shape[2] if layer == 0 else hidden
        if tuple(w_ih.shape) != (3 * hidden, inputs) or tuple(w_hh.shape) != (3 * hidden, hidden):
            raise ValueError(f"recompile.gru: layer {layer}'s weights are {tuple(w_ih.shape)} and "
                             f"{tuple(w_hh.shape)}, expected {(3 * hidden, inputs)} and {(3 * hidden, hidden)}")
    if any(w.dtype != input.dtype for w in weights):
        raise TypeError(f"recompile.gru: weights must have the input's dtype {input.dtype}")
    if hx is not None and tuple(hx.shape) != (num_layers, batch, hidden):
        raise ValueError(f"recompile.gru: hx must be {(num_layers, batch, hidden)}, got {tuple(hx.shape)}")
    return steps, batch, hidden


@torch.library.custom_op("recompile::gru", mutates_args=())
def gru(input: torch.Tensor, hx: Optional[torch.Tensor], weights: list[torch.Tensor], has_biases: bool,
        num_layers: int, batch_first: bool, save: bool, impl: str
        ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(output, h_n, saved) of the GRU over ``input`` (the module's docstring)."""
    _check(input, hx, weights, has_biases, num_layers, batch_first)
    return get_kernel(OP, impl)(input, hx, weights, has_biases, num_layers, batch_first, save)


@gru.register_fake
def _(input, hx, weights, has_biases, num_layers, batch_first, save, impl):
    _, batch, hidden = _check(input, hx, weights, has_biases, num_layers, batch_first)
    sequence = input.new_empty(*input.shape[:2], hidden)
    saved = [sequence.new_empty(sequence.shape) for _ in range(num_layers - 1)] + [
        input.new_empty(*input.shape[:2], 4 * hidden) for _ in range(num_layers)] if save else []
    return sequence, input.new_empty(num_layers, batch, hidden), saved


@torch.library.custom_op("recompile::gru_backward", mutates_args=())
def gru_backward(grad_output: Optional[torch.Tensor], grad_hn: Optional[torch.Tensor], input: torch.Tensor,
                 hx: Optional[torch.Tensor], weights: list[torch.Tensor], output: torch.Tensor,
                 saved: list[torch.Tensor], has_biases: bool, num_layers: int, batch_first: bool, impl: str
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(grad_input, grad_hx, grad_weights) of ``gru(..., save=True)``; grad_hx is returned with no ``hx`` too."""
    _check(input, hx, weights, has_biases, num_layers, batch_first)
    return get_kernel(BACKWARD, impl)(grad_output, grad_hn, input, hx, weights, output, saved, has_biases,
                                      num_layers, batch_first)


@gru_backward.register_fake
def _(grad_output, grad_hn, input, hx, weights, output, saved, has_biases, num_layers, batch_first, impl):
    _, batch, hidden = _check(input, hx, weights, has_biases, num_layers, batch_first)
    return (torch.empty_like(input), input.new_empty(num_layers, batch, hidden),
            [torch.empty_like(w) for w in weights])


def _setup_context(ctx, inputs, output):
    input, hx, weights, has_biases, num_layers, batch_first, save, impl = inputs
    out, _, saved = output
    ctx.has_hx = hx is not None
    ctx.save_for_backward(input, *([hx] if ctx.has_hx else []), out, *weights, *saved)
    ctx.arguments = (has_biases, num_layers, batch_first, impl, len(weights), save)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_output, grad_hn, _grad_saved):
    has_biases, num_layers, batch_first, impl, n, save = ctx.arguments
    if grad_output is None and grad_hn is None:
        return None, None, None, None, None, None, None, None
    if not save:
        raise RuntimeError("recompile.gru: differentiated after a forward that saved nothing (save=False)")
    input, *rest = ctx.saved_tensors
    hx = rest.pop(0) if ctx.has_hx else None
    out, weights, saved = rest[0], rest[1:1 + n], rest[1 + n:]
    grad_input, grad_hx, grad_weights = gru_backward(grad_output, grad_hn, input, hx, weights, out, saved,
                                                     has_biases, num_layers, batch_first, impl)
    return grad_input, grad_hx if ctx.has_hx else None, grad_weights, None, None, None, None, None


gru.register_autograd(_backward, setup_context=_setup_context)
