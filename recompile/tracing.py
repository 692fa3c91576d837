"""The Dynamo settings rec_ascend traces under (``TracingConfig``), held while Dynamo traces a call of a model
compiled with it (``TracingCalls``, its ``backend_ctx_ctor``).

Dynamo enters a backend's context around every call of a compiled model, not only while it traces, so the
context is on the hot path of every call. ``TracingConfig`` sets the settings' context variables and resets them
with their tokens (about 1 us), where ``torch._dynamo.config.patch`` (a class built and six attributes set) costs
15-30 us; but a context variable set on each call costs the rest of the call 4-8 us more (FM predict at batch 1,
measured: each context variable read after it, torch's config reads among them, misses its cache). So the backend's
context only counts the calls in progress (``TracingCalls``) and Dynamo's compile-start callback enters
``TracingConfig`` for a compile that starts inside one of them, until the compile ends. This module is light (no
Inductor, no pass): the backend's name registers it from a source checkout (``recompile/__init__.py``) without
loading the backend.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any

import torch._dynamo
from torch._dynamo.callback import callback_handler

# The settings, and why (``recompile.report.BREAK_REMEDIES`` names them to users whose graph breaks anyway).
TRACING_CONFIG = {
    # offsets -> (row, position): repeat_interleave, nonzero, masked_select, boolean-mask indexing
    "capture_dynamic_output_shape_ops": True,
    # a max length or a total read with .item() / int(tensor)
    "capture_scalar_outputs": True,
    # TorchRec's modules are traced, not skipped, so that their lookups reach the embedding pass
    "skip_torchrec": False,
    # nn.GRU / nn.LSTM / nn.RNN are traced (one torch.gru / lstm / rnn_* call), not a graph break: the recurrent
    # pass makes a GRU one op (docs/recurrent.md)
    "allow_rnn": True,
}


@functools.cache
def _variables() -> tuple:
    """The context variables of ``torch._dynamo.config``: each setting's (what ``config.<name> = value`` sets)
    with its value, the flag that marks the config's hash stale, and the names its cached copy must re-read."""
    config = torch._dynamo.config
    overrides = tuple((config._config[name].user_override, value) for name, value in TRACING_CONFIG.items())
    return overrides, config._hash_dirty_var, config._get_dict_dirty_keys_var


def _changed() -> None:
    """What ``torch._dynamo.config.__setattr__`` does after a set: its hash and its cached copy are stale."""
    _, hash_dirty, dict_dirty = _variables()
    hash_dirty.set(True)
    dirty = dict_dirty.get()
    if dirty is not None:
        dirty.update(TRACING_CONFIG)


class TracingConfig:
    """Dynamo's config with ``TRACING_CONFIG`` while entered (while Dynamo traces a call of rec_ascend's, ``TracingCalls``); nests."""

    __slots__ = ("_tokens", "_steps")

    def __enter__(self) -> None:
        from recompile.runtime.recurrent import symbolic_steps  # GRU / LSTM example values keep their length symbolic

        self._tokens = [var.set(value) for var, value in _variables()[0]]
        _changed()
        self._steps = symbolic_steps()
        self._steps.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._steps.__exit__(None, None, None)
        for (var, _), token in zip(_variables()[0], self._tokens):
            var.reset(token)
        _changed()


_state = threading.local()  # calls: rec_ascend calls in progress; held: per compile started, its TracingConfig or None


class TracingCalls:
    """rec_ascend's ``backend_ctx_ctor``: marks a call of a model compiled with it (no context variable set: see
    the module's docstring), so that a compile Dynamo starts during the call traces under ``TracingConfig``."""

    __slots__ = ()

    def __enter__(self) -> None:
        _state.calls = getattr(_state, "calls", 0) + 1
        if _compile_start not in callback_handler.start_callbacks:  # torch._dynamo.reset() clears them
            callback_handler.register_start_callback(_compile_start)
            callback_handler.register_end_callback(_compile_end)

    def __exit__(self, *exc: Any) -> None:
        _state.calls -= 1


def _compile_start(args: Any) -> None:
    """Dynamo's compile-start callback (for the outermost compile in progress): the settings, inside a call of ours."""
    config = TracingConfig() if getattr(_state, "calls", 0) else None
    if config is not None:
        config.__enter__()
    _state.held = [*getattr(_state, "held", ()), (config, time.perf_counter())]


def _compile_end(args: Any) -> None:
    held = getattr(_state, "held", None)
    config, _ = held.pop() if held else (None, None)
    if config is not None:
        config.__exit__(None, None, None)


def traced_s() -> float:
    """Seconds since Dynamo began the compile in progress (its tracing, before it calls the backend), on
    ``time.perf_counter``; 0.0 where no compile of a call of ours is in progress."""
    held = getattr(_state, "held", None)
    return time.perf_counter() - held[-1][1] if held else 0.0


def _backend_ctx_ctor(self):
    """The ``backend_ctx_ctor`` of the backend a ``WrapBackendDebug`` wraps, looking through the wrapper
    ``torch.compile`` puts around a backend given by name or with options (which drops the attribute)."""
    backend = self._torchdynamo_orig_backend
    if isinstance(backend, torch._TorchCompileWrapper):
        backend = backend.compiler_fn
    ctor = getattr(backend, "backend_ctx_ctor", None)
    if ctor is None:
        raise AttributeError("backend_ctx_ctor")
    return ctor


def break_on_data_dependent_tolist() -> None:
    """Make Dynamo break the graph at ``Tensor.tolist()`` of a tensor whose length is data-dependent, where it
    raises ``GuardOnDataDependentSymNode``, a hard error. Such tensors come from ops captured under ``capture_dynamic_output_shape_ops``: RecBole's GCSAN and
    SRGNN build their session graphs with ``torch.unique(seq).tolist()``, which failed to compile under
    rec_ascend and breaks the graph under Dynamo's defaults. Installed with ``forward_backend_context``; other
    tensors' ``tolist`` is Dynamo's."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.tensor import TensorVariable
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    traced = TensorVariable.method_tolist
    if getattr(traced, "breaks_on_data_dependent", False):
        return

    def method_tolist(self, tx):
        example = self.as_proxy().node.meta.get("example_value")
        if isinstance(example, torch.Tensor) and free_unbacked_symbols(example.shape):
            unimplemented(gb_type="Tensor.tolist() of a data-dependent length", context=str(example.shape),
                          explanation="the tensor's length is known only when the graph runs",
                          hints=["compute the list outside the compiled region, or keep the tensor"])
        return traced(self, tx)

    method_tolist.breaks_on_data_dependent = True
    TensorVariable.method_tolist = method_tolist


def forward_backend_context() -> None:
    """Make ``torch.compile(model, backend=...)`` honour the backend's ``backend_ctx_ctor``, as
    ``torch._dynamo.optimize(backend)`` does: Dynamo reads the attribute on the debug wrapper of
    ``torch.compile``'s own wrapper, where it is absent. Backends without the attribute are unaffected. Installed
    when the name is registered (before Dynamo reads it), whichever way it is."""
    from torch._dynamo.repro.after_dynamo import WrapBackendDebug

    if not hasattr(WrapBackendDebug, "backend_ctx_ctor"):
        WrapBackendDebug.backend_ctx_ctor = property(_backend_ctx_ctor)
    break_on_data_dependent_tolist()
