"""Unidirectional multi-layer GRU and LSTM as one op each: ``torch.ops.recompile.gru`` / ``recompile.lstm`` (and
their ``*_backward``).

``gru(input, hx, weights, has_biases, num_layers, batch_first, save)`` computes what
``torch.gru(input, hx, weights, has_biases, num_layers, 0.0, train, False, batch_first)`` does (``nn.GRU``'s
call once Dynamo traces it) and ``lstm(input, hx, cx, weights, ...)`` what ``torch.lstm(input, (hx, cx), ...)``
does (``nn.LSTM``'s): ``input`` ``[T, B, I]`` (``[B, T, I]`` with ``batch_first``), the initial states ``hx``
(and the LSTM's cell state ``cx``) ``[L, B, H]`` or None (zeros), ``weights`` per layer ``[w_ih, w_hh, b_ih, b_hh]``
(``[w_ih, w_hh]`` without biases, as the module's ``_flat_weights``). They return ``(output, h_n, saved)`` and
``(output, h_n, c_n, saved)``: with ``save`` (autograd will run through it) ``saved`` holds each layer's output but
the last and each layer's gates per step, which the backward reads instead of recomputing (GRU: ``r, z, n, hn``,
``[.., 4H]``; LSTM: ``i, f, g, o`` and the cell state ``c``, ``[.., 5H]``); without, ``saved`` is empty. No
dropout between layers, no LSTM projections (``recompile.passes.recurrent`` leaves those to ATen).

Why an op: ATen's ``gru`` / ``lstm`` are CompositeImplicitAutograd, so AOT autograd decomposes them into a handful
of ops per step and layer, forward and backward, and Inductor's compile of that graph takes several times a plain
compile's (``docs/recurrent.md``). As one op each stays one node in both graphs, and its sizes stay symbolic: while
rec_ascend traces, Dynamo computes ``torch.gru`` / ``torch.lstm``'s example values through these ops
(``symbolic_steps``) rather than ATen's step loop, which fixes the sequence length.

Kernels: ``reference`` (plain torch: the step formulas in a loop, forward and backward through time),
``native`` (``csrc/gru.h``, ``csrc/lstm.h``: input projections of all steps in one GEMM, a GEMM and one fused gate
pass per step; backward through time over the saved gates; float32, float64, bfloat16 and float16 on the CPU) and,
for an LSTM's inference call, ``aten`` (ATen's LSTM below autograd: oneDNN's on the CPU). Autograd: the formula
below for the Autograd key; on the CPU ``csrc/ops.cpp`` registers the same in C++ for AutogradCPU (no Python per
call, forward or backward).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch._C import DispatchKey

from hkv.native import NativeLibrary
from .kernels import get_kernel, native_supports, register_kernel, require

DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
NATIVE = NativeLibrary("recompile.runtime._C", DTYPES)
available = NATIVE.available
GATES = {"gru": 3, "lstm": 4}  # rows of w_ih per hidden unit


def _layer_weights(weights: list[torch.Tensor], has_biases: bool, layer: int) -> list[Optional[torch.Tensor]]:
    k = 4 if has_biases else 2
    w = weights[layer * k:(layer + 1) * k]
    return w if has_biases else [*w, None, None]


def _steps(x: torch.Tensor, batch_first: bool) -> list[torch.Tensor]:
    return list(x.unbind(1 if batch_first else 0))


# The cells in plain torch: a step maps (gi, gh, states) to (states, saved gates), gi and gh the input's and the
# hidden state's projections (biases in); a step back maps the states' gradients (the output's added) to the
# previous states' gradients and the gradients of gi and gh.

def _gru_step(gi, gh, states):
    (h,) = states
    ir, iz, in_ = gi.chunk(3, 1)
    hr, hz, hn = gh.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    n = torch.tanh(in_ + r * hn)
    return ((1 - z) * n + z * h,), torch.cat([r, z, n, hn], 1)


def _gru_step_back(d, gates, prev, w_hh):
    (dh,), (h,) = d, prev
    r, z, n, hn = gates.chunk(4, 1)
    dn = dh * (1 - z) * (1 - n * n)
    dr, dz = dn * hn * r * (1 - r), dh * (h - n) * z * (1 - z)
    dgh = torch.cat([dr, dz, dn * r], 1)
    return (dh * z + dgh @ w_hh,), torch.cat([dr, dz, dn], 1), dgh


def _lstm_step(gi, gh, states):
    _, c = states
    ai, af, ag, ao = (gi + gh).chunk(4, 1)
    i, f, g, o = torch.sigmoid(ai), torch.sigmoid(af), torch.tanh(ag), torch.sigmoid(ao)
    c = f * c + i * g
    return (o * torch.tanh(c), c), torch.cat([i, f, g, o, c], 1)


def _lstm_step_back(d, gates, prev, w_hh):
    (dh, dc), (_, c_prev) = d, prev
    i, f, g, o, c = gates.chunk(5, 1)
    tc = torch.tanh(c)
    dc = dc + dh * o * (1 - tc * tc)
    dg = torch.cat([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g), dh * tc * o * (1 - o)], 1)
    return (dg @ w_hh, dc * f), dg, dg


def _states_after(kind: str, y: torch.Tensor, gates: torch.Tensor) -> tuple:
    """The states after a step from its output and saved gates."""
    return (y,) if kind == "gru" else (y, gates.chunk(5, 1)[4])


CELLS = {"gru": (_gru_step, _gru_step_back), "lstm": (_lstm_step, _lstm_step_back)}


def _initial(states: tuple, layer: int, batch: int, hidden: int, like: torch.Tensor) -> tuple:
    return tuple(s[layer] if s is not None else like.new_zeros(batch, hidden) for s in states)


def recurrent_reference(kind: str, input: torch.Tensor, states: tuple, weights: list[torch.Tensor],
                        has_biases: bool, num_layers: int, batch_first: bool, save: bool) -> tuple:
    """``(output, *final states, saved)`` of the ``kind`` cell's layers by its step formulas in plain torch (the
    oracle; ``csrc/gru.h`` / ``csrc/lstm.h`` state them)."""
    step = CELLS[kind][0]
    dim = 1 if batch_first else 0
    batch = input.shape[1 - dim]
    x, finals, outputs, gates = input, [], [], []
    for layer in range(num_layers):
        w_ih, w_hh, b_ih, b_hh = _layer_weights(weights, has_biases, layer)
        state = _initial(states, layer, batch, w_hh.shape[1], input)
        ys, gs = [], []
        for xt in _steps(x, batch_first):
            state, g = step(F.linear(xt, w_ih, b_ih), F.linear(state[0], w_hh, b_hh), state)
            ys.append(state[0])
            gs.append(g)
        x = torch.stack(ys, dim)
        finals.append(state)
        if save:
            outputs += [x] if layer + 1 < num_layers else []
            gates.append(torch.stack(gs, dim))
    return (x, *(torch.stack(s) for s in zip(*finals)), outputs + gates)


def recurrent_backward_reference(kind: str, grad_output: Optional[torch.Tensor], grad_finals: tuple,
                                 input: torch.Tensor, states: tuple, weights: list[torch.Tensor],
                                 output: torch.Tensor, has_biases: bool, num_layers: int, batch_first: bool) -> tuple:
    """``(grad_input, *grad_states, grad_weights)``: backward through time in plain torch over the gates
    ``recurrent_reference`` recomputes (the saved ones are unread: a custom op's implementation runs below
    autograd, so this cannot differentiate the forward)."""
    step_back = CELLS[kind][1]
    dim = 1 if batch_first else 0
    kept = recurrent_reference(kind, input, states, weights, has_biases, num_layers, batch_first, True)[-1]
    outputs, gates = kept[:num_layers - 1] + [output], kept[num_layers - 1:]
    batch, hidden = input.shape[1 - dim], weights[1].shape[1]
    grad_weights, grad_states, dy = [], [], grad_output
    for layer in reversed(range(num_layers)):
        w_ih, w_hh, _, _ = _layer_weights(weights, has_biases, layer)
        x, y = input if layer == 0 else outputs[layer - 1], outputs[layer]
        first = _initial(states, layer, batch, hidden, input)
        d = _initial(grad_finals, layer, batch, hidden, input)
        ys, steps = _steps(y, batch_first), _steps(gates[layer], batch_first)
        dys = _steps(dy, batch_first) if dy is not None else [None] * len(ys)
        dgi, dgh = [None] * len(ys), [None] * len(ys)
        for t in reversed(range(len(ys))):
            d = (d[0] + dys[t], *d[1:]) if dys[t] is not None else d
            prev = _states_after(kind, ys[t - 1], steps[t - 1]) if t else first
            d, dgi[t], dgh[t] = step_back(d, steps[t], prev, w_hh)
        grad_states.insert(0, d)
        dgi_all, dgh_all = torch.stack(dgi, dim).flatten(0, 1), torch.stack(dgh, dim).flatten(0, 1)
        prev = torch.cat([first[0].unsqueeze(dim), y.narrow(dim, 0, len(ys) - 1)], dim).flatten(0, 1)
        grads = [dgi_all.T @ x.flatten(0, 1), dgh_all.T @ prev]
        grad_weights[:0] = grads + ([dgi_all.sum(0), dgh_all.sum(0)] if has_biases else [])
        dy = (dgi_all @ w_ih).view(x.shape)
    return (dy, *(torch.stack(s) for s in zip(*grad_states)), grad_weights)


def native_reads(input: torch.Tensor, hx: Optional[torch.Tensor] = None, weights: list = (),
                 cx: Optional[torch.Tensor] = None, **_) -> bool | str:
    return native_supports(NATIVE, input, hx, cx, weights)


def _check(kind: str, input: torch.Tensor, states: tuple, weights: list[torch.Tensor], has_biases: bool,
           num_layers: int, batch_first: bool) -> tuple[int, int]:
    """(B, H), or a clear error naming the op and the argument at fault."""
    op, gates = f"recompile.{kind}", GATES[kind]
    if input.dtype not in DTYPES:
        raise TypeError(f"{op}: input has dtype {input.dtype}; the op takes "
                        f"{', '.join(sorted(str(d) for d in DTYPES))}")
    if input.dim() != 3:
        raise ValueError(f"{op}: input must be 3-D ([T, B, I], or [B, T, I] with batch_first), got "
                         f"shape {tuple(input.shape)}")
    if num_layers < 1 or len(weights) != num_layers * (4 if has_biases else 2):
        raise ValueError(f"{op}: {len(weights)} weights for {num_layers} layers "
                         f"({'with' if has_biases else 'without'} biases)")
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else input.shape[:2]
    if steps == 0:
        raise ValueError(f"{op}: input has no steps (sequence length 0), as torch.{kind} refuses")
    hidden = weights[1].shape[1]
    for layer in range(num_layers):
        w_ih, w_hh = _layer_weights(weights, has_biases, layer)[:2]
        inputs = input.shape[2] if layer == 0 else hidden
        if tuple(w_ih.shape) != (gates * hidden, inputs) or tuple(w_hh.shape) != (gates * hidden, hidden):
            raise ValueError(f"{op}: layer {layer}'s weights are {tuple(w_ih.shape)} and {tuple(w_hh.shape)}, "
                             f"expected {(gates * hidden, inputs)} and {(gates * hidden, hidden)}")
    if any(w.dtype != input.dtype for w in weights):
        raise TypeError(f"{op}: weights must have the input's dtype {input.dtype}")
    for name, state in zip(("hx", "cx"), states):
        if state is not None and tuple(state.shape) != (num_layers, batch, hidden):
            raise ValueError(f"{op}: {name} must be {(num_layers, batch, hidden)}, got {tuple(state.shape)}")
    return batch, hidden


def _fake(kind: str, input, states, weights, has_biases, num_layers, batch_first, save) -> tuple:
    batch, hidden = _check(kind, input, states, weights, has_biases, num_layers, batch_first)
    sequence = input.new_empty(*input.shape[:2], hidden)
    width = {"gru": 4, "lstm": 5}[kind] * hidden
    saved = [sequence.new_empty(sequence.shape) for _ in range(num_layers - 1)] + [
        input.new_empty(*input.shape[:2], width) for _ in range(num_layers)] if save else []
    return (sequence, *(input.new_empty(num_layers, batch, hidden) for _ in states), saved)


def _fake_backward(kind: str, input, states, weights, has_biases, num_layers, batch_first) -> tuple:
    batch, hidden = _check(kind, input, states, weights, has_biases, num_layers, batch_first)
    return (torch.empty_like(input), *(input.new_empty(num_layers, batch, hidden) for _ in states),
            [torch.empty_like(w) for w in weights])


# The ops. Their schemas differ by the states (a GRU's h, an LSTM's h and c); all else is shared by ``kind``.

@torch.library.custom_op("recompile::gru", mutates_args=())
def gru(input: torch.Tensor, hx: Optional[torch.Tensor], weights: list[torch.Tensor], has_biases: bool,
        num_layers: int, batch_first: bool, save: bool, impl: str
        ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(output, h_n, saved) of the GRU over ``input`` (the module's docstring)."""
    _check("gru", input, (hx,), weights, has_biases, num_layers, batch_first)
    return get_kernel("gru", impl)(input, hx, weights, has_biases, num_layers, batch_first, save)


@gru.register_fake
def _(input, hx, weights, has_biases, num_layers, batch_first, save, impl):
    return _fake("gru", input, (hx,), weights, has_biases, num_layers, batch_first, save)


@torch.library.custom_op("recompile::gru_backward", mutates_args=())
def gru_backward(grad_output: Optional[torch.Tensor], grad_hn: Optional[torch.Tensor], input: torch.Tensor,
                 hx: Optional[torch.Tensor], weights: list[torch.Tensor], output: torch.Tensor,
                 saved: list[torch.Tensor], has_biases: bool, num_layers: int, batch_first: bool, impl: str
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(grad_input, grad_hx, grad_weights) of ``gru(..., save=True)``; grad_hx is returned with no ``hx`` too."""
    _check("gru", input, (hx,), weights, has_biases, num_layers, batch_first)
    return get_kernel("gru_backward", impl)(grad_output, grad_hn, input, hx, weights, output, saved, has_biases,
                                            num_layers, batch_first)


@gru_backward.register_fake
def _(grad_output, grad_hn, input, hx, weights, output, saved, has_biases, num_layers, batch_first, impl):
    return _fake_backward("gru", input, (hx,), weights, has_biases, num_layers, batch_first)


@torch.library.custom_op("recompile::lstm", mutates_args=())
def lstm(input: torch.Tensor, hx: Optional[torch.Tensor], cx: Optional[torch.Tensor], weights: list[torch.Tensor],
         has_biases: bool, num_layers: int, batch_first: bool, save: bool, impl: str
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(output, h_n, c_n, saved) of the LSTM over ``input`` (the module's docstring)."""
    _check("lstm", input, (hx, cx), weights, has_biases, num_layers, batch_first)
    return get_kernel("lstm", impl)(input, hx, cx, weights, has_biases, num_layers, batch_first, save)


@lstm.register_fake
def _(input, hx, cx, weights, has_biases, num_layers, batch_first, save, impl):
    return _fake("lstm", input, (hx, cx), weights, has_biases, num_layers, batch_first, save)


@torch.library.custom_op("recompile::lstm_backward", mutates_args=())
def lstm_backward(grad_output: Optional[torch.Tensor], grad_hn: Optional[torch.Tensor],
                  grad_cn: Optional[torch.Tensor], input: torch.Tensor, hx: Optional[torch.Tensor],
                  cx: Optional[torch.Tensor], weights: list[torch.Tensor], output: torch.Tensor,
                  saved: list[torch.Tensor], has_biases: bool, num_layers: int, batch_first: bool, impl: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(grad_input, grad_hx, grad_cx, grad_weights) of ``lstm(..., save=True)``."""
    _check("lstm", input, (hx, cx), weights, has_biases, num_layers, batch_first)
    return get_kernel("lstm_backward", impl)(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output, saved,
                                             has_biases, num_layers, batch_first)


@lstm_backward.register_fake
def _(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output, saved, has_biases, num_layers, batch_first,
      impl):
    return _fake_backward("lstm", input, (hx, cx), weights, has_biases, num_layers, batch_first)


# Kernels: reference and native, per op.

@register_kernel("gru", "reference")
def _gru_reference(input, hx, weights, has_biases, num_layers, batch_first, save):
    return recurrent_reference("gru", input, (hx,), weights, has_biases, num_layers, batch_first, save)


@register_kernel("gru_backward", "reference")
def _gru_backward_reference(grad_output, grad_hn, input, hx, weights, output, saved, has_biases, num_layers,
                            batch_first):
    return recurrent_backward_reference("gru", grad_output, (grad_hn,), input, (hx,), weights, output, has_biases,
                                        num_layers, batch_first)


@register_kernel("lstm", "reference")
def _lstm_reference(input, hx, cx, weights, has_biases, num_layers, batch_first, save):
    return recurrent_reference("lstm", input, (hx, cx), weights, has_biases, num_layers, batch_first, save)


@register_kernel("lstm_backward", "reference")
def _lstm_backward_reference(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output, saved, has_biases,
                             num_layers, batch_first):
    return recurrent_backward_reference("lstm", grad_output, (grad_hn, grad_cn), input, (hx, cx), weights, output,
                                        has_biases, num_layers, batch_first)


@register_kernel("gru", "native", supports=native_reads)
def _gru_native(input, hx, weights, has_biases, num_layers, batch_first, save):
    require("gru", "native", native_reads(input, hx, weights))
    return torch.ops.recompile_native.gru_fwd(input, hx, weights, has_biases, num_layers, batch_first, save)


@register_kernel("gru_backward", "native", supports=native_reads)
def _gru_backward_native(grad_output, grad_hn, input, hx, weights, output, saved, has_biases, num_layers, batch_first):
    require("gru_backward", "native", native_reads(input, hx, weights))
    return torch.ops.recompile_native.gru_bwd(grad_output, grad_hn, input, hx, weights, output, saved, has_biases,
                                              num_layers, batch_first)


@register_kernel("lstm", "native", supports=native_reads)
def _lstm_native(input, hx, cx, weights, has_biases, num_layers, batch_first, save):
    require("lstm", "native", native_reads(input, hx, weights, cx))
    return torch.ops.recompile_native.lstm_fwd(input, hx, cx, weights, has_biases, num_layers, batch_first, save)


@register_kernel("lstm_backward", "native", supports=native_reads)
def _lstm_backward_native(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output, saved, has_biases,
                          num_layers, batch_first):
    require("lstm_backward", "native", native_reads(input, hx, weights, cx))
    return torch.ops.recompile_native.lstm_bwd(grad_output, grad_hn, grad_cn, input, hx, cx, weights, output, saved,
                                               has_biases, num_layers, batch_first)


def aten_reads(input: torch.Tensor, hx: Optional[torch.Tensor] = None, cx: Optional[torch.Tensor] = None,
               weights: list = (), save: bool = False, **_) -> bool | str:
    """ATen's LSTM runs an inference call (``save`` off: the backward reads gates it does not keep) through oneDNN
    on the CPU for float32 and bfloat16, its GEMMs faster than a GEMM per step (``docs/recurrent.md``)."""
    if save:
        return "save: the op's backward reads gates ATen's LSTM does not keep"
    if not torch._C._get_mkldnn_enabled():
        return "oneDNN is off (torch.backends.mkldnn)"
    for t in (input, hx, cx, *weights):
        if t is not None and (t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16)):
            return f"a {t.dtype} tensor on {t.device}: ATen's oneDNN LSTM takes float32 and bfloat16 on the CPU"
    return True


@register_kernel("lstm", "aten", supports=aten_reads)
def _lstm_aten(input, hx, cx, weights, has_biases, num_layers, batch_first, save):
    require("lstm", "aten", aten_reads(input, hx, cx, weights, save))
    shape = (num_layers, input.shape[0 if batch_first else 1], weights[1].shape[1])
    states = tuple(s if s is not None else input.new_zeros(shape) for s in (hx, cx))
    out, h, c = torch.lstm(input, states, weights, has_biases, num_layers, 0.0, False, False, batch_first)
    return out.contiguous(), h.contiguous(), c.contiguous(), []  # batch_first: a transposed [T, B, H] (the fake's)


# Autograd: both ops' inputs are (input, *states, weights, has_biases, num_layers, batch_first, save, impl), their
# outputs (output, *final states, saved); the backward op takes (grad_output, *grad_finals, input, *states,
# weights, output, saved, has_biases, num_layers, batch_first, impl).

def _autograd(kind: str, backward_op: Callable, states: int) -> tuple[Callable, Callable]:
    def setup_context(ctx, inputs, output):
        input, *rest = inputs
        initial, (weights, has_biases, num_layers, batch_first, save, impl) = rest[:states], rest[states:]
        ctx.given = [s is not None for s in initial]
        ctx.save_for_backward(input, *(s for s in initial if s is not None), output[0], *weights, *output[-1])
        ctx.arguments = (has_biases, num_layers, batch_first, impl, len(weights), save)
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_output, *grads):
        grad_finals = grads[:states]
        has_biases, num_layers, batch_first, impl, n, save = ctx.arguments
        nones = [None] * (1 + states + 6)
        if grad_output is None and all(g is None for g in grad_finals):
            return tuple(nones)
        if not save:
            raise RuntimeError(f"recompile.{kind}: differentiated after a forward that saved nothing (save=False)")
        input, *rest = ctx.saved_tensors
        initial = [rest.pop(0) if given else None for given in ctx.given]
        out, weights, saved = rest[0], rest[1:1 + n], rest[1 + n:]
        grad_input, *grad_states, grad_weights = backward_op(grad_output, *grad_finals, input, *initial, weights, out,
                                                             saved, has_biases, num_layers, batch_first, impl)
        grad_states = [g if given else None for g, given in zip(grad_states, ctx.given)]
        return (grad_input, *grad_states, grad_weights, *nones[:5])

    return backward, setup_context


for _kind, _op, _backward_op, _states in (("gru", gru, gru_backward, 1), ("lstm", lstm, lstm_backward, 2)):
    _backward, _setup = _autograd(_kind, _backward_op, _states)
    _op.register_autograd(_backward, setup_context=_setup)


def computes(kind: str, input: torch.Tensor, params: list, has_biases: bool, num_layers, dropout, train,
             bidirectional) -> bool:
    """Whether ``torch.<kind>(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, ...)`` is a
    call the op computes: a 3-D input of a dtype it takes, one direction, no dropout drawn between layers, and the
    plain weights per layer (no LSTM projections)."""
    return (isinstance(input, torch.Tensor) and input.dim() == 3 and input.dtype in DTYPES
            and bidirectional is False and isinstance(num_layers, int)
            and not (dropout and train and num_layers > 1)
            and len(params) == num_layers * (4 if has_biases else 2))


OPS = {"gru": gru, "lstm": lstm}
ATEN = {"gru": torch.ops.aten.gru.input, "lstm": torch.ops.aten.lstm.input}
KEYS = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)


def _example(kind: str, decomposition: Callable) -> Callable:
    """``torch.<kind>`` by the op where it computes the call (its fake keeps every size symbolic), else by ATen's
    ``decomposition``."""

    def call(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if not computes(kind, input, params, has_biases, num_layers, dropout, train, bidirectional):
            return decomposition(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                 batch_first)
        states = tuple(hx) if kind == "lstm" else (hx,)
        out = OPS[kind](input, *states, list(params), has_biases, num_layers, batch_first, torch.is_grad_enabled(),
                        "reference")
        return tuple(out[:-1])

    return call


class symbolic_steps:
    """While entered, ATen's GRU and LSTM under the Python dispatcher (Dynamo computes example values under it) run
    as ``recompile.gru`` / ``lstm`` where those compute the call. ATen's Python decompositions of them loop over the
    steps and so fix the sequence length (a guard, one compile per length); the ops' fakes keep it symbolic. Held
    while rec_ascend traces (``recompile.tracing.TracingConfig``, entered per compile); restored on the outermost
    exit. The kernels are built once: entering costs two dict updates."""

    _depth = 0
    _kernels: dict[str, tuple[dict, dict]] = {}  # kind -> (ATen's kernels, ours), per dispatch key

    @classmethod
    def _install(cls, which: int) -> None:
        if not cls._kernels:
            for kind, op in ATEN.items():
                saved = {key: op.py_kernels[key] for key in KEYS if key in op.py_kernels}
                cls._kernels[kind] = (saved, {key: _example(kind, fn) for key, fn in saved.items()})
        for kind, op in ATEN.items():
            op.py_kernels.update(cls._kernels[kind][which])
            op._dispatch_cache.clear()

    def __enter__(self) -> None:
        if symbolic_steps._depth == 0:
            self._install(1)
        symbolic_steps._depth += 1

    def __exit__(self, *exc: Any) -> None:
        symbolic_steps._depth -= 1
        if symbolic_steps._depth == 0:
            self._install(0)
